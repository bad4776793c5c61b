"""A gateway: every service as a cluster, fallback chains as aggregates, and per listener a
Listener, its RouteConfiguration and what its HTTP filters refer to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf.message import Message

from meshfn import ir
from meshfn.contracts.qos import LIMIT_SERVICE_NODE_HEADER

from ..fragments.plugins import route_settings
from ..names import (
    CLUSTER,
    ENDPOINT,
    EXTENSION,
    LISTENER,
    ROUTE,
    cluster_name,
    traced_gateway_name,
)
from . import httpfilters
from .clusters import cluster, fallback_cluster, function_cluster, version_cluster
from .endpoints import load_assignment, tier_assignments
from .host import ProxyHost
from .httpfilters import FilterContext, QoSContext
from .httpfilters.base import AuditConfig, RouteConfig
from .httpfilters.degrade import degrade_for
from .httpfilters.tracing import split_gateway_routes, traced_inbound_cluster, tracing_for
from .listeners import listener, traced_listener
from .resources import Resources, merge
from .routes import (
    Target,
    Versions,
    function_target,
    rollout_versions,
    route_configuration,
    target_for,
)


def gateway_resources(
    model: ir.MeshModel,
    workload: ir.Workload,
    overlay: ir.Overlay,
    host: ProxyHost,
    audit: AuditConfig | None,
    limit_service_token: str | None = None,
) -> Resources:
    """Every service of the mesh becomes a cluster, not only those the current routes use
    (Istio's default without a Sidecar resource): when a route moves from one service to
    another, or Envoy NACKs a new route table and keeps the old one, the clusters the routes in
    force point at still exist."""
    built = _Clusters.of(model.services, workload.locality)
    targets = built.targets(model)
    built.add_shedding_twins(model.services, targets)
    versions = rollout_versions(model, overlay)
    built.add_version_twins(model, versions, targets)
    out: Resources = {
        LISTENER: {},
        ROUTE: {},
        CLUSTER: built.clusters,
        ENDPOINT: built.endpoints,
        EXTENSION: {},
    }
    limit_service_metadata = (
        ((LIMIT_SERVICE_NODE_HEADER, workload.node_cluster), ("authorization", limit_service_token))
        if limit_service_token and workload.qos is not None and workload.qos.global_rate
        else ()
    )
    workload_tracing = tracing_for(model, workload, host)
    for lst in workload.listeners:
        used = sorted({r.service for r in lst.routes})
        guarded = frozenset(r.key for r in lst.routes if targets[r.service].drift)
        route = model_router(model, lst, host)
        qos = qos_context(workload.qos, lst, limit_service_metadata)
        tracing = workload_tracing
        if tracing is not None and tracing.split and qos is not None and qos.shed:
            # A listener that sheds keeps its tracer on itself: its internal listener answers
            # some sampled requests it sheds with Envoy's bare 503 (UO, `x-envoy-overloaded`,
            # after ~13 ms: a retry's overflow?) instead of the shed reply (e2e/test_qos: 1 of
            # 600 in one run of ~15, 11 of 600 once; cause not yet found).
            tracing = dataclasses.replace(tracing, split=False)
        filters = FilterContext(
            workload.jwt_rules,
            workload.authz,
            audit,
            degrade_for(lst, guarded, model.drill, host.wasm_dir, workload.qos),
            qos=qos,
            mesh_route=model.audit is not None,
            tracing=tracing,
            route=route,
            openai=route is not None and route.openai,
        )
        rolled = sorted(
            {
                key
                for r in lst.routes
                if r.function and (key := f"{r.namespace}/{r.function}") in versions
            }
        )
        # the access-log stream feeds the drift breaker and the rollout controller
        watched = bool(rolled) or any(model.service(key).drift is not None for key in used)
        out[LISTENER][lst.name] = listener(lst, filters, watched)
        out[ROUTE][lst.name] = route_configuration(
            lst,
            tuple((key, targets[key]) for key in used),
            httpfilters.request_headers_to_remove(filters),
            model.audit is not None,
            gateway_qos=workload.qos,
            tracing=tracing,
            rollouts=tuple((key, versions[key]) for key in rolled),
        )
        # every gateway listener has its internal listener, split or not and tracing on or
        # off: no route ever points at one that is not there yet (routes come before listeners)
        split = tracing if tracing is not None and tracing.split else None
        if split is not None:
            out[ROUTE][lst.name] = split_gateway_routes(split, out[ROUTE][lst.name])
        traced = traced_gateway_name(lst.name)
        out[LISTENER][traced] = traced_listener(lst, split, filters)
        out[CLUSTER][traced] = traced_inbound_cluster(True, traced)
        merge(out, httpfilters.resources(filters, overlay))
    return out


@dataclass
class _Clusters:
    """A gateway's clusters and endpoints by name: one per service, then what fallback chains
    (aggregates, locality tiers) and gateway shedding (a Function's twins) add."""

    proxy: ir.Locality
    clusters: dict[str, Message]
    endpoints: dict[str, Message]
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, services: tuple[ir.Service, ...], proxy: ir.Locality) -> _Clusters:
        return cls(
            proxy,
            {cluster_name(s.key): cluster(s) for s in services},
            {cluster_name(s.key): load_assignment(s, proxy) for s in services},
        )

    def members_of(self, service: ir.Service) -> tuple[str, ...]:
        """How a service joins an aggregate: as itself, or one cluster per locality tier."""
        if service.key not in self.members:
            if service.traffic is not None and service.traffic.locality_failover:
                tiers = tier_assignments(service, self.proxy)
                for assignment in tiers:
                    self.clusters[assignment.cluster_name] = cluster(
                        service, assignment.cluster_name
                    )
                    self.endpoints[assignment.cluster_name] = assignment
                self.members[service.key] = tuple(a.cluster_name for a in tiers)
            else:
                self.members[service.key] = (cluster_name(service.key),)
        return self.members[service.key]

    def add_aggregates(
        self, service: ir.Service, chain: tuple[str, ...], tail: tuple[str, ...]
    ) -> None:
        """The aggregate over the whole chain, and over its tail alone where a drift breaker
        can skip the primary."""
        groups = [chain]
        if service.drift is not None and len(tail) > 1:
            groups.append(tail)
        for group in groups:
            aggregate = fallback_cluster(
                group, service.traffic.breakers if service.traffic else None
            )
            self.clusters[aggregate.name] = aggregate

    def targets(self, model: ir.MeshModel) -> dict[str, Target]:
        """Where each service's routes go: its cluster, or its fallback chain's aggregate."""
        targets: dict[str, Target] = {}
        for service in model.services:
            chain = tuple(model.service(key) for key in service.fallback)
            if not chain:
                targets[service.key] = target_for(service)
                continue
            primary = self.members_of(service)
            tail = tuple(name for fallback in chain for name in self.members_of(fallback))
            self.add_aggregates(service, primary + tail, tail)
            targets[service.key] = target_for(service, primary + tail, tail)
        return targets

    def add_shedding_twins(
        self, services: tuple[ir.Service, ...], targets: dict[str, Target]
    ) -> None:
        """QoS gateway shedding: each Function's twin clusters (routes.py)."""
        for service in services:
            target = targets[service.key]
            for function, limits in service.function_shed:
                for name in dict.fromkeys((target.cluster, *target.members)):
                    base = self.clusters[name]
                    assert isinstance(base, cluster_pb2.Cluster)
                    twin = function_cluster(base, function, limits)
                    self.clusters[twin.name] = twin
                twins = function_target(target, function)
                if twins.tail:
                    self.add_aggregates(service, twins.members, twins.tail)

    def add_version_twins(
        self, model: ir.MeshModel, versions: dict[str, Versions], targets: dict[str, Target]
    ) -> None:
        """A rolled-out Function's twins of its target's clusters, per version (routes.py)."""
        for key, split in versions.items():
            function = model.function(key)
            assert function is not None
            service = model.service(function.backend)
            target = targets[service.key]
            for version in (split.stable, split.candidate):
                for name in dict.fromkeys((target.cluster, *target.members)):
                    base = self.clusters[name]
                    assert isinstance(base, cluster_pb2.Cluster)
                    twin = version_cluster(base, function.name, version)
                    self.clusters[twin.name] = twin
                twins = split.target(target, version)
                if twins.tail:
                    self.add_aggregates(service, twins.members, twins.tail)


def model_router(model: ir.MeshModel, lst: ir.Listener, host: ProxyHost) -> RouteConfig | None:
    """The listener's model router, if it routes requests by the model their body names."""
    settings = route_settings(model, lst)
    if settings is None:
        return None
    return RouteConfig.of(lst.name, settings, host.wasm_dir)


def qos_context(
    gateway: ir.QoSPolicy | None,
    lst: ir.Listener,
    limit_service_metadata: tuple[tuple[str, str], ...] = (),
) -> QoSContext | None:
    """The listener's QoS: the gateway's policy and those its routes carry (policy checks make
    them read one claim)."""
    policies = [p for p in (gateway, *(r.qos for r in lst.routes)) if p is not None]
    if not policies:
        return None
    return QoSContext(
        policies[0].claim,
        gateway,
        any(p.rate_limited for p in policies),
        limit_service_metadata,
        any(p.gateway_shed for p in policies),
    )
