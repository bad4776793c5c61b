"""Listener routes -> RouteConfiguration: one virtual host per host name, routes by precedence."""

from __future__ import annotations

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
from meshfn.ir.routing import precedence

from .. import names
from ..fragments import qos as envoy_qos
from ..fragments.messages import duration
from ..fragments.routes import (
    degraded_clusters,
    degraded_match,
    path_rewrite,
    retry_policy,
    route_match,
)
from ..names import cluster_name, fallback_cluster_name, function_cluster_name
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


def _action(route: ir.Route, target: Target, degraded: bool) -> rc.RouteAction:
    action = rc.RouteAction()
    if degraded:
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
) -> list[rc.Route]:
    """The route, and for a drift-guarded target first its degraded twin: same match plus the
    internal routing header the degrade filter sets (clients cannot: the listener strips it before
    routing), so tripping the breaker changes only the filter's config, never this table."""
    key = route.key if mesh_route else None
    headers = _mesh_route_header(route) if mesh_route else []
    qos = route.qos or gateway_qos
    per_route = _qos_per_route(route, gateway_qos)
    shed = qos is not None and qos.gateway_shed and target.shed
    if shed and route.function in target.functions:
        target = function_target(target, route.function)
    normal = rc.Route(
        name=route_name(route, index),
        match=route_match(route.matches[index]),
        route=_action(route, target, degraded=False),
        metadata=_metadata(target, key, qos),
        request_headers_to_add=headers,
        typed_per_filter_config=per_route,
    )
    if not target.drift:
        return _by_priority([normal], qos) if shed and qos else [normal]
    degraded = rc.Route(
        name=degraded_route_name(route, index),
        match=degraded_match(route, index),
        route=_action(route, target, degraded=True),
        metadata=_metadata(target, key, qos),
        request_headers_to_add=headers,
        typed_per_filter_config=per_route,
    )
    return _by_priority([degraded, normal], qos) if shed and qos else [degraded, normal]


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
) -> route_pb2.RouteConfiguration:
    """`targets` maps the service keys the routes use to their Target (a tuple so the result
    can be memoised); `headers_to_remove` are the HTTP filters' (httpfilters); `mesh_route`: the
    mesh audits, so each route names itself (metadata, x-meshfn-route) for the records."""
    by_target = dict(targets)
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
