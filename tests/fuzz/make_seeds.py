"""Writes the fuzz corpora's seeds (tests/fuzz/corpus/<target>/) from the tests:
`.venv/bin/python tests/fuzz/make_seeds.py` (with PYTHONSAFEPATH=1, as ./dev.sh sets it).

- filter-*: the native harness tests, run with MESHFN_FUZZ_RECORD (fakehost.py writes each
  configuration's life as a fuzz_filter.c script);
- policy: the examples as one file, every golden case's in.yaml, and each bad document of the
  policy tests' tables appended to a valid set;
- kserve, ads, journal, als: the requests, lines and messages the unit tests send.
Seeds are named by their SHA-1, so rerunning only adds what is new.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import duration_pb2

from meshfn.testing.fuzz import CORPORA, ROOT
from meshfn.xds.names import CLUSTER, ENDPOINT, LATENCY_LOG, LISTENER

TESTS = ROOT / "tests"


def put(target: str, data: bytes) -> None:
    folder = CORPORA / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)


def framed(*messages: bytes) -> bytes:
    return b"".join(struct.pack("<H", len(m)) + m for m in messages)


def test_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"seed_{name}", TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def filters() -> None:
    with tempfile.TemporaryDirectory() as record:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                *(
                    str(TESTS / f"test_wasm_{n}_native.py")
                    for n in ("audit", "degrade", "meshfn", "route")
                ),
            ],
            env={**os.environ, "MESHFN_FUZZ_RECORD": record},
            check=True,
            cwd=ROOT,
        )
        for folder in Path(record).iterdir():
            for script in folder.iterdir():
                put(f"filter-{folder.name}", script.read_bytes())


def policies() -> None:
    examples = sorted((ROOT / "policies" / "examples").glob("*.yaml"))
    whole = b"\n---\n".join(p.read_bytes() for p in examples)
    put("policy", whole)
    for case in sorted((TESTS / "golden").glob("*/in.yaml")):
        put("policy", case.read_bytes())
    policy = test_module("test_policy")
    base = policy.BASE if hasattr(policy, "BASE") else whole.decode()
    for table in ("SCHEMA_CASES", "REFERENCE_CASES", "FUNCTION_CASES", "DRILL_CASES"):
        for case in getattr(policy, table, []):
            put("policy", (base + "\n---\n" + case[0]).encode())
    zero = test_module("test_zero_trust_policy")
    for case in zero.CASES:
        put("policy", (zero.BASE + "\n---\n" + case[0]).encode())


def kserve() -> None:
    iris = {
        "inputs": [
            {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}
        ]
    }
    bodies: list[tuple[int, Any]] = [
        (0, iris),
        (0, {**iris, "id": "r1", "outputs": [{"name": "label"}], "parameters": {}}),
        (
            0,
            {
                "inputs": [
                    {
                        "name": "features",
                        "datatype": "FP32",
                        "shape": [2, 4],
                        "data": [[1, 2, 3, 4], [5, 6, 7, 8]],
                    }
                ]
            },
        ),
        (
            0,
            {
                "inputs": [
                    {
                        "name": "features",
                        "datatype": "FP32",
                        "shape": [1, 4],
                        "data": [1, 2],
                        "parameters": {"binary_data_size": 16},
                    }
                ]
            },
        ),
        (0, {"inputs": []}),
        (
            1,
            {
                "inputs": [
                    {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]},
                    {
                        "name": "ids",
                        "datatype": "INT64",
                        "shape": [2, 1],
                        "data": [1, -9223372036854775808],
                    },
                    {"name": "mask", "datatype": "BOOL", "shape": [1], "data": [True]},
                ]
            },
        ),
    ]
    for signature, body in bodies:
        put("kserve", bytes([signature << 1]) + json.dumps(body).encode())
    # the binary tensor extension: a JSON header of the given length, then the raw tensors
    binary = [
        (
            0,
            {
                "inputs": [
                    {
                        "name": "features",
                        "datatype": "FP32",
                        "shape": [1, 4],
                        "parameters": {"binary_data_size": 16},
                    }
                ],
                "parameters": {"binary_data_output": True},
            },
            struct.pack("<4f", 5.1, 3.5, 1.4, 0.2),
        ),
        (
            1,
            {
                "inputs": [
                    {
                        "name": "text",
                        "datatype": "BYTES",
                        "shape": [2],
                        "parameters": {"binary_data_size": 10},
                    },
                    {"name": "ids", "datatype": "INT64", "shape": [2, 1], "data": [1, 2]},
                    {
                        "name": "mask",
                        "datatype": "BOOL",
                        "shape": [1],
                        "parameters": {"binary_data_size": 1},
                    },
                ]
            },
            struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b" + b"\x01",
        ),
        (
            0,
            {
                "inputs": [
                    {
                        "name": "features",
                        "datatype": "FP32",
                        "shape": [1, 4],
                        "parameters": {"binary_data_size": 16},
                    }
                ]
            },
            b"\x00" * 12,
        ),
    ]
    for signature, body, blob in binary:
        head = json.dumps(body).encode()
        put("kserve", bytes([signature << 1 | 1]) + struct.pack("<H", len(head)) + head + blob)
    put(
        "kserve",
        b"\x00"
        + b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [NaN, Infinity, -0.0, 1e309]}]}',
    )
    put("kserve", b"\x00not json")
    # JSON string escapes in BYTES data: a pair, and half of one
    put(
        "kserve",
        b"\x02"
        + b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], '
        + b'"data": ["\\ud83d\\ude00", "\\ud800"]}]}',
    )


def ads() -> None:
    node = base_pb2.Node(id="edge.default~fuzz", cluster="edge.default")

    def sotw(**kw: Any) -> bytes:
        return bytes(discovery_pb2.DiscoveryRequest(**kw).SerializeToString())

    def delta(**kw: Any) -> bytes:
        return bytes(discovery_pb2.DeltaDiscoveryRequest(**kw).SerializeToString())

    put("ads", b"\x00" + framed(sotw(node=node, type_url=CLUSTER)))
    put(
        "ads",
        b"\x00"
        + framed(
            sotw(node=node, type_url=CLUSTER),
            sotw(type_url=CLUSTER, version_info="v", response_nonce="1"),
            sotw(type_url=ENDPOINT, resource_names=["a", "b", "*"]),
            sotw(
                type_url=ENDPOINT,
                resource_names=["a"],
                response_nonce="2",
                error_detail={"code": 3, "message": "bad"},
            ),
            sotw(type_url="type.googleapis.com/evil.Thing"),
        ),
    )
    put(
        "ads",
        b"\x01"
        + framed(
            delta(node=node, type_url=CLUSTER),
            delta(
                type_url=ENDPOINT,
                resource_names_subscribe=["a", "c"],
                initial_resource_versions={"a": "x"},
            ),
            delta(type_url=ENDPOINT, resource_names_unsubscribe=["a"], response_nonce="zz"),
            delta(type_url=LISTENER, resource_names_subscribe=["*"]),
        ),
    )
    put("ads", b"\x01" + framed(delta(type_url=CLUSTER)))  # no node
    put("ads", b"\x00" + framed(b"\xff\xff garbage"))


def journal() -> None:
    base = {
        "id": "6f1c0d3e-0000-4000-8000-000000000001",
        "time": "2026-12-01T10:00:00.000123Z",
        "method": "POST",
        "authority": "127.0.0.1:10000",
        "path": "/v2/models/iris/infer",
        "status": 200,
        "duration_us": 812,
        "upstream_cluster": "models.default",
        "route": "default/iris/0",
        "principal": "spiffe://mesh.local/ns/ingress/sa/edge",
        "flags": "-",
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    }
    full = {
        "v": 1,
        "subject": "ab" * 32,
        "salt_id": "default",
        "subject_source": "jwt_authn",
        "tenant": "acme",
        "body": "hashed",
        "body_sha256": "cd" * 32,
    }
    lines = [
        {**base, "audit": json.dumps(full)},
        {
            **base,
            "audit": "ab" * 32,
            "audit_v": "1",
            "salt_id": "default",
            "subject_source": "jwt_headers",
            "tenant": {"nested": ["claim"]},
        },
        {**base, "audit": "null", "audit_v": "1"},
        {**base, "audit": None, "status": "503", "duration_ms": 12, "b3_trace_id": "a" * 16},
        {"id": "x" * 5000, "status": 1e400, "duration_us": -1},
    ]
    for line in lines:
        put("journal", json.dumps(line).encode())
    put("journal", b'{"id": "\\ud800", "path": "/\\u0000"}\n\xff garbage\n[1, 2]')


def als() -> None:
    def message(
        node: str, routes: list[tuple[str, str, int]], log_name: str = LATENCY_LOG
    ) -> bytes:
        m = als_pb2.StreamAccessLogsMessage()
        if node:
            m.identifier.node.id = node
            m.identifier.log_name = log_name
        for route, cluster, micros in routes:
            e = m.http_logs.log_entry.add()
            e.common_properties.route_name = route
            e.common_properties.upstream_cluster = cluster
            e.common_properties.duration.CopyFrom(duration_pb2.Duration(nanos=micros * 1000))
            e.common_properties.upstream_local_address.socket_address.address = "127.0.0.1"
        return bytes(m.SerializeToString())

    route = "default/iris/0"
    put("als", framed(message("edge.ingress~1", [(route, "models.default", 900)] * 3)))
    put(
        "als",
        framed(
            message("edge.ingress~1", [(route, "models.default", 900)]),
            message("", [(route + "/degraded", "models-lite.default", 400_000)] * 5),
        ),
    )
    put("als", framed(message("stranger~1", [(route, "models.default", 1)])))
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.common_properties.time_to_last_downstream_tx_byte.CopyFrom(
        duration_pb2.Duration(seconds=-5)
    )
    m = als_pb2.StreamAccessLogsMessage()
    m.identifier.node.id = "edge.ingress~1"
    m.identifier.log_name = LATENCY_LOG
    m.http_logs.log_entry.append(entry)
    put("als", framed(m.SerializeToString(), b"\xff\x00garbage"))


def tracecontext() -> None:
    trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    for parent, state in (
        (f"00-{trace}-{span}-01", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        (f"00-{trace}-{span}-00", ""),
        (f"01-{trace}-{span}-01-future", "a=b"),
        ("00-zz-yy-01", "=,=;"),
        (f"00-{'0' * 32}-{span}-01", "x" * 600),
        (f"ff-{trace}-{span}-01", ",".join(f"k{i}=v" for i in range(40))),
    ):
        put("tracecontext", framed(parent.encode(), state.encode()))


def otlp_exports() -> None:
    from meshfn.contracts import otlp

    request = otlp.ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.add(key="service.name", value=otlp.any_value("edge.ingress"))
    scope = resource.scope_spans.add()
    for n in range(3):
        span = scope.spans.add(
            trace_id=bytes([n + 1]) * 16,
            span_id=bytes([n + 1]) * 8,
            parent_span_id=bytes([n]) * 8 if n else b"",
            name=f"span {n}",
            kind=otlp.KIND_SERVER,
            start_time_unix_nano=1000 * n,
            end_time_unix_nano=1000 * n + 500,
        )
        span.attributes.add(key="meshfn.route", value=otlp.any_value("default/echo"))
        span.links.add(trace_id=b"\x09" * 16, span_id=b"\x09" * 8)
        span.events.add(time_unix_nano=5, name="first token")
    put("otlp", request.SerializeToString())
    scope.spans.add(trace_id=b"\x00" * 16, span_id=b"\x01" * 8)  # a zero trace id
    put("otlp", request.SerializeToString())
    put("otlp", b"\xff\xff\xff garbage")


def generations() -> None:
    """Request bodies of each kind the `generate` target reads (its first byte), good and bad."""
    chat = {
        "model": "tiny-lm",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_completion_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": -1,
        "stop": ["\n", "."],
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u",
    }
    completion = {"model": "tiny-lm", "prompt": ["once"], "max_tokens": 4, "stop": "\n", "n": 1}
    embeddings = {"model": "embedder", "input": ["a", "b"], "encoding_format": "base64"}
    generate = {"text_input": "once", "id": "7", "parameters": {"max_tokens": 4, "stream": True}}
    for kind, body in enumerate((chat, completion, embeddings, generate)):
        put("generate", bytes([kind]) + json.dumps(body).encode())
    for kind, raw in (
        (0, b'{"model": "m", "model": "n", "messages": []}'),
        (0, b'{"model": "m", "messages": [{"role": "tool", "content": "x"}], "tools": [{}]}'),
        (1, b'{"model": "m", "prompt": "\\ud800", "temperature": 1e999}'),
        (2, b'{"model": "m", "input": [], "dimensions": true}'),
        (2, b'{"model": "m", "input": ' + b"[" * 2000 + b"]" * 2000 + b"}"),
        (
            3,
            b'{"text_input": ["a"], "parameters": {"stop": ["", "b"], "seed": 18446744073709551616}}',
        ),
    ):
        put("generate", bytes([kind]) + raw)


if __name__ == "__main__":
    for make in (
        filters,
        policies,
        kserve,
        ads,
        journal,
        als,
        tracecontext,
        otlp_exports,
        generations,
    ):
        make()
    for folder in sorted(CORPORA.iterdir()):
        print(f"{folder.name}: {sum(1 for _ in folder.iterdir())} seeds")
