"""The few bpf(2), mount(2) and capability calls meshfn needs, typed, over ctypes.

Everything after the load (pinning, attaching, detaching, counters, cleanup) goes through here
rather than bcc: bcc 0.26 cannot wrap a sockhash, and a process that only reads counters or
detaches should not have to load LLVM.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_SYS_BPF: Final = 321  # x86_64
_ATTR_SIZE: Final = 128

# enum bpf_cmd
_MAP_CREATE: Final = 0
_MAP_LOOKUP_ELEM: Final = 1
_MAP_UPDATE_ELEM: Final = 2
_MAP_DELETE_ELEM: Final = 3
_MAP_GET_NEXT_KEY: Final = 4
_OBJ_PIN: Final = 6
_OBJ_GET: Final = 7
_PROG_ATTACH: Final = 8
_PROG_DETACH: Final = 9
_PROG_GET_NEXT_ID: Final = 11
_MAP_GET_NEXT_ID: Final = 12
_PROG_GET_FD_BY_ID: Final = 13
_MAP_GET_FD_BY_ID: Final = 14
_OBJ_GET_INFO_BY_FD: Final = 15
_PROG_QUERY: Final = 16

# enum bpf_map_type / bpf_attach_type
MAP_TYPE_SOCKHASH: Final = 18
ATTACH_CGROUP_SOCK_OPS: Final = 3
ATTACH_SK_MSG_VERDICT: Final = 7

# capabilities (linux/capability.h)
CAP_NET_ADMIN: Final = 12
CAP_SYS_ADMIN: Final = 21
CAP_BPF: Final = 39

MNT_DETACH: Final = 2
BPF_FS_MAGIC: Final = 0xCAFE4A11
CGROUP2_SUPER_MAGIC: Final = 0x63677270


class BpfError(OSError):
    """A failed bpf(2)/mount(2) call; `str()` names the operation and the errno text."""


def _raise(what: str) -> None:
    code = ctypes.get_errno()
    raise BpfError(code, f"{what}: {os.strerror(code)}")


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char], what: str) -> int:
    ret = int(_libc.syscall(_SYS_BPF, cmd, attr, _ATTR_SIZE))
    if ret < 0:
        _raise(what)
    return ret


def _attr(fmt: str, *values: int) -> ctypes.Array[ctypes.c_char]:
    buf = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into(fmt, buf, 0, *values)
    return buf


def _addr(buf: ctypes.Array[ctypes.c_char]) -> int:
    return ctypes.addressof(buf)


# --- objects -------------------------------------------------------------------------------------


def obj_pin(fd: int, path: Path) -> None:
    name = ctypes.create_string_buffer(os.fsencode(path))
    _bpf(_OBJ_PIN, _attr("=QI", _addr(name), fd), f"pin {path}")


def obj_get(path: Path) -> int:
    """Open a pinned object; the caller closes the returned fd."""
    name = ctypes.create_string_buffer(os.fsencode(path))
    return _bpf(_OBJ_GET, _attr("=QI", _addr(name), 0), f"open pinned {path}")


@dataclass(frozen=True)
class ObjInfo:
    id: int
    type: int
    name: str


def prog_info(fd: int) -> ObjInfo:
    # struct bpf_prog_info: type@0 id@4 ... name[16]@64
    info = ctypes.create_string_buffer(80)
    _bpf(_OBJ_GET_INFO_BY_FD, _attr("=IIQ", fd, len(info), _addr(info)), "prog info")
    kind, ident = struct.unpack_from("=II", info, 0)
    return ObjInfo(ident, kind, info.raw[64:80].split(b"\0", 1)[0].decode())


def map_info(fd: int) -> ObjInfo:
    # struct bpf_map_info: type@0 id@4 key_size@8 value_size@12 max_entries@16 flags@20 name@24
    info = ctypes.create_string_buffer(40)
    _bpf(_OBJ_GET_INFO_BY_FD, _attr("=IIQ", fd, len(info), _addr(info)), "map info")
    kind, ident = struct.unpack_from("=II", info, 0)
    return ObjInfo(ident, kind, info.raw[24:40].split(b"\0", 1)[0].decode())


def _next_ids(cmd: int) -> Iterator[int]:
    ident = 0
    while True:
        attr = _attr("=I", ident)
        if int(_libc.syscall(_SYS_BPF, cmd, attr, _ATTR_SIZE)) < 0:
            if ctypes.get_errno() == errno.ENOENT:
                return
            _raise("list ids")
        ident = struct.unpack_from("=I", attr, 4)[0]
        yield ident


def prog_ids() -> set[int]:
    """Every BPF program id loaded in the kernel."""
    return set(_next_ids(_PROG_GET_NEXT_ID))


def map_ids() -> set[int]:
    return set(_next_ids(_MAP_GET_NEXT_ID))


def prog_fd_by_id(ident: int) -> int:
    return _bpf(_PROG_GET_FD_BY_ID, _attr("=I", ident), f"open prog id {ident}")


def map_fd_by_id(ident: int) -> int:
    return _bpf(_MAP_GET_FD_BY_ID, _attr("=I", ident), f"open map id {ident}")


def create_map(map_type: int, key_size: int, value_size: int, max_entries: int) -> int:
    return _bpf(
        _MAP_CREATE, _attr("=IIIII", map_type, key_size, value_size, max_entries, 0), "create map"
    )


# --- attach --------------------------------------------------------------------------------------


def prog_attach(prog_fd: int, target_fd: int, attach_type: int) -> None:
    # attach_flags 0: exclusive. A second meshfn loader racing for the same cgroup fails with
    # EEXIST instead of stacking a second program.
    _bpf(_PROG_ATTACH, _attr("=IIII", target_fd, prog_fd, attach_type, 0), "attach")


def prog_detach(prog_fd: int, target_fd: int, attach_type: int) -> None:
    _bpf(_PROG_DETACH, _attr("=IIII", target_fd, prog_fd, attach_type, 0), "detach")


def prog_query(target_fd: int, attach_type: int) -> list[int]:
    """Ids of the programs attached to `target_fd` (a cgroup or a sockmap) for `attach_type`."""
    ids = (ctypes.c_uint32 * 64)()
    attr = _attr("=IIIIQI", target_fd, attach_type, 0, 0, ctypes.addressof(ids), len(ids))
    _bpf(_PROG_QUERY, attr, "query attached programs")
    count = struct.unpack_from("=I", attr, 24)[0]
    return list(ids[:count])


# --- map elements --------------------------------------------------------------------------------


def map_keys(fd: int, key_size: int, limit: int = 1 << 20) -> list[bytes]:
    keys: list[bytes] = []
    key = ctypes.create_string_buffer(key_size)
    nxt = ctypes.create_string_buffer(key_size)
    first = True
    while len(keys) < limit:
        attr = _attr("=IIQQ", fd, 0, 0 if first else _addr(key), _addr(nxt))
        if int(_libc.syscall(_SYS_BPF, _MAP_GET_NEXT_KEY, attr, _ATTR_SIZE)) < 0:
            if ctypes.get_errno() == errno.ENOENT:
                break
            _raise("iterate map")
        keys.append(nxt.raw)
        ctypes.memmove(key, nxt, key_size)
        first = False
    return keys


def map_delete(fd: int, key: bytes) -> bool:
    """False if the key was already gone (a socket closed meanwhile)."""
    buf = ctypes.create_string_buffer(key, len(key))
    attr = _attr("=IIQ", fd, 0, _addr(buf))
    if int(_libc.syscall(_SYS_BPF, _MAP_DELETE_ELEM, attr, _ATTR_SIZE)) < 0:
        if ctypes.get_errno() == errno.ENOENT:
            return False
        _raise("delete map element")
    return True


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes:
    kbuf = ctypes.create_string_buffer(key, len(key))
    vbuf = ctypes.create_string_buffer(value_size)
    _bpf(_MAP_LOOKUP_ELEM, _attr("=IIQQ", fd, 0, _addr(kbuf), _addr(vbuf)), "map lookup")
    return vbuf.raw


def map_update(fd: int, key: bytes, value: bytes) -> None:
    kbuf = ctypes.create_string_buffer(key, len(key))
    vbuf = ctypes.create_string_buffer(value, len(value))
    _bpf(_MAP_UPDATE_ELEM, _attr("=IIQQQ", fd, 0, _addr(kbuf), _addr(vbuf), 0), "map update")


def possible_cpus() -> int:
    """Per-CPU map values have one slot per *possible* CPU, not per online one."""
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


# --- mounts and capabilities ---------------------------------------------------------------------


def mount(source: str, target: Path, fstype: str, data: str = "") -> None:
    ret = _libc.mount(
        os.fsencode(source), os.fsencode(target), fstype.encode(), 0, data.encode() or None
    )
    if ret != 0:
        _raise(f"mount -t {fstype} {target}")


def umount(target: Path) -> None:
    if _libc.umount2(os.fsencode(target), 0) != 0:
        if ctypes.get_errno() != errno.EBUSY:
            _raise(f"umount {target}")
        if _libc.umount2(os.fsencode(target), MNT_DETACH) != 0:
            _raise(f"umount -l {target}")


def fs_magic(path: Path) -> int:
    """f_type of the filesystem holding `path` (statfs(2))."""
    buf = ctypes.create_string_buffer(120)  # struct statfs; f_type is the first long
    if _libc.statfs(os.fsencode(path), buf) != 0:
        _raise(f"statfs {path}")
    return int(struct.unpack_from("=q", buf, 0)[0]) & 0xFFFFFFFF


def effective_caps(status: Path = Path("/proc/self/status")) -> int:
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0
