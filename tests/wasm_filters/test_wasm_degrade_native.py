"""The degrade filter's C code, compiled natively against the fake proxy-wasm host (the same
sources as degrade.wasm): config fail-closed, anti-spoofing, reroute/reject, the trigger header
and hostile input. Real Envoy behaviour is covered in e2e/test_wasm_degrade.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshfn.testing.filters import harness, wasm_dir

ROOT = Path(__file__).resolve().parents[2]
ROUTE = b"xds\0route_name"
CLUSTER = b"xds\0cluster_name"
PEER = b"connection\0uri_san_peer_certificate"
OPS = b"spiffe://mesh.local/ns/ops/sa/drill"


fakehost = harness("fakehost")


@pytest.fixture(scope="module", params=["degrade", "degrade-lean"])
def host(request: pytest.FixtureRequest) -> Any:
    """Every test runs on both builds: the full one and the lean one (no per-request context)."""
    return fakehost.FakeHost(wasm_dir(native=True) / f"{request.param}_native.so")


def rule(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "classifier",
        "routes": ["classifier"],
        "mode": "reroute",
        "fallbacks": ["classifier-cpu", "classifier-cache"],
        "depth": 0,
    }
    base.update(kw)
    return base


def config(rules: list[dict[str, Any]] | None = None, **kw: Any) -> bytes:
    base: dict[str, Any] = {
        "rules": [rule()] if rules is None else rules,
        "trigger": {"principals": [OPS.decode()]},
    }
    base.update(kw)
    return json.dumps(base).encode()


class Request:
    def __init__(self, host: Any, cfg: bytes) -> None:
        self.host = host
        self.root, ok = host.configure(cfg)
        assert ok, host.logs()

    def send(
        self,
        headers: list[tuple[bytes, bytes]],
        route: bytes | None = b"classifier",
        cluster: bytes | None = b"classifier",
        peer: bytes | None = None,
    ) -> int:
        self.ctx = self.host.stream(self.root)
        if route is not None:
            self.host.set_property(ROUTE, route)
        if cluster is not None:
            self.host.set_property(CLUSTER, cluster)
        if peer is not None:
            self.host.set_property(PEER, peer)
        action: int = self.host.request_headers(self.ctx, headers)
        return action

    def respond(self) -> bytes | None:
        self.host.response_headers(self.ctx, [(b":status", b"200")])
        value: bytes | None = self.host.header(fakehost.RESPONSE_HEADERS, b"x-meshfn-degraded")
        return value

    def routing_header(self) -> bytes | None:
        value: bytes | None = self.host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-degrade-route")
        return value

    def close(self) -> None:
        self.host.delete(self.ctx)
        self.host.delete(self.root)


# ------------------------------------------------------------------ configuration fails closed

BAD: list[tuple[bytes, str]] = [
    (b"{}", "rules: required"),
    (
        json.dumps({"rules": [], "trigger": {"request_principals": []}}).encode(),
        "trigger.principals: principals or request_principals must name at least one caller",
    ),
    (
        json.dumps(
            {"rules": [], "trigger": {"request_principals": ["a/b"], "issuer_header": "X"}}
        ).encode(),
        "trigger.issuer_header: must be a lowercase header name",
    ),
    (
        json.dumps(
            {"rules": [], "trigger": {"request_principals": ["a/b"], "subject_header": 1}}
        ).encode(),
        "trigger.subject_header: must be a lowercase header name",
    ),
    (
        json.dumps({"rules": [], "trigger": {"request_principals": [""]}}).encode(),
        "trigger.request_principals: entries must be",
    ),
    (
        json.dumps({"rules": [], "listener_strips_routing_header": 1}).encode(),
        "listener_strips_routing_header: must be a boolean",
    ),
    (b'{"rules": {}}', "rules: required"),
    (json.dumps({"rules": [rule(fallbacks=[])]}).encode(), "reroute needs 1-8 fallbacks"),
    (json.dumps({"rules": [rule(mode="reject")]}).encode(), "not allowed with mode reject"),
    (json.dumps({"rules": [rule(mode="drop")]}).encode(), "rules[].mode"),
    (json.dumps({"rules": [rule(depth=3)]}).encode(), "deeper than the fallback list"),
    (json.dumps({"rules": [rule(depth=-1)]}).encode(), "rules[].depth"),
    (json.dumps({"rules": [rule(depth="1")]}).encode(), "rules[].depth"),
    (json.dumps({"rules": [rule(routes=[], clusters=[])]}).encode(), "at least one entry"),
    (json.dumps({"rules": [rule(routes=[""])]}).encode(), "rules[].routes"),
    (json.dumps({"rules": [rule(routes=["a,b"])]}).encode(), "rules[].routes"),
    (json.dumps({"rules": [rule(fallbacks=["x"] * 9)]}).encode(), "too many"),
    (json.dumps({"rules": [rule(name=None)]}).encode(), "rules[].name"),
    (json.dumps({"rules": [rule(extra=1)]}).encode(), "rules[]: unknown field"),
    (json.dumps({"rules": [rule()] * 257}).encode(), "too many rules"),
    (json.dumps({"rules": [], "trigger": {"principals": []}}).encode(), "at least one caller"),
    (json.dumps({"rules": [], "trigger": {}}).encode(), "at least one caller"),
    (
        json.dumps({"rules": [], "trigger": {"principals": ["a"], "header": "X-Up"}}).encode(),
        "trigger.header",
    ),
    (
        json.dumps(
            {"rules": [], "trigger": {"principals": ["a"], "header": "x-meshfn-degrade-route"}}
        ).encode(),
        "must differ from routing_header",
    ),
    (json.dumps({"rules": [], "routing_header": ""}).encode(), "routing_header"),
    (json.dumps({"rules": [], "routing_header": "a b"}).encode(), "routing_header"),
    (json.dumps({"rules": [], "mode": "x"}).encode(), "mode: unknown field"),
    (b'{"rules": [}', "offset 11"),
    (b'{"rules": []}\x00', "trailing data"),
    (b'{"rules": [], "rules": []}', "duplicate key"),
    (b'{"rules": [{"name": "\xc0\xaf"}]}', "invalid UTF-8"),
]


@pytest.mark.parametrize(("raw", "reason"), BAD)
def test_bad_config_is_rejected_with_reason(host: Any, raw: bytes, reason: str) -> None:
    root, ok = host.configure(raw)
    host.delete(root)
    assert not ok
    errors = [m for level, m in host.logs() if level == 4]
    assert len(errors) == 1 and reason in errors[0], host.logs()


def test_reconfigure_with_bad_config_keeps_the_good_one(host: Any) -> None:
    req = Request(host, config([rule(depth=1)]))
    assert not host.reconfigure(req.root, b"{not json")
    req.send([])
    assert req.routing_header() == b"classifier-cpu"
    req.close()


# ------------------------------------------------------------------ behaviour


def test_healthy_route_passes_untouched(host: Any) -> None:
    req = Request(host, config())
    assert req.send([(b"x-other", b"1")]) == fakehost.CONTINUE
    assert req.routing_header() is None
    assert host.foreign_calls() == 0
    assert req.respond() is None
    req.close()
    # only request headers are hooked: every exported callback costs Envoy CPU per request
    assert host.exports == (set() if host.lean else {"proxy_on_context_create", "proxy_on_delete"})


@pytest.mark.parametrize("value", [b"classifier-cpu", b"", b"\xff\xfe", b"x" * 100_000])
def test_spoofed_routing_header_is_stripped_and_route_recomputed(host: Any, value: bytes) -> None:
    req = Request(host, config())
    assert req.send([(b"X-Meshfn-Degrade-Route", value)]) == fakehost.CONTINUE
    assert req.routing_header() is None
    assert host.foreign_calls() == 1  # clear_route_cache
    assert host.metric("meshfn_degrade.routing_header_stripped") >= 1
    req.close()


def test_listener_strips_routing_header_skips_the_check(host: Any) -> None:
    """Where the listener removes the routing header before routing (the translator always
    configures that), the filter does not look for it again: no header read, no route cache
    clear for a healthy request. The spoofed header here could only exist without that
    listener configuration, which is exactly what the setting promises is not the case."""
    req = Request(host, config(listener_strips_routing_header=True))
    stripped = host.metric("meshfn_degrade.routing_header_stripped")
    assert req.send([(b"x-meshfn-degrade-route", b"classifier-cpu")]) == fakehost.CONTINUE
    assert req.routing_header() == b"classifier-cpu"
    assert host.foreign_calls() == 0
    assert host.metric("meshfn_degrade.routing_header_stripped") == stripped
    req.close()
    req = Request(host, config([rule(depth=1)], listener_strips_routing_header=True))
    assert req.send([]) == fakehost.CONTINUE  # a degraded route still reroutes
    assert req.routing_header() == b"classifier-cpu"
    assert host.foreign_calls() == 1
    req.close()


@pytest.mark.parametrize(("depth", "target"), [(1, b"classifier-cpu"), (2, b"classifier-cache")])
def test_degraded_route_is_rerouted(host: Any, depth: int, target: bytes) -> None:
    req = Request(host, config([rule(depth=depth)]))
    before = host.metric("meshfn_degrade.rerouted")
    assert req.send([(b"x-meshfn-degrade-route", b"spoof")]) == fakehost.CONTINUE
    assert req.routing_header() == target
    assert host.foreign_calls() == 2  # once for the stripped spoof, once for the reroute
    assert host.metric("meshfn_degrade.rerouted") == before + 1
    req.close()


def test_match_by_cluster_and_first_rule_wins(host: Any) -> None:
    reject = {"name": "a", "clusters": ["embedder"], "mode": "reject", "depth": 1}
    rules = [reject, rule(name="b", routes=["r2"], depth=1)]
    req = Request(host, config(rules))
    assert req.send([], route=b"r2", cluster=b"embedder") == fakehost.PAUSE
    response = host.local_response()
    assert response is not None and response.status == 503
    assert json.loads(response.body) == {"error": "service degraded", "rule": "a", "status": 503}
    assert (b"content-type", b"application/json") in response.headers
    assert (b"x-meshfn-degraded", b"reject") in response.headers
    req.close()
    req = Request(host, config(rules))
    assert req.send([], route=b"r2", cluster=b"other") == fakehost.CONTINUE
    assert req.routing_header() == b"classifier-cpu"
    req.close()


def test_unknown_route_or_no_route_passes(host: Any) -> None:
    req = Request(host, config([rule(depth=1)]))
    assert req.send([], route=None, cluster=None) == fakehost.CONTINUE
    assert req.routing_header() is None
    req.close()
    req = Request(host, config([rule(depth=1)]))
    assert req.send([], route=b"classifier\0x", cluster=b"") == fakehost.CONTINUE
    assert req.routing_header() is None
    req.close()


def test_trigger_honoured_only_for_named_callers(host: Any) -> None:
    req = Request(host, config())
    ok = host.metric("meshfn_degrade.trigger_honoured")
    req.send([(b"x-meshfn-degrade", b"2")], peer=OPS)
    assert req.routing_header() == b"classifier-cache"
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-degrade") is None  # not forwarded
    assert host.metric("meshfn_degrade.trigger_honoured") == ok + 1
    req.close()

    for peer in (None, b"spiffe://mesh.local/ns/ops/sa/drill2", b"", OPS + b"\0"):
        req = Request(host, config())
        denied = host.metric("meshfn_degrade.trigger_denied")
        req.send([(b"x-meshfn-degrade", b"1")], peer=peer)
        assert req.routing_header() is None
        assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-degrade") is None
        assert host.metric("meshfn_degrade.trigger_denied") == denied + 1
        req.close()


ISS = b"https://issuer.example"


def jwt_caller(iss: bytes | None, sub: bytes | None) -> list[tuple[bytes, bytes]]:
    """The claim headers jwt_authn writes for a verified token (clients cannot: stripped early)."""
    headers = [(b"x-meshfn-degrade", b"1")]
    if iss is not None:
        headers.append((b"x-meshfn-jwt-iss", iss))
    if sub is not None:
        headers.append((b"x-meshfn-jwt-sub", sub))
    return headers


@pytest.mark.parametrize(
    ("allowed", "iss", "sub", "honoured"),
    [
        ([ISS.decode() + "/alice"], ISS, b"alice", True),
        ([ISS.decode() + "/alice"], ISS, b"alice2", False),
        ([ISS.decode() + "/alice"], ISS, b"alic", False),
        ([ISS.decode() + "/alice"], ISS + b"/alice", b"", False),
        ([ISS.decode() + "/alice"], ISS, None, False),
        ([ISS.decode() + "/alice"], None, b"alice", False),
        ([ISS.decode() + "/*"], ISS, b"anyone", True),
        ([ISS.decode() + "/*"], ISS, b"", True),
        ([ISS.decode() + "/*"], b"https://issuer.exampleX", b"anyone", False),
        ([ISS.decode() + "/*"], ISS + b"/evil", b"x", False),  # not a prefix match
        ([ISS.decode() + "/*"], b"https://issuer", b"example/x", False),
        (["*"], b"a", b"b", True),
        (["no-slash"], b"no-slash", b"", False),
        (["other/x", ISS.decode() + "/bob"], ISS, b"bob", True),
    ],
)
def test_trigger_for_named_request_principals(
    host: Any, allowed: list[str], iss: bytes | None, sub: bytes | None, honoured: bool
) -> None:
    """Callers named by verified JWT, with RBAC's requestPrincipals semantics (`*`, `iss/*`,
    `iss/sub`), as at a gateway whose clients authenticate with tokens rather than mTLS."""
    cfg = json.dumps({"rules": [rule()], "trigger": {"request_principals": allowed}}).encode()
    req = Request(host, cfg)
    req.send(jwt_caller(iss, sub), peer=OPS)  # an mTLS peer not named: only the JWT counts
    assert req.routing_header() == (b"classifier-cpu" if honoured else None)
    assert host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-degrade") is None
    name = "trigger_honoured" if honoured else "trigger_denied"
    assert host.metric(f"meshfn_degrade.{name}") >= 1
    req.close()


def test_trigger_principals_and_request_principals_together(host: Any) -> None:
    trigger = {
        "principals": [OPS.decode()],
        "request_principals": ["iss/sub"],
        "issuer_header": "x-i",
        "subject_header": "x-s",
    }
    cfg = json.dumps({"rules": [rule()], "trigger": trigger}).encode()
    for headers, peer, honoured in [
        ([(b"x-meshfn-degrade", b"1")], OPS, True),
        ([(b"x-meshfn-degrade", b"1"), (b"x-i", b"iss"), (b"x-s", b"sub")], None, True),
        (
            [(b"x-meshfn-degrade", b"1"), (b"x-meshfn-jwt-iss", b"iss"), (b"x-s", b"sub")],
            None,
            False,
        ),
        ([(b"x-meshfn-degrade", b"1")], None, False),
    ]:
        req = Request(host, cfg)
        req.send(headers, peer=peer)
        assert req.routing_header() == (b"classifier-cpu" if honoured else None), headers
        req.close()


@pytest.mark.parametrize("value", [b"0", b"9", b"x", b"11", b"", b"\xff", b"1" * 70_000])
def test_invalid_trigger_values_are_ignored(host: Any, value: bytes) -> None:
    req = Request(host, config())
    bad = host.metric("meshfn_degrade.trigger_invalid")
    req.send([(b"x-meshfn-degrade", value)], peer=OPS)
    assert req.routing_header() is None
    assert host.metric("meshfn_degrade.trigger_invalid") == bad + 1
    req.close()


def test_trigger_deeper_than_fallbacks_uses_the_last(host: Any) -> None:
    req = Request(host, config())
    req.send([(b"x-meshfn-degrade", b"8")], peer=OPS)
    assert req.routing_header() == b"classifier-cache"
    req.close()


def test_without_trigger_config_the_header_is_just_stripped(host: Any) -> None:
    cfg = json.dumps({"rules": [rule()]}).encode()
    req = Request(host, cfg)
    req.send([(b"x-meshfn-degrade", b"1")], peer=OPS)
    assert req.routing_header() is None
    req.close()


def test_no_memory_leak_per_request(host: Any) -> None:
    req = Request(host, config([rule(depth=1)]))

    def one() -> None:
        req.send([(b"x-meshfn-degrade-route", b"s" * 3000), (b"x-meshfn-degrade", b"2")], peer=OPS)
        req.respond()
        host.delete(req.ctx)

    one()
    baseline = host.live_bytes()
    for _ in range(200):
        one()
    assert host.live_bytes() == baseline
    host.delete(req.root)
