"""Names two stages must agree on without sharing anything else.

A meshfn Route's match `index` is Envoy route `<namespace>/<name>/<index>` in both renderers
(the xDS translator's route names; the Istio renderer's VirtualService http route names, which
istiod passes on to Envoy). The degrade filter's rules and the drift breaker's access-log
samples are keyed by it.
"""

from __future__ import annotations


def route_name(route_key: str, index: int) -> str:
    return f"{route_key}/{index}"


def degraded_route_name(route_key: str, index: int) -> str:
    """The degraded twin of route `index` (drift breaker)."""
    return f"{route_name(route_key, index)}/degraded"


def priority_route_name(name: str, priority: str) -> str:
    """The twin of route `name` for one Envoy routing priority ("high" or "default") at a
    gateway that sheds by QoS class; the degrade filter's rules list both (fragments.plugins)."""
    return f"{name}|{priority}"
