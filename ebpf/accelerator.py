"""Attach, reuse, inspect and detach the mesh's socket redirection.

State lives in `<state_dir>/ebpf/`: a private bpffs (`bpffs/`) holding the pinned programs and
maps, `state.json` naming the cgroup and what was mounted, and a lock file. Anything attached can
therefore be found and detached by any later process (`python -P -m meshfn.ebpf detach`), also
after the process that attached it was SIGKILLed: the kernel keeps cgroup and sockmap attachments
after their loader exits, and bcc's cleanup does not detach them.

Detaching never drops data. Removing a socket from the sockhash frees its psock together with
any redirected bytes the application has not read yet (measured: 50 000 of 50 000 bytes lost), so
teardown only turns redirection off (new messages take the normal TCP path, after the queued ones
in order), detaches both programs and unpins them. Sockets already in the map keep their psock
until they close; the kernel frees the map and programs with the last of them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import platform
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, get_args

from . import bpfsys, loader, programs, statedir
from .cgroups import cgroup2_root, collect, detach_quietly, open_dir, remove_cgroup, unmount_own
from .host import (
    Host,
    Unavailable,
    cgroup2_mounts,
    check_bcc,
    check_privileges,
    check_sockmap,
    find_headers,
    is_mounted,
)

log = logging.getLogger("meshfn.ebpf")

Mode = Literal["ebpf", "off", "auto"]
MODES: Final[tuple[str, ...]] = get_args(Mode)
STATS_KEYS: Final = ("attached", *programs.COUNTERS, "sockets_in_map")

_ENABLED: Final = struct.pack("=I", 1)
_DISABLED: Final = struct.pack("=I", 0)


class AccelerationUnavailable(RuntimeError):
    """`setup("ebpf")` could not attach; `str()` is the one-line reason. Nothing stays attached."""


@dataclass(frozen=True)
class AccelerationStatus:
    mode: Mode
    attached: bool
    reason: str  # why it is off (one line), or what is attached
    cgroup: Path | None = None
    reused: bool = False  # pinned programs of an earlier loader were kept (restart)

    def line(self) -> str:
        state = "on" if self.attached else "off"
        return f"eBPF acceleration {state} (mode {self.mode}): {self.reason}"


@dataclass
class _State:
    build: str
    cgroup: str
    cgroup2_mount: str
    mounted_cgroup2: bool
    bpffs: str
    prog_ids: dict[str, int] = field(default_factory=dict)
    map_ids: dict[str, int] = field(default_factory=dict)


def cgroup_name(state_dir: Path) -> str:
    """One cgroup per state directory, named so a later process finds it without state.json."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return f"meshfn-{digest}"


class Accelerator:
    """eBPF socket redirection for the processes of one mesh (one state directory).

    All methods block (setup ~1 s: it compiles in a child process); call them from a thread
    (`asyncio.to_thread`) in an event loop.
    """

    def __init__(
        self, state_dir: Path, host: Host | None = None, program_source: str | None = None
    ) -> None:
        self.state_dir = Path(state_dir).resolve()  # state.json holds paths: never relative
        self.dir = self.state_dir / "ebpf"
        self.host = host or Host()
        self._text = programs.source() if program_source is None else program_source
        self._state: _State | None = None

    # --- public API ------------------------------------------------------------------------------

    @property
    def cgroup_path(self) -> Path | None:
        """The cgroup whose processes' loopback sockets are redirected; None when off."""
        return Path(self._state.cgroup) if self._state else None

    def setup(self, mode: Mode = "auto") -> AccelerationStatus:
        """Attach (or keep an identical attachment of an earlier loader) per `mode`.

        `auto` never raises: a status with `attached=False` carries the reason. `ebpf` raises
        AccelerationUnavailable with that reason. Either way nothing is half attached: a failure
        part way rolls back everything this call created.
        """
        if mode not in MODES:
            raise ValueError(f"acceleration mode must be one of {', '.join(MODES)}, not {mode!r}")
        status = statedir.attempt(
            mode,
            self.shutdown,
            lambda: self._setup(mode),
            lambda reason: AccelerationStatus(mode, False, reason),
            "eBPF",
        )
        if not status.attached and mode == "ebpf":
            raise AccelerationUnavailable(status.reason)
        return status

    def add_pid(self, pid: int) -> bool:
        """Move a running process into the cgroup; False when acceleration is off.

        Sockets keep the cgroup they were created in (accepted sockets: their listener's), so
        prefer `child_preexec()`, which joins before the child opens any socket. Only processes
        that use non-blocking sockets belong here (Envoy, asyncio servers): under redirection a
        *blocking* recv() on a socket that was shut down for writing, or woken for another
        reason, can fail with EAGAIN (e2e/test_ebpf_redirect.py shows it).
        """
        if self._state is None:
            return False
        (Path(self._state.cgroup) / "cgroup.procs").write_text(str(pid))
        return True

    def child_preexec(self) -> Callable[[], None] | None:
        """A `preexec_fn` that moves the child into the cgroup before exec; None when off."""
        if self._state is None:
            return None
        procs = os.fsencode(Path(self._state.cgroup) / "cgroup.procs")

        def join() -> None:  # runs in the forked child: plain syscalls only
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return join

    def stats(self) -> dict[str, int]:
        """Counters summed over CPUs, plus `sockets_in_map` and `attached` (0/1).

        Reads the pinned maps, so any process can ask (also one that did not attach). Counters
        survive a loader restart and start from zero after a detach.
        """
        out = dict.fromkeys(STATS_KEYS, 0)
        state = self._state or statedir.load(self.dir, _State)
        if state is None:
            return out
        bpffs = Path(state.bpffs)
        try:
            counters = bpfsys.obj_get(bpffs / programs.PIN_COUNTERS)
        except OSError:
            return out
        try:
            socks = bpfsys.obj_get(bpffs / programs.PIN_SOCKS)
        except OSError:
            os.close(counters)
            return out
        try:
            ncpu = bpfsys.possible_cpus()
            for slot, name in enumerate(programs.COUNTERS):
                raw = bpfsys.map_lookup(counters, struct.pack("=I", slot), 8 * ncpu)
                out[name] = sum(struct.unpack(f"={ncpu}Q", raw))
            out["sockets_in_map"] = len(bpfsys.map_keys(socks, programs.SOCK_KEY_SIZE))
            out["attached"] = 1
        finally:
            os.close(counters)
            os.close(socks)
        return out

    def shutdown(self) -> list[str]:
        """Detach everything this state directory has attached; idempotent.

        Returns the problems met (empty when all is gone). Sockets already redirected keep
        working: see the module docstring for why they are not removed from the map.
        """
        if not self.dir.exists():
            self._state = None
            return []
        with statedir.locked(self.dir):
            problems = self._teardown()
        self._state = None
        return problems

    def attached_ids(self) -> tuple[dict[str, int], dict[str, int]]:
        """(program ids, map ids) of the current attachment, for tests and diagnostics."""
        state = self._state or statedir.load(self.dir, _State)
        return (dict(state.prog_ids), dict(state.map_ids)) if state else ({}, {})

    # --- setup -----------------------------------------------------------------------------------

    def _setup(self, mode: Mode) -> AccelerationStatus:
        if platform.system() != "Linux":
            raise Unavailable(f"eBPF needs Linux, this is {platform.system()}")
        check_privileges()
        check_sockmap()
        check_bcc()
        headers = find_headers(self.host)
        build = programs.digest(self._text)
        self.dir.mkdir(parents=True, exist_ok=True)
        with statedir.locked(self.dir):
            state = statedir.load(self.dir, _State)
            if state is not None and state.build == build and self._verify(state):
                self._set_enabled(state, True)
                self._state = state
                return AccelerationStatus(
                    mode, True, self._describe(state, reused=True), Path(state.cgroup), True
                )
            leftovers = self._teardown()
            if leftovers:
                raise Unavailable(
                    "an earlier attachment could not be removed: " + "; ".join(leftovers)
                )
            try:
                state = self._attach(build, headers)
            except BaseException:
                for problem in self._teardown():
                    log.warning("rolling back the eBPF attachment: %s", problem)
                raise
        self._state = state
        return AccelerationStatus(mode, True, self._describe(state), Path(state.cgroup))

    @staticmethod
    def _describe(state: _State, reused: bool = False) -> str:
        how = "kept the pinned programs of an earlier loader" if reused else "attached"
        return f"{how}: sock_ops on cgroup {state.cgroup}, sk_msg on the sockhash"

    def _attach(self, build: str, headers: Path) -> _State:
        root, mounted = cgroup2_root(self.dir / "cgroup2")
        state = _State(
            build=build,
            cgroup=str(root / cgroup_name(self.state_dir)),
            cgroup2_mount=str(root),
            mounted_cgroup2=mounted,
            bpffs=str(self.dir / "bpffs"),
        )
        statedir.save(self.dir, state)  # from here on a crash leaves a record that teardown follows
        cgroup = Path(state.cgroup)
        if cgroup == root or cgroup.parent != root:
            raise Unavailable(f"refusing to attach to {cgroup}: not a child of {root}")
        cgroup.mkdir(exist_ok=True)
        bpffs = Path(state.bpffs)
        if not is_mounted(bpffs, bpfsys.BPF_FS_MAGIC):
            bpffs.mkdir(mode=0o700, exist_ok=True)
            try:
                bpfsys.mount("bpf", bpffs, "bpf", "mode=0700")
            except OSError as exc:
                raise Unavailable(f"cannot mount a private bpffs: {exc}") from None
        result = loader.load_in_child(self._text, bpffs, headers)
        if not result.ok:
            raise Unavailable(result.reason)
        with self._pins(state) as fds:
            for pin in (programs.PIN_SOCK_OPS, programs.PIN_SK_MSG):
                state.prog_ids[pin] = bpfsys.prog_info(fds[pin]).id
            for pin in programs.MAP_PINS:
                state.map_ids[pin] = bpfsys.map_info(fds[pin]).id
            statedir.save(self.dir, state)
            bpfsys.map_update(fds[programs.PIN_CONFIG], programs.CONFIG_ENABLED, _ENABLED)
            # sk_msg first: a socket recorded by sock_ops is useful only once sk_msg runs on it.
            bpfsys.prog_attach(
                fds[programs.PIN_SK_MSG], fds[programs.PIN_SOCKS], bpfsys.ATTACH_SK_MSG_VERDICT
            )
            with open_dir(cgroup) as cgfd:
                bpfsys.prog_attach(fds[programs.PIN_SOCK_OPS], cgfd, bpfsys.ATTACH_CGROUP_SOCK_OPS)
        return state

    def _verify(self, state: _State) -> bool:
        """True if the pinned objects are exactly what state.json says and both are attached."""
        try:
            with self._pins(state) as fds:
                for pin, ident in state.prog_ids.items():
                    if bpfsys.prog_info(fds[pin]).id != ident:
                        return False
                for pin, ident in state.map_ids.items():
                    if bpfsys.map_info(fds[pin]).id != ident:
                        return False
                on_map = bpfsys.prog_query(fds[programs.PIN_SOCKS], bpfsys.ATTACH_SK_MSG_VERDICT)
                with open_dir(Path(state.cgroup)) as cgfd:
                    on_cgroup = bpfsys.prog_query(cgfd, bpfsys.ATTACH_CGROUP_SOCK_OPS)
        except (OSError, KeyError):
            return False
        return on_map == [state.prog_ids.get(programs.PIN_SK_MSG)] and on_cgroup == [
            state.prog_ids.get(programs.PIN_SOCK_OPS)
        ]

    def _set_enabled(self, state: _State, enabled: bool) -> None:
        fd = bpfsys.obj_get(Path(state.bpffs) / programs.PIN_CONFIG)
        try:
            bpfsys.map_update(fd, programs.CONFIG_ENABLED, _ENABLED if enabled else _DISABLED)
        finally:
            os.close(fd)

    # --- teardown --------------------------------------------------------------------------------

    def _teardown(self) -> list[str]:
        """Undo whatever an earlier setup (of any process, complete or not) left. Locked."""
        problems: list[str] = []
        state = statedir.load(self.dir, _State)
        bpffs = Path(state.bpffs) if state else self.dir / "bpffs"
        # state.json's path can be missing here if it was under a mount of another namespace.
        cgroup = Path(state.cgroup) if state else None
        if cgroup is None or not cgroup.is_dir():
            cgroup = self._find_cgroup()
        if is_mounted(bpffs, bpfsys.BPF_FS_MAGIC):
            problems += self._detach_pinned(bpffs, cgroup)
            with collect(problems, f"unmount {bpffs}"):
                bpfsys.umount(bpffs)
        if state is not None:
            problems += _detach_map_by_id(state)
        with contextlib.suppress(OSError):
            bpffs.rmdir()
        if cgroup is not None and cgroup.is_dir():
            problems += remove_cgroup(cgroup, (bpfsys.ATTACH_CGROUP_SOCK_OPS,))
        # Our own cgroup2 mount point is always <dir>/cgroup2 (also if a crash came before
        # state.json recorded it).
        unmount_own(self.dir / "cgroup2", problems)
        if not problems:
            (self.dir / "state.json").unlink(missing_ok=True)
        return problems

    def _detach_pinned(self, bpffs: Path, cgroup: Path | None) -> list[str]:
        problems: list[str] = []
        fds: dict[str, int] = {}
        for pin in programs.PINS:
            with collect(problems, f"open {bpffs / pin}", ignore=(errno.ENOENT,)):
                fds[pin] = bpfsys.obj_get(bpffs / pin)
        try:
            # Off first: from here new messages take the TCP path, behind the queued ones.
            if programs.PIN_CONFIG in fds:
                with collect(problems, "turn redirection off"):
                    bpfsys.map_update(fds[programs.PIN_CONFIG], programs.CONFIG_ENABLED, _DISABLED)
            if programs.PIN_SOCK_OPS in fds and cgroup is not None and cgroup.is_dir():
                with collect(problems, "detach sock_ops"), open_dir(cgroup) as cgfd:
                    detach_quietly(fds[programs.PIN_SOCK_OPS], cgfd, bpfsys.ATTACH_CGROUP_SOCK_OPS)
            if programs.PIN_SK_MSG in fds and programs.PIN_SOCKS in fds:
                with collect(problems, "detach sk_msg"):
                    detach_quietly(
                        fds[programs.PIN_SK_MSG],
                        fds[programs.PIN_SOCKS],
                        bpfsys.ATTACH_SK_MSG_VERDICT,
                    )
        finally:
            for fd in fds.values():
                os.close(fd)
        for pin in programs.PINS:
            with collect(problems, f"unpin {bpffs / pin}"):
                (bpffs / pin).unlink(missing_ok=True)
        return problems

    def _find_cgroup(self) -> Path | None:
        name = cgroup_name(self.state_dir)
        for mount in [*cgroup2_mounts(), self.dir / "cgroup2"]:
            if (mount / name).is_dir():
                return mount / name
        return None

    # --- state file and lock ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _pins(self, state: _State) -> Iterator[dict[str, int]]:
        fds: dict[str, int] = {}
        try:
            for pin in programs.PINS:
                fds[pin] = bpfsys.obj_get(Path(state.bpffs) / pin)
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)


def detach(state_dir: Path, host: Host | None = None) -> list[str]:
    """Detach what any process attached for `state_dir` (e.g. after a crash)."""
    return Accelerator(state_dir, host).shutdown()


# --- helpers -------------------------------------------------------------------------------------


def _detach_map_by_id(state: _State) -> list[str]:
    """The sk_msg attachment lives on the map, which outlives its pin while sockets hold it."""
    problems: list[str] = []
    map_id = state.map_ids.get(programs.PIN_SOCKS)
    prog_id = state.prog_ids.get(programs.PIN_SK_MSG)
    if map_id is None or prog_id is None:
        return problems
    try:
        map_fd = bpfsys.map_fd_by_id(map_id)
    except OSError:
        return problems  # freed already
    try:
        if bpfsys.map_info(map_fd).name != programs.MAP_SOCKS[:15]:
            return problems  # the id was reused by someone else's map
        if prog_id in bpfsys.prog_query(map_fd, bpfsys.ATTACH_SK_MSG_VERDICT):
            with collect(problems, "detach sk_msg by id"):
                prog_fd = bpfsys.prog_fd_by_id(prog_id)
                try:
                    detach_quietly(prog_fd, map_fd, bpfsys.ATTACH_SK_MSG_VERDICT)
                finally:
                    os.close(prog_fd)
    finally:
        os.close(map_fd)
    return problems
