"""The combined filter (meshfn.wasm: audit + degrade in one plugin), natively against the fake
host: configuration routing and fail-closed errors naming the part, and both behaviours in one
request (audited first, so a rejected request is still audited)."""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from meshfn.testing import filters

ROOT = Path(__file__).resolve().parents[2]
SALT = "07" * 16
PEER = b"connection\0uri_san_peer_certificate"


fakehost = filters.harness("fakehost")


@pytest.fixture(scope="module", params=["meshfn", "meshfn-lean"])
def host(request: pytest.FixtureRequest) -> Any:
    """Every test runs on both builds: the full one and the lean one (no per-request context)."""
    return fakehost.FakeHost(filters.wasm_dir(native=True) / f"{request.param}_native.so")


def config(depth: int = 0, mode: str = "reroute") -> bytes:
    rule: dict[str, Any] = {"name": "r", "routes": ["classifier"], "mode": mode, "depth": depth}
    if mode == "reroute":
        rule["fallbacks"] = ["classifier-cpu"]
    settings = {
        "audit": {"subject_salt": SALT, "subject_source": "jwt_headers"},
        "degrade": {"rules": [rule], "trigger": {"principals": ["spiffe://ops"]}},
    }
    return json.dumps(settings).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{}", 'configuration: needs "audit", "route" or "degrade"'),
        (b'{"audit": {"subject_salt": "00"}}', "audit.subject_salt: must be"),
        (b'{"degrade": {"rules": [{"name": "x", "mode": "reject"}]}}', "degrade.rules[]: needs"),
        (b'{"audit": [], "degrade": {"rules": []}}', "audit: must be an object"),
        (b'{"degrade": {"rules": []}, "extra": 1}', "extra: unknown field"),
        (b'{"degrade": {"rules": []}', "unterminated"),
    ],
)
def test_bad_config_names_the_part(host: Any, raw: bytes, reason: str) -> None:
    root, ok = host.configure(raw)
    host.delete(root)
    assert not ok
    (error,) = [m for level, m in host.logs() if level == 4]
    assert error.startswith("meshfn: invalid plugin configuration, rejected: ") and reason in error


def test_one_part_alone(host: Any) -> None:
    root, ok = host.configure(b'{"degrade": {"rules": []}}')
    assert ok
    ctx = host.stream(root)
    host.request_headers(ctx, [(b"x-meshfn-degrade-route", b"x")])
    assert host.state(b"meshfn_audit") is None and host.foreign_calls() == 1
    host.delete(ctx)
    host.delete(root)
    root, ok = host.configure(json.dumps({"audit": {"subject_salt": SALT}}).encode())
    assert ok
    ctx = host.stream(root)
    host.request_headers(ctx, [])
    assert json.loads(host.state(b"meshfn_audit"))["subject"] is None
    host.delete(ctx)
    host.delete(root)


@pytest.mark.parametrize(("depth", "mode"), [(0, "reroute"), (1, "reroute"), (1, "reject")])
def test_audit_and_degrade_in_one_request(host: Any, depth: int, mode: str) -> None:
    root, ok = host.configure(config(depth, mode))
    assert ok, host.logs()
    ctx = host.stream(root)
    host.set_property(b"xds\0route_name", b"classifier")
    action = host.request_headers(
        ctx, [(b"x-meshfn-jwt-sub", b"dave"), (b"x-meshfn-degrade-route", b"spoof")]
    )
    # jwt_headers mode without body hashing: the filter state is the subject alone
    subject = hmac.new(bytes.fromhex(SALT), b"dave", "sha256").hexdigest()
    assert host.state(b"meshfn_audit") == subject.encode()
    route = host.header(fakehost.REQUEST_HEADERS, b"x-meshfn-degrade-route")
    response = host.local_response()
    if depth == 0:
        assert action == fakehost.CONTINUE and route is None and response is None
    elif mode == "reroute":
        assert action == fakehost.CONTINUE and route == b"classifier-cpu"
    else:
        assert action == fakehost.PAUSE and response is not None and response.status == 503
    host.delete(ctx)
    host.delete(root)


def test_body_hashing_through_the_combined_filter_and_no_leak(host: Any) -> None:
    cfg = {
        "audit": {"subject_salt": SALT, "body_hash": {"enabled": True}},
        "degrade": {"rules": []},
    }
    root, ok = host.configure(json.dumps(cfg).encode())
    if host.lean:  # request headers only: refuses what it could not do
        assert not ok
        assert "audit.body_hash.enabled: needs the full build" in host.logs()[-1][1]
        return
    assert ok

    def one() -> dict[str, Any]:
        ctx = host.stream(root)
        host.request_headers(ctx, [(b"content-length", b"5")], eos=False)
        host.request_body(ctx, b"hello", True)
        state: dict[str, Any] = json.loads(host.state(b"meshfn_audit"))
        host.delete(ctx)
        return state

    assert (
        one()["body_sha256"] == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    )
    baseline = host.live_bytes()
    for _ in range(100):
        one()
    assert host.live_bytes() == baseline
    assert host.exports == {"proxy_on_context_create", "proxy_on_delete", "proxy_on_request_body"}
    host.delete(root)
