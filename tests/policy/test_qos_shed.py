"""QoS priority shedding at the gateway (QoSPolicy.spec.gatewayShedding) without processes:
the thresholds derived from maxConcurrency, the backend's shedding point and the number of
gateways; the priority routes matched on the verified payload only; the shed reply; the
contradictory settings as file:line errors; Istio's warning; the audit-record counts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from meshfn import ir
from meshfn.contracts.qos import SHED_FLOOR, TENANT_HEADER, shed_threshold
from meshfn.health.drift import watched_routes
from meshfn.istio import render
from meshfn.policy import PolicyErrors, load_policies
from meshfn.testing.policies import qos_examples
from meshfn.xds.translate import OFFLINE_HOST, translate

from .test_qos import _edge

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "qos-shed" / "in.yaml"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTES = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ENDPOINTS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def _load(tmp_path: Path, text: str) -> ir.MeshModel:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "in.yaml").write_text(text)
    return load_policies(tmp_path)


def _errors(tmp_path: Path, text: str) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "in.yaml").write_text(text)
    with pytest.raises(PolicyErrors) as caught:
        load_policies(tmp_path)
    return [str(e).split("in.yaml:", 1)[-1] for e in caught.value.errors]


@pytest.fixture(scope="module")
def model() -> ir.MeshModel:
    return load_policies(GOLDEN)


def _thresholds(cluster: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {
        t.get("priority", "DEFAULT"): (t["maxRequests"], t["maxPendingRequests"])
        for t in cluster["circuitBreakers"]["thresholds"]
    }


def test_thresholds_follow_the_backends_shedding_point(model: ir.MeshModel) -> None:
    assert shed_threshold(2, 3, 16) == int(16 * SHED_FLOOR) == 8  # the lowest priority
    clusters = _edge(model)[CLUSTER]
    # The backend's cluster (every route to it) and iris's twin (its REST routes): DEFAULT
    # admits half of maxConcurrency 16, HIGH all of it.
    for name in ("models.default", "fn|iris|models.default"):
        assert _thresholds(clusters[name]) == {"DEFAULT": (8, 8), "HIGH": (16, 16)}, name
    # The twin reads the backend cluster's EDS resource: the same endpoints, one assignment.
    twin = clusters["fn|iris|models.default"]
    assert twin["edsClusterConfig"]["serviceName"] == "models.default"
    assert set(_edge(model)[ENDPOINTS]) == {"models.default"}


def test_two_gateways_share_the_backend(tmp_path: Path) -> None:
    text = GOLDEN.read_text().replace("gatewayShedding: {}", "gatewayShedding: {gateways: 3}")
    clusters = _edge(_load(tmp_path, text))[CLUSTER]
    assert _thresholds(clusters["fn|iris|models.default"]) == {
        "DEFAULT": (2, 2),
        "HIGH": (6, 6),
    }


def test_priority_routes_match_the_verified_payload_only(model: ir.MeshModel) -> None:
    edge = _edge(model)
    (config,) = edge[ROUTES].values()
    routes = {r["name"]: r for vh in config["virtualHosts"] for r in vh["routes"]}
    high = routes["default/function-iris/1|high"]
    other = routes["default/function-iris/1"]
    assert high["route"]["cluster"] == other["route"]["cluster"] == "fn|iris|models.default"
    assert high["route"]["priority"] == "HIGH" and "priority" not in other["route"]  # DEFAULT
    (matcher,) = high["match"]["dynamicMetadata"]
    assert matcher["filter"] == "envoy.filters.http.jwt_authn"
    assert matcher["path"] == [{"key": "payload"}, {"key": "org"}]
    assert matcher["value"] == {"stringMatch": {"exact": "acme"}}
    # No route reads a tenant from a header a client could send.
    assert TENANT_HEADER not in json.dumps(config)
    meta = high["metadata"]["filterMetadata"]["meshfn"]
    assert (meta["qos_class"], meta["qos_priority"]) == ("premium", "HIGH")
    meta = other["metadata"]["filterMetadata"]["meshfn"]
    assert (meta["qos_class"], meta["qos_priority"]) == ("standard,batch", "DEFAULT")
    # jwt_authn re-matches the route once it wrote the payload.
    # (and the internal listener where a split gateway traces, without filters)
    (listener,) = [lst for lst in edge[LISTENER].values() if "internalListener" not in lst]
    manager = listener["filterChains"][0]["filters"][0]["typedConfig"]
    (jwt,) = [f for f in manager["httpFilters"] if f["name"] == "envoy.filters.http.jwt_authn"]
    assert all(p["clearRouteCache"] for p in jwt["typedConfig"]["providers"].values())
    # No rate in the policy: no rate limit filter, but the shed replies.
    assert not any("local_ratelimit" in f["name"] for f in manager["httpFilters"])
    mappers = manager["localReplyConfig"]["mappers"]
    # (the shed replies, and on OpenAI's paths the plain one's twin in OpenAI's shape)
    *twins, grpc, plain = [m for m in mappers if "UO" in json.dumps(m["filter"])]
    (twin,) = twins
    assert twin["bodyFormatOverride"]["jsonFormat"]["error"]["type"] == "rate_limit_error"
    assert twin["bodyFormatOverride"]["jsonFormat"]["error"]["limit"] == "shed"
    for mapper in (grpc, plain):
        assert mapper["statusCode"] == 429
        body = mapper["bodyFormatOverride"]["jsonFormat"]
        assert (body["limit"], body["scope"]) == ("shed", "gateway")
        assert body["tenant"] == "%DYNAMIC_METADATA(envoy.filters.http.jwt_authn:payload:org)%"
        added = {h["header"]["key"]: h["header"]["value"] for h in mapper["headersToAdd"]}
        assert added["x-meshfn-qos-limit"] == "shed" and added["retry-after"] == "1"
    assert plain["filter"] == {"responseFlagFilter": {"flags": ["UO"]}}
    assert {h["header"]["key"]: h["header"]["value"] for h in grpc["headersToAdd"]}[
        "grpc-status"
    ] == "8"  # RESOURCE_EXHAUSTED


def test_default_class_on_top_lists_the_lower_tenants(tmp_path: Path) -> None:
    text = GOLDEN.read_text().replace("defaultClass: standard", "defaultClass: premium")
    text = text.replace("{name: premium, priority: 100}", "{name: premium, priority: 100}\n"
                        "    - {name: spare, priority: 100}")  # fmt: skip
    model = _load(tmp_path, text)
    (config,) = _edge(model)[ROUTES].values()
    routes = {r["name"]: r for vh in config["virtualHosts"] for r in vh["routes"]}
    listed = routes["default/function-iris/1|default"]
    assert "priority" not in listed["route"]  # DEFAULT: initech (batch), listed
    (matcher,) = listed["match"]["dynamicMetadata"]
    assert matcher["value"] == {"stringMatch": {"exact": "initech"}}
    assert routes["default/function-iris/1"]["route"]["priority"] == "HIGH"
    meta = routes["default/function-iris/1"]["metadata"]["filterMetadata"]["meshfn"]
    assert meta["qos_class"] == "premium,spare"


def test_several_listed_tenants_or_match(tmp_path: Path) -> None:
    text = GOLDEN.read_text().replace(
        "    - {name: acme, class: premium}", "    - {name: acme, class: premium}\n"
        "    - {name: umbrella, class: premium}"
    )  # fmt: skip
    (config,) = _edge(_load(tmp_path, text))[ROUTES].values()
    routes = {r["name"]: r for vh in config["virtualHosts"] for r in vh["routes"]}
    (matcher,) = routes["default/function-iris/1|high"]["match"]["dynamicMetadata"]
    assert matcher["value"] == {
        "orMatch": {
            "valueMatchers": [
                {"stringMatch": {"exact": "acme"}},
                {"stringMatch": {"exact": "umbrella"}},
            ]
        }
    }


BAD = [
    (
        ("    - {name: batch, priority: 0}", "    - {name: batch, priority: 100}"),
        (
            "    - {name: standard, priority: 10}",
            "    - {name: standard, priority: 100, rate: {requests: 5}}",
        ),
        "42: spec.gatewayShedding: every class has priority 100: no class to shed first",
    ),
    (
        ("    - {name: acme, class: premium}\n", ""),
        None,
        "42: spec.gatewayShedding: no listed tenant is in the top priority (premium): every "
        "request would route with one priority (the default class 'standard''s), so the gateway "
        "would shed all or none",
    ),
    (
        ("gatewayShedding: {}", "gatewayShedding: {gateways: 9}"),
        ("maxConcurrency: 16", "maxConcurrency: 16"),
        "42: spec.gatewayShedding: Function iris sheds its lower priorities from 8 requests in "
        "flight, fewer than the 9 gateways sharing its backend default/models: each gateway "
        "would shed every DEFAULT request (raise its maxConcurrency)",
    ),
    (
        ("gatewayShedding: {}", "gatewayShedding: {gateways: 0}"),
        None,
        "42: spec.gatewayShedding.gateways: Input should be greater than or equal to 1",
    ),
]


@pytest.mark.parametrize(("edit", "more", "expected"), BAD)
def test_contradictory_settings_are_file_line_errors(
    tmp_path: Path, edit: tuple[str, str], more: tuple[str, str] | None, expected: str
) -> None:
    text = GOLDEN.read_text()
    for old, new in (edit, more) if more else (edit,):
        assert old in text
        text = text.replace(old, new)
    assert _errors(tmp_path, text) == [expected]


def test_fallback_breakers_below_the_threshold(tmp_path: Path) -> None:
    fallback = (
        "\n---\napiVersion: meshfn.io/v1alpha1\nkind: FallbackPolicy\nmetadata: {name: fb}\n"
        "spec:\n  service: models\n  circuitBreakers: {maxRequests: 4}\n"
    )
    assert _errors(tmp_path, GOLDEN.read_text() + fallback) == [
        "42: spec.gatewayShedding: the backend default/models's FallbackPolicy admits at most 4 "
        "requests (circuitBreakers), below the 8 lower-priority requests each gateway admits "
        "before it sheds: the gateway would never shed by priority; raise circuitBreakers or "
        "drop gatewayShedding"
    ]
    # Above it: the FallbackPolicy's limit bounds HIGH too.
    roomy = fallback.replace("maxRequests: 4", "maxRequests: 12")
    clusters = _edge(_load(tmp_path / "ok", GOLDEN.read_text() + roomy))[CLUSTER]
    assert _thresholds(clusters["fn|iris|models.default"]) == {
        "DEFAULT": (8, 8),
        "HIGH": (12, 12),
    }


def test_the_drift_breaker_watches_the_twins(tmp_path: Path) -> None:
    """A shedding gateway sends a Function's REST calls through its twin clusters: the drift
    breaker must read their latencies too, or it is blind to every such call (the examples
    with the tenant policy: models has a drift breaker, iris is one of its Functions)."""
    root = Path(__file__).resolve().parents[2] / "policies"
    qos_examples(root / "examples", root / "qos" / "tenants.yaml", tmp_path / "examples")
    model = load_policies(tmp_path / "examples")
    gateway = next(w for w in model.workloads if w.kind == "gateway")
    out = translate(model, f"{gateway.name}.{gateway.namespace}", host=OFFLINE_HOST)
    assert out is not None
    clusters = set(out[CLUSTER])
    twins = {c for c in clusters if c.startswith("fn|iris|models.default")}
    assert twins, sorted(clusters)
    watched = {w.route: w.primary_clusters for w in watched_routes(model)}
    iris = next(c for r, c in watched.items() if r.endswith("/function-iris"))
    assert twins <= iris and "models.default" in iris


def test_shedding_needs_a_function(tmp_path: Path) -> None:
    text = GOLDEN.read_text()
    start = text.index("apiVersion: meshfn.io/v1alpha1\nkind: Function")
    end = text.index("---\n", start) + 4
    route = (
        "apiVersion: meshfn.io/v1alpha1\nkind: Route\nmetadata: {name: r}\n"
        "spec: {gateway: edge, matches: [{path: {prefix: /}}], destination: {service: models}}\n"
        "---\n"
    )
    found = _errors(tmp_path, text[:start] + route + text[end:])
    assert found == [
        "42: spec.gatewayShedding: binds no Function (nor a Gateway serving one): the "
        "gateway's thresholds come from the functions' maxConcurrency"
    ]


def test_istio_warns_that_it_cannot_shed_by_priority(model: ir.MeshModel) -> None:
    names = ("audit", "degrade", "meshfn")  # meshfn: the model router (OpenAI routes)
    digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in names}
    rendered = render(model, digests)
    codes = {(w.code, w.source.name, w.path) for w in rendered.warnings}
    assert ("qos-gateway-shedding", "tenants", ("spec", "gatewayShedding")) in codes
    # One DestinationRule limit per cluster is all Istio has: no per-priority thresholds.
    assert "HIGH" not in json.dumps(rendered.objects["DestinationRule"])


def test_the_drift_breaker_also_degrades_the_priority_twins(model: ir.MeshModel) -> None:
    from meshfn.xds.fragments.plugins import guarded_routes

    gateway = next(w for w in model.workloads if w.kind == "gateway")
    (listener,) = gateway.listeners
    route = next(r for r in listener.routes if r.function == "iris")
    ((key, names),) = guarded_routes(listener, frozenset({route.key}), gateway.qos)
    assert key == route.key
    assert {"default/function-iris/1", "default/function-iris/1|high"} <= set(names)


GRPC_GOLDEN = GOLDEN.parents[1] / "qos-shed-grpc" / "in.yaml"
EXTENSION = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"


def _router(edge: dict[str, Any]) -> dict[str, Any] | None:
    """The gateway's model router settings (its meshfn plugin's `route` part), if any."""
    for config in edge.get(EXTENSION, {}).values():
        value = config["typedConfig"]["config"]["configuration"]["value"]
        route: dict[str, Any] | None = json.loads(value).get("route")
        if route is not None:
            return route
    return None


def test_grpc_calls_reach_each_functions_own_breakers() -> None:
    """A backend that also serves gRPC, and a large Function (tiny-lm, maxConcurrency 64)
    beside iris: the backend's own cluster admits the sum over both (8 + 32 DEFAULT), so a burst
    of iris calls there would pass the gateway and be shed by the backend. Each Function's
    unary gRPC calls therefore have routes of their own (both priorities) to its own cluster,
    chosen by the model the model router read from the message; everything else gRPC (streams)
    keeps the backend's cluster."""
    edge = _edge(load_policies(GRPC_GOLDEN))
    clusters = edge[CLUSTER]
    assert _thresholds(clusters["models.default"]) == {"DEFAULT": (40, 40), "HIGH": (80, 80)}
    assert _thresholds(clusters["fn|iris|models.default"]) == {"DEFAULT": (8, 8), "HIGH": (16, 16)}
    (config,) = edge[ROUTES].values()
    routes = {r["name"]: r for vh in config["virtualHosts"] for r in vh["routes"]}
    order = list(routes)
    for name in ("iris", "tiny-lm"):
        high, other = routes[f"default/grpc-{name}/0|high"], routes[f"default/grpc-{name}/0"]
        assert high["route"]["cluster"] == other["route"]["cluster"] == f"fn|{name}|models.default"
        assert high["route"]["priority"] == "HIGH" and "priority" not in other["route"]
        assert other["match"]["path"] == "/inference.GRPCInferenceService/ModelInfer"
        headers = {h["name"]: h["stringMatch"] for h in other["match"]["headers"]}
        assert headers == {"content-type": {"prefix": "application/grpc"},
                           "x-meshfn-model": {"exact": name}}  # fmt: skip
        # before the backend's own gRPC route, which takes what the router did not route
        assert order.index(other["name"]) < order.index("default/kserve-grpc/0")
    assert routes["default/kserve-grpc/0"]["route"]["cluster"] == "models.default"
    router = _router(edge)
    assert router is not None
    assert router["grpc"] == {
        "paths": ["/inference.GRPCInferenceService/ModelInfer"],
        "models": ["iris", "tiny-lm"],
    }
    # the router's header comes only from the router: the listener strips clients' copies
    assert "x-meshfn-model" in json.dumps(edge[LISTENER])


def test_without_gateway_shedding_grpc_is_not_routed_by_model(tmp_path: Path) -> None:
    text = GRPC_GOLDEN.read_text().replace("  gatewayShedding: {}\n", "")
    edge = _edge(_load(tmp_path, text))
    (config,) = edge[ROUTES].values()
    names = [r["name"] for vh in config["virtualHosts"] for r in vh["routes"]]
    assert not [n for n in names if "/grpc-" in n]
    assert "default/kserve-grpc/0" in names
    router = _router(edge)
    assert router is not None and "grpc" not in router  # OpenAI's routes only
