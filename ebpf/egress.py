"""Egress control for the inference backends: cgroup sock_addr programs that refuse every
outbound connection except to the peers the policy names (egress_programs.py says what each
program checks).

    egress = EgressControl(state_dir, parent=<the acceleration cgroup, or None>)
    status = egress.setup("auto")               # never raises in "auto"; status.reason says why
    join = egress.add_backend("models-9101", [("127.0.0.1", 15201)])   # a preexec_fn
    egress.denials()                            # {backend: {reason: Denial}}
    egress.remove_backend("models-9101")        # after its processes exited
    egress.shutdown()                           # idempotent; `python -P -m meshfn.ebpf detach`

Layout: one cgroup per mesh, `<parent>/meshfn-egress-<hash of state dir>`, carries the programs;
one child cgroup per backend holds its processes (they join before exec, so every socket they
open is seen), and the allow map is keyed by that child's cgroup id. The parent is the
acceleration cgroup when acceleration is on, so the backends' loopback sockets stay redirected
(sock_ops is inherited down the hierarchy); otherwise the cgroup2 root.

State lives in `<state_dir>/ebpf/egress/`: a private bpffs with the pinned programs and maps,
`state.json`, a lock. Nothing survives a restart: `setup` tears down what an earlier (crashed)
run left, then attaches afresh (the backends are restarted with the control plane anyway).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import platform
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from . import bpfsys, egress_programs, loader, statedir
from .cgroups import cgroup2_root, collect, open_dir, remove_cgroup, unmount_own
from .host import Host, Unavailable, check_bcc, check_privileges, find_headers, is_mounted

log = logging.getLogger("meshfn.ebpf.egress")

EgressMode = Literal["auto", "required", "off"]
_ATTACH_TYPES: Final = tuple(p.attach_type for p in egress_programs.PROGRAMS)
_SLUG: Final = re.compile(r"[^A-Za-z0-9_.-]+")


class EgressUnavailable(RuntimeError):
    """`setup("required")` could not attach; `str()` is the one-line reason."""


@dataclass(frozen=True)
class EgressStatus:
    mode: str
    attached: bool
    reason: str  # why it is off, or what is attached
    cgroup: Path | None = None
    uncovered: tuple[str, ...] = ()  # optional hooks this kernel lacks (unix sockets)

    def line(self) -> str:
        state = "on" if self.attached else "off"
        return f"egress control {state}: {self.reason}"


@dataclass(frozen=True)
class Denial:
    count: int
    address: str  # the last refused destination ("" for unix and raw sockets)
    port: int  # its port (the protocol number for a raw socket)
    pid: int  # the process that tried
    last_ns: int  # CLOCK_MONOTONIC of the last one


@dataclass
class _State:
    cgroup: str
    bpffs: str
    mounted_cgroup2: bool
    prog_ids: dict[str, int] = field(default_factory=dict)
    map_ids: dict[str, int] = field(default_factory=dict)
    backends: dict[str, str] = field(default_factory=dict)  # name -> its cgroup
    uncovered: list[str] = field(default_factory=list)


def cgroup_name(state_dir: Path) -> str:
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return f"meshfn-egress-{digest}"


def _address(text: str) -> tuple[int, int, int, int]:
    """An address as the programs key it: IPv6, IPv4 as ::ffff:a.b.c.d (network byte order)."""
    addr = ipaddress.ip_address(text)
    if isinstance(addr, ipaddress.IPv4Address):
        addr = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + addr.packed)
    packed = addr.packed
    a, b, c, d = (int.from_bytes(packed[i : i + 4], sys.byteorder) for i in range(0, 16, 4))
    return a, b, c, d


def _text(words: tuple[int, ...]) -> str:
    if not any(words):
        return ""
    addr = ipaddress.IPv6Address(b"".join(w.to_bytes(4, sys.byteorder) for w in words))
    return str(addr.ipv4_mapped or addr)


class EgressControl:
    """All methods block (setup ~1 s: it compiles in a child); call them from a thread."""

    def __init__(
        self,
        state_dir: Path,
        parent: Path | None = None,
        host: Host | None = None,
        program_source: str | None = None,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.dir = self.state_dir / "ebpf" / "egress"
        self.parent = parent
        self.host = host or Host()
        self._text = egress_programs.source() if program_source is None else program_source
        self._state: _State | None = None

    # --- public API ------------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._state is not None

    def setup(self, mode: EgressMode = "auto") -> EgressStatus:
        """Attach per `mode`; `auto` never raises, `required` raises EgressUnavailable. Nothing
        stays half attached: a failure part way rolls back what this call made."""
        status = statedir.attempt(
            mode,
            self.shutdown,
            lambda: self._setup(mode),
            lambda reason: EgressStatus(mode, False, reason),
            "egress",
        )
        if not status.attached and mode == "required":
            raise EgressUnavailable(status.reason)
        return status

    def add_backend(self, name: str, peers: Iterable[tuple[str, int]]) -> Callable[[], None]:
        """A cgroup for backend `name` that may reach only `peers` ((address, port) pairs);
        returns the `preexec_fn` that moves a child into it before exec. Idempotent."""
        state = self._require()
        slug = _SLUG.sub("_", name)[:200] or "backend"
        cgroup = Path(state.cgroup) / slug
        cgroup.mkdir(exist_ok=True)
        cgroup_id = os.stat(cgroup).st_ino  # a cgroup2 directory's inode number is its id
        with statedir.locked(self.dir), self._map(egress_programs.PIN_ALLOW) as fd:
            for key in self._allow_keys(cgroup_id):
                bpfsys.map_delete(fd, key)
            for address, port in peers:
                a, b, c, d = _address(address)
                key = egress_programs.ALLOW_KEY.pack(cgroup_id, a, b, c, d, port, 0)
                bpfsys.map_update(fd, key, b"\1\0\0\0")
            state.backends[name] = str(cgroup)
            statedir.save(self.dir, state)
        procs = os.fsencode(cgroup / "cgroup.procs")

        def join() -> None:  # runs in the forked child: plain syscalls only
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return join

    def backend_cgroup(self, name: str) -> Path | None:
        state = self._state
        return Path(state.backends[name]) if state and name in state.backends else None

    def remove_backend(self, name: str) -> list[str]:
        """Forget backend `name` (its processes have exited): its allow entries, its cgroup."""
        state = self._state
        if state is None or name not in state.backends:
            return []
        cgroup = Path(state.backends.pop(name))
        problems: list[str] = []
        with statedir.locked(self.dir):
            self._forget(cgroup, problems)
            statedir.save(self.dir, state)
        return problems

    def denials(self) -> dict[str, dict[str, Denial]]:
        """backend name -> reason -> what was refused (counts since setup)."""
        state = self._state
        if state is None:
            return {}
        by_id: dict[int, str] = {}
        for name, cgroup in state.backends.items():
            with contextlib.suppress(OSError):
                by_id[os.stat(cgroup).st_ino] = name
        out: dict[str, dict[str, Denial]] = {name: {} for name in state.backends}
        try:
            with self._map(egress_programs.PIN_DENIED) as fd:
                for key in bpfsys.map_keys(fd, egress_programs.DENY_KEY.size):
                    cgroup_id, reason, _ = egress_programs.DENY_KEY.unpack(key)
                    backend = by_id.get(cgroup_id)
                    if backend is None or reason >= len(egress_programs.REASONS):
                        continue
                    try:
                        raw = bpfsys.map_lookup(fd, key, egress_programs.DENY_VALUE.size)
                    except OSError:
                        continue
                    count, last_ns, a, b, c, d, port, pid = egress_programs.DENY_VALUE.unpack(raw)
                    out[backend][egress_programs.REASONS[reason]] = Denial(
                        count, _text((a, b, c, d)), port, pid, last_ns
                    )
        except OSError:
            pass
        return out

    def attached_programs(self, name: str) -> list[int]:
        """Ids of the egress programs the kernel runs for backend `name`'s cgroup (inherited
        from the mesh's egress cgroup): what `meshfn status` reports, from the kernel itself."""
        state = self._state
        if state is None or name not in state.backends:
            return []
        ids: list[int] = []
        with open_dir(Path(state.cgroup)) as cgfd:
            for attach_type in _ATTACH_TYPES:
                with contextlib.suppress(OSError):
                    ids += bpfsys.prog_query(cgfd, attach_type)
        return ids

    def shutdown(self) -> list[str]:
        """Detach everything this state directory attached; idempotent."""
        if not self.dir.exists():
            self._state = None
            return []
        with statedir.locked(self.dir):
            problems = self._teardown()
        self._state = None
        return problems

    # --- setup -----------------------------------------------------------------------------------

    def _setup(self, mode: str) -> EgressStatus:
        if platform.system() != "Linux":
            raise Unavailable(f"eBPF needs Linux, this is {platform.system()}")
        check_privileges("the eBPF egress control")
        check_bcc()
        headers = find_headers(self.host)
        self.dir.mkdir(parents=True, exist_ok=True)
        with statedir.locked(self.dir):
            leftovers = self._teardown()
            if leftovers:
                raise Unavailable(
                    "an earlier egress attachment could not be removed: " + "; ".join(leftovers)
                )
            try:
                state = self._attach(headers)
            except BaseException:
                for problem in self._teardown():
                    log.warning("rolling back the egress attachment: %s", problem)
                raise
        self._state = state
        hooks = [p.pin for p in egress_programs.PROGRAMS if p.pin not in state.uncovered]
        reason = f"{', '.join(hooks)} on {state.cgroup}"
        if state.uncovered:
            reason += f" (this kernel has no {', '.join(state.uncovered)} hooks: unix sockets are"
            reason += " not covered)"
        return EgressStatus(mode, True, reason, Path(state.cgroup), tuple(state.uncovered))

    def _attach(self, headers: Path) -> _State:
        if self.parent is not None:
            root, mounted = self.parent, False
        else:
            root, mounted = cgroup2_root(self.dir / "cgroup2")
        state = _State(
            cgroup=str(root / cgroup_name(self.state_dir)),
            bpffs=str(self.dir / "bpffs"),
            mounted_cgroup2=mounted,
        )
        statedir.save(self.dir, state)  # from here on a crash leaves a record that teardown follows
        cgroup = Path(state.cgroup)
        cgroup.mkdir(exist_ok=True)
        bpffs = Path(state.bpffs)
        if not is_mounted(bpffs, bpfsys.BPF_FS_MAGIC):
            bpffs.mkdir(mode=0o700, exist_ok=True)
            try:
                bpfsys.mount("bpf", bpffs, "bpf", "mode=0700")
            except OSError as exc:
                raise Unavailable(f"cannot mount a private bpffs: {exc}") from None
        result = loader.load_in_child(self._text, bpffs, headers, plan="egress")
        if not result.ok:
            raise Unavailable(result.reason)
        state.uncovered = list(result.skipped)
        programs = [p for p in egress_programs.PROGRAMS if p.pin not in result.skipped]
        with open_dir(cgroup) as cgfd:
            for program in programs:
                fd = bpfsys.obj_get(bpffs / program.pin)
                try:
                    state.prog_ids[program.pin] = bpfsys.prog_info(fd).id
                    statedir.save(self.dir, state)
                    bpfsys.prog_attach(fd, cgfd, program.attach_type)
                finally:
                    os.close(fd)
        for pin, _ in egress_programs.MAPS:
            fd = bpfsys.obj_get(bpffs / pin)
            try:
                state.map_ids[pin] = bpfsys.map_info(fd).id
            finally:
                os.close(fd)
        statedir.save(self.dir, state)
        return state

    # --- teardown --------------------------------------------------------------------------------

    def _teardown(self) -> list[str]:
        """Undo whatever an earlier setup (of any process, complete or not) left. Locked."""
        problems: list[str] = []
        state = statedir.load(self.dir, _State)
        bpffs = Path(state.bpffs) if state else self.dir / "bpffs"
        cgroup = Path(state.cgroup) if state else None
        if cgroup is not None and cgroup.is_dir():
            for child in sorted(p for p in cgroup.iterdir() if p.is_dir()):
                self._forget(child, problems)
            problems += remove_cgroup(cgroup, _ATTACH_TYPES)
        if is_mounted(bpffs, bpfsys.BPF_FS_MAGIC):
            for program in egress_programs.PROGRAMS:
                with collect(problems, f"unpin {bpffs / program.pin}"):
                    (bpffs / program.pin).unlink(missing_ok=True)
            for pin, _ in egress_programs.MAPS:
                with collect(problems, f"unpin {bpffs / pin}"):
                    (bpffs / pin).unlink(missing_ok=True)
            with collect(problems, f"unmount {bpffs}"):
                bpfsys.umount(bpffs)
        with contextlib.suppress(OSError):
            bpffs.rmdir()
        unmount_own(self.dir / "cgroup2", problems)
        if not problems:
            (self.dir / "state.json").unlink(missing_ok=True)
        return problems

    def _forget(self, cgroup: Path, problems: list[str]) -> None:
        """A backend's allow entries and cgroup (its processes go to the mesh's cgroup)."""
        if not cgroup.is_dir():
            return
        with contextlib.suppress(OSError), self._map(egress_programs.PIN_ALLOW) as fd:
            for key in self._allow_keys(os.stat(cgroup).st_ino, fd):
                bpfsys.map_delete(fd, key)
        problems += remove_cgroup(cgroup, ())

    # --- maps, state file, lock ------------------------------------------------------------------

    @contextlib.contextmanager
    def _map(self, pin: str) -> Iterator[int]:
        state = self._state or statedir.load(self.dir, _State)
        bpffs = Path(state.bpffs) if state else self.dir / "bpffs"
        fd = bpfsys.obj_get(bpffs / pin)
        try:
            yield fd
        finally:
            os.close(fd)

    def _allow_keys(self, cgroup_id: int, fd: int | None = None) -> list[bytes]:
        if fd is None:
            with self._map(egress_programs.PIN_ALLOW) as own:
                return self._allow_keys(cgroup_id, own)
        keys = bpfsys.map_keys(fd, egress_programs.ALLOW_KEY.size)
        return [k for k in keys if egress_programs.ALLOW_KEY.unpack(k)[0] == cgroup_id]

    def _require(self) -> _State:
        if self._state is None:
            raise RuntimeError("egress control is not attached")
        return self._state


def detach(state_dir: Path) -> list[str]:
    """Detach what any process attached for `state_dir` (e.g. after a crash)."""
    return EgressControl(state_dir).shutdown()


__all__ = [
    "Denial",
    "EgressControl",
    "EgressMode",
    "EgressStatus",
    "EgressUnavailable",
    "cgroup_name",
    "detach",
]
