"""seccomp filters over ctypes and the system's libseccomp (Debian's libseccomp2, which apt
itself depends on): libseccomp resolves syscall names per architecture, refuses foreign
architectures and x32 calls, and compiles the rules into a binary-search BPF program.

A filter names an action per syscall, optionally per argument condition; whatever no rule names
gets the default action. `load()` installs it on every thread of the process at once (TSYNC),
which is why it can be applied after start-up, when worker threads already run. Filters stack
and can never be removed; every later thread and child inherits them. No meshfn imports.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

ALLOW: Final = 0x7FFF0000
KILL_PROCESS: Final = 0x80000000


def ERRNO(code: int) -> int:  # libseccomp's name
    return 0x00050000 | (code & 0xFFFF)


_ATTR_ACT_BADARCH: Final = 2
_ATTR_CTL_TSYNC: Final = 4
_ATTR_CTL_OPTIMIZE: Final = 8
_OPS: Final = {"!=": 1, "<": 2, "<=": 3, "==": 4, ">=": 5, ">": 6, "&==": 7}
_PR_GET_SECCOMP: Final = 21

Op = Literal["!=", "<", "<=", "==", ">=", ">", "&=="]


@dataclass(frozen=True)
class Arg:
    """Argument `index` compared with `value`; for "&==", `(arg & mask) == value`."""

    index: int
    op: Op
    value: int
    mask: int = 0


class _Cmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


class Unavailable(OSError):
    """No seccomp filter can be loaded here; `str()` is the one line a person reads."""


LIBRARY: Final = "libseccomp.so.2"


def _library() -> ctypes.CDLL:
    # By soname, through the loader's cache: ctypes.util.find_library would run ldconfig and a
    # compiler, which a confined process may not (and should not) do.
    try:
        lib = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError:
        raise Unavailable(
            errno.ENOENT, f"{LIBRARY} is not installed (Debian: libseccomp2)"
        ) from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    lib.seccomp_attr_set.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32)
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_Cmp),
    )  # fmt: skip
    lib.seccomp_load.argtypes = (ctypes.c_void_p,)
    return lib


def kernel_support() -> str:
    """ "" if the kernel takes seccomp filters, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) < 0:
        return "the kernel has no seccomp (CONFIG_SECCOMP off)"
    return ""


class Filter:
    """One filter under construction; `load()` it, or let it go (nothing is installed)."""

    def __init__(self, default: int) -> None:
        self._lib = _library()
        self._ctx = self._lib.seccomp_init(default)
        if not self._ctx:
            raise Unavailable(errno.EINVAL, "seccomp_init failed")
        self.unknown: list[str] = []  # names this architecture does not have
        self._set(_ATTR_ACT_BADARCH, KILL_PROCESS)
        self._set(_ATTR_CTL_TSYNC, 1)
        # A binary tree instead of a linear list: the per-syscall cost stays flat as the
        # allow-list grows (libseccomp 2.5+; older ones keep the list).
        self._lib.seccomp_attr_set(self._ctx, _ATTR_CTL_OPTIMIZE, 2)

    def _set(self, attr: int, value: int) -> None:
        rc = self._lib.seccomp_attr_set(self._ctx, attr, value)
        if rc < 0:
            raise Unavailable(-rc, f"seccomp_attr_set({attr}): {os.strerror(-rc)}")

    def number(self, name: str) -> int | None:
        nr = int(self._lib.seccomp_syscall_resolve_name(name.encode()))
        return nr if nr >= 0 else None

    def rule(self, action: int, name: str, *args: Arg) -> None:
        """`action` for syscall `name` when every condition holds (several rules for one
        syscall are alternatives). A name this architecture lacks is skipped and remembered."""
        nr = self.number(name)
        if nr is None:
            self.unknown.append(name)
            return
        cmps = (_Cmp * max(1, len(args)))(
            *(_Cmp(a.index, _OPS[a.op], a.mask if a.op == "&==" else a.value, a.value)
              for a in args)
        )  # fmt: skip
        rc = self._lib.seccomp_rule_add_array(self._ctx, action, nr, len(args), cmps)
        if rc < 0:
            raise ValueError(f"seccomp rule for {name}: {os.strerror(-rc)}")

    def rules(self, action: int, names: Sequence[str]) -> None:
        for name in names:
            self.rule(action, name)

    def load(self) -> None:
        """Install on every thread of this process; raises Unavailable if the kernel refuses."""
        try:
            problem = kernel_support()
            if problem:
                raise Unavailable(errno.ENOSYS, problem)
            rc = self._lib.seccomp_load(self._ctx)
            if rc < 0:
                raise Unavailable(-rc, f"the kernel refused the seccomp filter: {os.strerror(-rc)}")
        finally:
            self.release()

    def release(self) -> None:
        if self._ctx:
            self._lib.seccomp_release(self._ctx)
            self._ctx = None


def status(path: Path = Path("/proc/self/status")) -> tuple[int, int]:
    """(seccomp mode, number of filters) as the kernel reports them for a process: mode 2 is
    "filtered"; (-1, 0) where the kernel does not say."""
    mode, filters = -1, 0
    try:
        for line in path.read_text().splitlines():
            if line.startswith("Seccomp:"):
                mode = int(line.split()[1])
            elif line.startswith("Seccomp_filters:"):
                filters = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return mode, filters
