"""Pass 5, functions: each Function with the QoS its backend applies, its KServe routes (its
unary gRPC calls too where its policy sheds at the gateway) and each gateway's server routes
(policy.kserve), the repository guards on the workloads in front of its backend, and the
backends' load balancing; and every route a gateway carries, in order.

The repository guard sits on the sidecars of every service that serves a function (its backend,
and the services its backend's fallback chain reaches: they answer the same paths), and on the
gateway for functions whose backend has no sidecars.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from meshfn import ir
from meshfn.contracts.qos import FUNCTION_BACKEND_BALANCER

from .. import kserve
from ..errors import PolicyError
from ..model import Route
from ..validate import Loaded
from .qos import Bound


@dataclass(frozen=True)
class GatewayRoute:
    """A route on a gateway: the object it comes from (its errors point there), the route, and
    the one listener it is limited to (None: every listener of the gateway)."""

    item: Loaded
    route: ir.Route
    listener: str | None


@dataclass(frozen=True)
class Served(Bound):
    """`functions`: with the QoS their backends apply, in the order written; `routes`: per
    gateway key every Route and Function route in the order written (with its own QoSPolicy),
    then the KServe server routes; `guards`: per ("gateway" | "service", namespace/name) the
    repository guard its proxies add, and `guard_objects` the same as objects (the Istio
    renderer's AuthorizationPolicies), gateways' first; `tenant_claims`: per backend service the
    verified claim its sidecars pass on (its functions have QoS); `services` that serve a
    function balance by load unless they say otherwise; `errors`: gateways whose functions do
    not share one backend."""

    functions: tuple[ir.Function, ...]
    routes: Mapping[str, tuple[GatewayRoute, ...]]
    guards: Mapping[tuple[str, str], ir.AuthzPolicy]
    guard_objects: tuple[ir.AuthzObject, ...]
    tenant_claims: Mapping[str, str]
    errors: tuple[PolicyError, ...]


def serve(bound: Bound) -> Served:
    services = {s.key: s for s in bound.services}
    functions = _with_qos(bound)
    served = served_functions(list(functions.values()), services)
    claims = {
        key: claim
        for key, on_it in served.items()
        if (claim := next((f.qos.tenantClaim for f in on_it if f.qos is not None), None))
    }
    balanced = tuple(
        dataclasses.replace(
            s,
            load_balancer=s.load_balancer or FUNCTION_BACKEND_BALANCER,
            functions=True,
        )
        if s.key in served
        else s
        for s in bound.services
    )
    routes, hosted = _attach(bound, functions)
    errors: list[PolicyError] = []
    for key, on_it in hosted.items():
        server = kserve.gateway_routes(key, on_it, services)
        if isinstance(server, PolicyError):
            errors.append(server)
            continue
        routes[key].extend(GatewayRoute(on_it[0][0], route, None) for route in server)
    guards, objects = kserve.repository_guards(
        {key: [f for _, f in hosted.get(key, [])] for key in bound.gateways}, balanced, served
    )
    return Served(
        **(vars(bound) | {"services": balanced}),
        functions=tuple(functions.values()),
        routes={key: tuple(on_it) for key, on_it in routes.items()},
        guards=guards,
        guard_objects=objects,
        tenant_claims=claims,
        errors=tuple(errors),
    )


def _with_qos(bound: Bound) -> dict[str, ir.Function]:
    """Every Function (by namespace/name, as written) with the QoS its backend applies."""
    functions = {}
    for attached in bound.attached:
        item = attached.item
        if isinstance(item.lowered, ir.Function):
            backend = bound.backends.get(f"{item.namespace}/{item.name}")
            qos = backend.classes if backend is not None else None
            functions[f"{item.namespace}/{item.name}"] = dataclasses.replace(item.lowered, qos=qos)
    return functions


def _attach(
    bound: Bound, functions: dict[str, ir.Function]
) -> tuple[dict[str, list[GatewayRoute]], dict[str, list[tuple[Loaded, ir.Function]]]]:
    """Per gateway key its Routes and Functions' routes in the order written (each with its own
    QoSPolicy; a Function's gRPC route where its policy sheds at the gateway), and the Functions
    it hosts (with their objects)."""
    routes: dict[str, list[GatewayRoute]] = {key: [] for key in bound.gateways}
    services = {s.key: s for s in bound.services}
    hosted: dict[str, list[tuple[Loaded, ir.Function]]] = {}
    for attached in bound.attached:
        item, key = attached.item, f"{attached.item.namespace}/{attached.item.name}"
        if isinstance(item.lowered, ir.Function):
            function = functions[key]
            hosted.setdefault(attached.gateway, []).append((item, function))
            found = [kserve.function_route(function), kserve.openai_route(function)]
            if bound.sheds_at_gateway(key):  # its gRPC calls to its own circuit breakers
                found.append(kserve.grpc_route(function, services[function.backend]))
            lowered: list[tuple[ir.Route, str | None]] = [(r, None) for r in found if r]
        else:
            assert isinstance(item.lowered, ir.Route) and isinstance(item.obj, Route)
            lowered = [(item.lowered, item.obj.spec.listener)]
        own = bound.bound.get((item.kind, key))
        for route, only in lowered:
            bound_route = dataclasses.replace(route, qos=own) if own is not None else route
            routes[attached.gateway].append(GatewayRoute(item, bound_route, only))
    return routes, hosted


def served_functions(
    functions: list[ir.Function], services: dict[str, ir.Service]
) -> dict[str, list[ir.Function]]:
    """Service key -> the functions its endpoints serve: those it backs, and those whose
    backend's fallback chain reaches it (a fallback answers the same /v2/models/{name})."""
    out: dict[str, list[ir.Function]] = {}
    for function in sorted(functions, key=lambda f: (f.namespace, f.name)):
        backend = services[function.backend]
        for key in (backend.key, *backend.fallback):
            out.setdefault(key, []).append(function)
    return out
