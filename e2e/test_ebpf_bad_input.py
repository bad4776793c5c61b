"""Machines that cannot accelerate: one clear line, the mesh goes on, nothing half attached.

Each missing piece is produced for real in a child process: capabilities dropped with setpriv,
cgroup v2 taken away in a private mount namespace, a kernel without sockmap or cgroup2 mounts
imitated with a seccomp filter returning the errno such a kernel returns, a program the verifier
really rejects.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshfn.ebpf import AccelerationUnavailable, Accelerator, cgroup_name, detach, programs

pytestmark = pytest.mark.timeout(120)

# Runs in a child: sabotage the machine as argv[2] says, then setup(argv[3]) and print the result.
CHILD = r"""
import ctypes, errno, json, struct, sys
from pathlib import Path
from meshfn.ebpf import Accelerator, AccelerationUnavailable, probe

libc = ctypes.CDLL(None, use_errno=True)
state, sabotage, mode = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]

def without_cgroup2():
    # A private mount namespace in which no cgroup2 hierarchy is mounted.
    assert libc.unshare(0x00020000) == 0  # CLONE_NEWNS
    assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0  # MS_REC | MS_PRIVATE
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if line.split()[2] == "cgroup2":
            assert libc.umount2(line.split()[1].encode(), 2) == 0  # MNT_DETACH

def seccomp_errno(nr, err, arg0=None):
    # classic BPF over seccomp_data: nr @0, args[0] (low half) @16
    ins = [(0x20, 0, 0, 0), (0x15, 0, 3 if arg0 is not None else 1, nr)]
    if arg0 is not None:
        ins += [(0x20, 0, 0, 16), (0x15, 0, 1, arg0)]
    ins += [(0x06, 0, 0, 0x00050000 | err), (0x06, 0, 0, 0x7FFF0000)]
    raw = b"".join(struct.pack("=HBBI", *i) for i in ins)
    buf = ctypes.create_string_buffer(raw, len(raw))
    prog = struct.pack("=HxxxxxxQ", len(ins), ctypes.addressof(buf))
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.c_char_p(prog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER

if "no-cgroup2-mounted" in sabotage:
    without_cgroup2()
if "no-cgroup2-fs" in sabotage:
    seccomp_errno(165, errno.ENODEV)  # mount(2): "unknown filesystem type"
if "no-sockmap" in sabotage:
    seccomp_errno(321, errno.EINVAL, arg0=0)  # bpf(BPF_MAP_CREATE): unknown map type

accel = Accelerator(state)
out = {}
try:
    status = accel.setup(mode)
    out["status"] = {"attached": status.attached, "reason": status.reason}
except AccelerationUnavailable as exc:
    out["raised"] = str(exc)
if accel.cgroup_path is not None:
    out["cgroup"] = str(accel.cgroup_path)
    pong = probe.run(["pingpong", "--count", "20"], accel.child_preexec())
    out["redirected"] = accel.stats()["messages_redirected"]
    out["mounted"] = str(state) in Path("/proc/self/mounts").read_text()
    out["problems"] = accel.shutdown()
    out["mounted_after"] = str(state) in Path("/proc/self/mounts").read_text()
print(json.dumps(out))
"""


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"
    assert detach(tmp_path / "state") == []


def child(
    state_dir: Path, sabotage: str, mode: str, prefix: tuple[str, ...] = ()
) -> dict[str, object]:
    result = subprocess.run(
        [*prefix, sys.executable, "-P", "-c", CHILD, str(state_dir), sabotage, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out: dict[str, object] = json.loads(result.stdout)
    return out


def assert_nothing_left(state_dir: Path) -> None:
    assert not (state_dir / "ebpf/state.json").exists()
    assert not (state_dir / "ebpf/bpffs").exists()
    assert not (state_dir / "ebpf/cgroup2").exists()
    assert str(state_dir) not in Path("/proc/self/mounts").read_text()
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if line.split()[2] == "cgroup2":
            assert not (Path(line.split()[1]) / cgroup_name(state_dir)).exists()


NO_CAPS = ("setpriv", "--inh-caps=-all", "--bounding-set=-all")


def test_no_privileges(state_dir: Path) -> None:
    out = child(state_dir, "", "auto", NO_CAPS)
    assert out == {
        "status": {
            "attached": False,
            "reason": "no privileges: eBPF acceleration needs CAP_SYS_ADMIN and CAP_NET_ADMIN "
            "(run meshfn as root); missing CAP_SYS_ADMIN, CAP_NET_ADMIN",
        }
    }
    assert_nothing_left(state_dir)


def test_no_privileges_on_the_command_line(state_dir: Path) -> None:
    result = subprocess.run(
        [
            *NO_CAPS,
            sys.executable,
            "-P",
            "-m",
            "meshfn.ebpf",
            "attach",
            "--state-dir",
            str(state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("meshfn ebpf: acceleration unavailable: no privileges: ")
    assert result.stderr.count("\n") == 1
    assert_nothing_left(state_dir)


def test_kernel_without_sockmap(state_dir: Path) -> None:
    out = child(state_dir, "no-sockmap", "auto")
    status = out["status"]
    assert isinstance(status, dict) and not status["attached"]
    assert status["reason"].startswith(
        "the kernel has no sockmap support (CONFIG_BPF_STREAM_PARSER / CONFIG_NET_SOCK_MSG): "
    )
    assert_nothing_left(state_dir)


def test_no_cgroup2_anywhere(state_dir: Path) -> None:
    out = child(state_dir, "no-cgroup2-mounted,no-cgroup2-fs", "ebpf")
    raised = out["raised"]
    assert isinstance(raised, str)
    assert raised.startswith("no cgroup v2: none is mounted and mounting one at ")
    assert raised.endswith("No such device)")
    assert set(out) == {"raised"}
    assert_nothing_left(state_dir)


def test_no_cgroup2_mounted_means_we_mount_our_own(state_dir: Path) -> None:
    out = child(state_dir, "no-cgroup2-mounted", "ebpf")
    assert out["status"] == {
        "attached": True,
        "reason": f"attached: sock_ops on cgroup {state_dir}/ebpf/cgroup2/{cgroup_name(state_dir)}"
        ", sk_msg on the sockhash",
    }
    assert out["redirected"] == 40
    assert out["mounted"] is True and out["mounted_after"] is False
    assert out["problems"] == []
    assert_nothing_left(state_dir)


def test_verifier_rejection_rolls_everything_back(state_dir: Path) -> None:
    # A read past the end of the context: clang compiles it, the verifier refuses it.
    bad = programs.source().replace(
        "__u32 op = CTX(skops, op);", "__u32 op = *(volatile __u32 *)((char *)skops + 4000);"
    )
    accel = Accelerator(state_dir, program_source=bad)
    status = accel.setup("auto")
    assert not status.attached
    assert status.reason.startswith("the kernel's verifier rejected the program: ")
    assert "invalid bpf_context access off=4000" in status.reason
    assert accel.cgroup_path is None
    assert_nothing_left(state_dir)


def test_compile_error_names_the_line(state_dir: Path) -> None:
    accel = Accelerator(state_dir, program_source=programs.source() + "\nint broken( {\n")
    with pytest.raises(AccelerationUnavailable) as err:
        accel.setup("ebpf")
    assert str(err.value).startswith("BPF compile failed: /virtual/main.c:")
    assert "error:" in str(err.value)
    assert_nothing_left(state_dir)
