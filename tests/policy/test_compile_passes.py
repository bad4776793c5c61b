"""The policy compiler's passes (meshfn.policy.compile), each on its own: its input is the stage
the passes before it produce from a small policy set, and the test checks what this pass adds.
The golden cases then check the whole pipeline (tests/xds/test_golden.py, policy -> IR)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest

from meshfn import ir
from meshfn.contracts.qos import FUNCTION_BACKEND_BALANCER
from meshfn.policy import kserve, qos
from meshfn.policy.compile import (
    assemble,
    fallback,
    functions,
    gateways,
    resolve,
    rollouts,
    security,
    shedding,
    sidecars,
    tracing,
)
from meshfn.policy.compile import qos as qos_pass
from meshfn.policy.compile.pipeline import compile_model
from meshfn.policy.errors import PolicyError
from meshfn.policy.loader import PolicyLoader, lowered
from meshfn.policy.references import check_references
from meshfn.policy.source import parse_documents
from meshfn.policy.validate import Loaded
from meshfn.testing.policies import (
    ISSUER,
    doc,
    documents,
    endpoint,
    gateway,
    mesh,
    route,
    service,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "in.yaml").exists())


def _items(*docs: str) -> list[Loaded]:
    """Validated and lowered objects, past the reference and QoS checks (what the compiler
    is given)."""
    items = []
    for document in parse_documents(documents(*docs), "in.yaml"):
        item = lowered(document)
        assert isinstance(item, Loaded), item
        items.append(item)
    assert check_references(items) == []
    assert qos.check(items) == []
    return items


def _function(name: str, backend: str, namespace: str | None = None, **spec: Any) -> str:
    return doc("Function", name, {"backend": backend, **spec}, namespace)


def _qos(
    name: str, targets: list[tuple[str, str]], namespace: str | None = None, **spec: Any
) -> str:
    """A QoSPolicy on `targets` ((kind, name) pairs), with two priorities."""
    refs = [{"kind": kind, "name": target} for kind, target in targets]
    classes = [{"name": "standard", "priority": 10}, {"name": "premium", "priority": 100}]
    spec = {"targetRefs": refs, "defaultClass": "standard", "classes": classes, **spec}
    return doc("QoSPolicy", name, spec, namespace)


def _tokens(namespace: str | None = None) -> str:
    """Every proxy of the namespace verifies `meshfn token issue`'s tokens."""
    rules = [{"issuer": ISSUER, "jwksUri": "http://127.0.0.1:8000/.well-known/jwks.json"}]
    return doc("RequestAuthentication", "tokens", {"jwtRules": rules}, namespace)


def _allow_all(name: str, selector: dict[str, str]) -> str:
    rules = [{"from": [{"source": {"principals": ["*"]}}]}]
    return doc("AuthorizationPolicy", name, {"selector": selector, "rules": rules})


def _until_served(items: list[Loaded]) -> rollouts.Rolled:
    """Every pass up to the gateways' (functions, then rollouts)."""
    served = functions.serve(qos_pass.bind(fallback.chain(security.secure(resolve.resolve(items)))))
    return rollouts.roll(served)


def test_resolve_looks_every_reference_up_once() -> None:
    items = _items(
        mesh("m", "m.local", audit={"tenantClaim": "org"}),
        gateway(None, 10000, name="edge", namespace="a"),
        gateway(None, 10001, name="edge", namespace="a-b"),
        service("llm", 9000, namespace="a"),
        route("first", "llm", "/one", namespace="a", gateway="a-b/edge"),
        _function("iris", "llm", "a", gateway="edge"),
        route("second", "llm", "/two", namespace="a", gateway="edge"),
        doc("FallbackPolicy", "llm", {"service": "llm", "chain": []}, "a"),
        _tokens("a"),
        _tokens("a-b"),
        _qos("per-gateway", [("Gateway", "a-b/edge")], "a"),
        _qos("own", [("Function", "iris")], "a", tenantClaim="team"),
    )
    resolved = resolve.resolve(items)
    # namespace/name keys in string order, as the gateways' workloads are listed
    assert list(resolved.gateways) == ["a-b/edge", "a/edge"]
    assert [(a.item.name, a.gateway) for a in resolved.attached] == [
        ("first", "a-b/edge"),
        ("iris", "a/edge"),
        ("second", "a/edge"),
    ]
    assert [i.name for i in resolved.service_items] == ["llm"]
    assert list(resolved.fallback) == ["a/llm"]
    bindings = resolved.bindings
    assert [p.name for p in bindings.policies] == ["own", "per-gateway"]
    assert {t: p.name for t, p in bindings.targets.items()} == {
        ("Gateway", "a-b/edge"): "per-gateway",
        ("Function", "a/iris"): "own",
    }
    assert {f: p.name for f, p in bindings.backends.items()} == {"a/iris": "own"}
    # its own claim, else the audit trail's
    assert bindings.claims == {"QoSPolicy a/own": "team", "QoSPolicy a/per-gateway": "org"}


def test_resolve_binds_a_function_without_a_policy_to_its_gateways() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("llm", 9000),
        _function("iris", "llm"),
        _tokens(),
        _qos("tenants", [("Gateway", "edge")]),
    )
    bindings = resolve.resolve(items).bindings
    assert {f: p.name for f, p in bindings.backends.items()} == {"default/iris": "tenants"}
    assert bindings.claims == {"QoSPolicy default/tenants": qos.DEFAULT_CLAIM}


def test_security_gives_identities_modes_and_what_each_workload_enforces() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000, serviceAccount="ingress"),
        service("llm", 9000, [endpoint(9001, sidecar=15001), endpoint(9002, sidecar=15002)]),
        service("cache", 9100, serviceAccount="shared"),
        doc(
            "PeerAuthentication",
            "llm",
            {
                "selector": {"service": "llm"},
                "mtls": {"mode": "STRICT"},
                "portLevelMtls": {"9002": {"mode": "PERMISSIVE"}},
            },
        ),
        _tokens(),
        _allow_all("from-edge", {"service": "llm"}),
    )
    resolved = resolve.resolve(items)
    secured = security.secure(resolved)
    assert isinstance(secured, resolve.Resolved)
    cache, llm = secured.services
    assert (cache.identity, llm.identity) == (
        "spiffe://m.local/ns/default/sa/shared",
        "spiffe://m.local/ns/default/sa/llm",
    )
    assert [e.mtls for e in llm.endpoints] == ["STRICT", "PERMISSIVE"]  # port level wins
    assert [e.mtls for e in cache.endpoints] == ["DISABLE"]  # no sidecar
    edge = secured.access[("gateway", "default/edge")]
    assert edge.identity == "spiffe://m.local/ns/default/sa/ingress"
    assert [r.issuer for r in edge.jwt_rules] == ["https://issuer.meshfn.local"]
    assert edge.authz == ()
    assert [p.name for p in secured.access[("service", "default/llm")].authz] == [
        "default/from-edge"
    ]
    assert secured.access[("service", "default/cache")].authz == ()
    assert [p.name for p in secured.written.authz] == ["from-edge"]
    assert [p.name for p in secured.written.peer] == ["llm"]
    # what the pass before produced is carried as it was
    assert secured.attached is resolved.attached and secured.bindings is resolved.bindings


def test_fallback_lowers_each_services_policy_onto_it() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        *(service(name, 9000 + i) for i, name in enumerate(("llm", "small", "canned", "other"))),
        doc(
            "FallbackPolicy",
            "llm",
            {
                "service": "llm",
                "chain": ["small"],
                "circuitBreakers": {"maxRequests": 7},
                "driftBreaker": {"threshold": 40},
            },
        ),
        doc("FallbackPolicy", "small", {"service": "small", "chain": ["canned"]}),
    )
    secured = security.secure(resolve.resolve(items))
    chained = fallback.chain(secured)
    by_key = {s.key: s for s in chained.services}
    llm = by_key["default/llm"]
    # the chain flattened depth first: the fallback's own chain follows it
    assert llm.fallback == ("default/small", "default/canned")
    assert llm.traffic is not None and llm.traffic.policy == "llm"
    assert llm.traffic.breakers is not None and llm.traffic.breakers.max_requests == 7
    assert llm.drift is not None and llm.drift.threshold_percent == 40
    assert by_key["default/small"].fallback == ("default/canned",)
    # a service without a policy, and the identities the security pass gave, are kept
    assert by_key["default/other"] == {s.key: s for s in secured.services}["default/other"]
    assert [s.identity for s in chained.services] == [s.identity for s in secured.services]


def test_qos_lowers_the_policies_and_binds_them() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("llm", 9000),
        route("chat", "llm", "/chat"),
        _function("iris", "llm"),
        _function("digits", "llm"),
        _tokens(),
        _qos("gateway", [("Gateway", "edge")], tenantClaim="org"),
        _qos("chat", [("Route", "chat")], tenantClaim="org"),
        _qos("iris", [("Function", "iris")], tenantClaim="org"),
    )
    chained = fallback.chain(security.secure(resolve.resolve(items)))
    bound = qos_pass.bind(chained)
    assert [p.name for p in bound.qos] == ["chat", "gateway", "iris"]
    assert {target: p.name for target, p in bound.bound.items()} == {
        ("Gateway", "default/edge"): "gateway",
        ("Route", "default/chat"): "chat",
        ("Function", "default/iris"): "iris",
    }
    assert bound.qos[0].claim == "org"
    # a Function's backend applies its own policy, else its gateway's
    assert {f: b.classes.policy for f, b in bound.backends.items()} == {
        "default/iris": "default/iris",
        "default/digits": "default/gateway",
    }
    assert bound.backends["default/iris"].classes.tenantClaim == "org"
    assert bound.services == chained.services


def test_functions_routes_guards_and_balancing() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("models", 9000, [endpoint(sidecar=15000)]),
        service("plain", 9100),
        route("chat", "plain", "/chat"),
        _function("iris", "models", repository={"callers": ["https://issuer.meshfn.local/ops"]}),
        route("later", "plain", "/later"),
        _tokens(),
        _qos("iris", [("Function", "iris")]),
    )
    served = _until_served(items)
    assert served.errors == ()
    (iris,) = served.functions
    assert iris.qos is not None and iris.qos.policy == "default/iris"
    routes = served.routes["default/edge"]
    # as written (a Function's own REST routes in its place), then the gateway's server routes
    # (and its OpenAI route, by the body's model), then the gateway's server routes
    assert [r.route.name for r in routes] == [
        "chat", "function-iris", "openai-iris", "later", "kserve-server", "openai-models",
    ]  # fmt: skip
    assert routes[1].route.qos is not None and routes[1].route.qos.name == "iris"
    assert routes[2].route.qos == routes[1].route.qos and routes[2].route.model == "iris"
    assert routes[1].route.timeout == iris.settings.limits.timeout + kserve.DEADLINE_MARGIN
    assert routes[1].route.idle_timeout is None  # not generative: the proxy's default
    assert [r.listener for r in routes] == [None] * 6
    # the backend has sidecars: they hold the repository guard, the gateway does not
    assert set(served.guards) == {("service", "default/models")}
    assert [o.name for o in served.guard_objects] == ["meshfn-kserve-repository-models"]
    # the first rule denies everyone: Triton's repository, and the backend's endpoints that
    # only `meshfn up` may read (the sidecar forwards to the socket it reads them on)
    (everyone_ops,) = served.guards[("service", "default/models")].rules[0].operations
    assert {"/meshfn/shadow", "/meshfn/spans", "/v2/repository/models/*"} <= set(everyone_ops.paths)
    assert everyone_ops.not_paths == ("/v2/repository/models/iris/*",)
    by_key = {s.key: s for s in served.services}
    assert by_key["default/models"].load_balancer == FUNCTION_BACKEND_BALANCER
    assert by_key["default/plain"].load_balancer is None
    assert served.tenant_claims == {"default/models": qos.DEFAULT_CLAIM}


def test_functions_without_sidecars_are_guarded_at_the_gateway() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("models", 9000),
        _function("iris", "models"),
    )
    served = _until_served(items)
    guard = served.guards[("gateway", "default/edge")]
    assert guard.action == "DENY" and guard.name == "default/meshfn-kserve-repository"
    assert [(o.selector, o.name) for o in served.guard_objects] == [
        (ir.Selector("gateway", "edge"), "meshfn-kserve-repository-edge")
    ]
    assert ("service", "default/models") in served.guards  # its (absent) sidecars' too
    assert served.tenant_claims == {}


def test_functions_on_one_gateway_share_one_backend() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("a", 9000),
        service("b", 9100),
        _function("iris", "a"),
        _function("digits", "b"),
    )
    served = _until_served(items)
    (error,) = served.errors
    assert "must share one backend: iris is served by default/a, digits by default/b" in str(error)
    assert [r.route.name for r in served.routes["default/edge"]] == [
        "function-iris",
        "openai-iris",
        "function-digits",
        "openai-digits",
    ]


def test_gateways_build_listeners_and_refuse_shadowed_routes() -> None:
    two_listeners = gateway(None, 10000).replace(
        "listeners: [{name: http, port: 10000}]",
        "listeners: [{name: http, port: 10000}, {name: admin, port: 10001}]",
    )
    items = _items(
        mesh("m", "m.local"),
        two_listeners,
        gateway(None, 10100, name="side"),
        service("llm", 9000),
        route("main", "llm", "/v1", gateway="edge"),
        route("ops", "llm", "/ops", gateway="edge", listener="admin"),
        route("copy", "llm", "/v1", gateway="edge"),
        route("side", "llm", "/v1", gateway="side"),
    )
    routed = gateways.route(_until_served(items))
    edge, side = routed.gateway_workloads
    assert (edge.name, side.name) == ("edge", "side")
    assert [(lst.name, [r.name for r in lst.routes]) for lst in edge.listeners] == [
        ("http", ["copy", "main"]),
        ("admin", ["copy", "main", "ops"]),
    ]
    # copy and main claim the same requests on each listener; side is another gateway
    assert len(routed.errors) == 2
    assert all("identical match to Route default/copy" in str(e) for e in routed.errors)
    assert routed.reach == {"default/llm": 2}


def test_gateway_workloads_enforce_what_security_and_functions_gave() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("models", 9000),
        _function("iris", "models"),
        _tokens(),
        _qos("gateway", [("Gateway", "edge")]),
    )
    served = _until_served(items)
    (edge,) = gateways.route(served).gateway_workloads
    access = served.access[("gateway", "default/edge")]
    assert edge.identity == access.identity and edge.jwt_rules == access.jwt_rules
    assert edge.authz == (*access.authz, served.guards[("gateway", "default/edge")])
    assert edge.qos is not None and edge.qos.name == "gateway"


def _shedding_set(*extra: str, gateways_given: int | None = None) -> list[Loaded]:
    shedding_spec: dict[str, Any] = {} if gateways_given is None else {"gateways": gateways_given}
    return _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        gateway(None, 10100, name="side"),
        service("models", 9000),
        _function("iris", "models", gateway="edge", limits={"maxConcurrency": 16}),
        route("direct", "models", "/direct", gateway="side"),
        _tokens(),
        _qos(
            "tenants",
            [("Gateway", "edge")],
            gatewayShedding=shedding_spec,
            tenants=[{"name": "acme", "class": "premium"}],
        ),
        *extra,
    )


def test_shedding_divides_the_backends_limits_among_the_gateways_reaching_it() -> None:
    routed = gateways.route(_until_served(_shedding_set()))
    assert routed.reach == {"default/models": 2}
    shed = shedding.shed(routed)
    assert isinstance(shed, shedding.Shed)
    models = {s.key: s for s in shed.services}["default/models"]
    # HIGH: all 16 of iris's maxConcurrency, DEFAULT: what the backend admits before shedding
    # (half of it), each divided between the two gateways
    assert models.shed == ir.PriorityLimits(high=8, default=4)
    assert models.function_shed == (("iris", ir.PriorityLimits(high=8, default=4)),)


def test_shedding_refuses_fewer_gateways_than_reach_the_backend() -> None:
    shed = shedding.shed(gateways.route(_until_served(_shedding_set(gateways_given=1))))
    assert isinstance(shed, list)
    (error,) = shed
    assert isinstance(error, PolicyError)
    assert "1 gateway(s), but 2 Gateways reach the backend default/models" in str(error)


def test_sidecars_one_workload_per_endpoint_with_a_sidecar() -> None:
    items = _items(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("models", 9000, [endpoint(9001, sidecar=15001), endpoint(9002, sidecar=15002)]),
        service("bare", 9050),
        service("plain", 9100, [endpoint(sidecar=15100)]),
        _function("iris", "models"),
        _tokens(),
        _qos("gateway", [("Gateway", "edge")], tenantClaim="org"),
    )
    shed = shedding.shed(gateways.route(_until_served(items)))
    assert isinstance(shed, shedding.Shed)
    complete = sidecars.place(shed)
    assert [
        (w.name, w.inbound and (w.inbound.port, w.inbound.app_port))
        for w in complete.sidecar_workloads
    ] == [
        ("models", (15001, 9001)),
        ("models", (15002, 9002)),
        ("plain", (15100, 9100)),
    ]
    models, _, plain = complete.sidecar_workloads
    guard = shed.guards[("service", "default/models")]
    assert models.authz == (*shed.access[("service", "default/models")].authz, guard)
    assert models.inbound is not None and models.inbound.tenant_claim == "org"
    assert plain.inbound is not None and plain.inbound.tenant_claim is None
    assert all(
        w.kind == "sidecar" and w.xds_protocol == "delta" for w in complete.sidecar_workloads
    )


def test_assemble_puts_the_guards_beside_the_policies_as_written() -> None:
    items = _items(
        mesh("m", "m.local", acceleration="off"),
        gateway(None, 10000),
        service("models", 9000),
        _function("iris", "models"),
        _allow_all("zz-last", {"gateway": "edge"}),
    )
    shed = shedding.shed(gateways.route(_until_served(items)))
    assert isinstance(shed, shedding.Shed)
    model = assemble.assemble(sidecars.place(shed))
    assert [p.name for p in model.policies.authz] == ["meshfn-kserve-repository-edge", "zz-last"]
    assert model.workloads == shed.gateway_workloads
    assert [f.name for f in model.functions] == ["iris"]


# What each pass may refine of the stage before it; every other field is carried as it was.
REFINES = {
    security.secure: set(),
    fallback.chain: {"services"},
    qos_pass.bind: set(),
    functions.serve: {"services"},
    rollouts.roll: {"functions"},
    gateways.route: {"errors"},
    shedding.shed: {"services"},
    sidecars.place: set(),
}


@pytest.mark.parametrize("case", CASES)
def test_each_pass_keeps_what_the_passes_before_it_produced(case: str) -> None:
    """On every golden case: each stage is the one before it (an instance of its class, its
    fields carried unchanged but for what the pass says it refines) plus what its pass adds;
    the last one assembles the model the loader gives."""
    model, items = PolicyLoader(GOLDEN / case / "in.yaml").load_with_sources()
    stage: Any = resolve.resolve(items)
    for run, refined in REFINES.items():
        before = stage
        stage = run(before)
        assert isinstance(stage, type(before)), stage
        carried = set(vars(before)) - refined
        assert {k: vars(stage)[k] for k in carried} == {k: vars(before)[k] for k in carried}
    traced = tracing.trace(stage.mesh, stage.items)
    assert not isinstance(traced, list), traced
    assert assemble.assemble(stage, traced) == model == compile_model(items)


def test_stages_are_plain_dataclasses() -> None:
    """The passes build a stage from the one before it with `vars`: no slots."""
    stages = [
        resolve.Resolved,
        security.Secured,
        fallback.Chained,
        qos_pass.Bound,
        functions.Served,
        rollouts.Rolled,
        gateways.Routed,
        shedding.Shed,
        sidecars.Complete,
    ]
    for earlier, later in itertools.pairwise(stages):
        assert issubclass(later, earlier)
        assert dataclasses.is_dataclass(later) and not hasattr(later, "__slots__")
