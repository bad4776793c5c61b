"""Multi-tenant QoS through the real mesh (`meshfn up` on policies/examples plus
policies/qos/tenants.yaml): the edge gateway's Envoy limits each verified tenant's rate with its
local rate limit filter, the inference backend behind the sidecars sheds the lowest priority
at saturation and attributes guest CPU time to tenants. Tenants come only from verified
tokens: a spoofed x-meshfn-tenant changes nothing, a token without the claim is the default
class. Over KServe gRPC the same: RESOURCE_EXHAUSTED from the gateway's rate limit and from the
backend's shedding, spoofed tenant metadata ignored."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from meshfn_e2e import EXAMPLES, Processes, admin_get, http
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from meshfn.common.unix import UnixHTTPConnection, unix_request
from meshfn.contracts.qos import ORCA_HEADER, ORCA_HEADERS, TENANT_HEADER
from meshfn.control_plane.runtime.upstreams import backend_socket
from meshfn.testing.envoy import admin_json, admin_request, admin_socket
from meshfn.testing.policies import qos_examples, set_gateway_shedding
from meshfn.testing.processes import issue_token, meshfn, up_with_functions, wait_for

TENANTS = Path(__file__).resolve().parents[1] / "policies" / "qos" / "tenants.yaml"
GLOBEX_RATE, GLOBEX_BURST = 20, 20  # TENANTS: globex's rate
IRIS = "/v2/models/iris/infer"
BODY = json.dumps(
    {
        "inputs": [
            {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}
        ]
    }
).encode()


@dataclass
class Mesh:
    gateway: str
    admin: str  # the control plane's admin URL
    backends: list[Path]  # each inference backend serving iris: its unix socket (/metrics)
    state: Path
    policies: Path
    gateway_admin: Path  # the gateway Envoy's admin socket

    def token(self, tenant: str | None, sub: str = "alice") -> str:
        return issue_token(self.state, sub, tenant)

    def infer(self, bearer: str | None, **headers: str) -> Any:
        if bearer is not None:
            headers["authorization"] = f"Bearer {bearer}"
        headers["content-type"] = "application/json"
        return http(f"http://{self.gateway}{IRIS}", "POST", headers, BODY)

    def metric(self, name: str, **labels: str) -> float:
        """The sum over both backends of `name` series whose labels include `labels`."""
        total = 0.0
        for backend in self.backends:
            status, body = unix_request(backend, "/metrics")
            assert status == 200, body[:200]
            text = body.decode()
            for line in text.splitlines():
                match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
                if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
                    total += float(match.group(2))
        return total


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("qos")
    procs = Processes(tmp)
    policies = tmp / "examples"
    mapping = qos_examples(EXAMPLES, TENANTS, policies, audit_gateway=True, gateway_shedding=False)
    # Without the examples' drift breaker: at saturation it moved iris's REST routes to
    # models-lite (its gRPC route, one for every model, stays), so a saturating burst and the
    # calls it should shed could reach different backends. It has its own tests (test_fallback).
    fallback = policies / "fallback.yaml"
    text = fallback.read_text()
    drift = next(line for line in text.splitlines(keepends=True) if "driftBreaker:" in line)
    fallback.write_text(text.replace(drift, ""))
    state = tmp / "state"
    try:
        up = procs.start("up", up_with_functions(policies, state, tmp / "functions"))
        wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
        result = Mesh(
            f"127.0.0.1:{mapping[10000]}",
            f"http://127.0.0.1:{mapping[18001]}",
            # models' two endpoints and models-lite (its drift fallback) serve iris
            [backend_socket(state, "127.0.0.1", mapping[port]) for port in (9101, 9102, 9103)],
            state,
            policies,
            admin_socket(state, "edge.ingress"),
        )
        acme = result.token("acme")
        wait_for("iris through the mesh", lambda: result.infer(acme).status == 200, timeout=60)
        yield result
    finally:
        procs.stop_all()


async def _burst(url: str, headers: dict[str, str], count: int, connections: int) -> list[Any]:
    """`count` requests over `connections` connections at once: (status, headers, body)."""
    out: list[Any] = []
    queue = list(range(count))

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            queue.pop()
            async with session.post(url, data=BODY, headers=headers) as response:
                out.append((response.status, response.headers.copy(), await response.read()))

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(connections)))
    return out


def burst(
    mesh: Mesh, bearer: str | None, count: int, connections: int = 8, **extra: str
) -> list[Any]:
    headers = {"content-type": "application/json", **extra}
    if bearer is not None:
        headers["authorization"] = f"Bearer {bearer}"
    return asyncio.run(_burst(f"http://{mesh.gateway}{IRIS}", headers, count, connections))


def audited(mesh: Mesh, sub: str, status: str) -> list[dict[str, Any]]:
    """The audit trail's records of subject `sub` with `status` (the collector runs behind)."""
    found: list[dict[str, Any]] = []

    def query() -> bool:
        out = meshfn(
            "audit", "query", "--store", str(mesh.state / "audit" / "audit.db"), "--json",
            "--limit", "10000", "--subject-raw", sub, "--status", status,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        found[:] = [json.loads(line) for line in out.stdout.splitlines()]
        return bool(found)

    wait_for(f"audit records of {sub}", query, timeout=30)
    return found


def admitted_at_most(seconds: float) -> int:
    """What globex's bucket (TENANTS: 20 a second, a burst of 20; Envoy adds 20 at each 1 s
    tick of its own timer) admits at most in `seconds` from full: the burst, and 20 for each
    tick inside the interval (at most floor(seconds) + 1 of them)."""
    return GLOBEX_BURST + GLOBEX_RATE * (math.floor(seconds) + 1)


def test_rate_limit_per_verified_tenant(mesh: Mesh) -> None:
    globex = mesh.token("globex", sub="limited-globex")
    started = time.monotonic()
    replies = burst(mesh, globex, 60)
    took = time.monotonic() - started
    statuses = Counter(status for status, _, _ in replies)
    # The burst at least, and no more than the bucket allows in the burst's own duration.
    most = admitted_at_most(took)
    assert GLOBEX_BURST <= statuses[200] <= most, (statuses, took)
    assert statuses[429] >= 60 - most and statuses[429] > 0, (statuses, took)
    _, headers, body = next(r for r in replies if r[0] == 429)
    assert json.loads(body) == {
        "error": "rate limit exceeded", "limit": "rate", "scope": "gateway",
        "policy": "ingress/tenants", "tenant": "globex",
    }  # fmt: skip
    assert headers["Content-Type"] == "application/json"
    assert headers["retry-after"] == "1" and headers["x-meshfn-qos-limit"] == "rate"
    assert headers["x-ratelimit-limit"] == "20" and headers["x-ratelimit-remaining"] == "0"
    assert int(headers["x-ratelimit-reset"]) >= 0
    # Another tenant keeps its own bucket meanwhile.
    assert mesh.infer(mesh.token("acme")).status == 200
    # The audit trail says who was limited and why.
    records = audited(mesh, "limited-globex", "429")
    assert {(r["tenant"], r["qos_limit"]) for r in records} == {("globex", "rate")}


def test_spoofed_tenant_header_is_ignored(mesh: Mesh) -> None:
    globex, acme = mesh.token("globex"), mesh.token("acme")
    # globex claiming to be acme (premium, a burst of 2000): still limited as itself.
    spoofed = burst(mesh, globex, 60, **{TENANT_HEADER: "acme", "x-tenant": "acme"})
    limited = [json.loads(b) for s, _, b in spoofed if s == 429]
    assert len(limited) >= 20 and {b["tenant"] for b in limited} == {"globex"}, len(limited)
    # Someone else claiming to be the drained tenant: served as who the token says.
    before = mesh.metric("meshfn_qos_requests_total", tenant="initech")
    acme_before = mesh.metric("meshfn_qos_requests_total", tenant="acme", outcome="admitted")
    assert mesh.infer(acme, **{TENANT_HEADER: "globex"}).status == 200
    assert mesh.infer(acme, **{TENANT_HEADER: "initech"}).status == 200
    # The backend attributed both to acme: the sidecar replaced the header with the claim.
    assert mesh.metric("meshfn_qos_requests_total", tenant="initech") == before
    assert mesh.metric("meshfn_qos_requests_total", tenant="acme", outcome="admitted") == (
        acme_before + 2
    )
    # No token at all: the header buys nothing (the sidecar's tenant rule denies).
    assert mesh.infer(None, **{TENANT_HEADER: "acme"}).status == 403


def test_backend_load_reports_stay_inside_the_mesh(mesh: Mesh) -> None:
    """The backend reports its load (ORCA) on every answer for the gateway's balancer; the
    gateway's clients never see it."""
    connection = UnixHTTPConnection(mesh.backends[0], timeout=5)  # the backend, past its sidecar
    try:
        connection.request("POST", IRIS, BODY, {"content-type": "application/json"})
        direct = connection.getresponse()
        answer = direct.read()
    finally:
        connection.close()
    assert direct.status == 200, answer
    assert ORCA_HEADER in {name.lower() for name, _ in direct.getheaders()}
    through = mesh.infer(mesh.token("acme"))
    assert through.status == 200, through
    assert not {name.lower() for name in through.headers} & set(ORCA_HEADERS), through.headers
    # The gateway's weighted round robin (the default for a service serving Functions) weighs
    # the endpoints that served from their reports: Envoy parsed them (a host without a valid
    # report keeps the default weight, 1). The examples route through models' locality tiers.
    acme = mesh.token("acme")

    def weights() -> list[int] | None:
        burst(mesh, acme, 40, connections=4)
        clusters = admin_json(mesh.gateway_admin, "/clusters?format=json")
        served = [
            int(host.get("weight", 1))
            for cluster in clusters["cluster_statuses"]
            if cluster["name"].startswith("models.default")
            for host in cluster.get("host_statuses", [])
            if any(s["name"] == "rq_total" and int(s.get("value", 0)) for s in host["stats"])
        ]
        return served if served and min(served) > 1 else None

    wait_for("weights from the backends' load reports", weights, timeout=30, every=0.5)


def test_token_without_the_claim_is_the_default_class(mesh: Mesh) -> None:
    # standard: 50 per second with a burst of 100, one bucket for every claim-less request.
    replies = burst(mesh, mesh.token(None), 400, connections=16)
    limited = [json.loads(body) for status, _, body in replies if status == 429]
    assert len(limited) >= 100, Counter(s for s, _, _ in replies)
    assert {(b["limit"], b["policy"]) for b in limited} == {("rate", "ingress/tenants")}
    assert {b["tenant"] for b in limited} <= {None, "", "-"}
    # Those admitted passed the gateway and met the sidecar's tenant rule: 403, never a 200.
    assert {s for s, _, _ in replies} <= {403, 429}
    # An unlisted tenant: the default class too, in a bucket of its own.
    hooli = burst(mesh, mesh.token("hooli"), 400, connections=16)
    assert Counter(s for s, _, _ in hooli)[429] >= 100
    assert {json.loads(b)["tenant"] for s, _, b in hooli if s == 429} == {"hooli"}


def test_backend_sheds_the_lowest_priority_first(mesh: Mesh) -> None:
    initech, acme = mesh.token("initech", sub="low-initech"), mesh.token("acme")

    async def both() -> tuple[list[Any], list[Any]]:
        url = f"http://{mesh.gateway}{IRIS}"
        low = asyncio.create_task(
            _burst(
                url,
                {"authorization": f"Bearer {initech}", "content-type": "application/json"},
                1500,
                40,
            )
        )
        await asyncio.sleep(0.3)
        high = await _burst(
            url, {"authorization": f"Bearer {acme}", "content-type": "application/json"}, 150, 2
        )
        return await low, high

    low, high = asyncio.run(both())
    shed = [json.loads(b) for s, h, b in low if s == 429]
    assert shed, Counter(s for s, _, _ in low)
    assert {(b["limit"], b["class"], b["tenant"], b["scope"]) for b in shed} == {
        ("shed", "batch", "initech", "backend")
    }
    assert {s for s, _, _ in high} == {200}, Counter(s for s, _, _ in high)  # premium kept
    assert mesh.metric("meshfn_qos_requests_total", tenant="initech", outcome="shed") >= len(shed)
    assert mesh.metric("meshfn_qos_requests_total", tenant="acme", outcome="shed") == 0
    # Guest CPU time attributed per tenant (batched calls split by rows), and budget use.
    assert mesh.metric("meshfn_qos_guest_cpu_seconds_total", tenant="initech") > 0
    assert mesh.metric("meshfn_qos_budget_used_ms", tenant="initech", window="minute") > 0
    records = audited(mesh, "low-initech", "429")
    assert {(r["tenant"], r["qos_limit"]) for r in records} == {("initech", "shed")}
    # meshfn status shows the same per tenant (each backend's own counts).
    out = meshfn("status", "--state-dir", str(mesh.state))
    assert out.returncode == 0, out.stderr
    assert "multi-tenant QoS" in out.stdout
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in out.stdout.splitlines()
        if line.count("│") == 11
    ]
    # backend, function, tenant, class, admitted, limited, shed, guest CPU ms, budget used,
    # tokens
    shed_rows = [r for r in rows if r[2:4] == ["initech", "batch"] and r[6] != "0"]
    assert shed_rows and all(int(r[4]) > 0 for r in shed_rows), out.stdout
    assert all(r[6] == "0" for r in rows if r[2] == "acme"), out.stdout


def _grpc_infer(
    mesh: Mesh, bearer: str, attempts: int = 1, **headers: str
) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """KServe gRPC ModelInfer of iris through the gateway, on one channel, until a call fails
    or `attempts` succeeded: (code, details, trailers) of the failure, else OK."""
    request = service_pb2.ModelInferRequest(model_name="iris")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([5.1, 3.5, 1.4, 0.2])
    metadata = [("authorization", f"Bearer {bearer}"), *headers.items()]
    with grpc.insecure_channel(mesh.gateway) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(attempts):
            try:
                stub.ModelInfer(request, metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                trailers = {k: str(v) for k, v in exc.trailing_metadata() or ()}  # type: ignore[attr-defined]
                return exc.code(), exc.details() or "", trailers  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, "", {}


def test_grpc_rate_limit_and_spoofing(mesh: Mesh) -> None:
    """The same limits over KServe gRPC (tritonclient): the gateway's rate limit answers
    RESOURCE_EXHAUSTED (not Envoy's default UNAVAILABLE), and tenant metadata a client sends is
    ignored as the header is over HTTP/1."""
    client = tgrpc.InferenceServerClient(mesh.gateway)
    tensor = tgrpc.InferInput("features", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32))
    globex = mesh.token("globex", sub="grpc-globex")
    time.sleep(1.1)  # globex's bucket (20/s, burst 20) full again after the tests before
    codes: Counter[str] = Counter()
    details = []
    started = time.monotonic()
    for _ in range(60):
        spoofed = {"authorization": f"Bearer {globex}", TENANT_HEADER: "acme"}  # premium
        try:
            client.infer("iris", [tensor], headers=spoofed)
            codes["OK"] += 1
        except InferenceServerException as exc:
            codes[str(exc.status())] += 1
            details.append(exc.message())
    took = time.monotonic() - started
    assert set(codes) == {"OK", "StatusCode.RESOURCE_EXHAUSTED"}, codes
    # the burst at least, no more than the bucket allows in the calls' own duration
    most = admitted_at_most(took)
    assert GLOBEX_BURST <= codes["OK"] <= most, (codes, took)
    assert codes["StatusCode.RESOURCE_EXHAUSTED"] >= 60 - most, (codes, took)
    # The details are the JSON body REST clients get: the limit, the policy and who (globex,
    # from the token, not the metadata it sent).
    body = json.loads(details[-1])
    assert (body["limit"], body["policy"], body["tenant"]) == ("rate", "ingress/tenants", "globex")
    # on a channel of its own, until refused: a token refills every 50 ms, and a loaded machine
    # can take that long to open the channel, so its first call may be admitted
    code, _, trailers = _grpc_infer(mesh, globex, attempts=40)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailers["x-meshfn-qos-limit"] == "rate" and int(trailers["retry-after"]) >= 1
    # A spoofed tenant reaches the backend as the token's: acme, whatever the metadata says.
    acme = mesh.token("acme")
    before = mesh.metric("meshfn_qos_requests_total", tenant="initech")
    acme_before = mesh.metric("meshfn_qos_requests_total", tenant="acme", outcome="admitted")
    assert _grpc_infer(mesh, acme, **{TENANT_HEADER: "initech"})[0] == grpc.StatusCode.OK
    assert mesh.metric("meshfn_qos_requests_total", tenant="initech") == before
    assert mesh.metric("meshfn_qos_requests_total", tenant="acme", outcome="admitted") == (
        acme_before + 1
    )


async def _grpc_burst(
    target: str, bearer: str, count: int, concurrency: int
) -> list[tuple[grpc.StatusCode, str, dict[str, str]]]:
    """`count` KServe gRPC ModelInfer calls of iris, `concurrency` at once on one channel (HTTP/2
    multiplexes them): (code, details, trailers) of each."""
    request = service_pb2.ModelInferRequest(model_name="iris")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([5.1, 3.5, 1.4, 0.2])
    metadata = (("authorization", f"Bearer {bearer}"),)
    out: list[tuple[grpc.StatusCode, str, dict[str, str]]] = []
    queue = list(range(count))
    async with grpc.aio.insecure_channel(target) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )

        async def worker() -> None:
            while queue:
                queue.pop()
                call = infer(request, metadata=metadata, timeout=10)
                try:
                    await call
                except grpc.aio.AioRpcError as exc:
                    trailers = {k: str(v) for k, v in exc.trailing_metadata() or ()}
                    out.append((exc.code(), exc.details() or "", trailers))
                else:
                    out.append((grpc.StatusCode.OK, "", {}))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def test_grpc_backend_admission_is_resource_exhausted(mesh: Mesh) -> None:
    """At saturation the backend sheds the lowest priority over gRPC as over REST: initech's
    gRPC calls are refused RESOURCE_EXHAUSTED with the QoS trailers, acme's are served."""
    initech, acme = mesh.token("initech", sub="grpc-initech"), mesh.token("acme")
    url = f"http://{mesh.gateway}{IRIS}"
    headers = {"authorization": f"Bearer {initech}", "content-type": "application/json"}

    async def together() -> tuple[list[Any], list[Any], list[Any]]:
        # The load is REST (a Python gRPC client alone does not saturate iris); the gRPC calls
        # run in the same event loop, several at once, while it saturates the backend.
        rest = asyncio.create_task(_burst(url, headers, 1500, 40))
        await asyncio.sleep(0.1)
        low = asyncio.create_task(_grpc_burst(mesh.gateway, initech, 300, 8))
        high = await _grpc_burst(mesh.gateway, acme, 100, 2)
        return await rest, await low, high

    statuses = Counter[int]()
    low: list[Any] = []
    high: list[Any] = []
    for _ in range(3):  # a burst may miss the saturated moment on a busy machine
        more_rest, more_low, more_high = asyncio.run(together())
        statuses.update(s for s, _, _ in more_rest)
        low += more_low
        high += more_high
        if any(code != grpc.StatusCode.OK for code, _, _ in more_low):
            break
    assert statuses[429], statuses  # it saturated
    refused = [(code, trailers) for code, _, trailers in low if code != grpc.StatusCode.OK]
    assert refused, "no gRPC call of the lowest priority was shed at saturation"
    assert {code for code, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
    assert {t.get("x-meshfn-qos-limit") for _, t in refused} == {"shed"}, refused
    assert all(int(t["retry-after"]) >= 1 for _, t in refused)
    assert {code for code, _, _ in high} == {grpc.StatusCode.OK}, Counter(c for c, _, _ in high)


def test_gateway_sheds_the_lower_priorities_before_the_backend(mesh: Mesh) -> None:
    """Gateway shedding (last: it reloads the policy with gatewayShedding on): at saturation
    the gateway itself refuses the lower classes once half of iris's maxConcurrency of them is
    in flight (the backend never sees those), with the backend's shed reply; premium routes
    with Envoy's HIGH priority and is served. A client's tenant header cannot pick the HIGH
    route: the route matches jwt_authn's verified payload."""
    set_gateway_shedding(mesh.policies / TENANTS.name, True)

    def routes_by_priority() -> bool:
        dump = admin_request(mesh.gateway_admin, "/config_dump?resource=dynamic_route_configs")
        return b'"priority": "HIGH"' in dump

    wait_for("the gateway's priority routes", routes_by_priority, timeout=30)
    initech, acme = mesh.token("initech", sub="gw-initech"), mesh.token("acme")

    def seen(tenant: str) -> float:
        return sum(
            mesh.metric("meshfn_qos_requests_total", tenant=tenant, outcome=outcome)
            for outcome in ("admitted", "limited", "shed")
        )

    before = seen("initech")
    spoofed = {TENANT_HEADER: "acme", "x-tenant": "acme"}  # premium's name: ignored

    async def both() -> tuple[list[Any], list[Any]]:
        url = f"http://{mesh.gateway}{IRIS}"
        low_headers = {"authorization": f"Bearer {initech}", "content-type": "application/json"}
        low = asyncio.create_task(_burst(url, {**low_headers, **spoofed}, 600, 40))
        await asyncio.sleep(0.3)
        high = await _burst(
            url, {"authorization": f"Bearer {acme}", "content-type": "application/json"}, 100, 2
        )
        return await low, high

    low, high = asyncio.run(both())
    assert {s for s, _, _ in high} == {200}, Counter(s for s, _, _ in high)  # premium kept
    refused = [(h, json.loads(b)) for s, h, b in low if s == 429]
    at_gateway = [(h, b) for h, b in refused if b["scope"] == "gateway"]
    assert at_gateway, Counter(
        (s, json.loads(b).get("scope") if s == 429 else "") for s, _, b in low
    )
    assert {
        (b["limit"], b["policy"], b["tenant"], b["class"], b["priority"]) for _, b in at_gateway
    } == {("shed", "ingress/tenants", "initech", "standard,batch", "DEFAULT")}
    assert all(h["x-meshfn-qos-limit"] == "shed" and h["retry-after"] == "1" for h, _ in at_gateway)
    # The backends counted every initech request but those the gateway shed: those never
    # reached them (nor their sidecars).
    assert {s for s, _, _ in low} <= {200, 429}, Counter(s for s, _, _ in low)
    assert seen("initech") - before == len(low) - len(at_gateway)
    # The audit trail (the gateway's records) names the tenant and the limit.
    records = audited(mesh, "gw-initech", "429")
    assert {(r["tenant"], r["qos_limit"]) for r in records} == {("initech", "shed")}
    # Counted per class from those records: the control plane's /metrics and meshfn status.
    series = re.compile(
        r'^meshfn_qos_proxy_refusals_total\{class="batch",limit="shed",source="edge\.ingress",'
        r'tenant="initech"\} (\S+)$',
        re.M,
    )

    def counted() -> float:
        found = series.search(admin_get(mesh.admin, "/metrics", mesh.state).body.decode())
        return float(found.group(1)) if found else 0.0

    wait_for("the gateway's sheds in /metrics", lambda: counted() >= len(at_gateway), timeout=30)
    out = meshfn("status", "--state-dir", str(mesh.state))
    assert out.returncode == 0, out.stderr
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.stdout.splitlines()]
    assert any(r[:4] == ["edge.ingress", "initech", "batch", "shed"] for r in rows), out.stdout


def test_gateway_sheds_grpc_as_resource_exhausted(mesh: Mesh) -> None:
    """Gateway shedding over gRPC: the gateway's model router reads the model a ModelInfer
    call's message names, and iris's gRPC route sends it to iris's own cluster, whose DEFAULT
    circuit breaker (half of iris's maxConcurrency) sheds the lower classes at the gateway, as
    iris's REST routes do (the backend's own cluster admits the sum over all its functions,
    tiny-lm's 32 among them: a burst there would reach the backend); a shed call is
    RESOURCE_EXHAUSTED (what the backend's shed says, not the UNAVAILABLE Envoy derives from a
    429, which gRPC clients may retry at once) with the limit in its trailers and the JSON body
    as its message; premium calls are served throughout."""
    set_gateway_shedding(mesh.policies / TENANTS.name, True)  # on since the test above

    def routes_by_priority() -> bool:
        dump = admin_request(mesh.gateway_admin, "/config_dump?resource=dynamic_route_configs")
        return b'"priority": "HIGH"' in dump

    wait_for("the gateway's priority routes", routes_by_priority, timeout=30)
    initech, acme = mesh.token("initech", sub="gw-grpc-initech"), mesh.token("acme")

    async def both() -> tuple[list[Any], list[Any]]:
        low = asyncio.create_task(_grpc_burst(mesh.gateway, initech, 1500, 48))
        await asyncio.sleep(0.3)
        high = await _grpc_burst(mesh.gateway, acme, 100, 2)
        return await low, high

    low: list[Any] = []
    high: list[Any] = []
    for _ in range(5):  # a burst may miss the saturated moment on a busy machine
        more_low, more_high = asyncio.run(both())
        low += more_low
        high += more_high
        if any(d.startswith("{") for _, d, _ in more_low):  # shed at the gateway
            break
    assert {c for c, _, _ in high} == {grpc.StatusCode.OK}, Counter(c for c, _, _ in high)
    refused = [(d, t) for c, d, t in low if c != grpc.StatusCode.OK]
    assert refused, "no low-priority gRPC call was shed at saturation"
    assert {c for c, _, _ in low} == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, (
        Counter(c for c, _, _ in low)
    )
    # the gateway's message is its JSON body (the backend's, for what reached it, its text)
    at_gateway = [(json.loads(d), t) for d, t in refused if d.startswith("{")]
    assert all(b["scope"] == "gateway" for b, _ in at_gateway)
    assert at_gateway, Counter(d[:60] for d, _ in refused)
    assert {(b["limit"], b["tenant"], b["priority"]) for b, _ in at_gateway} == {
        ("shed", "initech", "DEFAULT")
    }
    assert all(t["x-meshfn-qos-limit"] == "shed" and t["retry-after"] == "1" for _, t in at_gateway)
    # The audit trail names the tenant and the limit. A gRPC reply's HTTP status is 200, with
    # RESOURCE_EXHAUSTED in grpc-status: the record's `status` is the 429 that stands for.
    refused_here: list[dict[str, Any]] = []

    def all_recorded() -> bool:  # the collector runs behind
        records = audited(mesh, "gw-grpc-initech", "429")
        refused_here[:] = [r for r in records if r["flags"] == "UO"]  # no upstream request made
        return len(refused_here) >= len(at_gateway)

    wait_for("the audit records of the gateway's gRPC sheds", all_recorded, timeout=30)
    assert len(refused_here) == len(at_gateway), (len(refused_here), len(at_gateway))
    assert {(r["tenant"], r["qos_limit"]) for r in refused_here} == {("initech", "shed")}
