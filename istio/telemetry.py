"""Telemetry, and the meshConfig snippet its providers need.

- `meshfn-latency`: Envoy's gRPC access-log stream (ALS) to the control plane, from gateways with
  drift-guarded routes or a rolled-out Function: the drift breaker's and the rollout
  controller's input (route names are meshfn's: the VirtualService routes carry them; a
  rollout's versions are its subsets' clusters).
- `meshfn-audit` / `meshfn-audit-bare`: the audit journal, Envoy's file access log with the
  collector's record format (meshfn.xds.fragments.plugins.access_log_format), on every audited
  workload. A workload-level Telemetry replaces the providers of namespace and mesh levels for that
  workload, so ours list every provider the workload needs.
- `meshfn-otlp`: Envoy's OpenTelemetry tracer, where the Mesh traces: the `tracing` of every
  Telemetry here, a mesh-wide one, and the EnvoyFilters of the routes' tracing
  (meshfn.istio.tracing).

How records reach the audit store: Envoy writes each request's line to `journal_path` in the
istio-proxy container, a hostPath volume the node's collector tails (offsets committed with the
records, exactly once). What can be lost: the lines in Envoy's file buffer when the proxy dies
uncleanly (at most Envoy's flush interval, `--file-flush-interval-msec`, 10 s unless istio-proxy
sets it, and at most 64 KiB), the same bound as in raw mode; a pod deleted before the collector
read its file loses nothing, since the volume is the node's.
"""

from __future__ import annotations

from meshfn import ir
from meshfn.contracts.plugins import AuditSettings, bare_filter_state
from meshfn.contracts.tracing import TRACEPARENT
from meshfn.xds.fragments.messages import seconds
from meshfn.xds.fragments.plugins import access_log_format
from meshfn.xds.names import LATENCY_LOG, LATENCY_LOG_FILTER

from . import tracing
from .core import Context, Obj, Source, gateways, mesh_source, resource, sidecar_services
from .plugins import audit_for, claim_headers_for, guarded

TELEMETRY = "telemetry.istio.io/v1"
LATENCY_PROVIDER = "meshfn-latency"


def audit_provider(settings: AuditSettings) -> str:
    return "meshfn-audit-bare" if bare_filter_state(settings) else "meshfn-audit"


def istio_log_format(settings: AuditSettings) -> dict[str, str]:
    """The collector's fields; the tenant from the claim header jwt_authn wrote (Istio keeps
    jwt_authn's payload under the issuer's name, which an access-log command cannot address).
    No gateway is believed for the mesh route: Istio's gateways do not set x-meshfn-route, and
    the providers are mesh-wide (records name Envoy's route, which carries meshfn's name)."""
    fields = access_log_format(settings, trusted_gateways=())
    if "tenant" in fields:
        fields["tenant"] = f"%REQ({settings.tenant_header.upper()})%"
    return fields


def _rolls_out(model: ir.MeshModel, workload: ir.Workload) -> bool:
    """The gateway carries a rolled-out Function's routes (the controller reads its stream)."""
    return any(
        route.function and model.rollout_of(f"{route.namespace}/{route.function}")
        for listener in workload.listeners
        for route in listener.routes
    )


def _providers(ctx: Context, workload: ir.Workload) -> list[str]:
    names = []
    if workload.kind == "gateway" and (
        any(guarded(ctx.model, lst) for lst in workload.listeners)
        or _rolls_out(ctx.model, workload)
    ):
        names.append(LATENCY_PROVIDER)
    audit = audit_for(ctx, workload)
    if audit is not None:
        names.append(audit_provider(audit))
    return names


def telemetries(ctx: Context) -> None:
    targets: list[tuple[ir.Workload, str, Source]] = [
        (gw, gw.name, Source("Gateway", gw.namespace, gw.name)) for gw in gateways(ctx.model)
    ]
    for service in sidecar_services(ctx.model):
        sidecar = next(
            w for w in ctx.model.workloads if w.inbound and w.inbound.service == service.key
        )
        targets.append((sidecar, service.name, Source("Service", service.namespace, service.name)))
    for workload, name, source in targets:
        providers = _providers(ctx, workload)
        traced = tracing.workload_tracing(ctx, workload, claim_headers_for(ctx, workload))
        if not providers and not traced:
            continue
        # the latency stream carries only requests sent on an upstream connection (as meshfn's own
        # gateways send it), the audit journal every request
        logging: list[Obj] = [
            {"providers": [{"name": p}], "filter": {"expression": LATENCY_LOG_FILTER}}
            if p == LATENCY_PROVIDER
            else {"providers": [{"name": p}]}
            for p in providers
        ]
        if workload.kind == "sidecar":
            # the requests the workload serves, not its own outbound calls (Istio's default
            # for a log without a match is CLIENT_AND_SERVER), as the audit plugin's match
            for entry in logging:
                entry["match"] = {"mode": "SERVER"}
        spec: Obj = {"selector": {"matchLabels": ctx.options.labels(name)}}
        if logging:
            spec["accessLogging"] = logging
        if traced:
            spec["tracing"] = traced
        ctx.emit(
            resource(TELEMETRY, "Telemetry", f"meshfn-{name}", workload.namespace, spec),
            source,
            mesh_source(ctx.model),
        )
    tracing.mesh_telemetry(ctx)
    tracing.gateway_filters(
        ctx,
        {
            gw.key: frozenset().union(*(guarded(ctx.model, lst) for lst in gw.listeners))
            for gw in gateways(ctx.model)
        },
    )


def mesh_config(ctx: Context) -> Obj:
    """For istiod's mesh config (IstioOperator `spec.meshConfig`, Helm `meshConfig`)."""
    model = ctx.model
    providers: list[Obj] = [
        {
            "name": LATENCY_PROVIDER,
            "envoyHttpAls": {
                "service": ctx.options.control_plane_host,
                "port": model.xds_port,
                "logName": LATENCY_LOG,
                # a trip names slow traces (the drift breaker's exemplars)
                "additionalRequestHeadersToLog": [TRACEPARENT],
            },
        }
    ]
    traced = tracing.provider(ctx)
    if traced is not None:
        providers.append(traced)
    seen = set()
    for workload in model.workloads:
        audit = audit_for(ctx, workload)
        if audit is None or audit_provider(audit) in seen:
            continue
        seen.add(audit_provider(audit))
        providers.append(
            {
                "name": audit_provider(audit),
                "envoyFileAccessLog": {
                    "path": ctx.options.journal_path,
                    "logFormat": {"labels": istio_log_format(audit)},
                },
            }
        )
    return {
        "meshConfig": {
            "trustDomain": model.trust_domain,
            # meshfn's proxies decode %2F and %5C, normalise paths and merge slashes before
            # matching (contracts.proxy.REQUEST_HYGIENE)
            "pathNormalization": {"normalization": "DECODE_AND_MERGE_SLASHES"},
            # workload certificates live as long as meshfn's (Mesh.spec.identity.certificateTTL)
            "defaultConfig": {"proxyMetadata": {"SECRET_TTL": seconds(model.certificate_ttl)}},
            "extensionProviders": sorted(providers, key=lambda p: p["name"]),
        }
    }
