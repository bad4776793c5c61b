"""The backend continues the trace: spans for each request, from the `traceparent` its sidecar
forwards (HTTP header or gRPC metadata), exported over OTLP by a thread of their own.

Spans of a request (children of the backend's server span `infer <model>`):
- `admission`: admission (draining, refusals, QoS, the concurrency limit) and parsing;
- `queue`: waiting for a worker thread, or for a batch;
- `batch`: the merged guest call a request joined, with a link to every other member's span
  (each member's trace keeps its own copy, so every trace is whole on its own);
- `cold start`: an instance had to be made first; its children `code-cache lookup`,
  `deserialize` (only on a miss) and `instantiate`;
- `guest call`: the function itself.
A generation's server span (`chat tiny-lm`, `text_completion tiny-lm`: the GenAI conventions'
`{operation} {model}`, with their usage attributes) has `admission` (admission, the prompt's
tokens, the token budget's reservation), `time to first token` and the `decode loop`, and a
`first token` event (generative.py); it ends when the generation does, not when its first
response bytes go.

Hand-built, not the OpenTelemetry SDK (measured, bench/tracing.py `--sdk`): the hot path only
reads clocks and appends tuples; protobuf messages are built on the exporter thread, in
batches. A request without a usable parent is sampled at `sampling` percent; with one, it
follows the parent's flag. A malformed `traceparent` is ignored: the request starts a new trace
under the backend's own sampling (contracts.tracing.parse_traceparent never raises).

Under `meshfn up` the spans are not sent but collected: they wait in the same bounded queue
until the control plane takes them (POST /meshfn/spans, a bearer token from the backend's
configuration, on the backend's private socket), so the sandboxed backend opens no connection
for them (its egress control refuses unix socket connects, and TCP the policy does not name).

The exporter never delays a request: the queue is bounded (`queue` spans), an export that fails
or takes longer than `timeout` drops its spans, and drops are counted (metrics, /meshfn/functions)
and logged at most once per LOG_EVERY seconds with the count since the last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import grpc

from meshfn.common.logs import trace_context
from meshfn.contracts import otlp
from meshfn.contracts.tracing import (
    BackendTracing,
    endpoint_port,
    parse_traceparent,
    parse_tracestate,
)

from .pool import ColdStart, Invocation

log = logging.getLogger("meshfn.inference.tracing")

# perf_counter_ns -> Unix nanoseconds (one offset per process: a request lasts milliseconds)
_EPOCH_NS = time.time_ns() - time.perf_counter_ns()
BATCH_SPANS = 512  # the exporter sends at most this many request spans per export
FLUSH_S = 1.0  # and at least this often while spans wait
LOG_EVERY = 30.0  # seconds between two log lines about lost spans
_getrandbits = random.getrandbits

Link = tuple[bytes, bytes]  # (trace id, span id)
# A request's (traceparent, tracestate), as its headers or gRPC metadata carry them.
TraceContext = tuple[str | bytes | None, str | bytes | None]


TRACE_HEADERS = (b"traceparent", b"tracestate")


def trace_of(headers: Mapping[bytes, bytes]) -> TraceContext:
    """The trace context of a request's HTTP headers."""
    parent, state = (headers.get(key) for key in TRACE_HEADERS)
    return parent, state


def wall(perf_ns: int) -> int:
    return perf_ns + _EPOCH_NS


class RequestSpan:
    """One request's spans in the backend: the server span and its children, as plain tuples
    (perf_counter_ns times) until the exporter thread builds the protobuf messages."""

    __slots__ = (
        "attrs",
        "children",
        "end",
        "events",
        "name",
        "parent",
        "sampled",
        "span_id",
        "start",
        "state",
        "status",
        "trace_id",
    )

    def __init__(
        self, name: str, trace_id: bytes, parent: bytes, sampled: bool, state: str = ""
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.parent = parent
        self.span_id = _getrandbits(64).to_bytes(8, "big") or b"\x01" * 8
        self.sampled = sampled
        self.state = state
        self.start = time.perf_counter_ns()
        self.end = 0
        self.status = 0
        self.attrs: dict[str, object] = {}
        # (span id, parent id, name, start, end, attributes or None, links or None)
        self.children: list[tuple[bytes, bytes, str, int, int, Any, Any]] = []
        self.events: list[tuple[str, int, Any]] = []

    def child(
        self,
        name: str,
        start: int,
        end: int,
        attrs: Mapping[str, object] | None = None,
        links: list[Link] | None = None,
        parent: bytes | None = None,
    ) -> bytes:
        """A finished child span (perf_counter_ns times); its span id (a parent for others;
        none where the request is not sampled: nothing records it)."""
        if not self.sampled:
            return b""
        span_id = _getrandbits(64).to_bytes(8, "big") or b"\x01" * 8
        self.children.append((span_id, parent or self.span_id, name, start, end, attrs, links))
        return span_id

    def event(self, name: str, at: int, attrs: Mapping[str, object] | None = None) -> None:
        """A point in time (perf_counter_ns) on the server span: a generation's first token."""
        if self.sampled:
            self.events.append((name, at, attrs))

    @property
    def ids(self) -> tuple[str, str]:
        """(trace id, span id) in hex, for log lines."""
        return self.trace_id.hex(), self.span_id.hex()

    def span_count(self) -> int:
        return 1 + len(self.children)


def record_call(span: RequestSpan, invocation: Invocation, parent: bytes | None = None) -> None:
    """The guest call of `invocation`, and the cold start before it if an instance had to be
    made, as children of `parent` (default: the request's span)."""
    if not span.sampled:
        return
    made = invocation.cold_start
    if made is not None:
        record_cold_start(span, made, parent)
    start = invocation.started_ns
    span.child("guest call", start, start + round(invocation.seconds * 1e9), None, None, parent)


def record_cold_start(span: RequestSpan, made: ColdStart, parent: bytes | None = None) -> None:
    cold = span.child(
        "cold start",
        made.begin,
        made.instantiated,
        {"meshfn.code_loaded": made.loaded, "meshfn.code_cache_hit": made.hit},
        None,
        parent,
    )
    if made.loaded:
        span.child("code-cache lookup", made.begin, made.looked_up, None, None, cold)
        if not made.hit:
            span.child("deserialize", made.looked_up, made.deserialized, None, None, cold)
    span.child("instantiate", made.deserialized, made.instantiated, None, None, cold)


class Tracer:
    """Begins and finishes request spans and owns the exporter. `settings` None: tracing off
    (begin returns None at once)."""

    def __init__(self, settings: BackendTracing | None, counters: Any = None) -> None:
        self.settings = settings
        self._rate = settings.sampling / 100.0 if settings is not None else 0.0
        self._counters = counters
        self.exporter = Exporter(settings, counters) if settings is not None else None
        self._retired: Exporter | None = None  # the last one, while tracing is off: its counts
        self._arrival: asyncio.Event | None = None  # set for the collections waiting in `queued`
        self._closing = False

    @property
    def enabled(self) -> bool:
        return self.exporter is not None

    def reconfigure(self, settings: BackendTracing | None) -> None:
        """The Mesh's tracing changed (`meshfn up` rewrote the config, SIGHUP): from the next
        request on, sample and export as `settings` says, without a restart (which would
        cold-start every function). Spans held for collection go to the new exporter, or count
        as dropped when tracing stops; a sender sends its own as it closes; the counts carry
        over. ValueError for another
        collector endpoint: the sandbox fixed at start where this process may connect."""
        if settings == self.settings:
            return
        had = self.settings.endpoint if self.settings is not None else None
        if settings is not None and settings.endpoint not in (None, had):
            raise ValueError(
                f"a new collector endpoint ({settings.endpoint}) needs a restart: the sandbox"
                " fixed the addresses this process may connect to when it started"
            )
        old = self.exporter
        new = Exporter(settings, self._counters) if settings is not None else None
        if old is not None:
            old.close(0)  # a sender sends what waits in the background, bounded by its timeout
            if new is None:
                if old.pulled:  # nobody will collect them
                    old.drop_queued("tracing was turned off")
                self._retired = old
        before = old or self._retired
        if new is not None and before is not None:
            new.inherit(before)
        self.settings, self.exporter = settings, new
        self._rate = settings.sampling / 100.0 if settings is not None else 0.0
        self.wake()  # a waiting collection answers from the exporter in force now

    def begin(
        self, name: str, traceparent: str | bytes | None, tracestate: str | bytes | None = None
    ) -> RequestSpan | None:
        """The request's span: continuing a well-formed parent (its sampled flag), or a new
        trace sampled at the configured rate; None when tracing is off or a new trace is not
        sampled (nothing anywhere would carry its id)."""
        if self.exporter is None:
            return None
        parent = parse_traceparent(traceparent) if traceparent else None
        if parent is not None:  # its tracestate only travels with spans exported
            state = parse_tracestate(tracestate) if tracestate and parent.sampled else ""
            return RequestSpan(
                name,
                bytes.fromhex(parent.trace_id),
                bytes.fromhex(parent.span_id),
                parent.sampled,
                state,
            )
        if random.random() >= self._rate:
            return None
        trace_id = _getrandbits(128).to_bytes(16, "big") or b"\x01" * 16
        return RequestSpan(name, trace_id, b"", True)

    def finish(self, span: RequestSpan, status: int) -> None:
        """End the span (once: a later call does nothing)."""
        if span.end:
            return
        span.end = time.perf_counter_ns()
        span.status = status
        if span.sampled and self.exporter is not None:
            self.exporter.submit(span)
            if self._arrival is not None:
                self.wake()

    async def queued(self, timeout: float) -> None:
        """Pulled: return once a span waits for collection, the tracing changes, the backend
        drains, or `timeout` seconds pass (the collector's long poll, SPANS_WAIT). On the event
        loop, as `finish` is."""
        exporter = self.exporter
        if self._closing or exporter is None or not exporter.pulled or exporter.queue:
            return
        if self._arrival is None:
            self._arrival = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrival.wait(), timeout)

    def wake(self, closing: bool = False) -> None:
        """Answer the collections waiting in `queued` now; `closing`: and every later one at
        once (the backend drains: its last spans go, and nothing holds the drain)."""
        self._closing = self._closing or closing
        arrival, self._arrival = self._arrival, None
        if arrival is not None:
            arrival.set()

    def logged(self, span: RequestSpan) -> Any:
        """Put the span's ids on every log line of this request (common.logs); the token to
        reset with."""
        return trace_context.set(span.ids)

    def close(self, timeout: float = 2.0) -> None:
        self.wake(closing=True)
        if self.exporter is not None:
            self.exporter.close(timeout)

    def document(self) -> dict[str, Any] | None:
        """For /meshfn/functions (meshfn status)."""
        if self.exporter is None or self.settings is None:
            return None
        return {
            "endpoint": self.settings.endpoint,
            "sampling": self.settings.sampling,
            **self.exporter.counts(),
        }


def _attributes(pairs: Mapping[str, object] | None) -> list[Any]:
    if not pairs:
        return []
    return [otlp.KeyValue(key=k, value=otlp.any_value(v)) for k, v in pairs.items()]


def encode(spans: list[RequestSpan], service: str) -> bytes:
    """ExportTraceServiceRequest bytes for finished request spans (the exporter thread)."""
    request = otlp.ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.extend(
        _attributes({"service.name": service, "process.pid": os.getpid()})
    )
    scope = resource.scope_spans.add()
    scope.scope.name = "meshfn.inference"
    for span in spans:
        out = scope.spans.add(
            trace_id=span.trace_id,
            span_id=span.span_id,
            parent_span_id=span.parent,
            trace_state=span.state,
            name=span.name,
            kind=otlp.KIND_SERVER,
            start_time_unix_nano=wall(span.start),
            end_time_unix_nano=wall(span.end),
            # the W3C sampled bit; whether the parent is known and remote (OTLP's bits 8, 9)
            flags=0x301 if span.parent else 0x101,
        )
        out.attributes.extend(_attributes(span.attrs))
        if span.status >= 500:
            out.status.code = otlp.STATUS_ERROR
            out.status.message = f"HTTP {span.status}"
        for name, at, attrs in span.events:
            out.events.add(time_unix_nano=wall(at), name=name).attributes.extend(_attributes(attrs))
        for span_id, parent, name, start, end, attrs, links in span.children:
            child = scope.spans.add(
                trace_id=span.trace_id,
                span_id=span_id,
                parent_span_id=parent,
                name=name,
                kind=otlp.KIND_INTERNAL,
                start_time_unix_nano=wall(start),
                end_time_unix_nano=wall(max(start, end)),
            )
            child.attributes.extend(_attributes(attrs))
            for trace_id, linked in links or ():
                child.links.add(trace_id=trace_id, span_id=linked)
    data: bytes = request.SerializeToString()
    return data


class Exporter:
    """A daemon thread that sends finished request spans in batches (or, pulled, a queue that
    `collect` empties); bounded, never blocking the event loop, counting what it had to drop."""

    def __init__(self, settings: BackendTracing, counters: Any = None) -> None:
        self.settings = settings
        self.queue: deque[RequestSpan] = deque()
        self.queued_spans = 0
        self.exported = 0
        self.dropped = 0
        self.failures = 0
        self.last_error = ""
        self._counters = counters  # (exported, dropped) prometheus counters, or None
        self._unlogged = 0
        self._logged_at = 0.0
        self._wake = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # the queue and its span count
        self._log_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if settings.endpoint is not None:
            self._send = self._sender(settings.endpoint)
            self._thread = threading.Thread(target=self._run, name="meshfn-otlp", daemon=True)
            self._thread.start()

    @property
    def pulled(self) -> bool:
        """Held for `meshfn up` to collect (BackendTracing.pullToken), not sent."""
        return self._thread is None

    def collect(self) -> tuple[bytes, int] | None:
        """Pulled: the oldest queued spans as one ExportTraceServiceRequest (at most
        BATCH_SPANS request spans) and their count, None while nothing waits. Encoding is the
        caller's thread's (server: a worker thread, not the event loop)."""
        batch = self._take()
        if not batch:
            return None
        spans = sum(s.span_count() for s in batch)
        self.exported += spans
        if self._counters is not None:
            self._counters[0].inc(spans)
        return encode(batch, self.settings.serviceName), spans

    def submit(self, span: RequestSpan) -> None:
        """Called on the event loop: O(1), never waits."""
        count = span.span_count()
        with self._lock:
            full = self.queued_spans + count > self.settings.queue or self._closed
            if not full:
                self.queue.append(span)
                self.queued_spans += count
        if full:
            self._lost(count, "the export queue is full")
            return
        if len(self.queue) >= BATCH_SPANS and not self.pulled:
            self._wake.set()

    def inherit(self, old: Exporter) -> None:
        """Take over a replaced exporter's counts and, pulled, the spans waiting in it (a
        sender sends its own in the background as it closes)."""
        self.exported, self.dropped, self.failures = old.exported, old.dropped, old.failures
        self.last_error = old.last_error
        if not old.pulled:
            return
        with old._lock:
            waiting, old.queue, old.queued_spans = list(old.queue), deque(), 0
        for span in waiting:
            self.submit(span)

    def drop_queued(self, reason: str) -> None:
        """Nothing will take the waiting spans (tracing stopped): counted as dropped."""
        with self._lock:
            spans, self.queue, self.queued_spans = self.queued_spans, deque(), 0
        if spans:
            self._lost(spans, reason)

    def _take(self) -> list[RequestSpan]:
        batch: list[RequestSpan] = []
        with self._lock:
            while self.queue and len(batch) < BATCH_SPANS:
                span = self.queue.popleft()
                self.queued_spans -= span.span_count()
                batch.append(span)
        return batch

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self._flush()

    def _flush(self) -> None:
        while self.queue:
            batch = self._take()
            spans = sum(s.span_count() for s in batch)
            try:
                self._send(encode(batch, self.settings.serviceName))
            except Exception as exc:  # a collector down, slow or answering garbage
                self.failures += 1
                self.last_error = str(exc)[:200]
                self._lost(spans, self.last_error)
                return  # the rest waits for the next round (or is dropped when full)
            self.exported += spans
            if self._counters is not None:
                self._counters[0].inc(spans)

    def _lost(self, spans: int, reason: str) -> None:
        with self._log_lock:
            self.dropped += spans
            self._unlogged += spans
            if self._counters is not None:
                self._counters[1].inc(spans)
            now = time.monotonic()
            if now - self._logged_at < LOG_EVERY:
                return
            lost, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.warning(
            "dropped %d span(s) since the last report: %s",
            lost,
            reason,
            extra={"endpoint": self.settings.endpoint, "dropped_total": self.dropped},
        )

    def _sender(self, endpoint: str) -> Any:
        parts = urlsplit(endpoint)
        host, port = parts.hostname or "127.0.0.1", endpoint_port(endpoint)
        timeout = self.settings.timeout
        if parts.scheme in ("grpc", "unix"):
            target = f"unix:{parts.path}" if parts.scheme == "unix" else f"{host}:{port}"
            channel = grpc.insecure_channel(target)
            call = channel.unary_unary(
                otlp.GRPC_METHOD,
                request_serializer=lambda body: body,
                response_deserializer=lambda body: body,
            )

            def send_grpc(body: bytes) -> None:
                call(body, timeout=timeout)

            return send_grpc
        path = parts.path or otlp.HTTP_PATH

        def send_http(body: bytes) -> None:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.request("POST", path, body, {"Content-Type": otlp.HTTP_CONTENT_TYPE})
                reply = conn.getresponse()
                reply.read()
                if reply.status // 100 != 2:
                    raise OSError(f"collector answered HTTP {reply.status}")
            finally:
                conn.close()

        return send_http

    def counts(self) -> dict[str, Any]:
        return {
            "collected_by": "meshfn up" if self.pulled else None,
            "exported_spans": self.exported,
            "dropped_spans": self.dropped,
            "queued_spans": self.queued_spans,
            "failed_exports": self.failures,
            "last_error": self.last_error or None,
        }

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (bounded by `timeout`), then stop."""
        self._closed = True
        if self._thread is None:
            return
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return
        self._flush()


__all__ = ["Exporter", "RequestSpan", "Tracer", "encode", "record_call"]
