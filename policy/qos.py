"""QoSPolicy: its checks across documents and its lowering to the IR.

A policy binds Gateways, Routes and Functions (`targetRefs`). The most specific binding wins:
a Route's or Function's own policy governs its requests, the Gateway's policy everything else on
that gateway (KServe's server routes and gRPC, whose messages name the model inside, included).
Every gateway a policy reaches must verify JWTs (the tenant is a verified claim), all policies
on one gateway read the same claim (one local reply names the tenant), and a backend that orders
requests by priority must be behind proxies that verify the claim too. A `global` rate binds
Gateways only (a Route's or Function's own policy replaces it on its routes and stays local).
"""

from __future__ import annotations

from collections.abc import Iterable

from meshfn import ir
from meshfn.contracts.qos import (
    FunctionQoS,
    Limits,
    TenantClasses,
    shed_threshold,
    split_priorities,
    window_seconds,
)

from .errors import PolicyError
from .model import Function, Gateway, Mesh, QoSPolicy, QoSPolicySpec, Route, Service
from .references import resolve_gateway, where
from .security import Security
from .validate import Loaded

DEFAULT_CLAIM = "tenant"


def _ref_key(item: Loaded, name: str) -> str:
    return name if "/" in name else f"{item.namespace}/{name}"


def claim_of(spec: TenantClasses, mesh: Mesh) -> str:
    """The tenant claim: the policy's own, else the audit trail's, else `tenant`."""
    if spec.tenantClaim:
        return spec.tenantClaim
    audit = mesh.spec.audit
    return audit.tenantClaim if audit is not None and audit.tenantClaim else DEFAULT_CLAIM


class Bindings:
    """Which QoSPolicy governs what: per target (kind, namespace/name) the binding policy."""

    def __init__(self, items: list[Loaded]) -> None:
        self.items = items
        self.policies = sorted(
            (i for i in items if isinstance(i.obj, QoSPolicy)), key=lambda i: (i.namespace, i.name)
        )
        self.by_target: dict[tuple[str, str], Loaded] = {}
        self.gateways = {f"{i.namespace}/{i.name}": i for i in items if isinstance(i.obj, Gateway)}
        for item in self.policies:
            assert isinstance(item.obj, QoSPolicy)
            for ref in item.obj.spec.targetRefs:
                self.by_target.setdefault((ref.kind, _ref_key(item, ref.name)), item)

    def of(self, kind: str, key: str) -> Loaded | None:
        return self.by_target.get((kind, key))

    def attachments(self) -> Iterable[tuple[Loaded, Loaded]]:
        """(Route or Function, its Gateway) for every Route and Function."""
        for item in self.items:
            if isinstance(item.obj, Route | Function):
                gateway = resolve_gateway(item, self.gateways)
                if not isinstance(gateway, PolicyError):
                    yield item, gateway

    def governing(self, gateway: Loaded) -> list[Loaded]:
        """Every policy whose requests pass `gateway`: its own and those of its routes."""
        found = []
        own = self.of("Gateway", f"{gateway.namespace}/{gateway.name}")
        if own is not None:
            found.append(own)
        for item, gw in self.attachments():
            if gw is gateway:
                policy = self.of(item.kind, f"{item.namespace}/{item.name}")
                if policy is not None and policy not in found:
                    found.append(policy)
        return found

    def for_function(self, item: Loaded) -> Loaded | None:
        """The policy a Function's backend applies: the Function's own, else its gateway's."""
        own = self.of("Function", f"{item.namespace}/{item.name}")
        if own is not None:
            return own
        gateway = resolve_gateway(item, self.gateways)
        if isinstance(gateway, PolicyError):
            return None
        return self.of("Gateway", f"{gateway.namespace}/{gateway.name}")


def check(items: list[Loaded]) -> list[PolicyError]:
    errors: list[PolicyError] = []
    policies = [i for i in items if isinstance(i.obj, QoSPolicy)]
    if not policies:
        return errors
    known = {
        kind: {f"{i.namespace}/{i.name}": i for i in items if i.kind == kind}
        for kind in ("Gateway", "Route", "Function")
    }
    claimed: dict[tuple[str, str], Loaded] = {}
    for item in policies:
        assert isinstance(item.obj, QoSPolicy)
        spec = item.obj.spec
        errors += [item.error(("spec", *loc), message) for loc, message in spec.problems()]
        for i, ref in enumerate(spec.targetRefs):
            key = _ref_key(item, ref.name)
            loc = ("spec", "targetRefs", i, "name")
            if key not in known[ref.kind]:
                errors.append(item.error(loc, f"unknown {ref.kind} {key}"))
                continue
            first = claimed.get((ref.kind, key))
            if first is item:
                errors.append(item.error(loc, f"{ref.kind} {key} is named twice"))
            elif first is not None:
                errors.append(
                    item.error(
                        loc,
                        f"{ref.kind} {key} is already bound by {first.ref} ({where(first)}): "
                        "one QoSPolicy per target",
                    )
                )
            claimed.setdefault((ref.kind, key), item)
    if errors:
        return errors
    return _check_enforcement(items, Bindings(items))


def _check_enforcement(items: list[Loaded], bindings: Bindings) -> list[PolicyError]:
    """Where a policy's limits are enforced, the tenant must be verified."""
    errors: list[PolicyError] = []
    security = Security(items)
    mesh = next(i.obj for i in items if isinstance(i.obj, Mesh))
    assert isinstance(mesh, Mesh)
    for gateway in bindings.gateways.values():
        governing = bindings.governing(gateway)
        if not governing:
            continue
        first = governing[0]
        assert isinstance(first.obj, QoSPolicy)
        claim = claim_of(first.obj.spec, mesh)
        if not security.jwt_rules("gateway", gateway.namespace, gateway.name):
            errors.append(
                first.error(
                    ("spec", "targetRefs"),
                    f"tenants are told apart by the verified JWT claim {claim!r}, but Gateway "
                    f"{gateway.namespace}/{gateway.name} verifies no JWT: add a "
                    "RequestAuthentication in its namespace that selects it",
                )
            )
        for other in governing[1:]:
            assert isinstance(other.obj, QoSPolicy)
            if claim_of(other.obj.spec, mesh) != claim:
                errors.append(
                    other.error(
                        ("spec", "tenantClaim"),
                        f"reads claim {claim_of(other.obj.spec, mesh)!r} where {first.ref} "
                        f"({where(first)}) reads {claim!r} on Gateway {gateway.namespace}/"
                        f"{gateway.name}: the policies of one gateway read one tenant claim",
                    )
                )
    services = {f"{i.namespace}/{i.name}": i for i in items if isinstance(i.obj, Service)}
    budgeted: set[str] = set()
    for item in items:
        if not isinstance(item.obj, Function):
            continue
        policy = bindings.for_function(item)
        if policy is None:
            continue
        budgeted.add(policy.ref)
        assert isinstance(policy.obj, QoSPolicy)
        backend = services.get(f"{item.namespace}/{item.obj.spec.backend}")
        assert backend is not None and isinstance(backend.obj, Service)
        sidecars = any(e.sidecar is not None for e in backend.obj.spec.endpoints)
        if sidecars and not security.jwt_rules("service", backend.namespace, backend.name):
            errors.append(
                policy.error(
                    ("spec", "targetRefs"),
                    f"the backend of Function {item.namespace}/{item.name} keeps its tenants' "
                    f"concurrency, budgets and priorities, but the sidecars of Service "
                    f"{backend.namespace}/{backend.name} verify no JWT, so it could not tell "
                    "tenants apart: add a RequestAuthentication selecting it",
                )
            )
    for item in bindings.policies:
        assert isinstance(item.obj, QoSPolicy)
        spec = item.obj.spec
        errors += _check_global(item)
        errors += _check_shedding(item, item.ref in budgeted)
        if item.ref not in budgeted and any(
            limits.compute for limits in (*spec.classes, *spec.tenants)
        ):
            errors.append(
                item.error(
                    ("spec", "targetRefs"),
                    "sets compute budgets, which the inference backend meters, but binds no "
                    "Function (nor a Gateway serving one)",
                )
            )
    return errors


def _check_shedding(item: Loaded, serves_functions: bool) -> list[PolicyError]:
    """Gateway shedding needs two priorities, a tenant the route table can name on the side
    the default class is not on, and a Function whose maxConcurrency sets the thresholds."""
    assert isinstance(item.obj, QoSPolicy)
    spec = item.obj.spec
    if spec.gatewayShedding is None:
        return []
    loc = ("spec", "gatewayShedding")
    priorities = {c.priority for c in spec.classes}
    if len(priorities) < 2:
        return [
            item.error(loc, f"every class has priority {priorities.pop()}: no class to shed first")
        ]
    split = split_priorities(
        ((c.name, c.priority) for c in spec.classes),
        spec.defaultClass,
        ((t.name, spec.class_of(t.name).name) for t in spec.tenants),
    )
    if not split.listed:
        side = "in" if split.listed_high else "below"
        return [
            item.error(
                loc,
                f"no listed tenant is {side} the top priority ({', '.join(split.high)}): every "
                f"request would route with one priority (the default class "
                f"{spec.defaultClass!r}'s), so the gateway would shed all or none",
            )
        ]
    if not serves_functions:
        return [
            item.error(
                loc,
                "binds no Function (nor a Gateway serving one): the gateway's thresholds come "
                "from the functions' maxConcurrency",
            )
        ]
    return []


ShedLimits = tuple[ir.PriorityLimits, tuple[tuple[str, ir.PriorityLimits], ...]]


def shed_limits(
    bindings: Bindings, services: list[ir.Service], reach: dict[str, int]
) -> dict[str, ShedLimits] | list[PolicyError]:
    """Per backend Service whose functions a policy sheds at the gateway, each gateway's
    per-priority concurrency towards it: (its cluster's, each such function's own cluster's).
    HIGH admits every request the backend admits (maxConcurrency), DEFAULT what it admits
    before it sheds its lowest priority (contracts.qos.shed_threshold: half), both divided among
    the `reach[service]` Gateways whose routes reach it (or the policy's
    `gatewayShedding.gateways`); the service's cluster sums its functions (all of a function
    whose policy does not shed)."""
    functions: dict[str, list[Loaded]] = {}
    for item in bindings.items:
        if isinstance(item.obj, Function):
            key = f"{item.namespace}/{item.obj.spec.backend}"
            functions.setdefault(key, []).append(item)
    out: dict[str, ShedLimits] = {}
    errors: list[PolicyError] = []
    by_key = {s.key: s for s in services}
    for key, served in sorted(functions.items()):
        own: list[tuple[str, int, int, Loaded]] = []  # (function, N, DEFAULT share, policy)
        high = default = 0
        for function in served:
            assert isinstance(function.obj, Function)
            limit = function.obj.spec.limits.maxConcurrency
            policy = bindings.for_function(function)
            high += limit
            spec = policy.obj.spec if policy is not None else None
            if policy is None or not isinstance(spec, QoSPolicySpec) or not spec.gatewayShedding:
                default += limit
                continue
            count = len({c.priority for c in spec.classes})
            share = shed_threshold(count - 1, count, limit)
            default += share
            own.append((function.name, limit, share, policy))
        if not own:
            continue
        shedding = own[0][3]
        assert isinstance(shedding.obj, QoSPolicy) and shedding.obj.spec.gatewayShedding
        loc = ("spec", "gatewayShedding")
        given = shedding.obj.spec.gatewayShedding.gateways
        gateways = reach.get(key, 1)
        if given is not None and given < gateways:
            errors.append(
                shedding.error(
                    (*loc, "gateways"),
                    f"{given} gateway(s), but {gateways} Gateways reach the backend {key}: each "
                    "would admit its share, together more than the backend sheds at",
                )
            )
            continue
        gateways = given or gateways
        service = by_key.get(key)
        breakers = service.traffic.breakers if service and service.traffic else None
        caps = (breakers.max_requests, breakers.max_pending_requests) if breakers else ()
        cap = min((c for c in caps if c is not None), default=None)
        if cap is not None and cap < default // gateways:
            errors.append(
                shedding.error(
                    loc,
                    f"the backend {key}'s FallbackPolicy admits at most {cap} requests "
                    f"(circuitBreakers), below the {default // gateways} lower-priority requests "
                    "each gateway admits before it sheds: the gateway would never shed by "
                    "priority; raise circuitBreakers or drop gatewayShedding",
                )
            )
            continue
        small = [(name, share) for name, _, share, _ in own if share // gateways < 1]
        if small:
            name, share = small[0]
            errors.append(
                shedding.error(
                    loc,
                    f"Function {name} sheds its lower priorities from {share} requests in "
                    f"flight, fewer than the {gateways} gateways sharing its backend {key}: each "
                    "gateway would shed every DEFAULT request (raise its maxConcurrency)",
                )
            )
            continue
        out[key] = (
            _per_gateway(high, default, gateways, cap),
            tuple((name, _per_gateway(n, share, gateways, cap)) for name, n, share, _ in own),
        )
    return errors or out


def _per_gateway(high: int, default: int, gateways: int, cap: int | None) -> ir.PriorityLimits:
    """One gateway's share; a FallbackPolicy's circuitBreakers bound both priorities."""
    most = -(-high // gateways)
    return ir.PriorityLimits(high=min(most, cap) if cap else most, default=default // gateways)


def _check_global(item: Loaded) -> list[PolicyError]:
    """A global rate is the rate of a whole gateway's policy (the limit service counts the
    requests of every gateway it binds); a Route's or Function's own stays per gateway."""
    assert isinstance(item.obj, QoSPolicy)
    spec = item.obj.spec
    if spec.global_ is None:
        return []
    loc = ("spec", "global")
    if not any(limits.rate for limits in (*spec.classes, *spec.tenants)):
        return [item.error(loc, "no class or tenant sets a rate: nothing to count globally")]
    kinds = sorted({ref.kind for ref in spec.targetRefs if ref.kind != "Gateway"})
    if kinds:
        return [
            item.error(
                loc,
                f"a global rate binds Gateways only (it also names {', '.join(kinds)}): bind "
                "the Route or Function with a policy of its own without `global`",
            )
        ]
    return []


# ---------------------------------------------------------------- lowering


def _limits(limits: Limits) -> ir.TenantLimits:
    rate = limits.rate
    return ir.TenantLimits(
        rate=ir.Bucket(rate.requests, rate.seconds, rate.bucket) if rate is not None else None,
        concurrency=limits.concurrency,
        compute=tuple(
            sorted(
                (ir.Budget(b.cpuMs, b.per) for b in limits.compute),
                key=lambda b: window_seconds(b.window),
            )
        ),
    )


def lower(item: Loaded, mesh: Mesh) -> ir.QoSPolicy:
    assert isinstance(item.obj, QoSPolicy)
    spec = item.obj.spec
    return ir.QoSPolicy(
        name=item.name,
        namespace=item.namespace,
        claim=claim_of(spec, mesh),
        default_class=spec.defaultClass,
        classes=tuple(ir.QoSClass(c.name, c.priority, _limits(c)) for c in spec.classes),
        tenants=tuple(
            ir.QoSTenant(t.name, spec.class_of(t.name).name, _limits(spec.limits_of(t.name)))
            for t in spec.tenants
        ),
        global_rate=ir.GlobalRate(
            deny=spec.global_.onLimitServiceError == "deny",
            timeout_ms=max(1, int(spec.global_.timeout.total_seconds() * 1000)),
        )
        if spec.global_ is not None
        else None,
        gateway_shed=spec.gatewayShedding is not None,
    )


def function_qos(item: Loaded, mesh: Mesh) -> FunctionQoS:
    """The backend's view of a policy: its tenant classes, as written (the contract schema)."""
    assert isinstance(item.obj, QoSPolicy)
    spec = item.obj.spec
    return FunctionQoS.model_construct(
        policy=f"{item.namespace}/{item.name}",
        tenantClaim=claim_of(spec, mesh),
        defaultClass=spec.defaultClass,
        classes=spec.classes,
        tenants=spec.tenants,
    )
