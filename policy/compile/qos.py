"""Pass 4, QoS: every QoSPolicy lowered to the IR, and bound as the resolve pass found: what
limits each Gateway's, Route's and Function's own requests, and what each Function's backend
applies (the Function's own policy, else its gateway's), in its tenant classes as the backend
reads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshfn import ir
from meshfn.contracts.qos import FunctionQoS, Limits, window_seconds

from ..model import QoSPolicy, QoSPolicySpec
from ..validate import Loaded
from .fallback import Chained


@dataclass(frozen=True)
class Backend:
    """The QoSPolicy a Function's backend applies (its errors point at it) and its tenant
    classes, as the backend reads them."""

    policy: Loaded
    classes: FunctionQoS


@dataclass(frozen=True)
class Bound(Chained):
    """`qos`: every QoSPolicy, lowered, in (namespace, name) order; `bound`: per target
    (kind, namespace/name) the policy that limits its own requests; `backends`: per Function
    (namespace/name) what its backend applies, where a policy does."""

    qos: tuple[ir.QoSPolicy, ...]
    bound: Mapping[tuple[str, str], ir.QoSPolicy]
    backends: Mapping[str, Backend]

    def sheds_at_gateway(self, function: str) -> bool:
        """Whether the policy Function `function` (namespace/name)'s backend applies sheds
        its lower priorities at the gateways too (gatewayShedding)."""
        backend = self.backends.get(function)
        spec = backend.policy.obj.spec if backend is not None else None
        return isinstance(spec, QoSPolicySpec) and spec.gatewayShedding is not None


def bind(chained: Chained) -> Bound:
    bindings = chained.bindings
    lowered = {p.ref: _lower(p, bindings.claims[p.ref]) for p in bindings.policies}
    return Bound(
        **vars(chained),
        qos=tuple(lowered.values()),
        bound={target: lowered[policy.ref] for target, policy in bindings.targets.items()},
        backends={
            function: Backend(policy, _function_qos(policy, bindings.claims[policy.ref]))
            for function, policy in bindings.backends.items()
        },
    )


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
        tokens=tuple(
            sorted(
                (ir.TokenBudget(b.tokens, b.per) for b in limits.tokens),
                key=lambda b: window_seconds(b.window),
            )
        ),
    )


def _lower(item: Loaded, claim: str) -> ir.QoSPolicy:
    assert isinstance(item.obj, QoSPolicy)
    spec = item.obj.spec
    return ir.QoSPolicy(
        name=item.name,
        namespace=item.namespace,
        claim=claim,
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


def _function_qos(item: Loaded, claim: str) -> FunctionQoS:
    """The backend's view of a policy: its tenant classes, as written (the contract schema)."""
    assert isinstance(item.obj, QoSPolicy)
    spec = item.obj.spec
    return FunctionQoS.model_construct(
        policy=f"{item.namespace}/{item.name}",
        tenantClaim=claim,
        defaultClass=spec.defaultClass,
        classes=spec.classes,
        tenants=spec.tenants,
        tokenReservation=spec.tokenReservation,
    )
