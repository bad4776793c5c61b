"""Which of meshfn's filters each Istio workload runs, with the settings from
meshfn.xds.fragments.plugins (the builders the xDS translator uses: the same JSON either way)."""

from __future__ import annotations

from dataclasses import dataclass

from meshfn import ir
from meshfn.contracts.plugins import (
    AuditSettings,
    DegradeSettings,
    FilterKind,
    MeshfnSettings,
    RouteSettings,
    bare_filter_state,
    internal_headers,
)
from meshfn.contracts.qos import TENANT_HEADER
from meshfn.xds.fragments import qos as envoy_qos
from meshfn.xds.fragments.plugins import (
    audit_settings,
    claim_header_pairs,
    degrade_settings,
    drill_trigger,
    route_settings,
)

from .core import Context


@dataclass(frozen=True)
class Plugin:
    """One WasmPlugin: `listener` names the gateway listener it serves (None: a sidecar)."""

    kind: FilterKind
    settings: AuditSettings | DegradeSettings | MeshfnSettings
    listener: ir.Listener | None = None

    @property
    def audit(self) -> AuditSettings | None:
        if isinstance(self.settings, AuditSettings):
            return self.settings
        return self.settings.audit if isinstance(self.settings, MeshfnSettings) else None

    @property
    def degrade(self) -> DegradeSettings | None:
        if isinstance(self.settings, DegradeSettings):
            return self.settings
        return self.settings.degrade if isinstance(self.settings, MeshfnSettings) else None

    @property
    def route(self) -> RouteSettings | None:
        return self.settings.route if isinstance(self.settings, MeshfnSettings) else None


def audit_for(ctx: Context, workload: ir.Workload) -> AuditSettings | None:
    audit = ctx.model.audit
    if audit is None or not audit.records(workload.kind):
        return None
    return audit_settings(audit, ctx.options.salt, bool(workload.jwt_rules))


def guarded(model: ir.MeshModel, listener: ir.Listener) -> frozenset[str]:
    """Routes of the listener a drift breaker may send down their chain."""
    return frozenset(
        r.key
        for r in listener.routes
        if model.service(r.service).drift is not None and model.service(r.service).fallback
    )


def plugins_of(ctx: Context, workload: ir.Workload) -> list[Plugin]:
    """As the translator: per gateway listener ONE plugin (meshfn) where it both audits and
    degrades, else the degrade filter where routes are guarded, else audit; a sidecar audits or
    runs nothing. The model router is not a WasmPlugin here (routers_of)."""
    audit = audit_for(ctx, workload)
    if workload.kind == "sidecar":
        return [Plugin("audit", audit)] if audit is not None else []
    out = []
    for listener in workload.listeners:
        routes = guarded(ctx.model, listener)
        degrade = (
            degrade_settings(listener, routes, ctx.overlay.degraded_routes, ctx.model.drill)
            if routes
            else None
        )
        if degrade is not None and audit is not None:
            out.append(Plugin("meshfn", MeshfnSettings(audit=audit, degrade=degrade), listener))
        elif degrade is not None:
            out.append(Plugin("degrade", degrade, listener))
        elif audit is not None:
            out.append(Plugin("audit", audit, listener))
    return out


def routers_of(ctx: Context, workload: ir.Workload) -> list[Plugin]:
    """The model router of each gateway listener with OpenAI routes: the meshfn plugin with only
    its route part, first in the chain (envoyfilter.router_patches). Not a WasmPlugin: the
    router holds the headers until it has read the body, which Envoy allows a wasm plugin only
    with its PluginConfig's allow_on_headers_stop_iteration, a field WasmPlugin does not have."""
    if workload.kind == "sidecar":
        return []
    out = []
    for listener in workload.listeners:
        route = route_settings(ctx.model, listener)
        if route is not None:
            out.append(Plugin("meshfn", MeshfnSettings(route=route), listener))
    return out


def claim_headers_for(ctx: Context, workload: ir.Workload) -> dict[str, str]:
    """header -> claim pairs jwt_authn must write on this workload. Beyond the translator's
    pairs, the audit tenant always travels in a header here: Istio stores jwt_authn's payload
    under the issuer's name, which the access log cannot address (an issuer URL has ':')."""
    out: dict[str, str] = {}
    for plugin in plugins_of(ctx, workload):
        audit = plugin.audit
        trigger = drill_trigger(ctx.model.drill) if plugin.degrade is not None else None
        out.update(claim_header_pairs(audit, trigger))
        if audit is not None and audit.subject_source == "jwt_headers" and audit.tenant_claim:
            out[audit.tenant_header] = audit.tenant_claim
    claim = envoy_qos.claim_of(workload)
    if claim is not None:  # the QoS tenant: the rate limit and the inference backend read it
        out[TENANT_HEADER] = claim
    return out


def logged_headers(ctx: Context, workload: ir.Workload) -> set[str]:
    """Claim headers the access log reads when the request is done: a bare audit's tenant
    (telemetry.istio_log_format). A route's request_headers_to_remove edits the very header map
    the access log reads afterwards (measured with Envoy 1.40: the tenant logged as null), so
    these must reach the application: jwt_authn wrote them from the verified token, after the
    early header mutation removed any a client sent."""
    audit = audit_for(ctx, workload)
    if audit is not None and bare_filter_state(audit) and audit.tenant_claim:
        return {audit.tenant_header}
    return set()


def stripped_headers(ctx: Context, workload: ir.Workload) -> list[str]:
    """Headers only Envoy may set on this workload (removed from client requests before any
    route is picked or filter runs): the routing header, the claim headers."""
    names: list[str] = []
    for plugin in [*plugins_of(ctx, workload), *routers_of(ctx, workload)]:
        names += internal_headers(plugin.degrade, plugin.audit, route=plugin.route)
    if envoy_qos.claim_of(workload) is not None:
        names.append(TENANT_HEADER)
    return sorted(set(names))
