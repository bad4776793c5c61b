"""`meshfn up`'s embedded trace collector: OTLP over gRPC and over HTTP on unix sockets in the
state directory (STATE/collector/otlp.sock and otlp-http.sock, 0600 in a 0700 directory: the
proxies and backends `meshfn up` runs reach them, no other local user; a loopback port would
let anyone on the host write spans), the recent traces kept in memory for `meshfn trace`, the
console and the drift breaker's exemplars.

Part of the composition, never of a renderer: the translator is told where it listens through
the proxy host (xds.translate.ProxyHost.collector), exactly as it would be told about Jaeger,
Tempo or an OpenTelemetry Collector named in the Mesh policy.

Bounded by count and by memory (MESHFN_TRACE_STORE_TRACES, MESHFN_TRACE_STORE_MIB): a trace
that arrives when either is full pushes out the oldest (first seen) traces, a trace holds at
most MAX_SPANS_PER_TRACE spans, a span at most MAX_ATTRIBUTES attributes of at most MAX_VALUE
characters, and a request body at most MAX_BODY bytes. Every span that is not kept is counted
by reason (`/metrics`, `meshfn status`); a collector under a flood of spans keeps serving.
Both receivers run on the control plane's event loop and only parse and append.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from google.protobuf.message import DecodeError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshfn import ir
from meshfn.common import env
from meshfn.common.files import private_directory
from meshfn.common.unix import SOCKET_MODE, listen_private, socket_path
from meshfn.contracts import otlp
from meshfn.contracts.durations import parse_duration
from meshfn.contracts.tracing import SPANS_PATH, SPANS_WAIT

from .envoy import local_session

log = logging.getLogger("meshfn.traces")

PULL_EVERY = 0.5  # seconds between two collections from a backend that had spans
PULL_WAIT = 10.0  # seconds a collection waits at a backend with none (a long poll)
MAX_PULLS = 8  # batches taken from one backend process per collection
MAX_SPANS_PER_TRACE = 1024
MAX_ATTRIBUTES = 64
MAX_VALUE = 1024
MAX_BODY = 8 << 20
_SPAN_OVERHEAD = 320  # bytes a stored span costs beyond its strings (measured, roughly)
DROP_REASONS = ("evicted", "trace_full", "malformed", "too_large")


class Span:
    """One stored span. Its attributes stay encoded (the span's own OTLP bytes, copied out of
    the export so that nothing else of it stays alive) until something reads them: at 100%
    sampling most traces are evicted unread, and turning every attribute into Python was most
    of what the collector spent per request."""

    __slots__ = (
        "_attributes",
        "_size",
        "end_ns",
        "events",
        "kind",
        "links",
        "message",
        "name",
        "parent_id",
        "service",
        "span_id",
        "start_ns",
        "status",
        "trace_id",
    )  # fmt: skip

    def __init__(
        self,
        trace_id: str,
        span_id: str,
        parent_id: str,
        name: str,
        service: str,
        kind: str,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, object] | bytes,  # a dict, or the span's OTLP encoding
        status: str = "unset",  # unset | ok | error
        message: str = "",
        events: list[dict[str, Any]] | None = None,
        links: list[tuple[str, str]] | None = None,
    ) -> None:
        self.trace_id, self.span_id, self.parent_id = trace_id, span_id, parent_id
        self.name, self.service, self.kind = name, service, kind
        self.start_ns, self.end_ns = start_ns, end_ns
        self._attributes = attributes
        self.status, self.message = status, message
        self.events = events if events is not None else []
        self.links = links if links is not None else []
        self._size = _SPAN_OVERHEAD + (
            len(attributes)
            if isinstance(attributes, bytes)
            else len(name) + len(service) + len(message)
            + sum(len(k) + len(str(v)) for k, v in attributes.items())
        )  # fmt: skip

    @property
    def attributes(self) -> dict[str, object]:
        if isinstance(self._attributes, bytes):
            self._attributes = _attributes(otlp.Span.FromString(self._attributes).attributes)
        return self._attributes

    @property
    def duration_us(self) -> int:
        return max(0, self.end_ns - self.start_ns) // 1000

    @property
    def failed(self) -> bool:
        code = self.attributes.get(
            "http.status_code", self.attributes.get("http.response.status_code")
        )
        try:
            http_error = int(str(code)) >= 500
        except ValueError:
            http_error = False
        return self.status == "error" or http_error

    def size(self) -> int:
        """Roughly what keeping it costs: its encoded size (as exported) or its strings."""
        return self._size

    def document(self) -> dict[str, Any]:
        return {
            "span_id": self.span_id,
            "parent_id": self.parent_id or None,
            "name": self.name,
            "service": self.service,
            "kind": self.kind,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "duration_us": self.duration_us,
            "status": "error" if self.failed else self.status,
            "message": self.message or None,
            "attributes": self.attributes,
            "events": self.events,
            "links": [{"trace_id": t, "span_id": s} for t, s in self.links],
        }


@dataclass(slots=True)
class Trace:
    trace_id: str
    spans: list[Span] = field(default_factory=list)
    bytes: int = 0
    received: float = 0.0  # wall clock of its first span's arrival

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.spans)

    @property
    def duration_us(self) -> int:
        return max(0, max(s.end_ns for s in self.spans) - self.start_ns) // 1000

    def root(self) -> Span:
        """The span whose parent is not in the trace (the earliest such), else the earliest."""
        ids = {s.span_id for s in self.spans}
        roots = [s for s in self.spans if not s.parent_id or s.parent_id not in ids]
        return min(roots or self.spans, key=lambda s: s.start_ns)

    def attribute(self, key: str) -> str | None:
        for span in self.spans:
            value = span.attributes.get(key)
            if value not in (None, ""):
                return str(value)
        return None

    @property
    def failed(self) -> bool:
        return any(s.failed for s in self.spans)

    def summary(self) -> dict[str, Any]:
        root = self.root()
        return {
            "trace_id": self.trace_id,
            "root": root.name,
            "service": root.service,
            "route": self.attribute("meshfn.route"),
            "model": self.attribute("meshfn.model"),
            "start_ns": self.start_ns,
            "duration_us": self.duration_us,
            "spans": len(self.spans),
            "services": sorted({s.service for s in self.spans}),
            "status": "error" if self.failed else "ok",
        }

    def document(self) -> dict[str, Any]:
        ordered = sorted(self.spans, key=lambda s: (s.start_ns, s.end_ns))
        return {**self.summary(), "span_list": [s.document() for s in ordered]}


class TraceStore:
    """The recent traces, oldest first out. Event loop only."""

    def __init__(self, max_traces: int | None = None, max_bytes: int | None = None) -> None:
        self.max_traces = max_traces or env.TRACE_STORE_TRACES.integer() or 2000
        self.max_bytes = max_bytes or (env.TRACE_STORE_MIB.integer() or 64) << 20
        self._traces: OrderedDict[str, Trace] = OrderedDict()
        self.bytes = 0
        self.spans = 0
        self.received = 0
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.evicted_traces = 0
        self.exports = 0

    def __len__(self) -> int:
        return len(self._traces)

    def add(self, spans: Iterable[Span]) -> int:
        """Keep `spans` (evicting the oldest traces to make room); how many were kept."""
        kept = 0
        now = time.time()
        for span in spans:
            self.received += 1
            trace = self._traces.get(span.trace_id)
            if trace is None:
                trace = self._traces[span.trace_id] = Trace(span.trace_id, received=now)
            if len(trace.spans) >= MAX_SPANS_PER_TRACE:
                self.dropped["trace_full"] += 1
                continue
            size = span.size()
            trace.spans.append(span)
            trace.bytes += size
            self.bytes += size
            self.spans += 1
            kept += 1
            self._evict(keep=span.trace_id)
        return kept

    def _evict(self, keep: str) -> None:
        while len(self._traces) > self.max_traces or self.bytes > self.max_bytes:
            oldest = next(iter(self._traces))
            if oldest == keep and len(self._traces) == 1:
                # one trace over the memory bound on its own: its newest span goes
                trace = self._traces[oldest]
                span = trace.spans.pop()
                trace.bytes -= span.size()
                self.bytes -= span.size()
                self.spans -= 1
                self.dropped["evicted"] += 1
                if not trace.spans:
                    del self._traces[oldest]
                return
            trace = self._traces.pop(oldest)
            self.bytes -= trace.bytes
            self.spans -= len(trace.spans)
            self.dropped["evicted"] += len(trace.spans)
            self.evicted_traces += 1

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] += count

    def get(self, trace_id: str) -> Trace | None:
        return self._traces.get(trace_id.lower())

    def traces(self) -> Iterator[Trace]:
        """Newest first."""
        return reversed(self._traces.values())

    def find(
        self,
        route: str | None = None,
        min_duration_us: int = 0,
        status: str | None = None,
        service: str | None = None,
        limit: int = 50,
        peer: str | None = None,
        model: str | None = None,
    ) -> list[Trace]:
        """Newest first, matching every given filter: the mesh route (`meshfn.route`, or a
        prefix of it ending in `/`), a least duration, ok/error, services its spans came from
        (`service` and `peer`: an edge of the service graph), the model it served."""
        out = []
        for trace in self.traces():
            if route is not None and not _route_matches(trace.attribute("meshfn.route"), route):
                continue
            if trace.duration_us < min_duration_us:
                continue
            if status is not None and ("error" if trace.failed else "ok") != status:
                continue
            services = {s.service for s in trace.spans}
            if (service is not None and service not in services) or (
                peer is not None and peer not in services
            ):
                continue
            if model is not None and trace.attribute("meshfn.model") != model:
                continue
            out.append(trace)
            if len(out) >= limit:
                break
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "traces": len(self._traces),
            "spans": self.spans,
            "bytes": self.bytes,
            "max_traces": self.max_traces,
            "max_bytes": self.max_bytes,
            "received_spans": self.received,
            "dropped_spans": dict(self.dropped),
            "evicted_traces": self.evicted_traces,
        }


def _route_matches(value: str | None, wanted: str) -> bool:
    if value is None:
        return False
    return value == wanted or (wanted.endswith("/") and value.startswith(wanted))


_PRINTABLE = re.compile(r"^[\x20-\x7e]{1,256}$")


def trace_filters(query: Mapping[str, str]) -> dict[str, Any]:
    """/debug/traces?route=&service=&peer=&model=&status=ok|error&min_duration=100ms&limit= ->
    TraceStore.find's arguments (ValueError naming the bad one)."""
    known = {"route", "service", "peer", "model", "status", "min_duration", "limit"}
    unknown = set(query) - known
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})"
        )
    out: dict[str, Any] = {}
    for key in ("route", "service", "peer", "model"):
        value = query.get(key, "")
        if value:
            if not _PRINTABLE.match(value):
                raise ValueError(f"{key}: at most 256 printable ASCII characters")
            out[key] = value
    status = query.get("status", "")
    if status:
        if status not in ("ok", "error"):
            raise ValueError("status: ok or error")
        out["status"] = status
    duration = query.get("min_duration", "")
    if duration:
        out["min_duration_us"] = round(parse_duration(duration).total_seconds() * 1e6)
    limit = query.get("limit", "")
    if limit:
        if not limit.isdigit() or not 1 <= int(limit) <= 500:
            raise ValueError("limit: a whole number from 1 to 500")
        out["limit"] = int(limit)
    return out


# ---------------------------------------------------------------- decoding OTLP


def _hex(raw: bytes, length: int) -> str | None:
    return raw.hex() if len(raw) == length and any(raw) else None


def _value(value: object) -> object:
    if isinstance(value, str) and len(value) > MAX_VALUE:
        return value[:MAX_VALUE] + "…"
    if isinstance(value, list | dict):
        text = str(value)
        return text if len(text) <= MAX_VALUE else text[:MAX_VALUE] + "…"
    return value


def _attributes(pairs: Any) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in list(pairs)[:MAX_ATTRIBUTES]:
        out[kv.key[:256]] = _value(otlp.plain(kv.value))
    return out


_STATUS = {otlp.STATUS_UNSET: "unset", otlp.STATUS_OK: "ok", otlp.STATUS_ERROR: "error"}


def _span(raw: Any, service: str) -> Span | None:
    trace_id = _hex(raw.trace_id, 16)
    span_id = _hex(raw.span_id, 8)
    if trace_id is None or span_id is None:
        return None
    start = raw.start_time_unix_nano
    status = raw.status
    # most spans have no event and no link: not even an empty list per span (a third of
    # decoding a backend's export went to listing nothing)
    events = raw.events
    links = raw.links
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_id=_hex(raw.parent_span_id, 8) or "",
        name=raw.name[:256],
        service=service,
        kind=otlp.KIND_NAMES.get(raw.kind, "unspecified"),
        start_ns=start,
        end_ns=max(raw.end_time_unix_nano, start),
        attributes=raw.SerializeToString(),
        status=_STATUS.get(status.code, "unset"),
        message=status.message[:MAX_VALUE],
        events=[
            {
                "name": e.name[:256],
                "time_ns": e.time_unix_nano,
                "attributes": _attributes(e.attributes),
            }
            for e in list(events)[:MAX_ATTRIBUTES]
        ]
        if events
        else None,
        links=[
            (t, s)
            for link in list(links)[:MAX_ATTRIBUTES]
            if (t := _hex(link.trace_id, 16)) is not None
            and (s := _hex(link.span_id, 8)) is not None
        ]
        if links
        else None,
    )


def decode(body: bytes) -> tuple[list[Span], int]:
    """An ExportTraceServiceRequest -> its well-formed spans, and how many were not
    (no 16-byte trace id or 8-byte span id). Raises DecodeError for bytes that are not one."""
    request = otlp.ExportTraceServiceRequest.FromString(body)
    spans, malformed = [], 0
    for resource in request.resource_spans:
        service = str(otlp.attributes(resource.resource.attributes).get("service.name", "unknown"))
        for scope in resource.scope_spans:
            for raw in scope.spans:
                span = _span(raw, service[:128])
                if span is None:
                    malformed += 1
                else:
                    spans.append(span)
    return spans, malformed


def ingest(store: TraceStore, body: bytes) -> bytes:
    """One export into the store; the ExportTraceServiceResponse to answer with (a partial
    success names the spans not kept). Raises DecodeError for a body that is not OTLP."""
    if len(body) > MAX_BODY:
        store.drop("too_large")
        raise ValueError(f"an export of {len(body)} bytes (at most {MAX_BODY})")
    spans, malformed = decode(body)
    store.exports += 1
    if malformed:
        store.drop("malformed", malformed)
    kept = store.add(spans)
    rejected = malformed + len(spans) - kept
    response = otlp.ExportTraceServiceResponse()
    if rejected:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = "spans without valid ids, or past a trace's cap"
    data: bytes = response.SerializeToString()
    return data


# ---------------------------------------------------------------- receivers


def sockets(directory: Path) -> tuple[Path, Path]:
    """The collector's OTLP/gRPC and OTLP/HTTP sockets in `directory` (STATE/collector)."""
    return (
        socket_path(directory, "otlp", "the trace collector's socket"),
        socket_path(directory, "otlp-http", "the trace collector's socket"),
    )


class TraceCollector:
    """The store and its two OTLP receivers (unix sockets), started and stopped with `meshfn
    up`."""

    def __init__(self, store: TraceStore | None = None) -> None:
        self.store = store or TraceStore()
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._puller: asyncio.Task[None] | None = None
        # (backend socket or address, token) -> its session and base URL, kept between pulls
        self._sessions: dict[tuple[Path | str, str], tuple[aiohttp.ClientSession, str]] = {}
        self.grpc_socket: Path | None = None
        self.http_socket: Path | None = None
        self.pulled = 0  # spans collected from the backends
        self.pull_failures = 0

    @property
    def started(self) -> bool:
        return self._grpc is not None

    def address(self) -> ir.TraceCollector:
        """Where the proxies and the backends send spans (OTLP/gRPC on its socket)."""
        assert self.grpc_socket is not None, "not started"
        return ir.TraceCollector.on_socket(str(self.grpc_socket))

    async def _export(self, body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        try:
            return ingest(self.store, body)
        except (DecodeError, ValueError) as exc:
            if isinstance(exc, DecodeError):
                self.store.drop("malformed")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not an OTLP export: {exc}")
            raise  # abort raises; for the type checker

    async def _post(self, request: web.Request) -> web.Response:
        if request.content_type not in (otlp.HTTP_CONTENT_TYPE, "application/protobuf"):
            return web.Response(status=415, text="OTLP/HTTP: send application/x-protobuf\n")
        if (request.content_length or 0) > MAX_BODY:
            self.store.drop("too_large")
            return web.Response(status=413, text=f"at most {MAX_BODY} bytes\n")
        try:
            body = await request.read()
            data = ingest(self.store, body)
        except web.HTTPRequestEntityTooLarge:
            self.store.drop("too_large")
            return web.Response(status=413, text=f"at most {MAX_BODY} bytes\n")
        except (DecodeError, ValueError) as exc:
            if isinstance(exc, DecodeError):
                self.store.drop("malformed")
            return web.Response(status=400, text=f"not an OTLP export: {exc}\n")
        return web.Response(body=data, content_type=otlp.HTTP_CONTENT_TYPE)

    def http_app(self) -> web.Application:
        """The OTLP/HTTP receiver (POST /v1/traces), for a site on any transport."""
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post(otlp.HTTP_PATH, self._post)
        return app

    async def start(self, directory: Path) -> None:
        """Listen on DIRECTORY/otlp.sock (gRPC) and otlp-http.sock (HTTP), made private."""
        private_directory(directory)
        grpc_socket, http_socket = sockets(directory)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_BODY)])
        service, method = otlp.GRPC_METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    service, {method: grpc.unary_unary_rpc_method_handler(self._export)}
                ),
            )
        )
        with contextlib.suppress(FileNotFoundError):
            grpc_socket.unlink()  # a stale one (the directory is meshfn's own)
        if not server.add_insecure_port(f"unix:{grpc_socket}"):
            raise OSError(f"cannot listen on {grpc_socket} for OTLP/gRPC")
        os.chmod(grpc_socket, SOCKET_MODE)  # before it accepts (the directory is private too)
        await server.start()
        self._grpc, self.grpc_socket = server, grpc_socket
        runner = web.AppRunner(self.http_app(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.SockSite(runner, listen_private(http_socket)).start()
        except OSError:
            await runner.cleanup()
            await self.stop()
            raise
        self._http, self.http_socket = runner, http_socket
        log.info(
            "trace collector listening",
            extra={"otlp_grpc": str(grpc_socket), "otlp_http": str(http_socket)},
        )

    def pull_from(self, backends: Callable[[], Iterable[tuple[Path | str, str]]]) -> None:
        """Collect the spans of the backends `meshfn up` runs: `backends()` names each serving
        process's socket (or address:port) and its token, looked at every PULL_EVERY seconds;
        each process is followed by its own long poll (`_follow`)."""
        if self._puller is None:
            self._puller = asyncio.create_task(self._pull_loop(backends), name="span-puller")

    async def _pull_loop(self, backends: Callable[[], Iterable[tuple[Path | str, str]]]) -> None:
        following: dict[tuple[Path | str, str], asyncio.Task[None]] = {}
        try:
            while True:
                serving = dict.fromkeys(backends())
                for gone in following.keys() - serving.keys():
                    following.pop(gone).cancel()
                    if gone in self._sessions:
                        await self._sessions.pop(gone)[0].close()
                for key in serving.keys() - following.keys():
                    following[key] = asyncio.create_task(self._follow(*key), name="span-follower")
                await asyncio.sleep(PULL_EVERY)
        finally:
            for task in following.values():
                task.cancel()
            await asyncio.gather(*following.values(), return_exceptions=True)

    async def _follow(self, where: Path | str, token: str) -> None:
        """One backend process: a collection that waits there until a span does (PULL_WAIT at
        most), then PULL_EVERY before the next once it took some (so spans come in batches,
        two collections a second at most, as often as polling every PULL_EVERY did) or
        failed. An idle backend costs one request per PULL_WAIT, where polling cost two a
        second at every backend while tracing was on."""
        while True:
            if await self.pull(where, token, PULL_WAIT) != 0:
                await asyncio.sleep(PULL_EVERY)

    async def pull(self, where: Path | str, token: str, wait: float = 0.0) -> int | None:
        """Take what one backend process holds (a batch at a time, until it has no more; the
        first request waits up to `wait` seconds for a span), over a connection kept from one
        collection to the next. The batches taken; None when the backend failed to answer."""
        key = (where, token)
        if key not in self._sessions:
            self._sessions[key] = local_session(where, aiohttp.ClientTimeout(total=2.0))
        session, base = self._sessions[key]
        headers = {"Authorization": f"Bearer {token}"}
        taken = 0
        while taken < MAX_PULLS:
            url = base + SPANS_PATH
            if wait and not taken:
                url += f"?{SPANS_WAIT}={wait:g}"
            try:
                async with session.post(
                    url, headers=headers, timeout=aiohttp.ClientTimeout(total=wait + 2.0)
                ) as reply:
                    body = await reply.read()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # a backend restarting: the next collection connects afresh
                if self._sessions.get(key, (None,))[0] is session:
                    del self._sessions[key]
                await session.close()
                self._pull_failed(where, str(exc) or exc.__class__.__name__)
                return None
            if reply.status != 200:
                if reply.status != 204:
                    self._pull_failed(where, f"HTTP {reply.status}")
                    return None
                return taken
            try:
                ingest(self.store, body)
            except (DecodeError, ValueError) as exc:
                self.store.drop("malformed")
                self._pull_failed(where, str(exc))
                return None
            self.pulled += 1
            taken += 1
        return taken

    def _pull_failed(self, where: Path | str, why: str) -> None:
        """A backend starting or restarting is not there yet: counted, logged at debug."""
        self.pull_failures += 1
        log.debug("collecting spans from %s failed: %s", where, why)

    async def stop(self) -> None:
        if self._puller is not None:
            self._puller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._puller
            self._puller = None
        for session, _ in self._sessions.values():
            await session.close()
        self._sessions.clear()
        if self._grpc is not None:
            await self._grpc.stop(0.5)
            self._grpc = None
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        for path in (self.grpc_socket, self.http_socket):
            if path is not None:
                path.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        """For /debug/status (meshfn status)."""
        return {
            "otlp_grpc": f"unix:{self.grpc_socket}",
            "otlp_http": f"unix:{self.http_socket} {otlp.HTTP_PATH}",
            "backend_collections": self.pulled,
            "backend_collection_failures": self.pull_failures,
            **self.store.stats(),
        }


class TraceMetrics(Collector):
    """/metrics of the embedded collector, read from its store at scrape time."""

    def __init__(self, collector: TraceCollector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        stats = self.collector.store.stats()
        received = CounterMetricFamily(
            "meshfn_trace_spans_received", "Spans the embedded trace collector received"
        )
        received.add_metric([], stats["received_spans"])
        dropped = CounterMetricFamily(
            "meshfn_trace_spans_dropped",
            "Spans the embedded trace collector did not keep: evicted (the store was full, the"
            " oldest traces went), trace_full (a trace's span cap), malformed, too_large",
            labels=["reason"],
        )
        for reason, count in stats["dropped_spans"].items():
            dropped.add_metric([reason], count)
        traces = GaugeMetricFamily("meshfn_trace_store_traces", "Traces the collector holds")
        traces.add_metric([], stats["traces"])
        size = GaugeMetricFamily(
            "meshfn_trace_store_bytes", "Estimated memory of the traces the collector holds"
        )
        size.add_metric([], stats["bytes"])
        yield from (received, dropped, traces, size)
