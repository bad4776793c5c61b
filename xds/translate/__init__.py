"""MeshModel -> Envoy resources for one workload. Pure and deterministic; golden-tested."""

from __future__ import annotations

from google.protobuf.message import Message

from meshfn import ir

from ..names import CLUSTER, ENDPOINT, EXTENSION, LISTENER, ROUTE, SECRET, cluster_name
from .clusters import cluster, fallback_cluster
from .endpoints import load_assignment, tier_assignments
from .extensions import (
    OFFLINE_HOST,
    Audit,
    ProxyHost,
    audit_for,
    degrade_extension,
    degrade_filter_name,
    degrade_settings,
    strip_internal_headers,
)
from .listeners import listener
from .resources import Resources
from .routes import Target, route_configuration, target_for
from .security import Credentials, jwks_cluster, jwks_uris, secrets
from .sidecar import sidecar_resources

NO_OVERLAY = ir.Overlay()


def translate(
    model: ir.MeshModel,
    node_cluster: str,
    credentials: Credentials | None = None,
    overlay: ir.Overlay = NO_OVERLAY,
    host: ProxyHost = OFFLINE_HOST,
) -> Resources | None:
    """Everything an Envoy of workload `node_cluster` needs, or None for an unknown workload.

    Every service of the mesh becomes a cluster on a gateway, not only those the current routes
    use (Istio's default without a Sidecar resource): when a route moves from one service to
    another, or Envoy NACKs a new route table and keeps the old one, the clusters the routes in
    force point at still exist. `credentials` (certificate, key, trust bundle) become the SDS
    secrets; without them the secrets are left out (offline rendering, golden files). `overlay`
    carries runtime state such as routes the drift breaker has tripped. `host` says where the
    built wasm filters and audit journals are and holds the subject salt.
    """
    workload = model.workload(node_cluster)
    if workload is None:
        return None
    out: Resources
    audit = audit_for(model, workload, host)
    if workload.kind == "sidecar":
        out = sidecar_resources(workload, audit)
    else:
        out = _gateway(model, workload, overlay, host, audit)
    if credentials is not None:
        out[SECRET] = dict(secrets(credentials))
    return out


def _gateway(
    model: ir.MeshModel,
    workload: ir.Workload,
    overlay: ir.Overlay,
    host: ProxyHost,
    audit: Audit | None,
) -> Resources:
    services = model.services
    proxy = workload.locality
    clusters: dict[str, Message] = {cluster_name(s.key): cluster(s) for s in services}
    endpoints: dict[str, Message] = {
        cluster_name(s.key): load_assignment(s, proxy) for s in services
    }
    members: dict[str, tuple[str, ...]] = {}

    def members_of(service: ir.Service) -> tuple[str, ...]:
        """How a service joins an aggregate: as itself, or one cluster per locality tier."""
        if service.key not in members:
            if service.traffic is not None and service.traffic.locality_failover:
                tiers = tier_assignments(service, proxy)
                for assignment in tiers:
                    clusters[assignment.cluster_name] = cluster(service, assignment.cluster_name)
                    endpoints[assignment.cluster_name] = assignment
                members[service.key] = tuple(a.cluster_name for a in tiers)
            else:
                members[service.key] = (cluster_name(service.key),)
        return members[service.key]

    targets: dict[str, Target] = {}
    for service in services:
        chain = tuple(model.service(key) for key in service.fallback)
        if not chain:
            targets[service.key] = target_for(service)
            continue
        primary = members_of(service)
        tail = tuple(name for fallback in chain for name in members_of(fallback))
        groups = [primary + tail]
        if service.drift is not None and len(tail) > 1:
            groups.append(tail)
        for group in groups:
            aggregate = fallback_cluster(
                group, service.traffic.breakers if service.traffic else None
            )
            clusters[aggregate.name] = aggregate
        targets[service.key] = target_for(service, primary + tail, tail)
    for uri in jwks_uris(workload.jwt_rules):
        jwks = jwks_cluster(uri)
        clusters[jwks.name] = jwks
    listeners: dict[str, Message] = {}
    routes: dict[str, Message] = {}
    extensions: dict[str, Message] = {}
    for lst in workload.listeners:
        used = sorted({r.service for r in lst.routes})
        drift = any(model.service(key).drift is not None for key in used)
        guarded = frozenset(r.key for r in lst.routes if targets[r.service].drift)
        degrade = degrade_filter_name(lst, audit) if guarded else None
        drill = model.drill if degrade is not None else None
        if degrade is not None:
            settings = degrade_settings(lst, guarded, overlay.degraded_routes, drill)
            extensions[degrade] = degrade_extension(degrade, settings, audit, host)
        listeners[lst.name] = listener(
            lst, workload.jwt_rules, workload.authz, drift, audit, degrade, drill
        )
        routes[lst.name] = strip_internal_headers(
            route_configuration(lst, tuple((key, targets[key]) for key in used)),
            audit,
            degrade is not None,
            drill,
        )
    return {
        LISTENER: listeners,
        ROUTE: routes,
        CLUSTER: clusters,
        ENDPOINT: endpoints,
        EXTENSION: extensions,
    }


__all__ = ["OFFLINE_HOST", "Credentials", "ProxyHost", "Resources", "translate"]
