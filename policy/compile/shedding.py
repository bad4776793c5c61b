"""Pass 8, shedding: where a QoSPolicy sheds the lower priorities at the gateways
(`gatewayShedding`), each backend's per-priority concurrency limits at every gateway that
reaches it, from its functions' maxConcurrency; or why they cannot hold."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshfn import ir
from meshfn.contracts.qos import shed_threshold

from ..errors import PolicyError
from ..model import Function, QoSPolicy, QoSPolicySpec
from ..validate import Loaded
from .gateways import Routed


@dataclass(frozen=True)
class Shed(Routed):
    """`services` now with their gateways' per-priority limits (shed, function_shed)."""


def shed(routed: Routed) -> Shed | list[PolicyError]:
    limits = _shed_limits(routed)
    if isinstance(limits, list):
        return limits
    services = tuple(
        dataclasses.replace(s, shed=limits[s.key][0], function_shed=limits[s.key][1])
        if s.key in limits
        else s
        for s in routed.services
    )
    return Shed(**(vars(routed) | {"services": services}))


ShedLimits = tuple[ir.PriorityLimits, tuple[tuple[str, ir.PriorityLimits], ...]]


def _shed_limits(routed: Routed) -> dict[str, ShedLimits] | list[PolicyError]:
    """Per backend Service whose functions a policy sheds at the gateway, each gateway's
    per-priority concurrency towards it: (its cluster's, each such function's own cluster's).
    HIGH admits every request the backend admits (maxConcurrency), DEFAULT what it admits
    before it sheds its lowest priority (contracts.qos.shed_threshold: half), both divided among
    the `reach[service]` Gateways whose routes reach it (or the policy's
    `gatewayShedding.gateways`); the service's cluster sums its functions (all of a function
    whose policy does not shed)."""
    functions: dict[str, list[Loaded]] = {}
    for attached in routed.attached:
        item = attached.item
        if isinstance(item.obj, Function):
            key = f"{item.namespace}/{item.obj.spec.backend}"
            functions.setdefault(key, []).append(item)
    out: dict[str, ShedLimits] = {}
    errors: list[PolicyError] = []
    by_key = {s.key: s for s in routed.services}
    reach = routed.reach
    for key, served in sorted(functions.items()):
        own: list[tuple[str, int, int, Loaded]] = []  # (function, N, DEFAULT share, policy)
        high = default = 0
        for function in served:
            assert isinstance(function.obj, Function)
            limit = function.obj.spec.limits.maxConcurrency
            backend = routed.backends.get(f"{function.namespace}/{function.name}")
            policy = backend.policy if backend is not None else None
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
