"""The compiler's passes, in order: each takes the stage the one before it produced."""

from __future__ import annotations

from meshfn import ir

from ..errors import PolicyError
from ..validate import Loaded
from . import (
    assemble,
    fallback,
    functions,
    gateways,
    qos,
    resolve,
    rollouts,
    security,
    shedding,
    sidecars,
    tracing,
)


def compile_model(items: list[Loaded]) -> ir.MeshModel | list[PolicyError]:
    """Validated objects (the reference and QoS checks passed) -> the MeshModel, or what only
    lowering the whole set finds: Functions on one gateway with different backends, routes that
    shadow each other, shedding that cannot hold, tracing overrides that cannot apply."""
    resolved = resolve.resolve(items)
    traced = tracing.trace(resolved.mesh, resolved.items)
    if isinstance(traced, list):
        return sorted(set(traced))
    secured = security.secure(resolved)
    chained = fallback.chain(secured)
    bound = qos.bind(chained)
    served = functions.serve(bound)
    rolled = rollouts.roll(served)
    routed = gateways.route(rolled)
    if routed.errors:
        return sorted(set(routed.errors))
    shed = shedding.shed(routed)
    if isinstance(shed, list):
        return sorted(set(shed))
    complete = sidecars.place(shed)
    return assemble.assemble(complete, traced)
