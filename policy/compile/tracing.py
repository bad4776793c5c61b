"""Tracing: Mesh.spec.tracing with each Gateway's and Route's override, as one IR setting
(ir.Tracing) that both renderers read. A leaf pass: it reads the objects as loaded and nothing
the other passes made.

Refused here: an override without tracing on the Mesh (it would silently do nothing), and a
route's sampling on a gateway that honors client context (there Envoy's OpenTelemetry sampler,
not the route table, decides which new traces start: see meshfn.xds.translate.tracing)."""

from __future__ import annotations

from meshfn import ir

from ..errors import PolicyError
from ..model import Gateway, Mesh, Route, Tracing
from ..validate import Loaded


def trace(mesh: Mesh, items: tuple[Loaded, ...]) -> ir.Tracing | list[PolicyError] | None:
    """The IR tracing setting, or the errors of overrides that cannot hold."""
    spec = mesh.spec.tracing
    gateways = [i for i in items if isinstance(i.obj, Gateway)]
    routes = [i for i in items if isinstance(i.obj, Route)]
    if spec is None:
        return [
            item.doc.error(
                ("spec", "tracing"), "the Mesh has no tracing (spec.tracing) to override"
            )
            for item in (*gateways, *routes)
            if getattr(item.obj.spec, "tracing", None) is not None
        ] or None
    base = ir.GatewayTracing(spec.sampling, spec.clientContext)
    overrides = {f"{g.namespace}/{g.name}": _gateway(g, base) for g in gateways}
    errors = []
    route_sampling = []
    for item in routes:
        assert isinstance(item.obj, Route)
        own = item.obj.spec.tracing
        if own is None:
            continue
        gateway = _gateway_of(item, overrides)
        if gateway is not None and gateway.client_context == "honor":
            errors.append(
                item.doc.error(
                    ("spec", "tracing", "sampling"),
                    "its gateway honors client trace context (tracing.clientContext: honor): new"
                    " traces start at the gateway's sampling there, not per route",
                )
            )
        route_sampling.append((f"{item.namespace}/{item.name}", own.sampling))
    if errors:
        return errors
    return _lowered(spec, overrides, base, route_sampling)


def _lowered(
    spec: Tracing,
    overrides: dict[str, ir.GatewayTracing],
    base: ir.GatewayTracing,
    routes: list[tuple[str, float]],
) -> ir.Tracing:
    collector = spec.collector
    return ir.Tracing(
        sampling=spec.sampling,
        collector=ir.TraceCollector(
            collector.protocol, collector.host, collector.port, collector.path, collector.timeout
        )
        if collector is not None
        else None,
        tags=tuple(spec.tags),
        tenant_claim=spec.tenantClaim,
        client_context=spec.clientContext,
        gateways=tuple(sorted((k, v) for k, v in overrides.items() if v != base)),
        routes=tuple(sorted(routes)),
    )


def _gateway(item: Loaded, base: ir.GatewayTracing) -> ir.GatewayTracing:
    assert isinstance(item.obj, Gateway)
    own = item.obj.spec.tracing
    if own is None:
        return base
    return ir.GatewayTracing(
        base.sampling if own.sampling is None else own.sampling,
        base.client_context if own.clientContext is None else own.clientContext,
    )


def _gateway_of(route: Loaded, gateways: dict[str, ir.GatewayTracing]) -> ir.GatewayTracing | None:
    """The settings of the gateway a Route attaches to (the only one, when it names none)."""
    assert isinstance(route.obj, Route)
    ref = route.obj.spec.gateway
    if ref is None:
        return next(iter(gateways.values()), None) if len(gateways) == 1 else None
    key = ref if "/" in ref else f"{route.namespace}/{ref}"
    return gateways.get(key)
