"""Attach, reuse, replace and detach: idempotent, safe across loader restarts, nothing left over.

Every test has its own state directory (so its own cgroup and maps) and detaches in `finally`,
also when it fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshfn.ebpf import Accelerator, bpfsys, detach, probe, programs

pytestmark = pytest.mark.timeout(120)
EBPF = [sys.executable, "-P", "-m", "meshfn.ebpf"]


@dataclass
class Attached:
    """What a setup attached, to check afterwards that all of it is gone."""

    state_dir: Path
    cgroup: Path
    prog_ids: set[int]
    map_ids: set[int]

    @classmethod
    def of(cls, accel: Accelerator) -> Attached:
        assert accel.cgroup_path is not None
        progs, maps = accel.attached_ids()
        assert len(progs) == 2 and len(maps) == len(programs.MAP_PINS)
        return cls(accel.state_dir, accel.cgroup_path, set(progs.values()), set(maps.values()))

    def assert_detached(self, freed: bool = True) -> None:
        """No cgroup, no bpffs, no state; `freed`: the kernel let go of programs and maps too
        (only once no socket that was in the map is open)."""
        assert not self.cgroup.exists()
        assert str(self.state_dir) not in Path("/proc/self/mounts").read_text()
        assert not (self.state_dir / "ebpf/state.json").exists()
        if freed:
            self.assert_freed()

    def assert_freed(self) -> None:
        deadline = time.monotonic() + 5  # the kernel frees them after an RCU grace period
        while (self.prog_ids & bpfsys.prog_ids()) or (self.map_ids & bpfsys.map_ids()):
            assert time.monotonic() < deadline, "programs or maps still loaded"
            time.sleep(0.05)

    def sock_ops_attached(self) -> list[int]:
        fd = os.open(self.cgroup, os.O_RDONLY)
        try:
            return bpfsys.prog_query(fd, bpfsys.ATTACH_CGROUP_SOCK_OPS)
        finally:
            os.close(fd)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"
    assert detach(tmp_path / "state") == []


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EBPF, *args], capture_output=True, text=True, timeout=60, check=False)


def test_setup_is_idempotent_and_so_is_shutdown(state_dir: Path) -> None:
    first = Accelerator(state_dir)
    status = first.setup("ebpf")
    assert status.attached and not status.reused
    attached = Attached.of(first)
    assert attached.sock_ops_attached() == [first.attached_ids()[0]["sock_ops"]]

    second = Accelerator(state_dir)
    again = second.setup("auto")
    assert again.attached and again.reused and again.cgroup == status.cgroup
    assert second.attached_ids() == first.attached_ids()
    assert len(attached.sock_ops_attached()) == 1  # not stacked twice

    assert second.shutdown() == []
    assert second.shutdown() == []
    assert first.shutdown() == []
    attached.assert_detached()
    assert first.stats()["attached"] == 0


def test_a_loader_restart_keeps_live_connections_redirected(state_dir: Path) -> None:
    result = cli("attach", "--state-dir", str(state_dir))  # this loader exits at once
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("eBPF acceleration on (mode ebpf): attached")

    accel = Accelerator(state_dir)  # "the control plane restarted"
    status = accel.setup("ebpf")
    assert status.reused
    held = probe.start(["hold"], accel.child_preexec())
    try:
        probe.ask(held)
        before = accel.stats()
        assert probe.ask(held, "ping 10") == {"ok": True}
        restarted = Accelerator(state_dir)
        assert restarted.setup("auto").reused
        assert probe.ask(held, "ping 10") == {"ok": True}
        after = restarted.stats()
        assert after["messages_redirected"] - before["messages_redirected"] == 40
        assert after["sockets_in_map"] == 2
    finally:
        held.kill()
        held.wait()
    attached = Attached.of(accel)
    assert accel.shutdown() == []
    attached.assert_detached()


def test_a_new_build_replaces_the_old_one_without_breaking_its_connections(
    state_dir: Path,
) -> None:
    old = Accelerator(state_dir)
    old.setup("ebpf")
    old_attached = Attached.of(old)
    held = probe.start(["hold"], old.child_preexec())
    try:
        probe.ask(held)
        assert probe.ask(held, "ping 5") == {"ok": True}
        assert probe.ask(held, "unread 30000") == {"sent": 30000}

        new = Accelerator(state_dir, program_source=programs.source() + "\n/* build 2 */\n")
        status = new.setup("ebpf")
        assert status.attached and not status.reused
        new_attached = Attached.of(new)
        assert not (new_attached.prog_ids & old_attached.prog_ids)
        assert new_attached.sock_ops_attached() == [new.attached_ids()[0]["sock_ops"]]

        # The old connection: queued bytes kept, then plain TCP in order.
        assert probe.ask(held, "drain") == {"drained": 30000}
        assert probe.ask(held, "ping 20") == {"ok": True}
        assert new.stats()["messages_redirected"] == 0
        # New connections use the new build.
        pong = probe.run(["pingpong", "--count", "10"], new.child_preexec())
        assert pong["messages"] == 20
        assert new.stats()["messages_redirected"] == 20
        # The old sk_msg program lives on only while the old sockets do.
        assert old.attached_ids()[0]["sk_msg"] in bpfsys.prog_ids()
    finally:
        held.kill()
        held.wait()
    old_attached.assert_freed()  # its cgroup and bpffs are the new build's now
    assert new.shutdown() == []
    new_attached.assert_detached()


def test_detach_in_the_middle_of_traffic_loses_nothing(state_dir: Path) -> None:
    accel = Accelerator(state_dir)
    accel.setup("ebpf")
    attached = Attached.of(accel)
    held = probe.start(["hold"], accel.child_preexec())
    stream = probe.start(
        ["exchange", "--mode", "asyncio", "--bytes", str(64 << 20)], accel.child_preexec()
    )
    try:
        probe.ask(held)
        assert probe.ask(held, "ping 5") == {"ok": True}
        assert probe.ask(held, "unread 50000") == {"sent": 50000}  # queued on the redirect path
        deadline = time.monotonic() + 20
        while accel.stats()["bytes_redirected"] < (8 << 20):
            assert time.monotonic() < deadline and stream.poll() is None
            time.sleep(0.005)

        assert accel.shutdown() == []

        assert probe.ask(held, "drain") == {"drained": 50000}
        assert probe.ask(held, "ping 50") == {"ok": True}
        result = probe.ask(stream)
        assert result["ok"] and result["a_bytes"] == result["b_bytes"] == 64 << 20, result
        attached.assert_detached(freed=False)  # the live sockets still hold them
    finally:
        for proc in (held, stream):
            proc.kill()
            proc.wait()
    attached.assert_detached()


def test_sigterm_detaches(state_dir: Path) -> None:
    run = subprocess.Popen(
        [*EBPF, "run", "--state-dir", str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert run.stdout is not None
        assert run.stdout.readline().startswith("eBPF acceleration on")
        attached = Attached.of(_reuse(state_dir))
        run.send_signal(signal.SIGTERM)
        assert run.wait(30) == 0
        assert run.stdout.read().strip() == "meshfn ebpf: detached"
    finally:
        run.kill()
        run.wait()
    attached.assert_detached()


def test_after_sigkill_the_detach_command_cleans_up(state_dir: Path) -> None:
    run = subprocess.Popen(
        [*EBPF, "run", "--state-dir", str(state_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert run.stdout is not None
        assert run.stdout.readline().startswith("eBPF acceleration on")
    finally:
        run.kill()
        run.wait()
    attached = Attached.of(_reuse(state_dir))
    assert len(attached.sock_ops_attached()) == 1  # the kernel kept it after the loader died

    for _ in range(2):  # idempotent
        result = cli("detach", "--state-dir", str(state_dir))
        assert result.returncode == 0 and result.stderr == "", result.stderr
    attached.assert_detached()


def test_off_removes_an_earlier_attachment(state_dir: Path) -> None:
    assert cli("attach", "--state-dir", str(state_dir)).returncode == 0
    attached = Attached.of(_reuse(state_dir))
    status = Accelerator(state_dir).setup("off")
    assert not status.attached and status.reason == "disabled by policy"
    attached.assert_detached()


def _reuse(state_dir: Path) -> Accelerator:
    """An Accelerator bound to what another process attached (setup reuses it)."""
    accel = Accelerator(state_dir)
    assert accel.setup("ebpf").reused
    return accel
