"""The Python fuzz targets, run under atheris (coverage-guided, libFuzzer's engine):
`python -m meshfn.testing.fuzz_targets TARGET [libFuzzer flags] CORPUS...`
(meshfn.testing.fuzz runs them with a time budget; bench/fuzz.py for long runs).

Each target feeds one input to the real code and checks what that code promises to do with bad
input: the policy loader answers with file:line errors (or a model the translator renders into
a consistent snapshot), the KServe decoder with a 4xx, the ADS handlers with a gRPC status that
ends only that stream, the journal parser with a record whose hash `audit verify` can
recompute, the access-log stream with an abort or a sink call, the trace-context parser with
a parent continued or a trace restarted, the trace collector with a bounded store. Anything else (another
exception, a hang, a response Envoy could not parse) is a finding: atheris stops and writes the
input as `crash-<sha1>`. Every finding becomes a named case in tests/fuzz/test_fuzz_regressions.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import struct
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["meshfn"]):
    import grpc
    from envoy.data.accesslog.v3 import accesslog_pb2
    from envoy.service.discovery.v3 import discovery_pb2
    from google.protobuf.message import DecodeError

    from meshfn.audit.record import canonical, from_log_line
    from meshfn.contracts import otlp
    from meshfn.contracts.function import FunctionLimits
    from meshfn.contracts.tracing import BackendTracing, parse_traceparent, parse_tracestate
    from meshfn.control_plane.runtime.traces import TraceStore, ingest
    from meshfn.health.drift import DriftBreaker, watched_routes
    from meshfn.inference import openai_api, triton_generate
    from meshfn.inference.generation import GenerationError, Sampling
    from meshfn.inference.kserve import (
        HEADER_LENGTH,
        KServeError,
        Signature,
        header_length,
        parse_http,
    )
    from meshfn.inference.tensors import element_count
    from meshfn.inference.tracing import Tracer
    from meshfn.policy import PolicyErrors, PolicyLoader
    from meshfn.xds.als import AccessLogReceiver
    from meshfn.xds.auth import StreamAuth
    from meshfn.xds.cache import InconsistentSnapshot, SnapshotCache, prepare
    from meshfn.xds.delta import DeltaHandler
    from meshfn.xds.names import LATENCY_LOG
    from meshfn.xds.recording import Recorder
    from meshfn.xds.sotw import SotwHandler
    from meshfn.xds.status import Metrics
    from meshfn.xds.stream import Handler, Stream
    from meshfn.xds.translate import translate

ROOT = Path(__file__).resolve().parents[1]
MESH = ROOT / "policies" / "examples"


class Finding(AssertionError):
    """The code under test broke its contract with bad input."""


def messages(data: bytes, limit: int = 16) -> list[bytes]:
    """An input as a sequence of messages: (u16 little-endian length, bytes)*; a short tail is
    one last message. The seeds in tests/fuzz/corpus/ are written by tests/fuzz/make_seeds.py."""
    out: list[bytes] = []
    while data and len(out) < limit:
        if len(data) < 2:
            out.append(data)
            break
        (n,) = struct.unpack_from("<H", data)
        out.append(data[2 : 2 + n])
        data = data[2 + n :]
    return out


# ---------------------------------------------------------------------- policy loader


class PolicyTarget:
    """One fuzzed policy file beside the examples' Mesh-less documents: the whole loader
    (YAML, models, references, compile) and, for a model that loads, the translator."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="meshfn-fuzz-policy-"))
        self.file = self.dir / "fuzz.yaml"
        self.loader = PolicyLoader(self.dir)

    def __call__(self, data: bytes) -> None:
        self.file.write_bytes(data)
        try:
            model = self.loader.load()
        except PolicyErrors as exc:
            for error in exc.errors:
                if not error.file or error.line < 0 or not error.message:
                    raise Finding(f"an error without file:line or message: {error!r}") from exc
            return
        for workload in model.workloads:
            resources = translate(model, workload.node_cluster)
            if resources is None:
                raise Finding(f"translate knows no workload {workload.node_cluster}")
            # an inconsistent one: the control plane refuses the reload, keeps the last good one
            with contextlib.suppress(InconsistentSnapshot):
                prepare(workload.node_cluster, resources, None)


# ---------------------------------------------------------------------- KServe decoder

SIGNATURES = [
    Signature.from_metadata(
        {
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [
                {"name": "label", "datatype": "INT64", "shape": [-1]},
                {"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]},
            ],
        }
    ),
    Signature.from_metadata(
        {
            "inputs": [
                {"name": "text", "datatype": "BYTES", "shape": [-1]},
                {"name": "ids", "datatype": "INT64", "shape": [2, -1]},
                {"name": "mask", "datatype": "BOOL", "shape": [-1]},
            ],
            "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 8]}],
        }
    ),
]


def kserve(data: bytes) -> None:
    """First byte: bit 0 whether the body uses the binary tensor extension (its JSON header
    length is then the next two bytes, little-endian), the bits above it which signature; the
    rest: the request body."""
    if not data:
        return
    signature = SIGNATURES[(data[0] >> 1) % len(SIGNATURES)]
    binary = data[0] & 1 and len(data) >= 3
    body = data[3:] if binary else data[1:]
    try:
        json_length = None
        if binary:
            declared = str(struct.unpack_from("<H", data, 1)[0]).encode()
            json_length = header_length({HEADER_LENGTH: declared}, len(body))
        request = parse_http(body, signature, json_length)
    except KServeError as exc:
        if not 400 <= exc.status < 500 or not exc.message:
            raise Finding(f"a decoder error must be a 4xx with a message: {exc.status}") from exc
        json.loads(exc.body())
        return
    for tensor in request.inputs:
        if tensor.dt.size and len(tensor.raw) != tensor.dt.size * element_count(tensor.shape):
            raise Finding(f"input {tensor.name!r}: {len(tensor.raw)} bytes for {tensor.shape}")
    json.loads(request.guest_json(raw=True))


# ---------------------------------------------------------------------- ADS


class _Aborted(Exception):
    pass


class _Context:
    """The gRPC servicer context a stream handler talks to (peer, metadata, write, abort)."""

    def __init__(self, parse: Callable[[bytes], Any]) -> None:
        self.parse = parse
        self.status: grpc.StatusCode | None = None
        self.written = 0

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def write(self, data: bytes) -> None:
        self.parse(data)  # what we send must be a response Envoy can decode
        self.written += 1

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        if not isinstance(code, grpc.StatusCode) or not message:
            raise Finding(f"abort without a status and message: {code!r} {message!r}")
        self.status = code
        raise _Aborted


async def _requests(raw: list[bytes]) -> AsyncIterator[bytes]:
    for r in raw:
        yield r
        await asyncio.sleep(0)


class AdsTarget:
    """A stream of fuzzed DiscoveryRequest (first byte even) or DeltaDiscoveryRequest (odd)
    bytes through the real SotW/Delta handlers over a published snapshot."""

    def __init__(self) -> None:
        from meshfn.testing.fuzz import ads_resources

        self.loop = asyncio.new_event_loop()
        self.cache = SnapshotCache()
        for group, resources in ads_resources().items():
            self.cache.publish(prepare(group, resources, None))
        recorder = Recorder(Metrics())
        auth = StreamAuth(None)  # the protocol alone: who may connect is another target's
        self.handlers: list[Handler] = [
            SotwHandler(self.cache, recorder, auth),
            DeltaHandler(self.cache, recorder, auth),
        ]
        self.parsers: list[Callable[[bytes], Any]] = [
            discovery_pb2.DiscoveryResponse.FromString,
            discovery_pb2.DeltaDiscoveryResponse.FromString,
        ]

    def __call__(self, data: bytes) -> None:
        if not data:
            return
        which = data[0] & 1
        context = _Context(self.parsers[which])
        handler = self.handlers[which]
        stream = Stream(handler.protocol, context)  # type: ignore[arg-type]
        try:
            self.loop.run_until_complete(
                asyncio.wait_for(handler.serve(stream, _requests(messages(data[1:]))), 10)
            )
        except _Aborted:
            pass
        except TimeoutError as exc:
            raise Finding("a stream did not finish after its requests ended") from exc
        if stream.error is not None and context.status is None:
            raise Finding(f"a protocol error without a status: {stream.error}")


# ---------------------------------------------------------------------- audit journal


def journal(data: bytes) -> None:
    """One access-log line -> a record whose canonical bytes survive the store's JSON round trip
    (`audit verify` recomputes the chain from what the store read back)."""
    for line in data.split(b"\n")[:8]:
        record = from_log_line(line, "edge~0")
        first = canonical(record)
        again = canonical(json.loads(first))
        if first != again:
            raise Finding("a record's canonical bytes change through JSON")
        for key in ("status", "duration_us"):
            value = record.get(key)
            if value is not None and not (isinstance(value, int) and abs(value) < 1 << 63):
                raise Finding(f"{key} is not a 64-bit integer: {value!r}")


# ---------------------------------------------------------------------- access-log stream


class AlsTarget:
    """StreamAccessLogsMessages (fuzzed bytes) through the real receiver into the drift breaker
    of the example mesh (which has drift-guarded routes)."""

    def __init__(self) -> None:
        from meshfn.policy import load_policies

        self.loop = asyncio.new_event_loop()
        model = load_policies(MESH)
        self.drift = DriftBreaker()
        self.drift.configure(watched_routes(model))
        self.now = 1000.0
        self.receiver = AccessLogReceiver(lambda node: node.startswith("edge"))
        self.receiver.subscribe(LATENCY_LOG, self._sink)

    def _sink(self, _node: str, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        self.drift.observe_access_log(entry, self.now)  # as ControlPlane._on_latency

    def __call__(self, data: bytes) -> None:
        context = _Context(lambda _data: None)
        with contextlib.suppress(_Aborted):
            self.loop.run_until_complete(
                self.receiver._stream(_requests(messages(data)), context)  # type: ignore[arg-type]
            )
        self.now += 1.0
        for transition in self.drift.evaluate(self.now):
            if not (math.isfinite(transition.p95_ms) and math.isfinite(transition.baseline_ms)):
                raise Finding(f"a transition with a non-finite latency: {transition}")
        json.dumps(self.drift.snapshot(self.now), allow_nan=False)


# ---------------------------------------------------------------------- tracing


class TraceContextTarget:
    """Two messages: a `traceparent` and a `tracestate`, as the inference backend reads them
    (HTTP header or gRPC metadata). The parser never raises; what it accepts is well formed
    (and formats back to itself); the backend continues a parent it accepts and restarts the
    trace otherwise, with ids that are never zero."""

    def __init__(self) -> None:
        # sampling 100: every request gets a span; nothing is finished, so nothing is exported
        self.tracer = Tracer(BackendTracing(endpoint="grpc://127.0.0.1:9", sampling=100))

    def __call__(self, data: bytes) -> None:
        raw = [*messages(data, 2), b"", b""]
        parent, state = raw[0], raw[1]
        found = parse_traceparent(parent)
        if found is not None:
            if len(found.trace_id) != 32 or len(found.span_id) != 16:
                raise Finding(f"ids of the wrong length: {found}")
            if parse_traceparent(found.traceparent()) != found:
                raise Finding(f"{found.traceparent()!r} does not read back as itself")
        kept = parse_tracestate(state)
        if kept and (len(kept) > 512 or parse_tracestate(kept) != kept):
            raise Finding(f"tracestate {kept!r} is not stable")
        span = self.tracer.begin("infer x", parent, state)
        if span is None or not any(span.trace_id) or not any(span.span_id):
            raise Finding("no span, or a zero id, at 100% sampling")
        if found is None and span.parent:
            raise Finding("a parent from a traceparent that did not parse")
        if found is not None and (span.trace_id.hex(), span.parent.hex()) != (
            found.trace_id,
            found.span_id,
        ):
            raise Finding("the parent was not continued")


class OtlpTarget:
    """One OTLP export into the embedded collector's store (small bounds: a few inputs evict):
    refused as not OTLP, or answered with a response that parses; the store stays within its
    bounds, counts what it drops, and every trace it keeps can be shown."""

    def __init__(self) -> None:
        self.store = TraceStore(max_traces=20, max_bytes=64 << 10)

    def __call__(self, data: bytes) -> None:
        try:
            answer = ingest(self.store, data)
        except (DecodeError, ValueError):
            return
        otlp.ExportTraceServiceResponse.FromString(answer)
        store = self.store
        if len(store) > store.max_traces or store.bytes > store.max_bytes:
            raise Finding(f"the store grew past its bounds: {store.stats()}")
        if store.spans != sum(len(t.spans) for t in store.traces()):
            raise Finding("the store's span count disagrees with its traces")
        for trace in store.traces():
            json.dumps(trace.document())


# ---------------------------------------------------------------------- generation requests

GEN_BOUNDS = openai_api.Bounds(
    max_tokens=64, default_max_tokens=16, max_temperature=2.0, max_stop=4
)
GEN_LIMITS = FunctionLimits(maxRequestBytes=1 << 16)


def _encodes(text: object, what: str) -> None:
    """What a parser accepts is read as UTF-8 bytes later (the tokenizer, stop matching)."""
    if not isinstance(text, str):
        raise Finding(f"{what} is {type(text).__name__}, not text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Finding(f"{what} was accepted but is not UTF-8: {exc}") from exc


def _check_sampling(sampling: Sampling) -> None:
    b = GEN_BOUNDS
    if not 1 <= sampling.max_tokens <= b.max_tokens:
        raise Finding(f"max_tokens {sampling.max_tokens} outside 1..{b.max_tokens}")
    if not 0 <= sampling.temperature <= b.max_temperature:
        raise Finding(f"temperature {sampling.temperature} outside the bounds")
    if not 0 < sampling.top_p <= 1:
        raise Finding(f"top_p {sampling.top_p} outside (0, 1]")
    if sampling.seed is not None and not 0 <= sampling.seed < 1 << 64:
        raise Finding(f"seed {sampling.seed} is not an unsigned 64-bit integer")
    if len(sampling.stop) > b.max_stop:
        raise Finding(f"{len(sampling.stop)} stop sequences, above {b.max_stop}")
    for stop in sampling.stop:
        _encodes(stop, "a stop sequence")
        if not stop:
            raise Finding("an empty stop sequence")
    json.dumps(sampling.guest_json())


def generate(data: bytes) -> None:
    """First byte: which request (0 chat, 1 text completion, 2 embeddings, 3 Triton's generate,
    by its value modulo 4); the rest: the body. Each parser answers with a 400 (413 for a body
    past the limit) carrying a message and the field's name if any, as OpenAI's error object,
    or with a request within the bounds whose text reads as UTF-8."""
    if not data:
        return
    kind, body = data[0] % 4, data[1:]
    try:
        if kind == 3:
            request = triton_generate.parse(body, GEN_BOUNDS, GEN_LIMITS)
            _encodes(request.prompt, "text_input")
            _check_sampling(request.sampling)
            if request.id is not None and not isinstance(request.id, str):
                raise Finding(f"id {request.id!r} is not a string")
            return
        value = openai_api.loads(body)
        if kind == 2:
            embeddings = openai_api.embeddings_request(value)
            if not 1 <= len(embeddings.texts) <= 2048:
                raise Finding(f"{len(embeddings.texts)} inputs accepted")
            for text in embeddings.texts:
                _encodes(text, "an input")
            return
        parse = openai_api.chat_request if kind == 0 else openai_api.completion_request
        asked = parse(value, GEN_BOUNDS)
        if not isinstance(asked.model, str) or not asked.model:
            raise Finding(f"model {asked.model!r} accepted")
        _encodes(asked.prompt, "the prompt")
        _check_sampling(asked.sampling)
        if asked.include_usage and not asked.stream:
            raise Finding("include_usage without stream")
    except GenerationError as exc:
        if exc.status not in (400, 413) or not str(exc):
            raise Finding(f"a refusal must be a 400 or 413 with a message: {exc.status}") from exc
        if exc.param is not None and not isinstance(exc.param, str):
            raise Finding(f"param {exc.param!r} is not a field's name") from exc
        json.loads(openai_api.error_body(exc.status, str(exc), exc.param))


TARGETS: dict[str, Callable[[], Callable[[bytes], None]]] = {
    "policy": PolicyTarget,
    "kserve": lambda: kserve,
    "ads": AdsTarget,
    "journal": lambda: journal,
    "als": AlsTarget,
    "tracecontext": TraceContextTarget,
    "otlp": OtlpTarget,
    "generate": lambda: generate,
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: python -m meshfn.testing.fuzz_targets {{{','.join(TARGETS)}}} ...")
    name = sys.argv.pop(1)
    logging.disable(logging.CRITICAL)  # bad input is logged by design; findings are exceptions
    target = TARGETS[name]()
    atheris.Setup(sys.argv, target)
    try:
        atheris.Fuzz()
    finally:
        if isinstance(target, PolicyTarget):
            shutil.rmtree(target.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
