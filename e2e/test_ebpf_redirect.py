"""Redirection on this machine's kernel: proven by counters and by `lo`, with intact data.

One accelerator is attached for the module; every probe that should be accelerated runs as a child
that joins its cgroup before exec. The control runs of the same probes stay outside the cgroup.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshfn.ebpf import Accelerator, bpfsys, probe, programs
from meshfn.testing.ebpf import attached

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def accel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Accelerator]:
    with attached(tmp_path_factory.mktemp("ebpf-redirect")) as (accelerator, status):
        assert status.cgroup is not None
        yield accelerator


@pytest.fixture
def capture() -> Iterator[probe.LoopbackCapture]:
    cap = probe.LoopbackCapture()
    yield cap
    cap.close()


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before if after[key] != before[key]}


@pytest.mark.parametrize("family", ["4", "6", "dual"])
def test_every_message_is_redirected_and_none_reaches_lo(
    accel: Accelerator, capture: probe.LoopbackCapture, family: str
) -> None:
    before = accel.stats()
    result = probe.run(
        ["pingpong", "--count", "300", "--size", "100", "--family", family], accel.child_preexec()
    )
    changed = delta(before, accel.stats())
    assert changed == {
        "sockets_added": 2,
        "messages_redirected": 600,
        "bytes_redirected": 60_000,
    }, changed
    assert result["messages"] == 600
    assert capture.payload_segments(result["ports"]) == 0


def test_outside_the_cgroup_nothing_changes(
    accel: Accelerator, capture: probe.LoopbackCapture
) -> None:
    """The control run: same traffic, not in the cgroup. Also proves the capture sees payload."""
    before = accel.stats()
    result = probe.run(["pingpong", "--count", "300", "--size", "100"])
    assert delta(before, accel.stats()) == {}
    assert capture.payload_segments(result["ports"]) >= 600


def test_a_client_outside_the_mesh_is_left_on_tcp(accel: Accelerator) -> None:
    """Envoy's listener accepts users' connections: those must not enter the map (their replies
    could never be redirected, and the sk_msg path would only cost time)."""
    server = probe.start(["echo"], accel.child_preexec())
    try:
        port = probe.ask(server)["port"]
        before = accel.stats()
        result = probe.run(["rtt", "--port", str(port), "--count", "200"])
        changed = delta(before, accel.stats())
    finally:
        server.kill()
        server.wait()
    assert result["p50_us"] > 0
    assert changed == {"sockets_peer_outside": 1}, changed


@pytest.mark.parametrize("mode", ["blocking", "asyncio"])
@pytest.mark.parametrize("seed", [1, 2])
def test_long_randomized_exchange_is_intact(accel: Accelerator, mode: str, seed: int) -> None:
    """Both directions at once, random write sizes (1 B .. 300 kB) and read sizes, pauses."""
    before = accel.stats()
    family = "dual" if seed == 2 else "4"
    result = probe.run(
        [
            "exchange",
            "--mode",
            mode,
            "--bytes",
            str(6 << 20),
            "--seed",
            str(seed),
            "--family",
            family,
        ],
        accel.child_preexec(),
    )
    changed = delta(before, accel.stats())
    assert result["ok"], result
    assert result["a_bytes"] == result["b_bytes"] == 6 << 20
    assert changed["bytes_redirected"] == 2 * (6 << 20), changed
    assert "messages_no_peer" not in changed and "messages_tcp_path" not in changed, changed


def test_blocking_recv_gets_eagain_after_own_shutdown_but_asyncio_is_fine(
    accel: Accelerator,
) -> None:
    """The measured hazard (FACTS.md): a thread blocked in recv() while its socket is shut down
    for writing gets EAGAIN under redirection; plain TCP keeps waiting. Non-blocking sockets (Envoy,
    asyncio backends) read the late data. This is why only such processes join the cgroup."""
    trials = ["--trials", "5"]
    redirected = probe.run(["halfclose", "--mode", "blocking", *trials], accel.child_preexec())
    plain = probe.run(["halfclose", "--mode", "blocking", *trials])
    asyncio_redirected = probe.run(
        ["halfclose", "--mode", "asyncio", *trials], accel.child_preexec()
    )
    assert plain == {"trials": 5, "eagain": 0, "late_data": 5}
    assert asyncio_redirected == {"trials": 5, "eagain": 0, "late_data": 5}
    # If this fails with eagain == 0, the kernel fixed tcp_bpf_recvmsg: update FACTS.md and the
    # note in Accelerator.add_pid.
    assert redirected["eagain"] >= 1, redirected
    assert redirected["eagain"] + redirected["late_data"] == 5, redirected


def test_removing_a_socket_from_the_map_drops_its_unread_data(accel: Accelerator) -> None:
    """Why teardown never deletes map entries: the kernel frees the psock with its queue."""
    held = probe.start(["hold"], accel.child_preexec())
    try:
        ports = probe.ask(held)["ports"]
        assert probe.ask(held, "unread 50000") == {"sent": 50000}
        socks = bpfsys.obj_get(accel.dir / "bpffs" / programs.PIN_SOCKS)
        try:
            keys = [
                k
                for k in bpfsys.map_keys(socks, programs.SOCK_KEY_SIZE)
                if _key_ports(k) in (tuple(ports), tuple(reversed(ports)))
            ]
            assert len(keys) == 2
            for key in keys:
                bpfsys.map_delete(socks, key)
        finally:
            os.close(socks)
        assert probe.ask(held, "drain") == {"drained": 0}  # 50 000 bytes gone
        assert probe.ask(held, "ping 3") == {"ok": True}  # the connection itself still works
    finally:
        held.kill()
        held.wait()


def _key_ports(key: bytes) -> tuple[int, int]:
    local, remote = struct.unpack_from("=II", key, 32)
    return local, remote


def test_add_pid_moves_a_running_process(accel: Accelerator) -> None:
    """Sockets created after the move are redirected; the process shows the cgroup."""
    code = (
        "import json, sys\nfrom meshfn.ebpf import probe\nsys.stdin.readline()\n"
        "print(json.dumps(probe.pingpong(10, 64, '4')))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert accel.add_pid(proc.pid) is True
        cgroup = accel.cgroup_path
        assert cgroup is not None
        assert f"::/{cgroup.name}" in Path(f"/proc/{proc.pid}/cgroup").read_text()
        before = accel.stats()
        out, _ = proc.communicate("go\n", timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert json.loads(out)["messages"] == 20
    assert delta(before, accel.stats())["messages_redirected"] == 20
