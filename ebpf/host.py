"""What the kernel and the machine offer: privileges, sockmap, kernel headers, cgroup v2.

Each check either returns what the loader needs or raises `Unavailable` with the one line a user
reads to understand why acceleration is off. `Host` holds where kernel headers are looked for, so
a test can point discovery at an empty directory and see the real failure path.
"""

from __future__ import annotations

import errno
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from meshfn.common import env

from . import bpfsys, programs


class Unavailable(RuntimeError):
    """Acceleration cannot run here; `str()` is the one-line reason."""


def default_cache() -> Path:
    return env.cache_home() / "meshfn"


@dataclass(frozen=True)
class Host:
    kernel_release: str = field(default_factory=platform.release)
    modules_dir: Path = Path("/lib/modules")
    header_cache: Path = field(default_factory=lambda: default_cache() / "kernel-headers")
    # None: read $BCC_KERNEL_SOURCE when a check runs; "" means "not set".
    kernel_source_env: str | None = None

    def env_headers(self) -> str:
        if self.kernel_source_env is not None:
            return self.kernel_source_env
        return env.BCC_KERNEL_SOURCE.get_or("")


# --- privileges and kernel features --------------------------------------------------------------

_NEEDED_CAPS = {"CAP_SYS_ADMIN": bpfsys.CAP_SYS_ADMIN, "CAP_NET_ADMIN": bpfsys.CAP_NET_ADMIN}


def check_privileges(what: str = "eBPF acceleration") -> None:
    """Mounting bpffs/cgroup2 needs CAP_SYS_ADMIN, attaching sock_ops CAP_NET_ADMIN."""
    caps = bpfsys.effective_caps()
    missing = [name for name, bit in _NEEDED_CAPS.items() if not caps >> bit & 1]
    if missing:
        raise Unavailable(
            f"no privileges: {what} needs {' and '.join(_NEEDED_CAPS)} "
            f"(run meshfn as root); missing {', '.join(missing)}"
        )


def check_sockmap() -> None:
    """Create and drop a one-entry sockhash: the cheapest proof the kernel has sockmap."""
    try:
        fd = bpfsys.create_map(bpfsys.MAP_TYPE_SOCKHASH, programs.SOCK_KEY_SIZE, 4, 1)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise Unavailable(
                f"no privileges: the kernel refused to create a BPF map ({exc})"
            ) from None
        if exc.errno == errno.ENOSYS:
            raise Unavailable(
                "the kernel has no bpf() system call (CONFIG_BPF_SYSCALL off)"
            ) from None
        raise Unavailable(
            f"the kernel has no sockmap support (CONFIG_BPF_STREAM_PARSER / CONFIG_NET_SOCK_MSG): {exc}"
        ) from None
    os.close(fd)


def check_bcc() -> None:
    import importlib.util

    if importlib.util.find_spec("bcc") is None:
        raise Unavailable(
            "bcc is not importable: install Debian's python3-bpfcc and expose it to the venv "
            "(ebpf/setup_host.sh does both)"
        )


# --- kernel headers ------------------------------------------------------------------------------

_HEADER_MARKERS = ("include/linux/kconfig.h", "include/generated/autoconf.h")


def _header_problem(tree: Path) -> str | None:
    missing = [marker for marker in _HEADER_MARKERS if not (tree / marker).is_file()]
    if missing:
        return f"{tree} lacks {', '.join(missing)}"
    return None


def find_headers(host: Host) -> Path:
    """$BCC_KERNEL_SOURCE, else /lib/modules/<release>/build, else the merged tree that
    ebpf/setup_host.sh caches. A tree needs the common headers AND the generated ones: Debian
    splits them into -common and -amd64 packages and either alone fails to compile."""
    explicit = host.env_headers()
    if explicit:
        problem = _header_problem(Path(explicit))
        if problem:
            raise Unavailable(f"no usable kernel headers: BCC_KERNEL_SOURCE={explicit}: {problem}")
        return Path(explicit)
    candidates = [
        host.modules_dir / host.kernel_release / "build",
        host.header_cache / "current",
    ]
    problems = []
    for tree in candidates:
        problem = _header_problem(tree)
        if problem is None:
            return tree.resolve()
        problems.append(problem if tree.exists() else f"{tree} does not exist")
    raise Unavailable(
        "no kernel headers: " + "; ".join(problems) + " (set BCC_KERNEL_SOURCE or run "
        "ebpf/setup_host.sh)"
    )


# --- cgroup v2 -----------------------------------------------------------------------------------


def cgroup2_mounts() -> list[Path]:
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            found.append(Path(parts[1].replace("\\040", " ")))
    return found


def is_mounted(path: Path, magic: int) -> bool:
    try:
        return bpfsys.fs_magic(path) == magic and os.path.ismount(path)
    except OSError:
        return False
