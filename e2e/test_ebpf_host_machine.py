"""This machine's side of eBPF host discovery: its kernel headers (ebpf/setup_host.sh), the
privilege check against the real effective set (root), and a missing-headers host turning
"auto" off (setup checks privileges and bcc before it looks for headers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshfn.ebpf import AccelerationUnavailable, Accelerator, Host
from meshfn.ebpf.host import check_privileges, find_headers
from meshfn.testing.ebpf import empty_host


def test_this_machine_has_usable_headers() -> None:
    """ebpf/setup_host.sh must have run (./dev.sh calls it)."""
    tree = find_headers(Host())
    assert (tree / "include/generated/autoconf.h").is_file()


def test_no_headers_turns_auto_off_with_the_reason(tmp_path: Path) -> None:
    accel = Accelerator(tmp_path / "state", host=empty_host(tmp_path))
    status = accel.setup("auto")
    assert not status.attached
    assert status.reason.startswith("no kernel headers: ")
    assert accel.cgroup_path is None and accel.child_preexec() is None
    assert accel.add_pid(1) is False
    assert accel.stats() == dict.fromkeys(accel.stats(), 0)
    with pytest.raises(AccelerationUnavailable, match=r"^no kernel headers: "):
        accel.setup("ebpf")
    assert not (tmp_path / "state/ebpf/state.json").exists()
    assert not (tmp_path / "state/ebpf/bpffs").exists()


def test_privileges_are_checked_from_the_effective_set() -> None:
    check_privileges()  # root here
    code = (
        "from meshfn.ebpf.host import check_privileges, Unavailable\n"
        "try:\n    check_privileges()\nexcept Unavailable as e:\n    print(e)\n"
    )
    out = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-P", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("no privileges: eBPF acceleration needs CAP_SYS_ADMIN and CAP_NET_ADMIN")
    assert "missing CAP_SYS_ADMIN, CAP_NET_ADMIN" in out
