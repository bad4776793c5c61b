"""Pass 7, gateways: one workload per Gateway, each listener with its routes (those limited to
another listener left out), what the gateway enforces and its own QoSPolicy; and two routes
that claim the exact same requests refused (one could never be used)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshfn import ir

from ..errors import PolicyError
from ..model import Gateway
from ..validate import where
from .functions import GatewayRoute
from .objects import locality
from .rollouts import Rolled


@dataclass(frozen=True)
class Routed(Rolled):
    """`gateway_workloads`: in gateway key order; `reach`: per service key, how many gateways
    have routes to it; `errors` now with the routes that shadow each other."""

    gateway_workloads: tuple[ir.Workload, ...]
    reach: Mapping[str, int]


def route(served: Rolled) -> Routed:
    errors = list(served.errors)
    workloads = []
    for key, gateway in served.gateways.items():
        assert isinstance(gateway.obj, Gateway)
        spec = gateway.obj.spec
        listeners = []
        for listener in spec.listeners:
            on_it = sorted(
                (r for r in served.routes[key] if r.listener in (None, listener.name)),
                key=lambda r: r.route.key,
            )
            errors += _shadowed(on_it)
            listeners.append(
                ir.Listener(
                    name=listener.name,
                    address=listener.address,
                    port=listener.port,
                    routes=tuple(r.route for r in on_it),
                )
            )
        access = served.access[("gateway", key)]
        guard = served.guards.get(("gateway", key))
        workloads.append(
            ir.Workload(
                name=gateway.name,
                namespace=gateway.namespace,
                kind="gateway",
                admin_port=spec.adminPort or 0,
                xds_protocol=spec.xdsProtocol,
                locality=locality(spec.locality),
                listeners=tuple(listeners),
                identity=access.identity,
                jwt_rules=access.jwt_rules,
                authz=access.authz + ((guard,) if guard is not None else ()),
                qos=served.bound.get(("Gateway", key)),
            )
        )
    reach: dict[str, int] = {}
    for routes in served.routes.values():
        for service in {r.route.service for r in routes}:
            reach[service] = reach.get(service, 0) + 1
    return Routed(
        **(vars(served) | {"errors": tuple(errors)}),
        gateway_workloads=tuple(workloads),
        reach=reach,
    )


def _shadowed(routes: list[GatewayRoute]) -> list[PolicyError]:
    """Two routes with an identical match on the same host: one would never be used."""
    errors = []
    claimed: dict[tuple[str, ir.RouteMatch], tuple[GatewayRoute, int]] = {}
    for route in routes:
        for index, match in enumerate(route.route.matches):
            for host in route.route.hosts:
                key = (host, match)
                if key in claimed and claimed[key][0].item is not route.item:
                    other, other_index = claimed[key]
                    errors.append(
                        route.item.error(
                            ("spec", "matches", index),
                            f"identical match to {other.item.ref} on host {host!r} "
                            f"({where(other.item, ('spec', 'matches', other_index))}): "
                            "one of the two routes could never be used",
                        )
                    )
                else:
                    claimed.setdefault(key, (route, index))
    return errors
