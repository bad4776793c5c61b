"""Landlock (the kernel's unprivileged access-control LSM) over ctypes: what the kernel offers,
and a ruleset that a process imposes on itself for the rest of its life.

Landlock denies by default whatever access types a ruleset *handles*, and grants them back only
beneath the directories (or on the files) that rules name: `restrict` handles every filesystem
right the kernel's ABI knows (execute, read, write, make, remove, rename across directories,
truncate, device ioctls), TCP bind/connect by port where the ABI has network rights (4+), and
the abstract-unix-socket and signal scopes (6+). A denied access fails with EACCES (EPERM for
a signal), whoever the process runs as: Landlock confines root as well.

Two properties shape how it is used (inference/sandbox.py):
- A domain is inherited by threads and children created *after* `landlock_restrict_self`, never
  by threads that exist already (this kernel's ABI 7 has no thread synchronisation), so a
  process restricts itself while it still has one thread, or not at all (`restrict` refuses).
- Rules name inodes, resolved when the rule is added: a path that does not exist yet cannot be
  granted, and a symlink is granted at its target.

Syscall numbers 444-446 are the same on every architecture (they came after the table was
unified). No meshfn imports: the kernel interface only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_SYS_CREATE_RULESET: Final = 444
_SYS_ADD_RULE: Final = 445
_SYS_RESTRICT_SELF: Final = 446
_CREATE_RULESET_VERSION: Final = 1 << 0
_RULE_PATH_BENEATH: Final = 1
_RULE_NET_PORT: Final = 2
_PR_SET_NO_NEW_PRIVS: Final = 38

# Filesystem access rights (uapi/linux/landlock.h), with the ABI that introduced each.
EXECUTE: Final = 1 << 0
WRITE_FILE: Final = 1 << 1
READ_FILE: Final = 1 << 2
READ_DIR: Final = 1 << 3
REMOVE_DIR: Final = 1 << 4
REMOVE_FILE: Final = 1 << 5
MAKE_CHAR: Final = 1 << 6
MAKE_DIR: Final = 1 << 7
MAKE_REG: Final = 1 << 8
MAKE_SOCK: Final = 1 << 9
MAKE_FIFO: Final = 1 << 10
MAKE_BLOCK: Final = 1 << 11
MAKE_SYM: Final = 1 << 12
REFER: Final = 1 << 13  # ABI 2
TRUNCATE: Final = 1 << 14  # ABI 3
IOCTL_DEV: Final = 1 << 15  # ABI 5
# Network rights (ABI 4): TCP only, by port.
NET_BIND_TCP: Final = 1 << 0
NET_CONNECT_TCP: Final = 1 << 1
# Scopes (ABI 6): no connecting to abstract unix sockets, nor signalling processes, outside
# the domain.
SCOPE_ABSTRACT_UNIX_SOCKET: Final = 1 << 0
SCOPE_SIGNAL: Final = 1 << 1

READ: Final = READ_FILE | READ_DIR
# The rights a rule on a regular file (not a directory) may carry.
_FILE_RIGHTS: Final = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
NET_ABI: Final = 4
SCOPE_ABI: Final = 6


def fs_rights(abi: int) -> int:
    """Every filesystem right the kernel's Landlock ABI `abi` knows (0: none)."""
    if abi < 1:
        return 0
    rights = (1 << 13) - 1  # EXECUTE .. MAKE_SYM: ABI 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


class Unavailable(OSError):
    """The kernel cannot apply the ruleset; `str()` is the one line a person reads."""


def abi() -> tuple[int, str]:
    """(the kernel's Landlock ABI version, "") or (0, why there is none)."""
    ret = int(_libc.syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION))
    if ret >= 0:
        return ret, ""
    code = ctypes.get_errno()
    if code == errno.ENOSYS:
        return 0, "the kernel has no Landlock (Linux 5.13+ built with CONFIG_SECURITY_LANDLOCK)"
    if code == errno.EOPNOTSUPP:
        return 0, "Landlock is built into the kernel but not enabled (add landlock to lsm=)"
    return 0, f"cannot query Landlock: {os.strerror(code)}"


@dataclass(frozen=True)
class Rules:
    """What a confined process may still do. Paths that do not exist are skipped (reported)."""

    read: tuple[Path, ...] = ()  # read files, list directories, beneath each
    list_dirs: tuple[Path, ...] = ()  # list these directories only (their files need rules)
    write: tuple[Path, ...] = ()  # everything beneath each (a state directory)
    make_sock: tuple[Path, ...] = ()  # bind (and replace) unix sockets in these directories
    bind_ports: tuple[int, ...] = ()  # TCP ports it may bind (ABI 4+)
    connect_ports: tuple[int, ...] = ()  # TCP ports it may connect to (ABI 4+)


@dataclass(frozen=True)
class Applied:
    """What `restrict` imposed: the ABI, what it handles, and the paths it could not grant."""

    abi: int
    network: bool  # TCP bind/connect restricted by port
    scoped: bool  # abstract unix sockets and signals restricted to the domain
    missing: tuple[Path, ...] = field(default=())


def _syscall(number: int, *args: object) -> int:
    ret = int(_libc.syscall(number, *args))
    if ret < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return ret


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def restrict(rules: Rules) -> Applied:
    """Impose `rules` on this process for the rest of its life (and on its future threads and
    children). Raises Unavailable (nothing imposed) if the kernel has no Landlock or the
    process already runs more than one thread."""
    version, reason = abi()
    if version < 1:
        raise Unavailable(errno.ENOSYS, reason)
    threads = thread_count()
    if threads != 1:
        raise Unavailable(
            errno.EBUSY,
            f"the process already runs {threads} threads; Landlock would confine only one",
        )
    handled_fs = fs_rights(version)
    network = version >= NET_ABI
    scoped = version >= SCOPE_ABI
    attr = struct.pack(
        "=QQQ",
        handled_fs,
        NET_BIND_TCP | NET_CONNECT_TCP if network else 0,
        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if scoped else 0,
    )
    size = 8 if version < NET_ABI else 16 if version < SCOPE_ABI else 24
    buf = ctypes.create_string_buffer(attr[:size], size)
    try:
        ruleset = _syscall(_SYS_CREATE_RULESET, buf, ctypes.c_size_t(size), 0)
    except OSError as exc:
        raise Unavailable(
            exc.errno or 0, f"cannot create a Landlock ruleset: {exc.strerror}"
        ) from None
    missing: list[Path] = []
    try:
        grants = [(p, READ) for p in rules.read] + [(p, handled_fs) for p in rules.write]
        grants += [(p, READ_DIR) for p in rules.list_dirs]
        grants += [(p, MAKE_SOCK | REMOVE_FILE) for p in rules.make_sock]
        for path, rights in grants:
            if not _add_path(ruleset, path, rights & handled_fs):
                missing.append(path)
        if network:
            for port in sorted(set(rules.bind_ports)):
                _add_port(ruleset, NET_BIND_TCP, port)
            for port in sorted(set(rules.connect_ports)):
                _add_port(ruleset, NET_CONNECT_TCP, port)
        _syscall_prctl_no_new_privs()
        try:
            _syscall(_SYS_RESTRICT_SELF, ruleset, 0)
        except OSError as exc:
            raise Unavailable(
                exc.errno or 0, f"landlock_restrict_self failed: {exc.strerror}"
            ) from None
    finally:
        os.close(ruleset)
    return Applied(version, network, scoped, tuple(missing))


def _add_path(ruleset: int, path: Path, rights: int) -> bool:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FILE_RIGHTS
        if not rights:
            return True
        rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
        _syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, rule, 0)
    finally:
        os.close(fd)
    return True


def _add_port(ruleset: int, right: int, port: int) -> None:
    rule = ctypes.create_string_buffer(struct.pack("=QQ", right, port), 16)
    _syscall(_SYS_ADD_RULE, ruleset, _RULE_NET_PORT, rule, 0)


def _syscall_prctl_no_new_privs() -> None:
    """No set-uid or file-capability gains from here on (Landlock requires it without
    CAP_SYS_ADMIN; a confined root must not regain what it gave up either)."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise Unavailable(code, f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(code)}")


def minimal(paths: Iterable[Path]) -> tuple[Path, ...]:
    """`paths` without duplicates and without those beneath another one (rules are recursive)."""
    unique = sorted({Path(os.path.normpath(p)) for p in paths}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return tuple(sorted(kept))
