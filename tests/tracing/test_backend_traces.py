"""The inference backend continues a request's trace (a real Backend, a real function, its HTTP
server on a private unix socket, the embedded collector taking the spans from it as `meshfn up`
does: POST /meshfn/spans with the backend's pull token): its server span under the sidecar's,
admission, queue, the cold start split into code-cache lookup, deserialize and instantiate, the
guest call; JSON log lines written while it handles the request carry the trace's ids; a
malformed traceparent restarts the trace, never fails the request; nobody without the token
takes the spans."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshfn.common.logs import JsonFormatter, trace_context
from meshfn.common.unix import listen_private, unix_request
from meshfn.contracts import otlp
from meshfn.control_plane.runtime.traces import TraceCollector, TraceStore
from meshfn.inference.backend import Backend
from meshfn.inference.config import parse_config
from meshfn.inference.examples import publish_examples
from meshfn.inference.http import HttpServer
from meshfn.inference.kserve import InferRequest, error_body, parse_http
from meshfn.inference.server import Router

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SIDECAR = "00f067aa0ba902b7"
BODY = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]})


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("registry")
    _, public = publish_examples(root, include_testing=True)
    return root, public


TOKEN = "ab" * 16


@dataclass
class Served:
    backend: Backend
    socket: Path


@pytest.fixture
async def collector(tmp_path: Path) -> AsyncIterator[TraceCollector]:
    found = TraceCollector(TraceStore())
    await found.start(tmp_path / "collector")
    yield found
    await found.stop()


@contextlib.asynccontextmanager
async def serving(registry: tuple[Path, Path], path: Path) -> AsyncIterator[Served]:
    """A backend holding its spans for a collector (pullToken), served on `path`."""
    root, key = registry
    config = parse_config(
        {
            "registry": str(root),
            "trustedKeys": [str(key)],
            "functions": [{"name": "chaos-core"}],
            "tracing": {"pullToken": TOKEN, "sampling": 100},
        }
    )
    found = Backend(config)
    await found.start()
    router = Router(found)
    server = HttpServer(router.handle, router.body_limit, error_body)
    await server.start("", 0, sock=listen_private(path))
    try:
        yield Served(found, path)
    finally:
        await server.close()
        await found.drain(1)


@pytest.fixture
async def served(
    registry: tuple[Path, Path], collector: TraceCollector, tmp_path: Path
) -> AsyncIterator[Served]:
    async with serving(registry, tmp_path / "http.sock") as found:
        collector.pull_from(lambda: [(found.socket, TOKEN)])
        yield found


@pytest.fixture
def backend(served: Served) -> Backend:
    return served.backend


async def _trace(collector: TraceCollector, trace_id: str, spans: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        trace = collector.store.get(trace_id)
        if trace is not None and len(trace.spans) >= spans:
            return list(trace.document()["span_list"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"trace {trace_id} did not arrive whole")


async def test_the_backend_continues_the_sidecars_trace(
    backend: Backend, collector: TraceCollector
) -> None:
    headers = {b"traceparent": f"00-{TRACE}-{SIDECAR}-01".encode(), b"tracestate": b"v=1"}
    reply = await backend.infer("chaos-core", None, BODY.encode(), headers)
    assert reply.status == 200, reply.body
    spans = {s["name"]: s for s in await _trace(collector, TRACE, 8)}
    server = spans["infer chaos-core"]
    assert server["parent_id"] == SIDECAR and server["kind"] == "server"
    assert server["attributes"]["meshfn.model"] == "chaos-core"
    assert server["attributes"]["http.response.status_code"] == 200
    for child in ("admission", "queue", "cold start", "guest call"):
        assert spans[child]["parent_id"] == server["span_id"], child
    # the first request loaded the function: lookup, deserialize (a miss), instantiate
    for step in ("code-cache lookup", "deserialize", "instantiate"):
        assert spans[step]["parent_id"] == spans["cold start"]["span_id"], step
    assert spans["cold start"]["attributes"] == {
        "meshfn.code_loaded": True,
        "meshfn.code_cache_hit": False,
    }
    order = ["admission", "queue", "cold start", "guest call"]
    starts = [spans[n]["start_ns"] for n in order]
    assert starts == sorted(starts)
    assert spans["guest call"]["end_ns"] <= server["end_ns"]


async def test_a_malformed_traceparent_restarts_the_trace(
    backend: Backend, collector: TraceCollector
) -> None:
    for bad in (b"00-zz-yy-01", b"\xff\xfe", b"00-" + b"0" * 32 + b"-" + b"1" * 16 + b"-01"):
        reply = await backend.infer("chaos-core", None, BODY.encode(), {b"traceparent": bad})
        assert reply.status == 200, (bad, reply.body)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(collector.store) < 3:
        await asyncio.sleep(0.05)
    roots = [t.root() for t in collector.store.traces()]
    assert len(roots) == 3 and all(r.parent_id == "" for r in roots)


async def test_json_log_lines_of_a_request_carry_its_trace(backend: Backend) -> None:
    """Every line written while the backend handles a traced request (here: by its parse step,
    where the dispatcher has set the request's context) carries trace_id and span_id; a line
    written outside a request carries neither."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("meshfn.inference.test")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    rt = backend.lookup("chaos-core", None)
    seen: list[tuple[str, str] | None] = []

    def parse() -> InferRequest:
        seen.append(trace_context.get())
        log.info("parsing the request", extra={"function": rt.label})
        assert rt.signature is not None
        return parse_http(BODY.encode(), rt.signature, None, (rt.name, rt.version))

    span = backend.tracer.begin("infer chaos-core", f"00-{TRACE}-{SIDECAR}-00")
    assert span is not None and not span.sampled  # not sampled: still in the logs
    try:
        await backend.dispatcher.serve(rt, "rest", parse, lambda c, r: c, "", span)
        log.info("after the request")
    finally:
        log.removeHandler(handler)
    inside, after = (json.loads(line) for line in stream.getvalue().splitlines())
    assert seen == [(TRACE, span.span_id.hex())]
    assert (inside["trace_id"], inside["span_id"]) == (TRACE, span.span_id.hex())
    assert inside["function"] == "chaos-core@1"
    assert "trace_id" not in after and "span_id" not in after


async def test_only_the_collectors_token_takes_the_spans(
    registry: tuple[Path, Path], tmp_path: Path
) -> None:
    """The sidecar forwards the mesh's requests to this same socket: without the token (or
    with another) nothing is taken and a GET is refused; with it, the spans come as OTLP and the
    queue empties."""
    async with serving(registry, tmp_path / "http.sock") as found:
        headers = {b"traceparent": f"00-{TRACE}-{SIDECAR}-01".encode()}
        reply = await found.backend.infer("chaos-core", None, BODY.encode(), headers)
        assert reply.status == 200
        exporter = found.backend.tracer.exporter
        assert exporter is not None and exporter.pulled and exporter.queued_spans > 0
        queued = exporter.queued_spans

        async def post(given: dict[str, str], method: str = "POST") -> tuple[int, bytes]:
            return await asyncio.to_thread(
                unix_request, found.socket, "/meshfn/spans", 5.0, method, None, given
            )

        for given in ({}, {"Authorization": "Bearer " + "cd" * 16}, {"Authorization": TOKEN}):
            assert (await post(given))[0] == 401, given
        assert (await post({"Authorization": f"Bearer {TOKEN}"}, "GET"))[0] == 405
        assert exporter.queued_spans == queued and exporter.exported == 0
        status, body = await post({"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and exporter.queued_spans == 0 and exporter.exported == queued
        request = otlp.ExportTraceServiceRequest.FromString(body)
        assert {s.trace_id.hex() for s in request.resource_spans[0].scope_spans[0].spans} == {TRACE}
        assert (await post({"Authorization": f"Bearer {TOKEN}"}))[0] == 204  # none left
