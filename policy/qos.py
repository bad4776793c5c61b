"""QoSPolicy: which policy binds what, and its checks across documents (compile/qos.py lowers
the policies, compile/shedding.py the gateways' shedding).

A policy binds Gateways, Routes and Functions (`targetRefs`). The most specific binding wins:
a Route's or Function's own policy governs its requests, the Gateway's policy everything else on
that gateway (KServe's server routes and gRPC, whose messages name the model inside, included).
Every gateway a policy reaches must verify JWTs (the tenant is a verified claim), all policies
on one gateway read the same claim (one local reply names the tenant), and a backend that orders
requests by priority must be behind proxies that verify the claim too. A `global` rate binds
Gateways only (a Route's or Function's own policy replaces it on its routes and stays local).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshfn.contracts.qos import TenantClasses, split_priorities

from .errors import PolicyError
from .model import Function, Gateway, Mesh, QoSPolicy, Route, Service
from .references import resolve_gateway
from .security import Security
from .validate import Loaded, where

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

    def __init__(self, items: Sequence[Loaded]) -> None:
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
        gateway = resolve_gateway(item, self.gateways)
        if isinstance(gateway, PolicyError):
            return self.for_function_on(item, None)
        return self.for_function_on(item, f"{gateway.namespace}/{gateway.name}")

    def for_function_on(self, item: Loaded, gateway: str | None) -> Loaded | None:
        """for_function, with the key of the Gateway the Function attaches to (None: none)."""
        own = self.of("Function", f"{item.namespace}/{item.name}")
        if own is not None or gateway is None:
            return own
        return self.of("Gateway", gateway)


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
            limits.compute or limits.tokens for limits in (*spec.classes, *spec.tenants)
        ):
            errors.append(
                item.error(
                    ("spec", "targetRefs"),
                    "sets compute or token budgets, which the inference backend meters, but "
                    "binds no Function (nor a Gateway serving one)",
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
