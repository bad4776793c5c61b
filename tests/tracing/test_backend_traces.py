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
import itertools
import json
import logging
import queue
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from meshfn.common.logs import JsonFormatter, trace_context
from meshfn.common.unix import listen_private, unix_request
from meshfn.contracts import genai, otlp
from meshfn.control_plane.cli.traces import generations
from meshfn.control_plane.runtime import traces
from meshfn.control_plane.runtime.traces import TraceCollector, TraceStore
from meshfn.inference.backend import Backend
from meshfn.inference.config import load_config, parse_config
from meshfn.inference.examples import publish_examples
from meshfn.inference.generation import Piece, Sampling
from meshfn.inference.grpc_api import GrpcServer
from meshfn.inference.http import HttpServer
from meshfn.inference.kserve import InferRequest, error_body, parse_http
from meshfn.inference.server import Router, reload_tracing
from meshfn.inference.status import functions_document

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
async def serving(
    registry: tuple[Path, Path], path: Path, functions: list[dict[str, Any]] | None = None
) -> AsyncIterator[Served]:
    """A backend holding its spans for a collector (pullToken), served on `path`."""
    root, key = registry
    config = parse_config(
        {
            "registry": str(root),
            "trustedKeys": [str(key)],
            "functions": functions or [{"name": "chaos-core"}],
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


async def test_the_collector_keeps_its_connection_and_reconnects_after_a_restart(
    registry: tuple[Path, Path], collector: TraceCollector, tmp_path: Path
) -> None:
    """Collections reuse one connection per backend; a backend that restarts on the same
    socket is collected from again, and one that is gone has its connection closed."""
    path = tmp_path / "http.sock"
    backends = [(path, TOKEN)]
    collector.pull_from(lambda: backends)
    traces = iter(f"{n:032x}" for n in range(0x1A0, 0x1B0))

    async def traced(served: Served) -> None:
        trace = next(traces)
        headers = {b"traceparent": f"00-{trace}-{SIDECAR}-01".encode()}
        reply = await served.backend.infer("chaos-core", None, BODY.encode(), headers)
        assert reply.status == 200, reply.body
        await _trace(collector, trace, 3)

    async with serving(registry, path) as first:
        await traced(first)
        session = collector._sessions[(path, TOKEN)][0]
        await traced(first)
        assert collector._sessions[(path, TOKEN)][0] is session and not session.closed
    async with serving(registry, path) as second:  # the same socket, a new process
        await traced(second)
        assert not collector._sessions[(path, TOKEN)][0].closed
        backends.clear()
        deadline = time.monotonic() + 5
        while collector._sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not collector._sessions


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


async def test_a_collection_waits_for_the_first_span_and_no_longer(
    registry: tuple[Path, Path], tmp_path: Path
) -> None:
    """`?wait=S` (the collector's long poll): an idle backend holds the collection until a
    span is queued and answers with it at once, or answers 204 after S seconds; a collector
    that goes away while it waits leaves the spans queued for the next one; a drain
    answers a waiting collection now and every later one without waiting. A `wait` that is not
    a number of seconds within bounds is refused with 400 and takes nothing."""
    async with serving(registry, tmp_path / "http.sock") as found:
        exporter = found.backend.tracer.exporter
        assert exporter is not None

        async def take(query: str, timeout: float = 10.0) -> tuple[int, bytes, float]:
            started = time.monotonic()
            status, body = await asyncio.to_thread(
                unix_request, found.socket, "/meshfn/spans" + query, timeout, "POST", None,
                {"Authorization": f"Bearer {TOKEN}"},
            )  # fmt: skip
            return status, body, time.monotonic() - started

        status, _, took = await take("?wait=0.4")
        assert status == 204 and took >= 0.4
        waiting = asyncio.create_task(take("?wait=30"))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        headers = {b"traceparent": f"00-{TRACE}-{SIDECAR}-01".encode()}
        answered = time.monotonic()
        reply = await found.backend.infer("chaos-core", None, BODY.encode(), headers)
        assert reply.status == 200, reply.body
        status, body, _ = await asyncio.wait_for(waiting, 5)
        assert status == 200 and time.monotonic() - answered < 5
        spans = otlp.ExportTraceServiceRequest.FromString(body).resource_spans[0]
        assert {s.trace_id.hex() for s in spans.scope_spans[0].spans} == {TRACE}
        assert exporter.queued_spans == 0

        reply = await found.backend.infer("chaos-core", None, BODY.encode(), headers)
        queued = exporter.queued_spans
        assert queued > 0
        for bad in ("-1", "abc", "nan", "inf", "61", ""):
            status, body, _ = await take(f"?wait={bad}" if bad else "?wait=")
            assert status == 400 and b"wait must be a number of seconds" in body, (bad, body)
        assert exporter.queued_spans == queued  # nothing taken
        assert (await take("?wait=5"))[0] == 200  # waiting spans answer without a wait

        # a collector that goes away while it waits takes nothing: the span stays queued
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(str(found.socket))
        raw.sendall(
            f"POST /meshfn/spans?wait=30 HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer {TOKEN}"
            "\r\nContent-Length: 0\r\n\r\n".encode()
        )
        await asyncio.sleep(0.5)
        raw.close()
        await asyncio.sleep(0.3)
        reply = await found.backend.infer("chaos-core", None, BODY.encode(), headers)
        await asyncio.sleep(0.3)
        assert exporter.queued_spans > 0
        assert (await take("?wait=5"))[0] == 200

        waiting = asyncio.create_task(take("?wait=30"))
        await asyncio.sleep(0.5)
        found.backend.tracer.wake(closing=True)  # serve() does this as the backend drains
        status, _, took = await asyncio.wait_for(waiting, 5)
        assert status == 204 and took < 5
        status, _, took = await take("?wait=30")
        assert status == 204 and took < 5


async def test_an_idle_backend_costs_its_collector_one_collection_per_wait(
    registry: tuple[Path, Path], collector: TraceCollector, tmp_path: Path
) -> None:
    """Polling asked every backend twice a second while tracing was on; following one by a
    long poll asks an idle backend once per PULL_WAIT, and still collects a span as soon as
    one is queued."""
    calls: list[float] = []
    pull = collector.pull

    async def counted(where: Path | str, token: str, wait: float = 0.0) -> int | None:
        calls.append(wait)
        return await pull(where, token, wait)

    collector.pull = counted  # type: ignore[method-assign]
    async with serving(registry, tmp_path / "http.sock") as found:
        collector.pull_from(lambda: [(found.socket, TOKEN)])
        await asyncio.sleep(2.0)
        assert calls == [traces.PULL_WAIT]  # one collection, waiting still
        headers = {b"traceparent": f"00-{TRACE}-{SIDECAR}-01".encode()}
        started = time.monotonic()
        reply = await found.backend.infer("chaos-core", None, BODY.encode(), headers)
        assert reply.status == 200, reply.body
        await _trace(collector, TRACE, 3)
        assert time.monotonic() - started < traces.PULL_WAIT


GENERATIVE = [{"name": "chaos-gen", "generation": {"maxTokens": 64}}, {"name": "embedder"}]


async def test_a_generation_is_traced_to_its_end(
    registry: tuple[Path, Path], collector: TraceCollector, tmp_path: Path
) -> None:
    """A streamed chat completion (the Python generator chaos-gen) continues the sidecar's
    trace: its server span is named and attributed as the GenAI conventions say, with the
    usage the client got; admission, time to first token and the decode loop follow each
    other, the first token is an event, and the span ends with the stream. A refused request
    (max_tokens above the Function's bound) is a span with its 400; Triton's generate (HTTP
    and tritonclient's gRPC stream), KServe's /infer of the generative model and OpenAI's
    embeddings continue the trace too; a stream whose client left says it was cancelled."""
    async with serving(registry, tmp_path / "http.sock", GENERATIVE) as found:
        collector.pull_from(lambda: [(found.socket, TOKEN)])

        async def post(path: str, trace: str, body: dict[str, Any]) -> tuple[int, bytes]:
            headers = {"traceparent": f"00-{trace}-{SIDECAR}-01", "tracestate": "v=1",
                       "content-type": "application/json"}  # fmt: skip
            data = json.dumps(body).encode()
            return await asyncio.to_thread(
                unix_request, found.socket, path, 10.0, "POST", data, headers
            )

        chat = {"model": "chaos-gen", "messages": [{"role": "user", "content": "one two three"}],
                "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 10}  # fmt: skip
        status, body = await post("/v1/chat/completions", TRACE, chat)
        assert status == 200, body
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        usage = events[-1]["usage"]
        reason = next(e["choices"][0]["finish_reason"] for e in events if e["choices"]
                      and e["choices"][0]["finish_reason"])  # fmt: skip
        spans = {s["name"]: s for s in await _trace(collector, TRACE, 4)}
        server = spans["chat chaos-gen"]
        assert server["parent_id"] == SIDECAR and server["kind"] == "server"
        attrs = server["attributes"]
        assert attrs[genai.OPERATION] == "chat" and attrs[genai.REQUEST_MODEL] == "chaos-gen"
        assert attrs[genai.REQUEST_MAX_TOKENS] == 10
        assert attrs[genai.INPUT_TOKENS] == usage["prompt_tokens"]
        assert attrs[genai.OUTPUT_TOKENS] == usage["completion_tokens"] > 0
        assert attrs[genai.FINISH_REASONS] == str([reason])  # an array, kept as its text
        assert attrs["http.response.status_code"] == 200 and genai.ERROR_TYPE not in attrs
        order = [spans[n] for n in ("admission", "time to first token", "decode loop")]
        assert all(s["parent_id"] == server["span_id"] for s in order)
        for before, after in itertools.pairwise(order):
            assert before["end_ns"] <= after["start_ns"], (before["name"], after["name"])
        assert order[-1]["end_ns"] <= server["end_ns"]
        assert order[-1]["attributes"][genai.OUTPUT_TOKENS] == usage["completion_tokens"]
        (first,) = server["events"]
        assert first["name"] == "first token"
        assert first["time_ns"] == order[1]["end_ns"]
        trace = collector.store.get(TRACE)
        assert trace is not None
        (line,) = generations(trace.document())  # what `meshfn trace show` prints below it
        assert line.startswith(
            f"generation chat chaos-gen: {usage['prompt_tokens']} prompt + "
            f"{usage['completion_tokens']} completion tokens, first token after "
        ), line
        assert line.endswith(f"ended: {attrs[genai.FINISH_REASON]}"), line

        refused = "5" * 32
        over = {**chat, "max_tokens": 65}
        status, body = await post("/v1/chat/completions", refused, over)
        assert status == 400, body
        spans = {s["name"]: s for s in await _trace(collector, refused, 1)}
        assert spans["chat chaos-gen"]["attributes"]["http.response.status_code"] == 400
        assert "decode loop" not in spans

        # Triton's generate extension, and KServe's /infer of the same model
        kserve = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                              "data": ["epsilon zeta"]}], "parameters": {"max_tokens": 2}}  # fmt: skip
        for trace_id, path, request in (
            ("6" * 32, "generate_stream", {"text_input": "alpha", "parameters": {"max_tokens": 4}}),
            ("a" * 32, "infer", kserve),
        ):
            status, body = await post(f"/v2/models/chaos-gen/{path}", trace_id, request)
            assert status == 200, body
            spans = {s["name"]: s for s in await _trace(collector, trace_id, 4)}
            assert spans["text_completion chaos-gen"]["parent_id"] == SIDECAR, path
            assert "decode loop" in spans, path

        streamed = "8" * 32
        grpc_server = GrpcServer(found.backend)
        port = await grpc_server.start("127.0.0.1", 0)
        try:
            await asyncio.to_thread(_grpc_stream, port, streamed)
        finally:
            await grpc_server.stop(0)
        spans = {s["name"]: s for s in await _trace(collector, streamed, 4)}
        server = spans["text_completion chaos-gen"]
        assert server["parent_id"] == SIDECAR
        assert server["attributes"]["meshfn.protocol"] == "grpc"
        assert spans["decode loop"]["parent_id"] == server["span_id"]

        # a client that leaves after the first piece: the span says the stream was cancelled
        left = "9" * 32
        generative = found.backend.generative
        rt = found.backend.lookup("chaos-gen", None)
        context = (f"00-{left}-{SIDECAR}-01", None)
        operation = "text_completion"
        with generative.traced(rt, "rest", operation, context, "") as span:
            opened = await generative.open(
                rt, "rest", "slow 200000 a b c", Sampling(max_tokens=30), "", operation, span
            )
        events = opened.stream.events()
        assert isinstance(await anext(events), Piece)
        await events.aclose()
        spans = {s["name"]: s for s in await _trace(collector, left, 4)}
        attrs = spans["text_completion chaos-gen"]["attributes"]
        assert (
            attrs[genai.ERROR_TYPE] == "cancelled" and attrs["meshfn.finish_reason"] == "cancelled"
        )
        assert attrs[genai.OUTPUT_TOKENS] < 30

        embeddings = "7" * 32
        status, body = await post(
            "/v1/embeddings", embeddings, {"model": "embedder", "input": "a few words"}
        )
        assert status == 200, body
        spans = {s["name"]: s for s in await _trace(collector, embeddings, 2)}
        assert spans["embeddings embedder"]["parent_id"] == SIDECAR
        assert spans["embeddings embedder"]["attributes"][genai.OPERATION] == "embeddings"
        assert "guest call" in spans


def _grpc_stream(port: int, trace: str) -> None:
    """tritonclient's decoupled stream (ModelStreamInfer) to its end, the trace in the call's
    metadata as the sidecar forwards it."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
    headers = {"traceparent": f"00-{trace}-{SIDECAR}-01"}
    client.start_stream(lambda result, error: answers.put((result, error)), headers=headers)
    try:
        text_input = tgrpc.InferInput("text_input", [1], "BYTES")
        text_input.set_data_from_numpy(np.array([b"gamma delta"], dtype=np.object_))
        client.async_stream_infer(
            "chaos-gen", [text_input], parameters={"max_tokens": 3},
            enable_empty_final_response=True,
        )  # fmt: skip
        while True:
            result, error = answers.get(timeout=10)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def _config_file(path: Path, registry: tuple[Path, Path], tracing: dict[str, Any] | None) -> None:
    root, key = registry
    config: dict[str, Any] = {
        "registry": str(root),
        "trustedKeys": [str(key)],
        "functions": [{"name": "chaos-core"}],
    }
    if tracing is not None:
        config["tracing"] = tracing
    path.write_text(json.dumps(config))


async def test_sighup_reloads_tracing_in_place_and_nothing_else(
    registry: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Mesh's tracing changed: `meshfn up` rewrites the backend's config and sends SIGHUP
    (server.reload_tracing) instead of restarting it. Off, a sampled parent makes no span and
    the collector's path answers 404; on again, spans are collected and the counts go on; a
    span waiting for the collector survives a change of sampling; a new collector endpoint (the
    sandbox allowed none at start), an unreadable file and other changes are refused or
    reported, never half-applied."""
    path = tmp_path / "backend.json"
    pulled = {"pullToken": TOKEN, "sampling": 100}
    _config_file(path, registry, pulled)
    started = load_config(path)
    root, key = registry
    async with serving(registry, tmp_path / "http.sock") as found:
        backend = found.backend
        tracer = backend.tracer

        async def infer(trace: str) -> None:
            headers = {b"traceparent": f"00-{trace}-{SIDECAR}-01".encode()}
            reply = await backend.infer("chaos-core", None, BODY.encode(), headers)
            assert reply.status == 200, reply.body

        async def take() -> tuple[int, bytes]:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            return await asyncio.to_thread(
                unix_request, found.socket, "/meshfn/spans", 5.0, "POST", None, auth
            )

        await infer(f"{1:032x}")
        exporter = tracer.exporter
        assert exporter is not None and exporter.queued_spans > 0
        waiting = exporter.queued_spans
        # sampling changes while a span waits: the new exporter has it
        _config_file(path, registry, {**pulled, "sampling": 5})
        reload_tracing(backend, path, started)
        assert tracer.exporter is not exporter and tracer.settings is not None
        assert tracer.settings.sampling == 5 and tracer.exporter is not None
        assert tracer.exporter.queued_spans == waiting
        status, body = await take()
        assert status == 200
        spans = otlp.ExportTraceServiceRequest.FromString(body).resource_spans[0]
        assert {s.trace_id.hex() for s in spans.scope_spans[0].spans} == {f"{1:032x}"}
        # off: nothing begins, nothing is collected, the waiting spans count as dropped
        await infer(f"{2:032x}")
        dropped = tracer.exporter.queued_spans
        _config_file(path, registry, None)
        reload_tracing(backend, path, started)
        assert tracer.exporter is None and functions_document(backend)["tracing"] is None
        assert backend.tracer.begin("x", f"00-{3:032x}-{SIDECAR}-01") is None
        assert (await take())[0] == 404
        # on again: collected, the counts of before carried on
        _config_file(path, registry, pulled)
        reload_tracing(backend, path, started)
        await infer(f"{4:032x}")
        document = functions_document(backend)["tracing"]
        assert document["exported_spans"] == waiting and document["dropped_spans"] == dropped > 0
        assert (await take())[0] == 200
        # refused: another endpoint, an unreadable file; reported: any other change
        before = tracer.settings
        with caplog.at_level(logging.INFO, "meshfn.inference"):
            _config_file(path, registry, {"endpoint": "grpc://127.0.0.1:4317"})
            reload_tracing(backend, path, started)
            assert tracer.settings is before
            path.write_text("{not json")
            reload_tracing(backend, path, started)
            assert tracer.settings is before
            config = {"registry": str(root), "trustedKeys": [str(key)],
                      "functions": [{"name": "chaos-core"}, {"name": "iris"}],
                      "tracing": {**pulled, "sampling": 50}}  # fmt: skip
            path.write_text(json.dumps(config))
            reload_tracing(backend, path, started)
            assert tracer.settings is not None and tracer.settings.sampling == 50
            assert backend.model_names() == ["chaos-core"]
        messages = [r.getMessage() for r in caplog.records]
        assert any("a new collector endpoint" in m and "needs a restart" in m for m in messages)
        assert any(
            m.startswith("config reload: tracing unchanged") and "backend.json" in m
            for m in messages
        )
        assert any("takes tracing only" in m for m in messages)
