"""The Python fuzz targets, run under atheris (coverage-guided, libFuzzer's engine):
`python -m meshfn.testing.fuzz_targets TARGET [libFuzzer flags] CORPUS...`
(meshfn.testing.fuzz runs them with a time budget; bench/fuzz.py for long runs).

Each target feeds one input to the real code and checks what that code promises to do with bad
input: the policy loader answers with file:line errors (or a model the translator renders into
a consistent snapshot), the KServe decoder with a 4xx, the ADS handlers with a gRPC status that
ends only that stream, the journal parser with a record whose hash `audit verify` can
recompute, the access-log stream with an abort or a sink call. Anything else (another
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

    from meshfn.audit.record import canonical, from_log_line
    from meshfn.health.drift import DriftBreaker, watched_routes
    from meshfn.inference.kserve import (
        HEADER_LENGTH,
        KServeError,
        Signature,
        header_length,
        parse_http,
    )
    from meshfn.inference.tensors import element_count
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


TARGETS: dict[str, Callable[[], Callable[[bytes], None]]] = {
    "policy": PolicyTarget,
    "kserve": lambda: kserve,
    "ads": AdsTarget,
    "journal": lambda: journal,
    "als": AlsTarget,
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
