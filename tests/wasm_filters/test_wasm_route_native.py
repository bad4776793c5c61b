"""The model router (route/route.c, part of meshfn.wasm), natively against the fake host: an
OpenAI request waits for its body, and the model it names becomes the routing header (the route
cache cleared), or the request is refused with OpenAI's error object (400, 404
model_not_found, 413); the degrade part runs after it on the route it chose, the audit part
hashes the body once; other requests pass untouched; nothing leaks. A KServe gRPC ModelInfer
call (configured where the gateway sheds by priority) is routed by the model_name its message
names, and one that cannot be passes unrouted, never refused."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from meshfn.contracts.plugins import GrpcRouteSettings, RouteSettings
from meshfn.testing import filters

fakehost = filters.harness("fakehost")
SALT = "07" * 16
ROUTE = RouteSettings(models=["tiny-lm", "embedder"], max_body_bytes=4096).model_dump()
CHAT = [(b":method", b"POST"), (b":path", b"/v1/chat/completions")]


@pytest.fixture(scope="module")
def host() -> Any:
    return fakehost.FakeHost(filters.wasm_dir(native=True) / "meshfn_native.so")


def configure(host: Any, **parts: Any) -> int:
    root, ok = host.configure(json.dumps({"route": ROUTE, **parts}).encode())
    assert ok, host.logs()
    return int(root)


def send(
    host: Any, root: int, body: bytes, headers: list[tuple[bytes, bytes]] = CHAT
) -> tuple[int, int]:
    ctx = host.stream(root)
    first = host.request_headers(ctx, headers, eos=False)
    second = host.request_body(ctx, body, True)
    return ctx, (first << 8) | second


def test_the_body_names_the_route(host: Any) -> None:
    root = configure(host)
    before = host.foreign_calls()
    ctx = host.stream(root)
    assert host.request_headers(ctx, CHAT, eos=False) == fakehost.PAUSE  # waits for the body
    body = json.dumps({"messages": [], "model": "tiny-lm", "stream": True}).encode()
    assert host.request_body(ctx, body, True) == fakehost.CONTINUE
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") == b"tiny-lm"
    assert host.foreign_calls() == before + 1  # clear_route_cache: Envoy picks the route again
    assert host.local_response() is None
    assert host.metric("meshfn_route.routed") >= 1
    host.delete(ctx)
    # KServe's spelling, a query string: routed too
    ctx, _ = send(host, root, b'{"model": "embedder"}',
                  [(b":method", b"POST"), (b":path", b"/openai/v1/embeddings?x=1")])  # fmt: skip
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") == b"embedder"
    host.delete(ctx)
    host.delete(root)


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, None),
        (b'["tiny-lm"]', 400, None, None),
        (b'{"messages": []}', 400, "model", None),
        (b'{"model": 7}', 400, "model", None),
        (b'{"model": "tiny-lm", "model": "embedder"}', 400, None, None),  # twice: never
        (b'{"model": "gpt-4o"}', 404, "model", "model_not_found"),
        (b'{"model": "TINY-LM"}', 404, "model", "model_not_found"),
        (b'{"model": "tiny-lm", "x": "' + b"a" * 5000 + b'"}', 413, None, None),
    ],
)
def test_what_cannot_be_routed_is_an_openai_error(
    host: Any, body: bytes, status: int, param: str | None, code: str | None
) -> None:
    root = configure(host)
    ctx, _ = send(host, root, body)
    response = host.local_response()
    assert response is not None and response.status == status
    error = json.loads(response.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error"
    if code:
        assert json.loads(body)["model"] in error["message"]
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") is None
    host.delete(ctx)
    host.delete(root)


def test_a_post_without_a_body_names_the_missing_model(host: Any) -> None:
    root = configure(host)
    ctx = host.stream(root)
    assert host.request_headers(ctx, CHAT, eos=True) == fakehost.PAUSE
    response = host.local_response()
    assert response is not None and response.status == 400
    assert json.loads(response.body)["error"]["param"] == "model"
    host.delete(ctx)
    host.delete(root)


def test_other_requests_pass_untouched(host: Any) -> None:
    root = configure(host)
    for headers in (
        [(b":method", b"GET"), (b":path", b"/v1/chat/completions")],
        [(b":method", b"POST"), (b":path", b"/v1/models")],
        [(b":method", b"POST"), (b":path", b"/v2/models/tiny-lm/infer")],
    ):
        ctx = host.stream(root)
        assert host.request_headers(ctx, headers, eos=False) == fakehost.CONTINUE
        assert host.request_body(ctx, b'{"model": "tiny-lm"}', True) == fakehost.CONTINUE
        assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") is None
        host.delete(ctx)
    host.delete(root)


def test_degrade_runs_on_the_route_the_body_chose(host: Any) -> None:
    rule = {"name": "r", "routes": ["default/openai-tiny-lm/0"], "mode": "reroute",
            "fallbacks": ["default/openai-tiny-lm"], "depth": 1}  # fmt: skip
    root = configure(host, degrade={"rules": [rule]})
    ctx = host.stream(root)
    host.set_property(b"xds\0route_name", b"default/openai-tiny-lm/0")  # what Envoy re-picked
    assert host.request_headers(ctx, CHAT, eos=False) == fakehost.PAUSE
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-degrade-route") is None  # not yet
    host.request_body(ctx, b'{"model": "tiny-lm"}', True)
    assert (
        host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-degrade-route")
        == b"default/openai-tiny-lm"
    )
    host.delete(ctx)
    host.delete(root)


def test_the_audit_part_hashes_the_body_once(host: Any) -> None:
    root = configure(host, audit={"subject_salt": SALT, "body_hash": {"enabled": True}})
    body = b'{"model": "tiny-lm", "prompt": "hi"}'
    ctx = host.stream(root)
    host.request_headers(ctx, [*CHAT, (b"content-length", str(len(body)).encode())], eos=False)
    host.request_body(ctx, body, True)
    state = json.loads(host.state(b"meshfn_audit"))
    assert state["body_sha256"] == hashlib.sha256(body).hexdigest()
    host.delete(ctx)
    host.delete(root)


def test_the_router_is_refused_by_the_lean_build_and_leaks_nothing(host: Any) -> None:
    lean = fakehost.FakeHost(filters.wasm_dir(native=True) / "meshfn-lean_native.so")
    root, ok = lean.configure(json.dumps({"route": ROUTE}).encode())
    assert not ok and "route: needs the full build" in lean.logs()[-1][1]
    lean.delete(root)
    root = configure(host)
    send(host, root, b'{"model": "tiny-lm"}')
    baseline = host.live_bytes()
    for body in (b'{"model": "tiny-lm"}', b'{"model": "nope"}', b"{bad"):
        for _ in range(50):
            ctx, _ = send(host, root, body)
            host.delete(ctx)
    assert host.live_bytes() == baseline
    host.delete(root)


def test_bad_router_configuration_names_the_field(host: Any) -> None:
    for route, reason in (
        ({}, "route.paths: required"),
        ({"models": []}, "route.paths: required"),
        ({"paths": ["/v1/x"], "models": ["Bad Name"]}, "route.models: has an invalid entry"),
        ({"paths": ["nope"], "models": ["a"]}, "route.paths: has an invalid entry"),
        ({"paths": ["/v1/x"], "models": ["a"], "max_body_bytes": 0}, "route.max_body_bytes"),
        ({"paths": ["/v1/x"], "models": ["a"], "extra": 1}, "route.extra: unknown field"),
    ):
        root, ok = host.configure(
            json.dumps({"route": {"header": "x-meshfn-model", **route}}).encode()
        )
        host.delete(root)
        assert not ok
        assert reason in host.logs()[-1][1], (route, host.logs()[-1])


# ---- KServe gRPC (a gateway that sheds by priority: each Function's calls to its own breakers)

GRPC_ROUTE = RouteSettings(
    models=["tiny-lm"],
    max_body_bytes=4096,
    grpc=GrpcRouteSettings(models=["iris", "digits"]),
).model_dump(exclude_none=True)
INFER = [
    (b":method", b"POST"),
    (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
    (b"content-type", b"application/grpc"),
]


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    """One gRPC message: the compressed flag, the big-endian length, the payload."""
    return bytes([int(compressed)]) + struct.pack(">I", len(payload)) + payload


def infer_request(model: str, rows: int = 1) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, id="r1")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[rows, 4])
    tensor.contents.fp32_contents.extend([5.1, 3.5, 1.4, 0.2] * rows)
    request.parameters["priority"].int64_param = 3
    return request.SerializeToString()


def grpc_send(host: Any, root: int, body: bytes) -> tuple[int, int, int]:
    ctx = host.stream(root)
    first = host.request_headers(ctx, INFER, eos=False)
    return ctx, first, host.request_body(ctx, body, True)


def test_a_grpc_call_is_routed_by_the_model_its_message_names(host: Any) -> None:
    root, ok = host.configure(json.dumps({"route": GRPC_ROUTE}).encode())
    assert ok, host.logs()
    before = host.foreign_calls()
    ctx, first, second = grpc_send(host, root, grpc_message(infer_request("iris")))
    assert (first, second) == (fakehost.PAUSE, fakehost.CONTINUE)  # waited for the message
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") == b"iris"
    assert host.foreign_calls() == before + 1  # clear_route_cache
    assert host.local_response() is None
    host.delete(ctx)
    # protobuf's rule: the last model_name given is the one the backend reads
    twice = b"\x0a\x04iris\x0a\x06digits\x1a\x02r1"
    assert service_pb2.ModelInferRequest.FromString(twice).model_name == "digits"
    ctx, _, _ = grpc_send(host, root, grpc_message(twice))
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") == b"digits"
    host.delete(ctx)
    host.delete(root)


@pytest.mark.parametrize(
    "body",
    [
        grpc_message(infer_request("tiny-lm")),  # not routed over gRPC here
        grpc_message(infer_request("cancer")),  # not a model this gateway routes
        grpc_message(infer_request("IRIS")),
        grpc_message(infer_request("iris"), compressed=True),
        grpc_message(infer_request("iris")) + grpc_message(infer_request("iris")),  # two
        grpc_message(infer_request("iris"))[:-1],  # truncated
        grpc_message(b"\x0a\x04iris\x0a\x09digits"),  # a field past the end
        grpc_message(b"\x0a\x04iris\x0b"),  # a group: never in ModelInferRequest
        grpc_message(b"\x08\x01"),  # field 1 as a varint: not a name
        grpc_message(b"\x0a\x04iris" + b"\x18" + b"\xff" * 10 + b"\x01"),  # varint over 10 bytes
        grpc_message(infer_request("iris", rows=300)),  # larger than max_body_bytes
        b"",
        b"\x00\x00",
    ],
)
def test_a_grpc_call_that_cannot_be_routed_passes_unrefused(host: Any, body: bytes) -> None:
    """The backend's own gRPC route takes it, and the backend answers it as it would."""
    root, ok = host.configure(json.dumps({"route": GRPC_ROUTE}).encode())
    assert ok, host.logs()
    ctx, _, second = grpc_send(host, root, body)
    assert second == fakehost.CONTINUE
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") is None
    assert host.local_response() is None
    host.delete(ctx)
    host.delete(root)


def test_grpc_routing_reads_only_unary_grpc_calls(host: Any) -> None:
    root, ok = host.configure(json.dumps({"route": GRPC_ROUTE}).encode())
    assert ok, host.logs()
    stream = [(b":method", b"POST"), (b":path", b"/inference.GRPCInferenceService/ModelStreamInfer"),
              (b"content-type", b"application/grpc")]  # fmt: skip
    not_grpc = [*INFER[:2], (b"content-type", b"application/json")]
    for headers in (stream, not_grpc, INFER[:2]):
        ctx = host.stream(root)
        assert host.request_headers(ctx, headers, eos=False) == fakehost.CONTINUE
        assert host.request_body(ctx, grpc_message(infer_request("iris")), True) == 0
        assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") is None
        host.delete(ctx)
    ctx = host.stream(root)  # no message at all
    assert host.request_headers(ctx, INFER, eos=True) == fakehost.CONTINUE
    assert host.local_response() is None
    host.delete(ctx)
    host.delete(root)


def test_grpc_only_routing_leaves_openai_paths_alone(host: Any) -> None:
    only = RouteSettings(paths=[], models=[], grpc=GrpcRouteSettings(models=["iris"]))
    root, ok = host.configure(json.dumps({"route": only.model_dump(exclude_none=True)}).encode())
    assert ok, host.logs()
    ctx = host.stream(root)
    assert host.request_headers(ctx, CHAT, eos=False) == fakehost.CONTINUE
    host.delete(ctx)
    ctx, _, _ = grpc_send(host, root, grpc_message(infer_request("iris")))
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") == b"iris"
    host.delete(ctx)
    host.delete(root)


def test_the_audit_part_hashes_a_grpc_message_too_large_to_route(host: Any) -> None:
    """The router gives up before the end: the audit part hashes what it held back, then the
    rest as it comes, so the record's digest is the whole body's."""
    audit = {"subject_salt": SALT, "body_hash": {"enabled": True}}
    root, ok = host.configure(json.dumps({"route": GRPC_ROUTE, "audit": audit}).encode())
    assert ok, host.logs()
    body = grpc_message(infer_request("iris", rows=400))
    head, tail = body[:5000], body[5000:]
    ctx = host.stream(root)
    length = [(b"content-length", str(len(body)).encode())]
    assert host.request_headers(ctx, [*INFER, *length], eos=False) == fakehost.PAUSE
    assert host.request_body(ctx, head[:3000], False) == fakehost.PAUSE  # still waiting
    assert host.request_body(ctx, head, False) == fakehost.CONTINUE  # over the limit: unrouted
    assert host.request_body(ctx, tail, True) == fakehost.CONTINUE
    state = json.loads(host.state(b"meshfn_audit"))
    assert state["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") is None
    host.delete(ctx)
    host.delete(root)


def test_grpc_routing_leaks_nothing(host: Any) -> None:
    root, ok = host.configure(json.dumps({"route": GRPC_ROUTE}).encode())
    assert ok, host.logs()
    grpc_send(host, root, grpc_message(infer_request("iris")))
    baseline = host.live_bytes()
    for body in (infer_request("iris"), infer_request("nope"), b"\x0a\xff"):
        for _ in range(50):
            ctx, _, _ = grpc_send(host, root, grpc_message(body))
            host.delete(ctx)
    assert host.live_bytes() == baseline
    host.delete(root)


def test_bad_grpc_router_configuration_names_the_field(host: Any) -> None:
    openai = {"header": "x-meshfn-model", "paths": ["/v1/x"], "models": ["a"]}
    for route, reason in (
        ({**openai, "grpc": []}, "route.grpc: must be an object"),
        ({**openai, "grpc": {"paths": ["/x"]}}, "route.grpc.models: required"),
        ({**openai, "grpc": {"paths": ["/x"], "models": []}}, "route.grpc.models: must be"),
        ({**openai, "grpc": {"paths": ["x"], "models": ["a"]}}, "route.grpc.paths: has an"),
        ({**openai, "grpc": {"paths": ["/x"], "models": ["a"], "z": 1}}, "route.grpc: has an"),
        ({**openai, "paths": [], "grpc": {"paths": ["/x"], "models": ["a"]}}, "route.models"),
        ({**openai, "paths": [], "models": []}, "route.paths: must be a non-empty"),
    ):
        root, ok = host.configure(json.dumps({"route": route}).encode())
        host.delete(root)
        assert not ok
        assert reason in host.logs()[-1][1], (route, host.logs()[-1])


def test_a_grpc_call_too_large_to_hold_passes_before_envoys_buffer_limit(host: Any) -> None:
    """However large the functions' maxRequestBytes, the router stops holding a message back
    below Envoy's buffer limit per stream (1 MiB), which would otherwise answer 413."""
    route = {**GRPC_ROUTE, "max_body_bytes": 8 << 20}
    root, ok = host.configure(json.dumps({"route": route}).encode())
    assert ok, host.logs()
    body = grpc_message(infer_request("iris", rows=70_000))  # ~1.1 MiB
    assert len(body) > 1 << 20
    ctx = host.stream(root)
    assert host.request_headers(ctx, INFER, eos=False) == fakehost.PAUSE
    assert host.request_body(ctx, body[: 900 << 10], False) == fakehost.PAUSE
    assert host.request_body(ctx, body[: 1000 << 10], False) == fakehost.CONTINUE
    assert host.request_body(ctx, body[1000 << 10 :], True) == fakehost.CONTINUE
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-model") is None
    assert host.local_response() is None
    host.delete(ctx)
    host.delete(root)
