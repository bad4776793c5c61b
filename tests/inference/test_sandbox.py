"""The backend's own confinement (inference/sandbox.py): what Landlock grants, what the seccomp
filter allows, kills and refuses, each tried on the real kernel in a short-lived child process
(the whole backend under attack is e2e/test_sandbox.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import meshfn.inference
from meshfn.contracts.function import BackendConfig
from meshfn.inference import landlock, sandbox, seccomp

REPO = Path(__file__).resolve().parents[2]
HAS_LANDLOCK = landlock.abi()[0] >= 1
HAS_SECCOMP = seccomp.kernel_support() == ""


def config(tmp: Path, **sandbox_settings: object) -> BackendConfig:
    (tmp / "registry").mkdir(exist_ok=True)
    keys = tmp / "keys"
    keys.mkdir(exist_ok=True)
    (keys / "dev.pub").write_text("public")
    (keys / "dev.key").write_text("PRIVATE")
    return BackendConfig.model_validate(
        {"registry": str(tmp / "registry"), "trustedKeys": [str(keys)],
         "sandbox": {"stateDir": str(tmp / "state"), **sandbox_settings}}
    )  # fmt: skip


def test_landlock_rights_follow_the_abi() -> None:
    assert landlock.fs_rights(0) == 0
    assert landlock.fs_rights(1) == (1 << 13) - 1
    assert (
        landlock.fs_rights(3) & landlock.TRUNCATE and not landlock.fs_rights(3) & landlock.IOCTL_DEV
    )
    assert landlock.fs_rights(7) == (1 << 16) - 1


def test_landlock_rules_grant_keys_not_their_neighbours_and_never_the_repository(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, connect=[{"address": "127.0.0.1", "port": 15201}])
    rules = sandbox.Sandbox(cfg, tmp_path / "backend.json", (9101,)).rules()
    assert tmp_path / "keys" / "dev.pub" in rules.read
    assert tmp_path / "keys" / "dev.key" not in rules.read
    assert tmp_path / "keys" not in rules.read and rules.list_dirs == (tmp_path / "keys",)
    assert {tmp_path / "registry", tmp_path / "backend.json"} <= set(rules.read)
    assert rules.write == (tmp_path / "state",)
    assert rules.bind_ports == (9101,) and rules.connect_ports == (15201,)
    # meshfn's code is read where it really lives (an editable install links to the package
    # folders), and the repository root, where a state directory with the CA key may live, is not.
    inference = Path(meshfn.inference.__file__).resolve().parent
    assert any(inference == p or p in inference.parents for p in rules.read)
    assert REPO not in rules.read and not any(
        p in REPO.parents for p in rules.read if p != Path("/")
    )
    assert Path("/") not in rules.read and Path("/etc") not in rules.read


def test_minimal_drops_what_a_broader_rule_covers() -> None:
    paths = [Path("/usr/lib"), Path("/usr/lib/python3"), Path("/usr/libexec"), Path("/usr/lib")]
    assert landlock.minimal(paths) == (Path("/usr/lib"), Path("/usr/libexec"))


def test_seccomp_kills_what_the_issue_names_and_allows_none_of_it() -> None:
    named = {"execve", "ptrace", "mount", "bpf", "keyctl", "add_key", "request_key",
             "process_vm_readv", "process_vm_writev"}  # fmt: skip
    assert named <= set(sandbox.NEVER)
    assert not set(sandbox.NEVER) & set(sandbox.ALLOWED)
    assert {"mmap", "clone", "socket", "ioctl", "prctl", "bind", "listen"}.isdisjoint(
        sandbox.ALLOWED
    )  # by argument, or not at all


def _child(code: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter: it confines itself, then prints JSON results."""
    prelude = textwrap.dedent(
        f"""
        import errno, json, mmap, os, socket, sys, threading
        from pathlib import Path
        from meshfn.contracts.function import BackendConfig
        from meshfn.inference import sandbox
        cfg = BackendConfig.model_validate(json.loads({json.dumps(json.dumps(config(tmp).model_dump(mode="json")))}))
        box = sandbox.Sandbox(cfg)
        def attempt(f):
            try:
                f()
                return "allowed"
            except OSError as exc:
                return errno.errorcode[exc.errno]
        """
    )
    return subprocess.run(
        [sys.executable, "-P", "-c", prelude + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.skipif(not HAS_LANDLOCK, reason="the kernel has no Landlock")
def test_landlock_on_the_real_kernel(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (tmp_path / "registry").mkdir(exist_ok=True)
    (tmp_path / "registry" / "entry").write_text("module")
    out = _child(
        f"""
        layer = box.confine_filesystem()
        print(json.dumps({{
            "layer": [layer.state, layer.detail],
            "read outside": attempt(lambda: open({str(outside)!r}).read()),
            "read the private key": attempt(lambda: open({str(tmp_path / "keys/dev.key")!r}).read()),
            "read the public key": attempt(lambda: open({str(tmp_path / "keys/dev.pub")!r}).read()),
            "read the registry": attempt(lambda: open({str(tmp_path / "registry/entry")!r}).read()),
            "write the state dir": attempt(lambda: open({str(tmp_path / "state/x")!r}, "w").write("x")),
            "write outside": attempt(lambda: open({str(tmp_path / "y")!r}, "w").write("y")),
            "exec": attempt(lambda: os.execv("/bin/true", ["true"])),
            "import late": attempt(lambda: __import__("decimal")),
            "connect": attempt(lambda: socket.create_connection(("127.0.0.1", 9), 1)),
        }}))
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result.pop("layer")[0] == "on"
    assert result == {
        "read outside": "EACCES", "read the private key": "EACCES", "read the public key": "allowed",
        "read the registry": "allowed", "write the state dir": "allowed", "write outside": "EACCES",
        "exec": "EACCES", "import late": "allowed",
        "connect": "EACCES" if landlock.abi()[0] >= landlock.NET_ABI else "ECONNREFUSED",
    }  # fmt: skip


@pytest.mark.skipif(not HAS_SECCOMP, reason="the kernel has no seccomp filters")
def test_seccomp_allows_serving_refuses_the_rest_and_kills_the_never_list(tmp_path: Path) -> None:
    out = _child(
        """
        box.refuse_io_uring()
        layer = box.confine_syscalls()
        thread = threading.Thread(target=lambda: None); thread.start(); thread.join()
        print(json.dumps({
            "layer": layer.state,
            "thread": "allowed",
            "chmod": attempt(lambda: os.chmod("/tmp", 0o777)),
            "fork": attempt(os.fork),
            "raw socket": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)),
            "netlink": attempt(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)),
            "tcp socket": attempt(lambda: socket.socket().close()),
            "bind": attempt(lambda: socket.socket().bind(("127.0.0.1", 0))),
            "signal another process": attempt(lambda: os.kill(1, 0)),
            "anonymous read-write mmap": attempt(lambda: mmap.mmap(-1, 4096).close()),
        }), flush=True)
        if sys.argv[1:] == ["exec"]:
            os.execv("/bin/true", ["true"])
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        print("still alive", flush=True)
        """,
        tmp_path,
    )
    assert out.returncode == -signal.SIGSYS, out.stdout + out.stderr
    assert "still alive" not in out.stdout
    result = json.loads(out.stdout.splitlines()[0])
    assert result == {
        "layer": "on", "thread": "allowed", "chmod": "EPERM", "fork": "EPERM",
        "raw socket": "EPERM", "netlink": "EPERM", "tcp socket": "allowed", "bind": "EPERM",
        "signal another process": "EPERM", "anonymous read-write mmap": "allowed",
    }  # fmt: skip


@pytest.mark.skipif(not HAS_SECCOMP, reason="the kernel has no seccomp filters")
def test_seccomp_kills_execve(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    out = _child(
        f"""
        box.confine_syscalls()
        os.execv("/bin/sh", ["sh", "-c", "touch {marker}"])
        """,
        tmp_path,
    )
    assert out.returncode == -signal.SIGSYS and not marker.exists(), out.stderr


def test_a_required_layer_that_is_off_refuses_to_start(tmp_path: Path) -> None:
    out = _child(
        """
        import ctypes
        from meshfn.inference import seccomp
        fake = seccomp.Filter(seccomp.ALLOW)
        fake.rule(seccomp.ERRNO(errno.ENOSYS), "landlock_create_ruleset")
        fake.load()  # a kernel without Landlock, from here on
        cfg = cfg.model_copy(update={"sandbox": cfg.sandbox.model_copy(update={"landlock": "required"})})
        try:
            sandbox.Sandbox(cfg).confine_filesystem()
        except sandbox.SandboxError as exc:
            print(exc)
        """,
        tmp_path,
    )
    assert out.stdout.strip() == (
        "landlock is required but unavailable: the kernel has no Landlock (Linux 5.13+ built "
        "with CONFIG_SECURITY_LANDLOCK)"
    ), out.stderr


def test_report_goes_to_the_state_dir(tmp_path: Path) -> None:
    box = sandbox.Sandbox(config(tmp_path, landlock="off", seccomp="off"))
    box.confine_filesystem()
    box.confine_syscalls()
    (tmp_path / "state").mkdir()
    box.write_report()
    report = json.loads((tmp_path / "state" / sandbox.REPORT_FILE).read_text())
    assert report == {
        "pid": os.getpid(),
        "landlock": {"state": "off", "detail": "disabled by policy"},
        "seccomp": {"state": "off", "detail": "disabled by policy"},
    }
