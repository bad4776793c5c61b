"""The model router (route/route.c, part of meshfn.wasm), natively against the fake host: an
OpenAI request waits for its body, and the model it names becomes the routing header (the route
cache cleared), or the request is refused with OpenAI's error object (400, 404
model_not_found, 413); the degrade part runs after it on the route it chose, the audit part
hashes the body once; other requests pass untouched; nothing leaks."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from meshfn.contracts.plugins import RouteSettings
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
