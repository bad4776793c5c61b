"""Tracing for Istio: the same Mesh.spec.tracing as Envoy's OpenTelemetry tracer under istiod.

- meshConfig.extensionProviders: `meshfn-otlp`, an `opentelemetry` provider pointing at the
  collector (the policy's, else the render options', from the Helm value tracing.collector);
  OTLP over HTTP when the collector takes HTTP, gRPC otherwise.
- Telemetry `tracing`: the mesh-wide default in the root namespace, and on every workload
  Telemetry meshfn renders (a workload's Telemetry replaces the mesh's for it): the provider,
  the gateway's sampling, the tags Istio can take from verified data (the caller's SPIFFE ID at
  sidecars; the tenant from the claim header jwt_authn writes where one is written).
- An EnvoyFilter per gateway for what Telemetry cannot say: each route's tracing (its sampling
  and its route and model tags, the fragment the translator sets: meshfn.xds.fragments.tracing)
  and, where client context restarts, the early header mutation that drops a client's trace
  headers before Envoy reads them.

What differs from raw Envoy (docs/concepts/tracing.md): Istio's opentelemetry provider offers
no parent-based sampler, so a gateway that honors client context keeps the client's trace id
and parent but decides sampling again at its own rate (a sampled parent stays sampled only where
that decision agrees); and the tenant tag needs a claim header (Istio keeps jwt_authn's payload
under the issuer's name, which a tag cannot address).
"""

from __future__ import annotations

from meshfn import ir
from meshfn.contracts.tracing import CLIENT_CONTEXT_HEADERS, TAG_PRINCIPAL, TAG_TENANT
from meshfn.xds.fragments import tracing as fragments
from meshfn.xds.fragments.headers import early_header_removal
from meshfn.xds.fragments.messages import envoy_json, seconds
from meshfn.xds.names import degraded_route_name, route_name

from .core import Context, Obj, Source, gateways, mesh_source, resource, rolled_out

PROVIDER = "meshfn-otlp"
NETWORKING = "networking.istio.io/v1alpha3"
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
PRIORITY = 20  # after meshfn's other EnvoyFilters (10): these only add route tracing


def collector(ctx: Context) -> ir.TraceCollector | None:
    """Where spans go: the policy's collector, else the render options' (Helm)."""
    tracing = ctx.model.tracing
    if tracing is None:
        return None
    return tracing.collector or ctx.options.collector


def active(ctx: Context) -> ir.Tracing | None:
    """The mesh's tracing, where it can be rendered (a collector is known); warns otherwise."""
    tracing = ctx.model.tracing
    if tracing is None:
        return None
    if collector(ctx) is None:
        ctx.warn(
            "tracing-no-collector",
            mesh_source(ctx.model),
            ("spec", "tracing", "collector"),
            "tracing needs a collector on Kubernetes: set spec.tracing.collector or the Helm"
            " value tracing.collector; nothing of tracing is rendered",
        )
        return None
    return tracing


def provider(ctx: Context) -> Obj | None:
    """The meshConfig.extensionProviders entry."""
    found = collector(ctx)
    if found is None:
        return None
    otel: Obj = {"service": found.host.strip("[]"), "port": found.port}
    if found.protocol == "http":
        otel["http"] = {"path": found.path, "timeout": seconds(found.timeout)}
    return {"name": PROVIDER, "opentelemetry": otel}


def _tenant_header(ctx: Context, workload: ir.Workload, claims: dict[str, str]) -> str | None:
    tracing = ctx.model.tracing
    assert tracing is not None
    header = next((h for h, c in sorted(claims.items()) if c == tracing.tenant_claim), None)
    if header is None and workload.jwt_rules:
        kind = "Gateway" if workload.kind == "gateway" else "Service"
        ctx.warn(
            "tracing-tenant-tag",
            Source(kind, workload.namespace, workload.name),
            ("spec", "tracing", "tags"),
            "Istio keeps jwt_authn's verified payload under the issuer's name, which a span tag"
            f" cannot address: the tenant tag needs the {tracing.tenant_claim!r} claim written"
            " to a header meshfn strips from clients (a QoSPolicy's or the audit's claim"
            " header); this workload's spans carry no tenant",
        )
    return header


def workload_tracing(ctx: Context, workload: ir.Workload, claims: dict[str, str]) -> list[Obj]:
    """A workload Telemetry's `tracing` (empty where the mesh does not trace). `claims`: the
    verified claim headers jwt_authn writes on it (header -> claim)."""
    tracing = active(ctx)
    if tracing is None:
        return []
    gateway = workload.kind == "gateway"
    settings = tracing.gateway(workload.key) if gateway else None
    entry: Obj = {
        "providers": [{"name": PROVIDER}],
        "randomSamplingPercentage": settings.sampling if settings else tracing.sampling,
    }
    tags: Obj = {}
    if "tenant" in tracing.tags and workload.jwt_rules:
        header = _tenant_header(ctx, workload, claims)
        if header is not None:
            tags[TAG_TENANT] = {"header": {"name": header}}
    if "principal" in tracing.tags and not gateway:
        tags[TAG_PRINCIPAL] = {"formatter": {"value": fragments.PEER_PRINCIPAL}}
    if tags:
        entry["customTags"] = tags
    if not gateway:
        entry["match"] = {"mode": "SERVER"}
    return [entry]


def mesh_telemetry(ctx: Context) -> None:
    """The mesh-wide default (root namespace): every workload without a Telemetry of meshfn's."""
    tracing = active(ctx)
    if tracing is None:
        return
    spec = {
        "tracing": [
            {"providers": [{"name": PROVIDER}], "randomSamplingPercentage": tracing.sampling}
        ]
    }
    ctx.emit(
        resource(
            "telemetry.istio.io/v1", "Telemetry", "meshfn-tracing", ctx.options.root_namespace, spec
        ),
        mesh_source(ctx.model),
    )


def _route_patch(name: str, value: Obj) -> Obj:
    return {
        "applyTo": "HTTP_ROUTE",
        "match": {"context": "GATEWAY", "routeConfiguration": {"vhost": {"route": {"name": name}}}},
        "patch": {"operation": "MERGE", "value": {"tracing": value}},
    }


def gateway_filters(ctx: Context, guarded: dict[str, frozenset[str]]) -> None:
    """Per gateway, its routes' tracing and (restart) the removal of client trace headers.
    `guarded`: per gateway key, the routes with a degraded twin in the route table. One patch
    per route name: a rolled-out match's pinned tenants and split share theirs."""
    tracing = active(ctx)
    if tracing is None:
        return
    for gw in gateways(ctx.model):
        settings = tracing.gateway(gw.key)
        sources = {Source("Gateway", gw.namespace, gw.name), mesh_source(ctx.model)}
        patches: list[Obj] = []
        if settings.client_context == "restart":
            mutation = envoy_json(early_header_removal(CLIENT_CONTEXT_HEADERS))
            manager = {"@type": HCM_TYPE, "early_header_mutation_extensions": [mutation]}
            patches.append(
                {
                    "applyTo": "NETWORK_FILTER",
                    "match": {
                        "context": "GATEWAY",
                        "listener": {"filterChain": {"filter": {"name": HCM}}},
                    },
                    "patch": {
                        "operation": "MERGE",
                        "value": {"name": HCM, "typed_config": manager},
                    },
                }
            )
        twins = guarded.get(gw.key, frozenset())
        for listener in gw.listeners:
            for route in listener.routes:
                value = envoy_json(fragments.route_tracing(tracing, settings, route, sampler=False))
                names = [route_name(route.key, i) for i in range(len(route.matches))]
                if route.key in twins:  # a rollout's split has no degraded twin in Istio
                    names += [
                        degraded_route_name(route.key, i)
                        for i in range(len(route.matches))
                        if rolled_out(ctx.model, route, i) is None
                    ]
                patches += [_route_patch(name, value) for name in names]
                if tracing.route_sampling(route.key) is not None:
                    sources.add(Source("Route", route.namespace, route.name))
        spec = {
            "workloadSelector": {"labels": ctx.options.labels(gw.name)},
            "priority": PRIORITY,
            "configPatches": patches,
        }
        ctx.emit(
            resource(NETWORKING, "EnvoyFilter", f"meshfn-{gw.name}-tracing", gw.namespace, spec),
            *sorted(sources),
        )
