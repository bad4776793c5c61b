"""Global rate limits without Envoy: QoSPolicy `global` errors at file:line, and the control
plane's rate-limit service (Envoy's RLS protocol) counting each tenant's bucket across calls
from any gateway, over a real gRPC channel, with a fake clock; bad requests get gRPC errors."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from meshfn import ir
from meshfn.contracts.qos import DESCRIPTOR_POLICY, DESCRIPTOR_TENANT
from meshfn.control_plane.policy import PolicyErrors, load_policies
from meshfn.istio import render
from meshfn.xds.rls import RateLimitService, global_policies

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "qos-global" / "in.yaml"
POLICY = "default/tenants"  # standard: 50/s burst 100; acme premium 1000/s; globex 20 per 10s
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(tenant: str | None, domain: str = POLICY, **extra: str) -> rls_pb2.RateLimitRequest:
    entries = [(DESCRIPTOR_POLICY, POLICY)]
    if tenant is not None:
        entries.append((DESCRIPTOR_TENANT, tenant))
    entries += list(extra.items())
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
    )
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=[descriptor])


@pytest.fixture(scope="module")
def model() -> ir.MeshModel:
    return load_policies(GOLDEN)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def service(model: ir.MeshModel, clock: Clock) -> RateLimitService:
    policies = global_policies(model.qos)
    return RateLimitService(lambda: policies, CollectorRegistry(), clock)


def test_lowered(model: ir.MeshModel) -> None:
    policy = next(p for p in model.qos if p.key == POLICY)
    assert policy.global_rate == ir.GlobalRate(deny=True, timeout_ms=50)
    assert list(global_policies(model.qos)) == [POLICY]  # the Route's own policy stays local


def test_one_bucket_per_tenant_across_calls(service: RateLimitService, clock: Clock) -> None:
    # globex: 20 per 10s, burst 20, whichever gateway asks.
    codes = [service.decide(request("globex")).overall_code for _ in range(25)]
    assert codes == [OK] * 20 + [OVER] * 5
    over = service.decide(request("globex"))
    status = over.statuses[0]
    assert status.limit_remaining == 0 and status.code == OVER
    headers = {h.key: h.value for h in over.response_headers_to_add}
    assert headers == {"retry-after": "1", "x-meshfn-qos-limit": "rate"}  # 1 token: 0.5s
    assert service.decide(request("initech")).overall_code == OK  # unlisted: its own bucket
    assert service.decide(request(None)).overall_code == OK  # anonymous: its own too
    clock.now += 1.0  # 2 tokens back
    assert [service.decide(request("globex")).overall_code for _ in range(3)] == [OK, OK, OVER]
    clock.now += 3600
    assert service.decide(request("globex")).statuses[0].limit_remaining == 19  # capped at burst


def test_current_limit_and_hits(service: RateLimitService) -> None:
    status = service.decide(request("acme")).statuses[0]
    assert status.current_limit.requests_per_unit == 1000
    assert status.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.SECOND
    assert status.limit_remaining == 1999
    many = request("someone")
    many.hits_addend = 100
    assert service.decide(many).overall_code == OK  # standard: burst 100
    assert service.decide(request("someone")).overall_code == OVER


def test_counted_per_tenant(service: RateLimitService) -> None:
    for _ in range(21):
        service.decide(request("globex"))
    service.decide(request("wile"))
    text = generate_latest(service.registry).decode()
    assert f'outcome="allowed",policy="{POLICY}",tenant="globex"}} 20.0' in text
    assert f'outcome="over_limit",policy="{POLICY}",tenant="globex"}} 1.0' in text
    assert f'outcome="allowed",policy="{POLICY}",tenant="*"}} 1.0' in text  # unlisted


@pytest.fixture
async def stub(service: RateLimitService) -> AsyncIterator[rls_pb2_grpc.RateLimitServiceStub]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield rls_pb2_grpc.RateLimitServiceStub(channel)
    await server.stop(0)


BAD = [
    (request("acme", domain="default/nope"), grpc.StatusCode.NOT_FOUND, "no QoSPolicy"),
    (rls_pb2.RateLimitRequest(domain=POLICY), grpc.StatusCode.INVALID_ARGUMENT, "no descriptors"),
    (request("acme", other="x"), grpc.StatusCode.INVALID_ARGUMENT, "unexpected descriptor"),
    (request("a\x01b"), grpc.StatusCode.INVALID_ARGUMENT, "not a claim value"),
]


async def test_over_grpc(stub: rls_pb2_grpc.RateLimitServiceStub) -> None:
    replies = await asyncio.gather(*(stub.ShouldRateLimit(request("globex")) for _ in range(22)))
    assert sorted(r.overall_code for r in replies) == [OK] * 20 + [OVER] * 2
    for bad, code, text in BAD:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ShouldRateLimit(bad)
        assert caught.value.code() == code and text in (caught.value.details() or "")
    wrong_policy = request("acme")
    wrong_policy.descriptors[0].entries[0].value = "default/other"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ShouldRateLimit(wrong_policy)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _errors(tmp_path: Path, old: str, new: str, *more: tuple[str, str]) -> list[str]:
    text = GOLDEN.read_text()
    for a, b in ((old, new), *more):
        assert a in text
        text = text.replace(a, b, 1)
    (tmp_path / "in.yaml").write_text(text)
    with pytest.raises(PolicyErrors) as caught:
        load_policies(tmp_path)
    return [str(e).split("in.yaml:", 1)[-1] for e in caught.value.errors]


GLOBAL = "  global: {onLimitServiceError: deny, timeout: 50ms}\n"


def test_bad_global(tmp_path: Path) -> None:
    assert _errors(tmp_path, "timeout: 50ms", "timeout: 10s") == [
        "55: spec.global: timeout must be between 1ms and 5s: requests must never hang"
    ]
    assert _errors(tmp_path, "onLimitServiceError: deny", "onLimitServiceError: maybe")[
        0
    ].startswith("55: spec.global.onLimitServiceError")
    routed = "  targetRefs: [{kind: Route, name: batch}]\n"
    assert _errors(tmp_path, routed, routed + GLOBAL) == [
        "72: spec.global: a global rate binds Gateways only (it also names Route): bind the "
        "Route or Function with a policy of its own without `global`"
    ]


def test_global_without_a_rate(tmp_path: Path) -> None:
    bulk = "    - {name: bulk, rate: {requests: 5, per: 1m, burst: 10}}\n"
    routed = "  targetRefs: [{kind: Route, name: batch}]\n"
    found = _errors(
        tmp_path,
        bulk,
        "    - {name: bulk, priority: 1}\n    - {name: rush, priority: 2}\n",
        (routed, routed + GLOBAL),
    )
    assert found == ["72: spec.global: no class or tenant sets a rate: nothing to count globally"]


def test_istio_renders_a_global_rate_as_local_limits_with_a_warning(model: ir.MeshModel) -> None:
    digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("audit", "degrade")}
    rendered = render(model, digests)
    codes = {(w.code, w.source.name, w.path) for w in rendered.warnings}
    assert ("qos-global-rate-needs-meshfn-rls", "tenants", ("spec", "global")) in codes
    filters = json.dumps(rendered.objects["EnvoyFilter"])
    assert "envoy.filters.http.local_ratelimit" in filters
    assert 'envoy.filters.http.ratelimit"' not in filters
