"""The embedded trace collector (control_plane.runtime.traces) and the backend's exporter
(inference.tracing) against it, over real sockets: OTLP over gRPC and over HTTP, a store bounded
under a flood, malformed exports, and a collector that is down or never answers."""

from __future__ import annotations

import asyncio
import logging
import socket
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from google.protobuf.message import DecodeError

from meshfn.common.unix import unix_request
from meshfn.contracts import otlp
from meshfn.contracts.tracing import BackendTracing
from meshfn.control_plane.runtime.traces import (
    MAX_ATTRIBUTES,
    MAX_SPANS_PER_TRACE,
    MAX_VALUE,
    Span,
    TraceCollector,
    TraceStore,
    ingest,
)
from meshfn.control_plane.runtime.upstreams import embedded_collector, spans_token, upstreams_for
from meshfn.inference import tracing as backend_tracing
from meshfn.inference.tracing import RequestSpan, Tracer, encode
from meshfn.policy.loader import load_policies
from meshfn.testing import policies as p
from meshfn.testing.ports import free_ports, hanging_server

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _span(trace: int, n: int = 0, attributes: dict[str, object] | None = None) -> Span:
    return Span(
        trace_id=f"{trace:032x}",
        span_id=f"{n + 1:016x}",
        parent_id="",
        name="s",
        service="svc",
        kind="server",
        start_ns=trace * 1000,
        end_ns=trace * 1000 + 500,
        attributes=attributes or {},
    )


def test_the_store_keeps_the_newest_traces_within_its_count() -> None:
    store = TraceStore(max_traces=100, max_bytes=1 << 30)
    store.add(_span(t + 1, n) for t in range(5000) for n in range(2))
    assert len(store) == 100
    assert store.get(f"{5000:032x}") is not None and store.get(f"{4900:032x}") is None
    stats = store.stats()
    assert stats["dropped_spans"]["evicted"] == 4900 * 2 and stats["evicted_traces"] == 4900
    assert stats["received_spans"] == 10000 and stats["spans"] == 200


def test_the_store_stays_within_its_memory_under_a_flood_of_large_spans() -> None:
    store = TraceStore(max_traces=1_000_000, max_bytes=1 << 20)
    big = {f"k{i}": "v" * 900 for i in range(8)}
    for t in range(2000):
        store.add([_span(t + 1, 0, big)])
        assert store.bytes <= store.max_bytes
    assert 100 < len(store) < 200
    assert store.stats()["dropped_spans"]["evicted"] == 2000 - len(store)


def test_a_trace_holds_at_most_its_cap_of_spans() -> None:
    store = TraceStore(max_traces=10, max_bytes=1 << 30)
    kept = store.add(_span(1, n) for n in range(MAX_SPANS_PER_TRACE + 10))
    assert kept == MAX_SPANS_PER_TRACE and store.dropped["trace_full"] == 10


def _export(*spans: tuple[bytes, bytes]) -> bytes:
    request = otlp.ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.add(key="service.name", value=otlp.any_value("edge.ingress"))
    scope = resource.scope_spans.add()
    for trace_id, span_id in spans:
        scope.spans.add(trace_id=trace_id, span_id=span_id, name="x", start_time_unix_nano=5)
    data: bytes = request.SerializeToString()
    return data


def test_malformed_exports_are_refused_and_bad_spans_counted() -> None:
    store = TraceStore()
    with pytest.raises(DecodeError):
        ingest(store, b"\xff\xff\xff\xff")
    good = (b"\x01" * 16, b"\x02" * 8)
    answer = otlp.ExportTraceServiceResponse.FromString(
        ingest(store, _export(good, (b"\x00" * 16, b"\x02" * 8), (b"\x01" * 3, b"\x02" * 8)))
    )
    assert answer.partial_success.rejected_spans == 2
    assert store.dropped["malformed"] == 2 and len(store) == 1
    (trace,) = store.traces()
    assert trace.spans[0].service == "edge.ingress" and trace.spans[0].end_ns == 5


def test_a_stored_span_keeps_its_own_encoding_until_its_attributes_are_read() -> None:
    """Attributes are decoded when read, from the span's own bytes (not a view into the export,
    which would keep all of it alive past the store's memory bound), truncated as ever."""
    request = otlp.ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    raw = scope.spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="x")
    raw.attributes.add(key="meshfn.route", value=otlp.any_value("default/iris"))
    raw.attributes.add(key="long", value=otlp.any_value("v" * (MAX_VALUE + 10)))
    for i in range(MAX_ATTRIBUTES + 5):
        raw.attributes.add(key=f"k{i}", value=otlp.any_value(i))
    store = TraceStore()
    ingest(store, request.SerializeToString())
    (trace,) = store.traces()
    (span,) = trace.spans
    assert isinstance(span._attributes, bytes) and span.size() > len(span._attributes)
    assert trace.summary()["route"] == "default/iris"  # the first read decodes
    assert span.attributes["long"] == "v" * MAX_VALUE + "…"
    assert len(span.attributes) == MAX_ATTRIBUTES
    assert isinstance(span._attributes, dict)


@pytest.fixture
async def collector(tmp_path: Path) -> AsyncIterator[TraceCollector]:
    found = TraceCollector(TraceStore())
    await found.start(tmp_path / "collector")
    try:
        yield found
    finally:
        await found.stop()


async def test_the_collector_listens_on_private_sockets_only(tmp_path: Path) -> None:
    """Unix sockets (0600) in a private directory (0700): what `meshfn up` runs reaches them,
    no other local user (a loopback port would let anyone write spans); gone when it stops."""
    collector = TraceCollector(TraceStore())
    await collector.start(tmp_path / "collector")
    try:
        assert stat.S_IMODE((tmp_path / "collector").stat().st_mode) == 0o700
        for path in (collector.grpc_socket, collector.http_socket):
            assert path is not None and path.parent == tmp_path / "collector"
            info = path.stat()
            assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert collector.address().endpoint == f"unix://{collector.grpc_socket}"
        assert collector.http_socket is not None
        body = encode([_request_span()], "svc")
        status, answer = await asyncio.to_thread(
            unix_request, collector.http_socket, "/v1/traces", 5.0, "POST", body,
            {"Content-Type": otlp.HTTP_CONTENT_TYPE},
        )  # fmt: skip
        assert status == 200 and otlp.ExportTraceServiceResponse.FromString(answer)
        assert collector.store.get(PARENT.split("-")[1]) is not None
    finally:
        await collector.stop()
    assert not list((tmp_path / "collector").iterdir())


def _request_span() -> RequestSpan:
    tracer = Tracer(BackendTracing(endpoint="grpc://127.0.0.1:9"))
    try:
        span = tracer.begin("infer iris", PARENT)
    finally:
        tracer.close(timeout=0.1)
    assert span is not None
    span.end = span.start + 1000
    return span


@pytest.fixture
async def http_port(collector: TraceCollector) -> AsyncIterator[int]:
    """The collector's OTLP/HTTP receiver on a loopback port, as an external collector would
    listen (the backends' HTTP exporter is for those)."""
    runner = web.AppRunner(collector.http_app(), access_log=None)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def _wait_for(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_the_backend_exports_its_spans_to_the_collector(
    collector: TraceCollector, http_port: int, protocol: str
) -> None:
    """OTLP/gRPC over the embedded collector's socket (as under `meshfn up`), OTLP/HTTP to a
    port (as to an external collector)."""
    if protocol == "grpc":
        endpoint = collector.address().endpoint
    else:
        endpoint = f"http://127.0.0.1:{http_port}/v1/traces"
    tracer = Tracer(BackendTracing(endpoint=endpoint, sampling=0))
    try:
        span = tracer.begin("infer iris", PARENT, "vendor=1")
        assert span is not None and span.sampled
        now = time.perf_counter_ns()
        queue = span.child("queue", now, now + 1000)
        span.child("guest call", now + 1000, now + 5000, {"rows": 2}, None, queue)
        span.event("first token", now + 3000)
        tracer.finish(span, 200)
        # a new trace at 0% is not sampled: nothing to carry its id
        assert tracer.begin("infer iris", None) is None
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        await _wait_for(lambda: collector.store.get(trace_id) is not None)
        await _wait_for(lambda: len(collector.store.get(trace_id).spans) == 3)  # type: ignore[union-attr]
    finally:
        tracer.close()
    trace = collector.store.get(trace_id)
    assert trace is not None
    by_name = {s.name: s for s in trace.spans}
    server = by_name["infer iris"]
    assert server.parent_id == "00f067aa0ba902b7" and server.kind == "server"
    assert by_name["queue"].parent_id == server.span_id
    assert by_name["guest call"].parent_id == by_name["queue"].span_id
    assert by_name["guest call"].attributes == {"rows": 2}
    assert server.events[0]["name"] == "first token"
    assert server.service == "meshfn-inference"
    assert tracer.exporter is not None and tracer.exporter.exported == 3


async def test_a_malformed_traceparent_restarts_the_trace() -> None:
    tracer = Tracer(BackendTracing(endpoint="grpc://127.0.0.1:9", sampling=100))
    try:
        span = tracer.begin("infer x", "00-zz-00-01", "!!bad state!!")
        assert span is not None and span.sampled and span.parent == b""
        assert span.trace_id.hex() != "0" * 32 and span.state == ""
    finally:
        tracer.close(timeout=0.1)


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("kind", ["down", "hanging"])
def test_a_collector_down_or_hanging_never_delays_requests_and_loses_are_counted(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    silent = None
    if kind == "down":
        port = _dead_port()
    else:
        silent, port = hanging_server()
    tracer = Tracer(
        BackendTracing(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=0.2, queue=64),
        None,
    )
    exporter = tracer.exporter
    assert exporter is not None
    caplog.set_level(logging.WARNING, "meshfn.inference.tracing")
    try:
        worst = 0
        for _ in range(2000):
            started = time.perf_counter_ns()
            span = tracer.begin("infer x", PARENT)
            assert span is not None
            now = time.perf_counter_ns()
            span.child("guest call", now, now + 10)
            tracer.finish(span, 200)
            worst = max(worst, time.perf_counter_ns() - started)
        # never waits on the collector: each request's tracing stays within microseconds
        assert worst < 20_000_000, worst
        exporter._wake.set()
        deadline = time.monotonic() + 5
        while exporter.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exporter.failures >= 1
        # the queue was bounded: most spans were dropped at once, the rest when the export failed
        assert exporter.dropped >= 2 * 2000 - 64 and exporter.queued_spans <= 64
        assert exporter.counts()["dropped_spans"] == exporter.dropped
    finally:
        tracer.close(timeout=0.5)
        if silent is not None:
            silent.close()
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    # rate limited: one line (with the count) however many spans were lost
    assert len(lines) == 1, [r.getMessage() for r in lines]


def test_encoded_spans_carry_links_and_remote_parents() -> None:
    tracer = Tracer(BackendTracing(endpoint="grpc://127.0.0.1:9"))
    try:
        span = tracer.begin("infer iris", PARENT)
        assert span is not None
        other = (b"\x05" * 16, b"\x06" * 8)
        now = time.perf_counter_ns()
        span.child("batch", now, now + 10, {"meshfn.batch.requests": 2}, [other])
        span.end = now + 20
        request = otlp.ExportTraceServiceRequest.FromString(encode([span], "svc"))
    finally:
        tracer.close(timeout=0.1)
    server, batch = request.resource_spans[0].scope_spans[0].spans
    assert server.flags & 0x300 == 0x300 and server.flags & 1
    assert (batch.links[0].trace_id, batch.links[0].span_id) == other
    assert backend_tracing.wall(now) == batch.start_time_unix_nano


@pytest.mark.parametrize("named", [False, True])
def test_meshfn_up_collects_its_backends_spans_or_lets_them_reach_the_named_collector(
    tmp_path: Path, named: bool
) -> None:
    """The embedded collector: the backends get a pull token (no endpoint, so no connection of
    theirs is needed: the egress sandbox stays closed), the same across reloads. A collector
    the Mesh names by address: the backends push there, and their egress allows exactly it."""
    collector = {"collector": {"host": "10.1.2.3", "port": 4317}} if named else {}
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "mesh.yaml").write_text(
        p.documents(
            p.mesh("m", "m.local", tracing={"sampling": 5, **collector}),
            p.gateway(None, 10000),
            p.service("models", 9000, [p.endpoint(sidecar=15000)]),
            p.doc("Function", "iris", {"backend": "models"}),
        )
    )
    model = load_policies(tmp_path / "p")
    state = tmp_path / "state"
    (spec,) = upstreams_for(model, state, 1).values()
    # at 5% its sidecar is split and decides for every request: the backend draws none itself
    assert spec.tracing is not None and spec.tracing.sampling == 0
    if named:
        assert spec.tracing.endpoint == "grpc://10.1.2.3:4317" and spec.tracing.pullToken is None
        assert ("10.1.2.3", 4317) in spec.egress
        assert embedded_collector(model, state) is None
    else:
        assert spec.tracing.endpoint is None and spec.tracing.pullToken == spans_token(state)
        assert spec.egress == ()
        again = upstreams_for(model, state, 1)  # a reload: the same token, no backend restart
        assert list(again.values()) == [spec]
        assert stat.S_IMODE((state / "collector" / "spans.key").stat().st_mode) == 0o600
        address = embedded_collector(model, state)
        assert address is not None and address.socket.endswith("/collector/otlp.sock")


@pytest.mark.parametrize(("sampling", "sidecar", "drawn"), [(5, None, 5), (50, 15000, 50)])
def test_a_backend_draws_for_requests_without_a_parent_unless_a_split_sidecar_decided(
    tmp_path: Path, sampling: float, sidecar: int | None, drawn: float
) -> None:
    """Without a sidecar of meshfn's, or behind one that traces on its own listener (25% or
    more), the backend samples the mesh's share of the requests that come without a parent."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "mesh.yaml").write_text(
        p.documents(
            p.mesh("m", "m.local", tracing={"sampling": sampling}),
            p.gateway(None, 10000),
            p.service("models", 9000, [p.endpoint(sidecar=sidecar)]),
            p.doc("Function", "iris", {"backend": "models"}),
        )
    )
    (spec,) = upstreams_for(load_policies(tmp_path / "p"), tmp_path / "state", 1).values()
    assert spec.tracing is not None and spec.tracing.sampling == drawn
