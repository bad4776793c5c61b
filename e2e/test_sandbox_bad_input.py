"""The sandbox where a layer cannot be had, and policies that name what does not exist.

A kernel without Landlock or seccomp is met for real: the backend's first act (the test-only
hook, sandbox_hook/sitecustomize.py) installs a seccomp filter of its own that answers the
Landlock syscalls ENOSYS and PR_GET_SECCOMP/seccomp() EINVAL, as such a kernel does. A control
plane without the privileges for eBPF is `meshfn up` started without CAP_SYS_ADMIN,
CAP_NET_ADMIN and CAP_BPF (setpriv). In each case meshfn starts, says which layer is off and
why (at start and in `meshfn status`), runs with the others, and claims nothing it lacks.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_rig import Ports, policies, start_mesh

from meshfn.testing.processes import Processes, meshfn


@pytest.fixture
def short(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short directory: the state directory holds unix sockets (at most 107 bytes a path)."""
    return tmp_path_factory.mktemp("sbx")


@pytest.fixture
def procs(short: Path) -> Iterator[Processes]:
    rig = Processes(short)
    try:
        yield rig
    finally:
        rig.stop_all()


def test_sandbox_egress_peer_that_does_not_exist_is_a_file_line_error(tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()
    path = tmp_path / "policies" / "mesh.yaml"
    path.write_text(policies(Ports.pick(), {}, egress_peer="feature-stor"))
    lines = path.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.endswith("service: feature-stor"))
    want = (
        f"{path}:{line}: spec.egress[0].service: unknown Service default/feature-stor: an egress "
        "peer must be a Service of the mesh (did you mean default/feature-store?)"
    )
    checked = meshfn("validate", str(tmp_path / "policies"))
    assert checked.returncode == 1 and want in checked.stdout + checked.stderr
    up = meshfn("up", "--policies", str(tmp_path / "policies"), "--state-dir", str(tmp_path / "s"))
    assert up.returncode == 1 and want in up.stdout + up.stderr and "nothing started" in up.stdout


def test_sandbox_kernel_without_landlock_and_seccomp_runs_with_egress(
    procs: Processes, short: Path
) -> None:
    mesh = start_mesh(
        procs, short, short / "functions", {}, "old", kernel_without="landlock,seccomp"
    )
    name = mesh.backend_name
    for text in (mesh.log(), mesh.status_text()):
        assert f"sandbox {name}: landlock off, seccomp off, egress on" in text
        assert "landlock: unavailable: the kernel has no Landlock (Linux 5.13+ built with" in text
        assert "seccomp: unavailable: the kernel has no seccomp (CONFIG_SECCOMP off)" in text
    assert mesh.outcome(attempt="read", path="/etc/shadow") == "allowed"  # nothing claimed
    workload = {"attempt": "connect", "host": "127.0.0.1", "port": mesh.ports.echo_sidecar}
    assert mesh.outcome(**workload) == "EPERM"  # the egress control still refuses
    assert mesh.denied("tcp_loopback") == 1
    mode = Path(f"/proc/{mesh.backend_pid()}/status").read_text()
    assert "Seccomp_filters:\t1" in mode  # the emulation's own filter: no allow-list was loaded


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_sandbox_control_plane_without_privileges_runs_without_egress(
    procs: Processes, short: Path
) -> None:
    drop = ["setpriv", "--bounding-set", "-sys_admin,-net_admin,-bpf", "--"]
    mesh = start_mesh(procs, short, short / "functions", {}, "nocaps", wrap=drop)
    name = mesh.backend_name
    for text in (mesh.log(), mesh.status_text()):
        assert f"sandbox {name}: landlock on, seccomp on, egress off" in text
        assert (
            "egress: no privileges: the eBPF egress control needs CAP_SYS_ADMIN and "
            "CAP_NET_ADMIN (run meshfn as root); missing CAP_SYS_ADMIN, CAP_NET_ADMIN"
        ) in text
    workload = {"attempt": "connect", "host": "127.0.0.1", "port": mesh.ports.echo_sidecar}
    assert mesh.outcome(**workload) == "EACCES"  # Landlock still refuses
    assert mesh.sandbox()["denied"] == {}
