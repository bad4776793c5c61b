"""The backend confined by the kernel: Landlock from the first moment of `serve`, a seccomp
allow-list once it has started (docs/concepts/sandbox.md).

Landlock (landlock.py) is applied by `confine_filesystem`, while the process has one thread
(a Landlock domain reaches only threads created after it): the backend may then read its
registry, its trusted public keys (not their directory's other files), its configuration and the
code it runs (the interpreter, its libraries and meshfn's packages), plus the few system files a
running Python reads (the loader cache, time zone, name service files, its own /proc entry,
/proc/meminfo); it may write only `sandbox.stateDir`. Where the ABI has network rights it may
bind only its own TCP ports and connect only to the ports the policy's egress peers listen on;
where it has scopes, it may not signal processes or reach abstract unix sockets outside its
domain. Execution of any file is refused.

seccomp (seccomp.py) is applied by `confine_syscalls` after start-up (every thread, at once):
an allow-list measured on the serving paths (HTTP, gRPC, cold starts from the code cache,
traps, timeouts, memory caps, repository load/unload, warm-up, drain). Three classes:
- allowed: the list below, some by argument (clone only for threads, socket only for unix/TCP/
  UDP, ioctl only for non-blocking/close-on-exec/tty queries, prctl only for thread names,
  kill/tgkill only of itself, prlimit64 only to read);
- killed (SIGSYS, the whole process): `NEVER`, and mmap with PROT_EXEC|MAP_ANONYMOUS. No
  healthy backend makes these after start-up (measured), so one attempt is proof of compromise:
  the process dies at once, its in-flight requests fail, and its supervisor starts a fresh one
  that logs it. EPERM would let an attacker keep probing, and hide the attempt;
- everything else gets EPERM (clone3 ENOSYS, so glibc falls back to clone, whose flags seccomp
  can see): an unforeseen but harmless call (a newer library, a rarely used path) fails
  softly rather than killing a serving process in production. chmod/chown/xattr/utimes, which
  Landlock does not cover, are in this class.

What it cannot see: what an `mprotect` covers (wasmtime makes the code cache's text executable
on every cold start, so `mprotect` stays allowed), nor a file mapped executable after the
process wrote it into its state directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from meshfn.contracts.function import SandboxSettings

from . import landlock, seccomp
from .config import BackendConfig
from .errors import InferenceError

log = logging.getLogger("meshfn.inference.sandbox")

REPORT_FILE: Final = "sandbox.json"

# --- Landlock -------------------------------------------------------------------------------------

# Read by a running CPython and glibc besides the code: the loader cache, time zone data, name
# service configuration (a future function with egress resolves names), CPU count.
SYSTEM_READ: Final = (
    "/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo", "/etc/hosts",
    "/etc/nsswitch.conf", "/etc/resolv.conf", "/etc/host.conf", "/etc/gai.conf",
    "/etc/services", "/etc/protocols", "/proc/meminfo", "/proc/sys/vm/overcommit_memory",
    "/proc/sys/net/core/somaxconn",
    "/sys/devices/system/cpu", "/dev/null", "/dev/urandom",
)  # fmt: skip
# Shared libraries (dlopen after start-up: an extension module imported late, libgcc_s).
LIBRARY_DIRS: Final = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")

# --- seccomp --------------------------------------------------------------------------------------

# Never after start-up: the list and the administrative calls. Killed.
NEVER: Final = (
    "execve", "execveat",  # run another program
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",  # other processes
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "setns", "unshare",  # the file system, namespaces
    "bpf", "perf_event_open", "userfaultfd",  # kernel programs and exploit primitives
    "add_key", "request_key", "keyctl",  # the kernel keyring
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm", "open_by_handle_at",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "personality",  # READ_IMPLIES_EXEC would make every readable mapping executable
)  # fmt: skip

ALLOWED: Final = (
    # files (Landlock decides which)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2",
    "pwritev2", "close", "close_range", "lseek", "fstat", "newfstatat", "statx", "stat", "lstat",
    "fstatfs", "statfs", "openat", "open", "getdents64", "readlink", "readlinkat", "access",
    "faccessat", "faccessat2", "fcntl", "dup", "dup2", "dup3", "flock", "fsync", "fdatasync",
    "ftruncate", "fallocate", "fadvise64", "rename", "renameat", "renameat2", "unlink",
    "unlinkat", "mkdir", "mkdirat", "rmdir", "getcwd", "umask",
    # memory (mmap by argument, below)
    "munmap", "mremap", "mprotect", "brk", "membarrier", "mincore",
    # threads, time, signals, identity
    "futex", "futex_waitv", "set_robust_list", "rseq", "exit", "exit_group", "sched_yield",
    "sched_getaffinity", "sched_getparam", "sched_getscheduler", "sched_get_priority_max",
    "sched_get_priority_min", "getcpu", "clock_gettime", "clock_getres", "clock_nanosleep",
    "nanosleep", "gettimeofday", "time", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn",
    "rt_sigtimedwait", "rt_sigpending", "sigaltstack", "restart_syscall", "getpid", "gettid",
    "getppid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid", "getresgid",
    "getpgrp", "getpgid", "getsid", "getrandom", "uname", "sysinfo", "getrlimit", "getrusage",
    "times",
    # event loops
    "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll",
    "select", "pselect6", "eventfd2", "pipe2", "pipe", "timerfd_create", "timerfd_settime",
    "timerfd_gettime", "signalfd4",
    # sockets it has, or the policy lets it open (Landlock and the egress cgroup decide where)
    "connect", "accept", "accept4", "getsockname", "getpeername", "setsockopt", "getsockopt",
    "shutdown", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg",
)  # fmt: skip

_PROT_EXEC: Final = 0x4
_MAP_ANONYMOUS: Final = 0x20
_CLONE_THREAD: Final = 0x10000
_SOCK_TYPE_MASK: Final = 0xF
_SOCKET_FAMILIES: Final = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
_SOCKET_TYPES: Final = (1, 2)  # SOCK_STREAM, SOCK_DGRAM (no raw or packet sockets)
# FIONBIO, FIONREAD, FIOCLEX, FIONCLEX, TCGETS (isatty), TIOCGWINSZ
_IOCTLS: Final = (0x5421, 0x541B, 0x5451, 0x5450, 0x5401, 0x5413)
# PR_GET_DUMPABLE, PR_SET_NAME, PR_GET_NAME, PR_GET_SECCOMP, PR_SET_VMA (glibc names mappings)
_PRCTLS: Final = (3, 15, 16, 21, 0x53564D41)
_MADV_HWPOISON: Final = 100
_MADV_SOFT_OFFLINE: Final = 101


def build_filter(pid: int) -> seccomp.Filter:
    """The serving processes' filter (module docstring); `pid`: the process it is built for
    (signals only to itself)."""
    A = seccomp.Arg
    f = seccomp.Filter(seccomp.ERRNO(errno.EPERM))
    f.rules(seccomp.ALLOW, ALLOWED)
    f.rules(seccomp.KILL_PROCESS, NEVER)
    # Anonymous executable memory: killed. Executable file mappings (the code cache's .cwasm,
    # shared libraries) and anonymous read-write memory stay allowed.
    f.rule(seccomp.ALLOW, "mmap", A(2, "&==", 0, _PROT_EXEC))
    f.rule(seccomp.ALLOW, "mmap", A(3, "&==", 0, _MAP_ANONYMOUS))
    f.rule(
        seccomp.KILL_PROCESS,
        "mmap",
        A(2, "&==", _PROT_EXEC, _PROT_EXEC),
        A(3, "&==", _MAP_ANONYMOUS, _MAP_ANONYMOUS),
    )
    # Threads only; no new processes. clone3 hides its flags in memory seccomp cannot read.
    f.rule(seccomp.ALLOW, "clone", A(0, "&==", _CLONE_THREAD, _CLONE_THREAD))
    f.rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for family in _SOCKET_FAMILIES:
        for kind in _SOCKET_TYPES:
            f.rule(seccomp.ALLOW, "socket", A(0, "==", family), A(1, "&==", kind, _SOCK_TYPE_MASK))
    f.rule(seccomp.ALLOW, "socketpair", A(0, "==", 1))
    for request in _IOCTLS:
        f.rule(seccomp.ALLOW, "ioctl", A(1, "==", request))
    for option in _PRCTLS:
        f.rule(seccomp.ALLOW, "prctl", A(0, "==", option))
    # (libseccomp takes one comparison per argument and rule: two rules around the pair)
    f.rule(seccomp.ALLOW, "madvise", A(2, "<", _MADV_HWPOISON))
    f.rule(seccomp.ALLOW, "madvise", A(2, ">", _MADV_SOFT_OFFLINE))
    f.rule(seccomp.ALLOW, "kill", A(0, "==", pid))
    f.rule(seccomp.ALLOW, "tgkill", A(0, "==", pid))
    f.rule(seccomp.ALLOW, "prlimit64", A(2, "==", 0))  # read a limit, never set one
    return f


# --- the backend's sandbox ------------------------------------------------------------------------


class SandboxError(InferenceError):
    """A layer in mode `required` could not be applied."""


@dataclass
class Layer:
    state: str = "off"  # on | off | failed
    detail: str = ""

    def line(self, name: str) -> str:
        return f"{name} {self.state}: {self.detail}" if self.detail else f"{name} {self.state}"


@dataclass
class Sandbox:
    """The confinement of one serving process (`serve`). Not thread-safe: start-up only."""

    config: BackendConfig
    config_path: Path | None = None
    bind_ports: tuple[int, ...] = ()  # TCP ports this process binds itself
    unix_paths: tuple[Path, ...] = ()  # unix sockets this process binds itself
    layers: dict[str, Layer] = field(
        default_factory=lambda: {"landlock": Layer(), "seccomp": Layer()}
    )
    _pinned: list[int] = field(default_factory=list)

    @property
    def settings(self) -> SandboxSettings:
        return self.config.sandbox

    # --- Landlock -------------------------------------------------------------------------------

    def rules(self) -> landlock.Rules:
        config = self.config
        read: list[Path] = [config.registry]
        list_only: list[Path] = []
        for key in config.trustedKeys:
            if key.is_dir():  # its *.pub only: a signing key may sit beside them
                list_only.append(key)
                read.extend(sorted(key.glob("*.pub")))
            else:
                read.append(key)
        if self.config_path is not None:
            read.append(self.config_path)
        read += code_paths()
        read += [Path(p) for p in (*LIBRARY_DIRS, *SYSTEM_READ)]
        read.append(Path(f"/proc/{os.getpid()}"))
        state = self.settings.stateDir
        writable = (state,) if state is not None else ()
        # its unix sockets: in its state dir under meshfn up; elsewhere, their directory
        writable_or_below = {p.parent for p in self.unix_paths if state and state in p.parents}
        return landlock.Rules(
            read=landlock.minimal(read),
            list_dirs=tuple(list_only),
            write=writable,
            make_sock=tuple(sorted({p.parent for p in self.unix_paths} - writable_or_below)),
            bind_ports=self.bind_ports,
            connect_ports=tuple(sorted({peer.port for peer in self.settings.connect})),
        )

    def at_start(self) -> None:
        """What must come before any thread exists: Landlock, and (with seccomp on) refusing
        io_uring. Raises SandboxError if a `required` layer is not possible."""
        self.confine_filesystem()
        if self.settings.seccomp != "off":
            self.refuse_io_uring()

    def refuse_io_uring(self) -> None:
        """io_uring_setup answers ENOSYS from now on, as on a kernel without io_uring.

        A ring's operations (open, connect, socket...) never pass through seccomp, so a ring
        made before the allow-list would be a way around it. libuv (uvloop) makes one for every
        event loop, to batch epoll_ctl, whatever UV_USE_IO_URING says, and aborts if the ring
        later fails; refused at the start, it uses plain epoll_ctl."""
        try:
            early = seccomp.Filter(seccomp.ALLOW)
            for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
                early.rule(seccomp.ERRNO(errno.ENOSYS), name)
            early.load()
        except seccomp.Unavailable as exc:
            log.debug("io_uring left as it is: %s", exc)

    def confine_filesystem(self) -> Layer:
        """Landlock, now (one thread). Raises SandboxError if `required` and not possible."""
        mode = self.settings.landlock
        layer = self.layers["landlock"]
        if mode == "off":
            layer.detail = "disabled by policy"
            return layer
        state = self.settings.stateDir
        if state is not None:
            state.mkdir(parents=True, exist_ok=True, mode=0o700)
        rules = self.rules()
        self._pin_proc_entries(rules)
        try:
            applied = landlock.restrict(rules)
        except landlock.Unavailable as exc:
            return self._unavailable("landlock", mode, exc.strerror or str(exc))
        if not _denied_root():
            # Never claim a layer that is not there: a ruleset that does not refuse listing /
            # (granted by no rule) is not in force.
            return self._not_in_force("landlock", mode, "applied, but / is still readable")
        layer.state = "on"
        layer.detail = _landlock_detail(applied, rules)
        if state is not None:
            wide = [p for p in rules.read if p in state.resolve().parents]
            if wide:  # e.g. a registry that holds the control plane's state directory
                layer.detail += f"; reads include {', '.join(map(str, wide))}, above its state dir"
                log.warning("Landlock grants reading %s, which holds the state directory", wide)
        return layer

    def _pin_proc_entries(self, rules: landlock.Rules) -> None:
        """procfs makes a fresh inode when an uncached dentry is looked up again, and a rule
        names an inode: keep the granted /proc and /sys entries open, so they stay the same."""
        for path in rules.read:
            if path.parts[1:2] in (("proc",), ("sys",)):
                with contextlib.suppress(OSError):
                    self._pinned.append(os.open(path, os.O_PATH | os.O_CLOEXEC))

    # --- seccomp --------------------------------------------------------------------------------

    def confine_syscalls(self) -> Layer:
        """The seccomp allow-list, on every thread, after start-up."""
        mode = self.settings.seccomp
        layer = self.layers["seccomp"]
        if mode == "off":
            layer.detail = "disabled by policy"
            return layer
        try:
            problem = seccomp.kernel_support()
            if problem:
                raise seccomp.Unavailable(errno.ENOSYS, problem)
            build_filter(os.getpid()).load()
        except seccomp.Unavailable as exc:
            return self._unavailable("seccomp", mode, exc.strerror or str(exc))
        mode_now, filters = seccomp.status()
        if mode_now != 2:
            return self._not_in_force(
                "seccomp", mode, f"loaded, but the kernel says mode {mode_now}"
            )
        layer.state = "on"
        layer.detail = (
            f"{len(ALLOWED)}+ syscalls allowed, killed on exec/ptrace/mount/bpf/keyring/"
            "process_vm and anonymous executable mmap, EPERM otherwise"
            f" ({filters} filter{'s' if filters != 1 else ''})"
        )
        return layer

    def _not_in_force(self, name: str, mode: str, detail: str) -> Layer:
        """Applied, yet the kernel does not show it: "failed", never "on"."""
        if mode == "required":
            raise SandboxError(f"{name}: {detail}")
        layer = self.layers[name]
        layer.state, layer.detail = "failed", detail
        log.error("%s is not in force: %s", name, detail)
        return layer

    def _unavailable(self, name: str, mode: str, reason: str) -> Layer:
        if mode == "required":
            raise SandboxError(f"{name} is required but unavailable: {reason}")
        layer = self.layers[name]
        layer.state, layer.detail = "off", f"unavailable: {reason}"
        log.warning("%s unavailable; running without it: %s", name, reason)
        return layer

    # --- report ---------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            **{name: {"state": x.state, "detail": x.detail} for name, x in self.layers.items()},
        }

    def line(self) -> str:
        return "sandbox: " + "; ".join(x.line(name) for name, x in self.layers.items())

    def write_report(self) -> None:
        """`<stateDir>/sandbox.json`, where the control plane reads what each backend applied."""
        state = self.settings.stateDir
        if state is None:
            return
        tmp = state / f".{REPORT_FILE}.{os.getpid()}"
        try:
            tmp.write_text(json.dumps(self.report()))
            tmp.replace(state / REPORT_FILE)
        except OSError as exc:
            log.warning("cannot write the sandbox report: %s", exc)


def _denied_root() -> bool:
    try:
        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return True
    os.close(fd)
    return False


def _landlock_detail(applied: landlock.Applied, rules: landlock.Rules) -> str:
    parts = [f"ABI {applied.abi}", "read: registry, keys, config, code", "write: "]
    parts[-1] += "state dir" if rules.write else "nothing"
    if applied.network:
        ports = ",".join(map(str, rules.connect_ports)) or "none"
        parts.append(f"TCP connect: {ports}")
    else:
        parts.append(f"no TCP port rules (ABI {applied.abi} < {landlock.NET_ABI})")
    if not applied.scoped:
        parts.append("no signal/abstract-socket scopes")
    parts.append("exec: nothing")
    return ", ".join(parts)


def code_paths() -> list[Path]:
    """Where the code this process runs comes from: the interpreter's installation, every
    directory on sys.path, and the targets of an editable install's links (meshfn's package
    folders, never the repository root, which may hold a state directory)."""
    paths = {Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    for entry in sys.path:
        if entry and os.path.exists(entry):
            paths.add(Path(entry))
            paths.update(_link_targets(Path(entry)))
    return sorted(paths)


def _link_targets(root: Path) -> Iterable[Path]:
    """The folders symlinks below `root` point into (setuptools' strict editable installs are
    link farms; Landlock checks the target of a link, not the link)."""
    if not root.is_dir() or "__editable__" not in root.name:
        return set()
    targets: set[Path] = set()
    for folder, dirs, files in os.walk(root):
        for name in files + dirs:
            path = Path(folder) / name
            if path.is_symlink():
                resolved = path.resolve()
                targets.add(resolved if resolved.is_dir() else resolved.parent)
    return targets
