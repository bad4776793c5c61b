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
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from meshfn import ir
from meshfn.contracts.qos import DESCRIPTOR_POLICY, DESCRIPTOR_TENANT, LIMIT_SERVICE_NODE_HEADER
from meshfn.control_plane.identity.bootstrap_token import LIMIT_SERVICE_PURPOSE, BootstrapTokens
from meshfn.istio import render
from meshfn.policy import PolicyErrors, load_policies
from meshfn.xds.dump import REDACTED, resources_to_plain
from meshfn.xds.fragments.qos import GLOBAL_RATE_LIMIT
from meshfn.xds.names import LISTENER
from meshfn.xds.rls import RateLimitService, global_policies
from meshfn.xds.translate import translate

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "qos-global" / "in.yaml"
POLICY = "default/tenants"  # standard: 50/s burst 100; acme premium 1000/s; globex 20 per 10s
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
EDGE, EDGE_B = "edge.default", "edge-b.default"  # the gateways the policy binds


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
def tokens(tmp_path: Path) -> BootstrapTokens:
    return BootstrapTokens(tmp_path / "xds-token.key")


@pytest.fixture
def service(model: ir.MeshModel, clock: Clock, tokens: BootstrapTokens) -> RateLimitService:
    policies = global_policies(model)

    def authenticate(node: str, header: str | None) -> bool:
        return tokens.verify(node, header, LIMIT_SERVICE_PURPOSE)

    return RateLimitService(lambda: policies, authenticate, CollectorRegistry(), clock)


def test_lowered(model: ir.MeshModel) -> None:
    policy = next(p for p in model.qos if p.key == POLICY)
    assert policy.global_rate == ir.GlobalRate(deny=True, timeout_ms=50)
    bound = global_policies(model)
    assert list(bound) == [POLICY]  # the Route's own policy stays local
    assert bound[POLICY].gateways == {EDGE, EDGE_B}


def test_one_bucket_per_tenant_across_calls(service: RateLimitService, clock: Clock) -> None:
    # globex: 20 per 10s, burst 20, whichever gateway asks.
    codes = [service.decide(request("globex"), EDGE).overall_code for _ in range(25)]
    assert codes == [OK] * 20 + [OVER] * 5
    over = service.decide(request("globex"), EDGE)
    status = over.statuses[0]
    assert status.limit_remaining == 0 and status.code == OVER
    headers = {h.key: h.value for h in over.response_headers_to_add}
    assert headers == {"retry-after": "1", "x-meshfn-qos-limit": "rate"}  # 1 token: 0.5s
    assert service.decide(request("initech"), EDGE).overall_code == OK  # unlisted: its own bucket
    assert service.decide(request(None), EDGE).overall_code == OK  # anonymous: its own too
    clock.now += 1.0  # 2 tokens back
    assert [service.decide(request("globex"), EDGE).overall_code for _ in range(3)] == [
        OK,
        OK,
        OVER,
    ]
    clock.now += 3600
    assert (
        service.decide(request("globex"), EDGE).statuses[0].limit_remaining == 19
    )  # capped at burst


def test_current_limit_and_hits(service: RateLimitService) -> None:
    status = service.decide(request("acme"), EDGE).statuses[0]
    assert status.current_limit.requests_per_unit == 1000
    assert status.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.SECOND
    assert status.limit_remaining == 1999
    many = request("someone")
    many.hits_addend = 100
    assert service.decide(many, EDGE_B).overall_code == OK  # standard: burst 100
    assert service.decide(request("someone"), EDGE).overall_code == OVER


def test_counted_per_tenant(service: RateLimitService) -> None:
    for _ in range(21):
        service.decide(request("globex"), EDGE)
    service.decide(request("wile"), EDGE)
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


def caller(
    tokens: BootstrapTokens, node: str, as_node: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The metadata of gateway `node` (claiming to be `as_node`, if given)."""
    header = tokens.header(node, LIMIT_SERVICE_PURPOSE)
    return ((LIMIT_SERVICE_NODE_HEADER, as_node or node), ("authorization", header))


BAD = [
    (request("acme", domain="default/nope"), grpc.StatusCode.NOT_FOUND, "no QoSPolicy"),
    (rls_pb2.RateLimitRequest(domain=POLICY), grpc.StatusCode.INVALID_ARGUMENT, "no descriptors"),
    (request("acme", other="x"), grpc.StatusCode.INVALID_ARGUMENT, "unexpected descriptor"),
    (request("a\x01b"), grpc.StatusCode.INVALID_ARGUMENT, "not a claim value"),
]


async def test_over_grpc(stub: rls_pb2_grpc.RateLimitServiceStub, tokens: BootstrapTokens) -> None:
    # Both bound gateways spend the one bucket.
    replies = await asyncio.gather(
        *(
            stub.ShouldRateLimit(request("globex"), metadata=caller(tokens, (EDGE, EDGE_B)[i % 2]))
            for i in range(22)
        )
    )
    assert sorted(r.overall_code for r in replies) == [OK] * 20 + [OVER] * 2
    for bad, code, text in BAD:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ShouldRateLimit(bad, metadata=caller(tokens, EDGE))
        assert caught.value.code() == code and text in (caught.value.details() or "")
    wrong_policy = request("acme")
    wrong_policy.descriptors[0].entries[0].value = "default/other"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ShouldRateLimit(wrong_policy, metadata=caller(tokens, EDGE))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


async def test_callers_must_prove_a_bound_gateway(
    stub: rls_pb2_grpc.RateLimitServiceStub, tokens: BootstrapTokens, service: RateLimitService
) -> None:
    ads = (
        (LIMIT_SERVICE_NODE_HEADER, EDGE),
        ("authorization", tokens.header(EDGE)),  # its ADS token: another purpose
    )
    hostile: list[tuple[tuple[tuple[str, str], ...], grpc.StatusCode]] = [
        ((), UNAUTHENTICATED),  # no credentials at all
        (((LIMIT_SERVICE_NODE_HEADER, EDGE),), UNAUTHENTICATED),  # a node claim, no token
        ((("authorization", caller(tokens, EDGE)[1][1]),), UNAUTHENTICATED),  # no node
        (caller(tokens, "web.default:8443", as_node=EDGE), UNAUTHENTICATED),  # another's token
        (((LIMIT_SERVICE_NODE_HEADER, EDGE), ("authorization", "Bearer x")), UNAUTHENTICATED),
        (ads, UNAUTHENTICATED),
        (caller(tokens, "edge-c.default"), DENIED),  # proven, but a gateway it does not bind
    ]
    for metadata, code in hostile:
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ShouldRateLimit(request("globex"), metadata=metadata)
            assert caught.value.code() == code, metadata
    # Nothing was spent: the bucket is whole for the gateways it binds.
    reply = await stub.ShouldRateLimit(request("globex"), metadata=caller(tokens, EDGE_B))
    assert reply.overall_code == OK and reply.statuses[0].limit_remaining == 19
    text = generate_latest(service.registry).decode()
    assert 'meshfn_qos_global_errors_total{reason="unauthenticated"} 18.0' in text
    assert 'meshfn_qos_global_errors_total{reason="permission_denied"} 3.0' in text
    assert 'outcome="over_limit"' not in text


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
    digests = {
        name: hashlib.sha256(name.encode()).hexdigest() for name in ("audit", "degrade", "meshfn")
    }
    rendered = render(model, digests)
    codes = {(w.code, w.source.name, w.path) for w in rendered.warnings}
    assert ("qos-global-rate-needs-meshfn-rls", "tenants", ("spec", "global")) in codes
    (text,) = {w.message for w in rendered.warnings if w.code == "qos-global-rate-needs-meshfn-rls"}
    assert "up to N times the rate and N times the burst" in text  # the error of splitting
    filters = json.dumps(rendered.objects["EnvoyFilter"])
    assert "envoy.filters.http.local_ratelimit" in filters
    assert 'envoy.filters.http.ratelimit"' not in filters


def _limit_service_metadata(
    model: ir.MeshModel, node: str, token: str | None
) -> list[list[tuple[str, str]]]:
    """The initial metadata of each ratelimit filter in `node`'s listeners."""
    resources = translate(model, node, limit_service_token=token)
    assert resources is not None
    found = []
    for lst in resources[LISTENER].values():
        for chain in lst.filter_chains:  # type: ignore[attr-defined]
            manager = hcm.HttpConnectionManager()
            chain.filters[0].typed_config.Unpack(manager)
            for http_filter in manager.http_filters:
                if http_filter.name == GLOBAL_RATE_LIMIT:
                    config = rate_limit_pb2.RateLimit()
                    http_filter.typed_config.Unpack(config)
                    service = config.rate_limit_service.grpc_service
                    found.append([(m.key, m.value) for m in service.initial_metadata])
    return found


def test_each_bound_gateway_gets_its_own_limit_service_credentials(
    model: ir.MeshModel, tokens: BootstrapTokens
) -> None:
    for node in (EDGE, EDGE_B):
        header = tokens.header(node, LIMIT_SERVICE_PURPOSE)
        assert _limit_service_metadata(model, node, header) == [
            [(LIMIT_SERVICE_NODE_HEADER, node), ("authorization", header)]
        ]
    assert _limit_service_metadata(model, EDGE, None) == [[]]  # offline: none (golden files)
    # Dumps (meshfn config dump, /debug/config_dump) show that a token is sent, not the token.
    header = tokens.header(EDGE, LIMIT_SERVICE_PURPOSE)
    resources = translate(model, EDGE, limit_service_token=header)
    assert resources is not None
    dumped = json.dumps(resources_to_plain(resources))
    assert header not in dumped and tokens.token(EDGE, LIMIT_SERVICE_PURPOSE) not in dumped
    assert f'"key": "authorization", "value": "{REDACTED}"' in dumped


async def test_buckets_survive_a_restart(
    model: ir.MeshModel, tokens: BootstrapTokens, tmp_path: Path
) -> None:
    policies, path = global_policies(model), tmp_path / "rls-buckets.db"
    wall = Clock()
    wall.now = 1_700_000_000.0

    def started() -> RateLimitService:
        clock = Clock()  # each process its own monotonic clock
        clock.now = 50.0

        def authenticate(node: str, header: str | None) -> bool:
            return tokens.verify(node, header, LIMIT_SERVICE_PURPOSE)

        return RateLimitService(
            lambda: policies, authenticate, CollectorRegistry(), clock, path, wall
        )

    first = started()
    assert not path.exists()  # nothing decided, nothing written
    codes = [first.decide(request("globex"), EDGE).overall_code for _ in range(21)]
    assert codes == [OK] * 20 + [OVER]
    await first.flush()
    # Restarted at once: globex's bucket is still empty, not a fresh burst of 20.
    assert started().decide(request("globex"), EDGE).overall_code == OVER
    wall.now += 1.0  # down a second: 2 tokens back, no more
    again = started()
    assert [again.decide(request("globex"), EDGE_B).overall_code for _ in range(3)] == [
        OK,
        OK,
        OVER,
    ]
    assert again.decide(request("initech"), EDGE).overall_code == OK  # others untouched
    # An unreadable file: logged, counted, replaced; the buckets start full.
    path.write_bytes(b"not a database" * 100)
    broken = started()
    assert (
        'meshfn_qos_global_errors_total{reason="state"} 1.0'
        in generate_latest(broken.registry).decode()
    )
    assert broken.decide(request("globex"), EDGE).statuses[0].limit_remaining == 19
    await broken.flush()
    assert started().decide(request("globex"), EDGE).statuses[0].limit_remaining == 18
