"""What the console reads besides the ControlPlane: state that lives in other processes.

- `FunctionStats`: each inference backend's own `/meshfn/functions` (on its private socket).
- `EndpointHealth`: each gateway Envoy's admin `/clusters?format=json` (host health, priority).
- `AuditView`: the audit store, opened read-only through its in-process query/verify API.
- `AuditAccess`: the writer of the trail (`meshfn up`'s AuditTrail), for what reading personal
  data leaves behind (access records) and for erasures.

Pollers fetch only while someone watches the console (`ConsoleHub` calls `refresh` at most once
a second), and say when they last succeeded: the console shows an unreachable backend as
unreachable, never its last answer as current.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from meshfn.audit import layout, signing
from meshfn.audit.access import accessed
from meshfn.audit.salt import load as load_salt
from meshfn.audit.sqlite import SqliteStore
from meshfn.audit.store import CONTROL_CHAIN, StoreError
from meshfn.audit.verify import VerifyReport, verify
from meshfn.audit.witness import FileWitness
from meshfn.common.adminauth import Principal
from meshfn.contracts.function import BACKEND_STATUS_PATH

from ..envoy import local_session
from ..traces import TraceStore

log = logging.getLogger("meshfn.console")

FETCH_TIMEOUT = aiohttp.ClientTimeout(total=0.8)


@dataclass(frozen=True)
class Fetched:
    """One remote document and when it was fetched (wall clock); `error` if the last try
    failed (then `document` is empty: stale data is not kept)."""

    document: Mapping[str, Any]
    at: float
    error: str | None = None


async def _get_json(session: aiohttp.ClientSession, url: str) -> Fetched:
    try:
        async with session.get(url) as reply:
            if reply.status != 200:
                return Fetched({}, time.time(), f"HTTP {reply.status} from {url}")
            document = await reply.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Fetched({}, time.time(), f"{url}: {exc.__class__.__name__} {exc}".strip())
    if not isinstance(document, dict):
        return Fetched({}, time.time(), f"{url}: not a JSON object")
    return Fetched(document, time.time())


@dataclass(frozen=True)
class Backend:
    service: str
    address: str
    port: int
    where: Path | str  # where it listens: its unix socket (behind a sidecar), or address:port


class FunctionStats:
    """`backends()` names the inference backends to ask (whatever `meshfn up` runs now)."""

    def __init__(self, backends: Callable[[], list[Backend]]) -> None:
        self.backends = backends
        self.latest: dict[Backend, Fetched] = {}

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        wanted = self.backends()
        results = await asyncio.gather(*(_local_json(b.where, BACKEND_STATUS_PATH) for b in wanted))
        self.latest = dict(zip(wanted, results, strict=True))


@dataclass(frozen=True)
class HostHealth:
    address: str
    port: int
    healthy: bool
    flags: tuple[str, ...]  # why not healthy: failed_outlier_check, failed_active_health_check...
    priority: int


def parse_clusters(document: Mapping[str, Any]) -> dict[str, list[HostHealth]]:
    """Envoy's `/clusters?format=json` -> cluster name -> its hosts' health."""
    out: dict[str, list[HostHealth]] = {}
    for cluster in document.get("cluster_statuses") or []:
        hosts = []
        for host in cluster.get("host_statuses") or []:
            socket = (host.get("address") or {}).get("socket_address") or {}
            status = host.get("health_status") or {}
            flags = tuple(
                sorted(k for k, v in status.items() if k.startswith("failed") and v is True)
            )
            eds = status.get("eds_health_status", "HEALTHY")
            if eds not in ("HEALTHY", "UNKNOWN"):
                flags = (*flags, f"eds {eds.lower()}")
            hosts.append(
                HostHealth(
                    address=str(socket.get("address", "")),
                    port=int(socket.get("port_value", 0)),
                    healthy=not flags,
                    flags=flags,
                    priority=int(host.get("priority", 0)),
                )
            )
        out[str(cluster.get("name", ""))] = hosts
    return out


async def _local_json(where: Path | str, path: str) -> Fetched:
    """From a server of the mesh's own: an Envoy's admin interface on its unix socket (see
    runtime/bootstrap.py), a backend on its socket or address:port."""
    session, base = local_session(where, FETCH_TIMEOUT)
    async with session:
        return await _get_json(session, base + path)


class EndpointHealth:
    """`gateways()` maps each gateway's node cluster to its Envoy's admin socket."""

    def __init__(self, gateways: Callable[[], dict[str, Path]]) -> None:
        self.gateways = gateways
        self.latest: dict[str, Fetched] = {}

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        wanted = self.gateways()
        results = await asyncio.gather(
            *(_local_json(socket, "/clusters?format=json") for socket in wanted.values())
        )
        self.latest = dict(zip(wanted, results, strict=True))

    def clusters(self, gateway: str) -> tuple[dict[str, list[HostHealth]] | None, str | None]:
        """(cluster -> hosts, None), or (None, why there is no current answer)."""
        fetched = self.latest.get(gateway)
        if fetched is None:
            return None, "not fetched yet"
        if fetched.error is not None:
            return None, fetched.error
        return parse_clusters(fetched.document), None


@dataclass(frozen=True)
class AuditQuery:
    """A validated console query (see web.parse_query): every field optional."""

    subject: str | None = None  # 64 hex digits, as the records carry it
    subject_raw: str | None = None  # hashed with the local subject salt
    route: str | None = None
    status: int | None = None
    status_class: int | None = None
    limit: int = 50
    trace: str | None = None  # 32 hex digits: a trace's records (the trace page)

    @property
    def empty(self) -> bool:
        return not (
            self.subject
            or self.subject_raw
            or self.route
            or self.status
            or self.status_class
            or self.trace
        )

    @property
    def by_subject(self) -> bool:
        """A lookup of personal data: auditors only, rate-limited, recorded, never live."""
        return bool(self.subject or self.subject_raw)


@dataclass
class Verification:
    ok: bool
    records: int
    chains: int
    checkpoints: int
    unsigned_tail: int
    problems: list[str]
    at: float


@dataclass
class AuditView:
    """Read-only access to the audit store `meshfn up` writes (`path()` is None while audit is
    off). Verification walks the whole chain, so it runs in a thread and at most every
    `verify_every` seconds, when the store has changed."""

    path: Callable[[], Path | None]
    state_dir: Path
    verify_every: float = 5.0
    verification: Verification | None = None
    error: str | None = None
    _store: SqliteStore | None = field(default=None, repr=False)
    _verified_head: tuple[int, ...] = ()
    _verified_at: float = 0.0
    _records: dict[AuditQuery, tuple[tuple[int, ...], list[dict[str, Any]]]] = field(
        default_factory=dict, repr=False
    )

    @staticmethod
    def _version(store: SqliteStore) -> tuple[int, ...]:
        """Changes whenever the writer commits (the store file or its WAL changed); cheap, and
        unlike a read-only store's cached head it does not stand still."""
        out: list[int] = []
        for path in (store.path, store.path.with_name(store.path.name + "-wal")):
            try:
                stat = path.stat()
            except FileNotFoundError:
                out += [0, 0]
                continue
            out += [stat.st_mtime_ns, stat.st_size]
        return tuple(out)

    def _open(self) -> SqliteStore | None:
        path = self.path()
        if path is None:
            return None
        if self._store is None or self._store.path != path:
            if not path.exists():
                return None
            self._store = SqliteStore(path, readonly=True)
        return self._store

    async def refresh(self) -> None:
        try:
            store = self._open()
            if store is None:
                return
            head = self._version(store)
            now = time.monotonic()
            if head != self._verified_head and now - self._verified_at >= self.verify_every:
                self._verified_at = now
                report = await asyncio.to_thread(self._verify, store)
                self._verified_head = head
                self.verification = Verification(
                    ok=report.ok,
                    records=report.records,
                    chains=len(report.chains),
                    checkpoints=report.checkpoints,
                    unsigned_tail=report.unsigned_tail,
                    problems=[
                        f"{p.kind}: {p.chain + ' ' if p.chain else ''}"
                        f"{'seq ' + str(p.seq) + ': ' if p.seq is not None else ''}{p.detail}"
                        for p in report.problems
                    ],
                    at=time.time(),
                )
            self.error = None
        except (StoreError, OSError) as exc:
            self.error = str(exc)

    def _verify(self, store: SqliteStore) -> VerifyReport:
        """As `meshfn audit verify` does for this state directory: the signer's public key and
        the witness (the signer may not have written its key yet: then nothing is signed)."""
        try:
            key = signing.load_public(layout.public_key_path(self.state_dir))
        except signing.KeyError_ as exc:
            raise StoreError(f"no checkpoint key yet: {exc}") from None
        return verify(store, key, FileWitness(layout.witness_path(self.state_dir)))

    def lookup(self, query: AuditQuery) -> tuple[list[dict[str, Any]], list[str]]:
        """A query by subject, asked of the store every time (never cached: each one is
        recorded): the newest matching records, and the pseudonyms the subject's records carry
        (for the access record)."""
        store = self._open()
        if store is None:
            return [], []
        subject = self._subject(query)
        pseudonyms = store.pseudonyms(subject) if subject is not None else []
        return self._query(store, query), pseudonyms

    def accessed(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest access and erasure records (the console's access list)."""
        store = self._open()
        return accessed(store, limit) if store is not None else []

    def forget(self) -> None:
        """Drop every cached answer (after an erasure: nothing of the subject stays here)."""
        self._records.clear()

    def records(self, query: AuditQuery) -> list[dict[str, Any]]:
        """The newest `query.limit` records matching `query`, newest first (asked of the store
        again only when its chain has grown). Not for queries by subject: `lookup`."""
        if query.by_subject:
            raise ValueError("a query by subject goes through lookup(), which is recorded")
        store = self._open()
        if store is None:
            return []
        head = self._version(store)
        cached = self._records.get(query)
        if cached is not None and cached[0] == head:
            return cached[1]
        rows = self._query(store, query)
        if len(self._records) > 32:
            self._records.clear()
        self._records[query] = (head, rows)
        return rows

    def _subject(self, query: AuditQuery) -> str | None:
        if query.subject_raw is None:
            return query.subject
        salt = load_salt(self.state_dir)
        if salt is None:
            raise StoreError("no subject salt next to the store: cannot hash subject_raw")
        return hmac.new(bytes.fromhex(salt.hex), query.subject_raw.encode(), "sha256").hexdigest()

    def _query(self, store: SqliteStore, query: AuditQuery) -> list[dict[str, Any]]:
        subject = self._subject(query)
        filters: dict[str, Any] = {
            "subject": subject,
            "route": query.route,
            "status": query.status,
            "status_class": query.status_class,
            "trace": query.trace,
        }
        # The store answers oldest first: look back over growing windows for the newest rows.
        for window in (60.0, 3600.0, 86400.0, None):
            since = None
            if window is not None:
                since = time.strftime(
                    "%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(time.time() - window)
                )
            rows = store.query(since=since, limit=None, **filters)
            # requests only: the control chain's access and erasure records have a table of
            # their own (accessed)
            rows = [r for r in rows if r["chain"] != CONTROL_CHAIN]
            if len(rows) >= query.limit or window is None:
                return rows[-query.limit :][::-1]
        return []

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


class Refreshable(Protocol):
    async def refresh(self, session: aiohttp.ClientSession) -> None: ...


class AuditAccess(Protocol):
    """The trail's writer (runtime/audit.py's AuditTrail)."""

    async def record_access(
        self,
        principal: Principal,
        action: str,
        pseudonyms: list[str],
        records: int,
        via: str = "console",
    ) -> int: ...

    async def erase(
        self, subject: str, principal: Principal, via: str = "api"
    ) -> dict[str, Any]: ...


@dataclass
class ConsoleSources:
    """Everything the console shows beyond the ControlPlane (each part optional: `meshfn serve`
    runs no backends, gateways or audit trail)."""

    functions: FunctionStats | None = None
    health: EndpointHealth | None = None
    audit: AuditView | None = None
    acceleration: Callable[[], dict[str, Any]] | None = None
    trail: AuditAccess | None = None
    traces: TraceStore | None = None  # meshfn up's embedded trace collector
    # every Envoy's statistics, for the service graph (console.graph.ProxyStats)
    proxies: Refreshable | None = None

    async def refresh(self) -> None:
        async with aiohttp.ClientSession(timeout=FETCH_TIMEOUT) as session:
            await asyncio.gather(
                *(
                    part.refresh(session)
                    for part in (self.functions, self.health)
                    if part is not None
                ),
                *([self.audit.refresh()] if self.audit is not None else []),
            )
            if self.proxies is not None:  # after the functions: it reads their counts
                await self.proxies.refresh(session)

    def close(self) -> None:
        if self.audit is not None:
            self.audit.close()
