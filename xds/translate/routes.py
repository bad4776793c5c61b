"""Listener routes -> RouteConfiguration: one virtual host per host name, routes by precedence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.type.matcher.v3 import metadata_pb2
from google.protobuf import any_pb2, json_format, struct_pb2, wrappers_pb2

from meshfn import ir
from meshfn.contracts.naming import priority_route_name
from meshfn.contracts.plugins import MESH_ROUTE_HEADER, MESH_ROUTE_KEY, ROUTE_METADATA
from meshfn.contracts.qos import ORCA_HEADERS
from meshfn.contracts.rollout import ROLLOUT_AUTHORITY
from meshfn.ir.routing import precedence

from .. import names
from ..fragments import qos as envoy_qos
from ..fragments import rollout as versions_split
from ..fragments import tracing as envoy_tracing
from ..fragments.messages import duration
from ..fragments.routes import (
    degraded_clusters,
    degraded_match,
    path_rewrite,
    retry_policy,
    route_match,
)
from ..names import (
    cluster_name,
    fallback_cluster_name,
    function_cluster_name,
    version_cluster_name,
)
from .httpfilters.base import TracingContext
from .httpfilters.qos import rate_limit_config


@dataclass(frozen=True)
class Target:
    """Where a route's destination service sends traffic: its own cluster, and with a fallback
    chain the aggregate members in order (`members`) and those after the primary (`tail`)."""

    cluster: str
    members: tuple[str, ...] = ()
    tail: tuple[str, ...] = ()
    chain: tuple[str, ...] = ()  # service cluster names, for the 503 body
    probe_percent: int = 0
    locality_failover: bool = False
    drift: bool = False  # a drift breaker may send it down the chain (see degraded_routes)
    shed: bool = False  # per-priority circuit breakers (QoS gateway shedding)
    functions: frozenset[str] = frozenset()  # Functions with a cluster of their own

    @property
    def normal_cluster(self) -> str:
        return fallback_cluster_name(self.members) if self.tail else self.cluster

    @property
    def degraded_cluster(self) -> str:
        return fallback_cluster_name(self.tail) if len(self.tail) > 1 else self.tail[0]


def target_for(
    service: ir.Service, members: tuple[str, ...] = (), tail: tuple[str, ...] = ()
) -> Target:
    return Target(
        cluster=cluster_name(service.key),
        members=members,
        tail=tail,
        chain=tuple(cluster_name(key) for key in service.fallback),
        probe_percent=service.drift.probe_percent if service.drift else 0,
        locality_failover=bool(service.traffic and service.traffic.locality_failover),
        drift=service.drift is not None and bool(tail),
        shed=service.shed is not None,
        functions=frozenset(name for name, _ in service.function_shed),
    )


def function_target(target: Target, function: str) -> Target:
    """Where a Function's own routes go at a shedding gateway: the twin of every cluster of
    the service's target (its fallback chain's too), with the function's circuit breakers."""

    def twin(name: str) -> str:
        return function_cluster_name(name, function)

    return replace(
        target,
        cluster=twin(target.cluster),
        members=tuple(map(twin, target.members)),
        tail=tuple(map(twin, target.tail)),
    )


@dataclass(frozen=True)
class Versions:
    """A rolled-out Function's traffic at the gateway now: `weight` percent to the candidate,
    `mirror` percent copied to it, and (until the rollout ends) its pinned tenants."""

    function: str  # the Function's name
    stable: str
    candidate: str
    weight: int
    mirror: int
    pinning: ir.Pinning | None = None

    def target(self, target: Target, version: str) -> Target:
        """Where one version's requests go: the twin of every cluster of the Function's
        target (its fallback chain's too), named by the version."""

        def twin(name: str) -> str:
            return version_cluster_name(name, self.function, version)

        return replace(
            target,
            cluster=twin(target.cluster),
            members=tuple(map(twin, target.members)),
            tail=tuple(map(twin, target.tail)),
        )


def rollout_versions(model: ir.MeshModel, overlay: ir.Overlay) -> dict[str, Versions]:
    """Per Function key, its rollout's traffic now (where the overlay puts it)."""
    out = {}
    for rollout in model.rollouts:
        split = overlay.split(rollout)
        out[rollout.function] = Versions(
            rollout.function_name,
            rollout.stable,
            rollout.candidate,
            split.weight,
            split.mirror,
            rollout.pinning if split.pinned else None,
        )
    return out


def _versioned(
    action: rc.RouteAction,
    target: Target,
    versions: Versions,
    degraded: bool,
    only: str | None = None,
) -> None:
    """The split between the versions' twins (`only`: a pinned tenant's one version), with
    the drift breaker's probe share inside each version once degraded, and the shadow
    mirror; and the authority only meshfn sets (contracts.rollout)."""
    weight = versions.weight * 100
    shares = {versions.stable: 10_000 - weight, versions.candidate: weight}
    if only is not None:
        shares = {v: 10_000 if v == only else 0 for v in shares}
    entries = []
    for version, share in shares.items():
        if only is not None and version != only:
            continue
        twin = versions.target(target, version)
        if degraded:
            probe = target.probe_percent
            entries.append((twin.cluster, share * probe // 100, version))
            entries.append((twin.degraded_cluster, share * (100 - probe) // 100, version))
        else:
            entries.append((twin.normal_cluster, share, version))
    action.weighted_clusters.CopyFrom(versions_split.versioned_clusters(entries))
    if versions.mirror and only is None:
        shadow = versions.target(target, versions.candidate).normal_cluster
        action.request_mirror_policies.append(versions_split.mirror(shadow, versions.mirror))
    action.host_rewrite_literal = ROLLOUT_AUTHORITY


def _action(
    route: ir.Route,
    target: Target,
    degraded: bool,
    versions: Versions | None = None,
    only: str | None = None,
) -> rc.RouteAction:
    action = rc.RouteAction()
    if versions is not None:
        _versioned(action, target, versions, degraded, only)
    elif degraded:
        # Chosen by the degrade filter once the drift breaker trips.
        action.weighted_clusters.CopyFrom(
            degraded_clusters(target.cluster, target.degraded_cluster, target.probe_percent)
        )
    else:
        action.cluster = target.normal_cluster
    if route.timeout is not None:
        action.timeout.CopyFrom(duration(route.timeout))
    if route.idle_timeout is not None:
        action.idle_timeout.CopyFrom(duration(route.idle_timeout))
    if route.rewrite is not None:
        action.regex_rewrite.CopyFrom(path_rewrite(route.rewrite))
    if route.retries is not None:
        action.retry_policy.CopyFrom(retry_policy(route.retries, target.locality_failover))
    return action


def _metadata(
    target: Target, mesh_route: str | None, qos: ir.QoSPolicy | None
) -> base_pb2.Metadata | None:
    """The chain, for the JSON body of a 503 when every member is down (see listeners.py), in
    a mesh that audits the mesh route (the gateway's audit records name it), and the QoSPolicy
    governing the route, for the JSON body of its 429s (fragments.qos)."""
    fields = {}
    if target.chain:
        fields["chain"] = struct_pb2.Value(string_value=" > ".join((target.cluster, *target.chain)))
    if mesh_route is not None:
        fields[MESH_ROUTE_KEY] = struct_pb2.Value(string_value=mesh_route)
    if qos is not None:
        fields[envoy_qos.QOS_KEY] = struct_pb2.Value(string_value=qos.key)
        fields[envoy_qos.QOS_SCOPE_KEY] = struct_pb2.Value(string_value=envoy_qos.scope(qos))
    if not fields:
        return None
    return base_pb2.Metadata(filter_metadata={ROUTE_METADATA: struct_pb2.Struct(fields=fields)})


def _mesh_route_header(route: ir.Route) -> list[base_pb2.HeaderValueOption]:
    """x-meshfn-route for the sidecar's audit record (clients' copies were stripped before the
    route was matched: httpfilters.internal_headers)."""
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=MESH_ROUTE_HEADER, value=route.key),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    ]


def _qos_per_route(route: ir.Route, gateway: ir.QoSPolicy | None) -> dict[str, any_pb2.Any]:
    """A route bound to a QoSPolicy of its own limits by it alone (Envoy's per-route config
    replaces the listener's, the gateway's policy); without one the listener's applies."""
    if route.qos is None or not (route.qos.rate_limited or (gateway and gateway.rate_limited)):
        return {}
    typed = any_pb2.Any()
    typed.Pack(rate_limit_config(route.qos))
    out = {envoy_qos.LOCAL_RATE_LIMIT: typed}
    if gateway is not None and gateway.global_rate is not None:
        # The route's own policy replaces the gateway's global rate too.
        off = any_pb2.Any()
        off.Pack(rc.FilterConfig(disabled=True))
        out[envoy_qos.GLOBAL_RATE_LIMIT] = off
    return out


def route_config_name(listener: ir.Listener) -> str:
    return names.route_config_name(listener.name)


def route_name(route: ir.Route, index: int) -> str:
    return names.route_name(route.key, index)


def degraded_route_name(route: ir.Route, index: int) -> str:
    return names.degraded_route_name(route.key, index)


def _routes(
    route: ir.Route,
    index: int,
    target: Target,
    mesh_route: bool,
    gateway_qos: ir.QoSPolicy | None = None,
    tracing: TracingContext | None = None,
    versions: Versions | None = None,
) -> list[rc.Route]:
    """The route, and for a drift-guarded target first its degraded twin: same match plus the
    internal routing header the degrade filter sets (clients cannot: the listener strips it before
    routing), so tripping the breaker changes only the filter's config, never this table. A
    rolled-out Function's route splits between its versions, after the routes of its pinned
    tenants (same names: the degrade filter and the drift breaker see one route)."""
    key = route.key if mesh_route else None
    headers = _mesh_route_header(route) if mesh_route else []
    qos = route.qos or gateway_qos
    per_route = _qos_per_route(route, gateway_qos)
    shed = qos is not None and qos.gateway_shed and target.shed
    if shed and route.function in target.functions:
        target = function_target(target, route.function)
    # the same tracing on every twin: the degraded one, the pinned tenants' and the split
    traced = (
        envoy_tracing.route_tracing(tracing.tracing, tracing.settings, route)
        if tracing is not None
        else None
    )

    def make(degraded: bool, only: str | None = None) -> rc.Route:
        return rc.Route(
            name=degraded_route_name(route, index) if degraded else route_name(route, index),
            match=degraded_match(route, index) if degraded else route_match(route.matches[index]),
            route=_action(route, target, degraded, versions, only),
            metadata=_metadata(target, key, qos),
            request_headers_to_add=headers,
            typed_per_filter_config=per_route,
            tracing=traced,
        )

    twins = [True, False] if target.drift else [False]
    out = [make(degraded) for degraded in twins]
    if versions is not None and versions.pinning is not None:
        out = _pinned(versions, versions.pinning, twins, make) + out
    return _by_priority(out, qos) if shed and qos else out


def _pinned(
    versions: Versions,
    pinning: ir.Pinning,
    twins: list[bool],
    make: Callable[[bool, str | None], rc.Route],
) -> list[rc.Route]:
    """The routes of tenants pinned to one version: the route's own, matched also on the
    verified claim (jwt_authn's payload, which jwt_authn re-matches routes after writing)."""
    out = []
    for tenants, version in (
        (pinning.stable, versions.stable),
        (pinning.candidate, versions.candidate),
    ):
        if not tenants:
            continue
        matcher = json_format.ParseDict(
            envoy_qos.tenant_matcher(pinning.claim, tenants), metadata_pb2.MetadataMatcher()
        )
        for degraded in twins:
            pinned = make(degraded, version)
            pinned.match.dynamic_metadata.append(matcher)
            out.append(pinned)
    return out


def _versions(route: ir.Route, index: int, rollouts: dict[str, Versions]) -> Versions | None:
    """A rolled-out Function's split, for its /v2/models/{name} paths only: Triton's
    repository load and unload act on every version and must never be mirrored."""
    if not route.function or not route.matches[index].path.value.startswith("/v2/models/"):
        return None
    return rollouts.get(f"{route.namespace}/{route.function}")


PRIORITY_NAMES = {base_pb2.HIGH: "HIGH", base_pb2.DEFAULT: "DEFAULT"}


def _by_priority(routes: list[rc.Route], qos: ir.QoSPolicy) -> list[rc.Route]:
    """Each route twice at a gateway that sheds: first for the listed tenants of one side
    (matched on jwt_authn's verified payload, which jwt_authn re-matches routes after writing;
    a client header can never select it), then for everyone else, each with its side's Envoy
    priority (the cluster's per-priority circuit breakers shed DEFAULT first) and its classes in
    the route metadata for the shed reply."""
    split = qos.priority_split()
    high, default = base_pb2.HIGH, base_pb2.DEFAULT
    listed_side = (high, split.high) if split.listed_high else (default, split.low)
    other_side = (default, split.low) if split.listed_high else (high, split.high)
    matcher = json_format.ParseDict(
        envoy_qos.tenant_matcher(qos.claim, split.listed), metadata_pb2.MetadataMatcher()
    )
    out = []
    for route in routes:
        listed = rc.Route()
        listed.CopyFrom(route)
        listed.name = priority_route_name(route.name, PRIORITY_NAMES[listed_side[0]].lower())
        listed.match.dynamic_metadata.append(matcher)
        for copy, (priority, classes) in ((listed, listed_side), (route, other_side)):
            copy.route.priority = priority
            fields = copy.metadata.filter_metadata[ROUTE_METADATA].fields
            fields[envoy_qos.QOS_CLASS_KEY].string_value = ",".join(classes)
            fields[envoy_qos.QOS_PRIORITY_KEY].string_value = PRIORITY_NAMES[priority]
        out += [listed, route]
    return out


@lru_cache(maxsize=4096)
def route_configuration(
    listener: ir.Listener,
    targets: tuple[tuple[str, Target], ...] = (),
    headers_to_remove: tuple[str, ...] = (),
    mesh_route: bool = False,
    gateway_qos: ir.QoSPolicy | None = None,
    tracing: TracingContext | None = None,
    rollouts: tuple[tuple[str, Versions], ...] = (),
) -> route_pb2.RouteConfiguration:
    """`targets` maps the service keys the routes use to their Target (a tuple so the result
    can be memoised); `headers_to_remove` are the HTTP filters' (httpfilters); `mesh_route`: the
    mesh audits, so each route names itself (metadata, x-meshfn-route) for the records;
    `tracing`: the gateway traces, so each route carries its sampling and tags; `rollouts`: per
    Function key (namespace/name) its rollout's traffic now."""
    by_target = dict(targets)
    by_function = dict(rollouts)
    by_host: dict[str, list[tuple[ir.Route, int]]] = {}
    for route in listener.routes:
        for host in route.hosts:
            by_host.setdefault(host, []).extend((route, i) for i in range(len(route.matches)))
    virtual_hosts = []
    # Specific hosts first only for readability: Envoy picks virtual hosts by best domain match.
    for host in sorted(by_host, key=lambda h: (h == "*", h)):
        entries = sorted(by_host[host], key=lambda pair: precedence(*pair))
        virtual_hosts.append(
            rc.VirtualHost(
                name=host,
                domains=[host],
                routes=[
                    out
                    for route, index in entries
                    for out in _routes(
                        route,
                        index,
                        by_target.get(route.service, Target(cluster_name(route.service))),
                        mesh_route,
                        gateway_qos,
                        tracing,
                        _versions(route, index, by_function),
                    )
                ],
            )
        )
    return route_pb2.RouteConfiguration(
        name=route_config_name(listener),
        virtual_hosts=virtual_hosts,
        validate_clusters=wrappers_pb2.BoolValue(value=False),
        request_headers_to_remove=headers_to_remove,
        response_headers_to_remove=ORCA_HEADERS,
    )
