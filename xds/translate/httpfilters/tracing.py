"""Envoy's OpenTelemetry tracer on a connection manager (not a filter of the chain: the
connection manager's own `tracing`), and what it needs: the cluster to the collector and, on a
gateway that restarts client context, the early header mutation that drops the client's trace
headers before Envoy reads them. The sampling rules are meshfn.xds.fragments.tracing's (shared
with the Istio renderer); routes carry their own part (routes.py).

A connection manager with a tracer starts a span for every request, sampled or not, and sets
its tags when the request ends; the `traceparent` it then puts on every request costs each
proxy and backend after it too (docs/benchmarks.md#tracing). While every caller samples little
(`ir.Tracing.split`) meshfn's proxies therefore have no tracer on their own listeners:
- a gateway's routes send the requests it samples (one draw per request, at each route's
  rate) to an internal listener whose connection manager traces them, along the same route;
  the others go on without any trace context, marked `UNSAMPLED` so that no proxy after it
  draws again;
- a sidecar sends the requests it traces (a sampled parent, or neither a parent nor the mark
  and its own draw at the mesh's rate) to an internal listener that traces, and the others
  straight to the application; the backend behind it draws none of its own."""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable
from functools import lru_cache

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    grpc_service_pb2,
    http_service_pb2,
    http_uri_pb2,
)
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.config.trace.v3 import http_tracer_pb2, opentelemetry_pb2
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.matching.input_matchers.runtime_fraction.v3 import runtime_fraction_pb2
from envoy.type.matcher.v3 import http_inputs_pb2, regex_pb2, string_pb2
from envoy.type.tracing.v3 import custom_tag_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2

from meshfn import ir
from meshfn.contracts.tracing import (
    CLIENT_CONTEXT_HEADERS,
    SPLIT_CLUSTER_METADATA,
    SPLIT_FLAGS_METADATA,
    SPLIT_TRACE_METADATA,
    SPLIT_UPSTREAM_METADATA,
)
from xds.core.v3 import extension_pb2 as xds_extension_pb2
from xds.type.matcher.v3 import matcher_pb2

from ...fragments import tracing as fragments
from ...fragments.messages import duration, pack
from ...names import CLUSTER, TRACE_COLLECTOR_CLUSTER, TRACED_INBOUND, traced_gateway_name
from ..clusters import HTTP_PROTOCOL_OPTIONS, downstream_protocol, http2_options
from ..common import Same, one_endpoint, pipe_endpoints, static_endpoints
from ..host import ProxyHost
from ..resources import Resources
from .base import FilterContext, HttpFilter, TracingContext

OPENTELEMETRY = "envoy.tracers.opentelemetry"

# A split gateway's mark on the requests it did not sample (they carry no traceparent): a split
# sidecar draws for a request without a parent only when it is absent. It can only ever stop a
# sampling, so whoever sets it gains nothing; the sidecar removes it before the application.
UNSAMPLED = "x-meshfn-unsampled"
# The route a split gateway's twin stands for, to its internal listener (which routes by it
# alone: the outer listener's filters already matched the request and wrote its metadata).
_TRACED_ROUTE = "x-meshfn-traced-route"
# The internal listener's answer carries its trace id back to the outer listener, which moves it
# into metadata for its access logs (SPLIT_TRACE_METADATA) before the client sees the answer.
_TRACE_ID = "x-meshfn-trace-id"
_TRACED_CLUSTER = "x-meshfn-traced-cluster"  # and the cluster it went to (SPLIT_CLUSTER_METADATA)
_TRACED_FLAGS = "x-meshfn-traced-flags"  # its response flags (SPLIT_FLAGS_METADATA)
_TRACED_UPSTREAM = "x-meshfn-traced-upstream"  # its upstream connection (SPLIT_UPSTREAM_METADATA)
# What the internal listener's answer carries back, each into the metadata of its key.
_TRACED_ANSWER = (
    (_TRACE_ID, "%TRACE_ID%", SPLIT_TRACE_METADATA),
    (_TRACED_CLUSTER, "%UPSTREAM_CLUSTER%", SPLIT_CLUSTER_METADATA),
    (_TRACED_FLAGS, "%RESPONSE_FLAGS%", SPLIT_FLAGS_METADATA),
    (_TRACED_UPSTREAM, "%UPSTREAM_LOCAL_ADDRESS%", SPLIT_UPSTREAM_METADATA),
)
# What a split gateway's draw reads: the request id its own listener makes for every request.
_REQUEST_ID = xds_extension_pb2.TypedExtensionConfig(
    name="request-id",
    typed_config=pack(http_inputs_pb2.HttpRequestHeaderMatchInput(header_name="x-request-id")),
)
# W3C trace flags with the sampled bit (the last hex digit odd); RE2, matched whole.
_SAMPLED_PARENT = rc.HeaderMatcher(
    name="traceparent",
    string_match=string_pb2.StringMatcher(
        safe_regex=regex_pb2.RegexMatcher(regex=".*-[0-9a-f][13579bdf]")
    ),
)
_NO_PARENT = rc.HeaderMatcher(name="traceparent", present_match=True, invert_match=True)
_NOT_MARKED = rc.HeaderMatcher(name=UNSAMPLED, present_match=True, invert_match=True)
# The tags that need the outer connection's facts (the mTLS peer, jwt_authn's metadata) travel to
# the internal listener in request headers of this prefix, which the outer routes set (a
# caller's own dropped first) and the internal listener moves into metadata (carried_tags).
_CARRIED_TAG = "x-meshfn-span-"
_CARRIED_METADATA = "meshfn.span"


class Tracing(HttpFilter[TracingContext]):
    def config(self, ctx: FilterContext) -> TracingContext | None:
        return ctx.tracing

    def connection_manager(
        self, ctx: FilterContext, config: TracingContext
    ) -> hcm.HttpConnectionManager | None:
        if config.split:  # the internal listener traces (traced_inbound_tracing)
            return None
        return hcm.HttpConnectionManager(tracing=connection_tracing(config))

    def http_filters(self, ctx: FilterContext, config: TracingContext) -> Iterable[hcm.HttpFilter]:
        return (trace_id_to_metadata(),) if config.split and config.kind == "gateway" else ()

    def early_headers_to_remove(self, ctx: FilterContext, config: TracingContext) -> Iterable[str]:
        if not config.restarts:
            return ()
        return client_context_headers(config.split)

    def resources(
        self, ctx: FilterContext, config: TracingContext, overlay: ir.Overlay
    ) -> Resources:
        cluster = collector_cluster(config.collector)
        return {CLUSTER: {cluster.name: cluster}}


@lru_cache(maxsize=1024)
def connection_tracing(config: TracingContext) -> hcm.HttpConnectionManager.Tracing:
    """The connection manager's tracing: the tracer, its percentages, its tags, span names."""
    settings = config.settings
    provider = opentelemetry_pb2.OpenTelemetryConfig(service_name=config.service)
    collector = config.collector
    if collector.protocol == "grpc":
        provider.grpc_service.CopyFrom(
            grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                    cluster_name=TRACE_COLLECTOR_CLUSTER
                ),
                timeout=duration(collector.timeout),
            )
        )
    else:
        provider.http_service.CopyFrom(
            http_service_pb2.HttpService(
                http_uri=http_uri_pb2.HttpUri(
                    uri=f"http://{collector.host}:{collector.port}{collector.path}",
                    cluster=TRACE_COLLECTOR_CLUSTER,
                    timeout=duration(collector.timeout),
                )
            )
        )
    if config.honors:
        provider.sampler.CopyFrom(fragments.sampler(settings.sampling))
    random = fragments.sampling(settings) if config.kind == "gateway" else settings.sampling
    out = hcm.HttpConnectionManager.Tracing(
        provider=http_tracer_pb2.Tracing.Http(name=OPENTELEMETRY, typed_config=pack(provider)),
        custom_tags=fragments.connection_tags(config.tracing, config.kind, config.verified_tokens),
        operation="%REQ(:METHOD)% %ROUTE_NAME%"
        if config.kind == "gateway"
        else f"%REQ(:METHOD)% {config.service}",
    )
    out.random_sampling.value = random
    out.client_sampling.value = 100.0 if config.honors else 0.0
    out.overall_sampling.value = 100.0
    return out


def client_context_headers(split: bool = False) -> tuple[str, ...]:
    """A client's trace context, dropped before Envoy reads it (contracts.tracing); at a split
    gateway also the key of a traced route, which only its twins may set (a client's would
    reach a route's action without its match)."""
    return (*CLIENT_CONTEXT_HEADERS, _TRACED_ROUTE) if split else CLIENT_CONTEXT_HEADERS


@lru_cache(maxsize=64)
def collector_cluster(collector: ir.TraceCollector) -> cluster_pb2.Cluster:
    """The collector: a unix socket (a pipe address) or an IP literal STATIC, a name
    STRICT_DNS; HTTP/2 for OTLP over gRPC."""
    host = collector.host.strip("[]")
    kind = cluster_pb2.Cluster.STATIC
    if collector.socket:
        endpoints = pipe_endpoints(TRACE_COLLECTOR_CLUSTER, [collector.socket])
    else:
        endpoints = one_endpoint(TRACE_COLLECTOR_CLUSTER, host, collector.port)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            kind = cluster_pb2.Cluster.STRICT_DNS
    cluster = cluster_pb2.Cluster(
        name=TRACE_COLLECTOR_CLUSTER,
        type=kind,
        connect_timeout=duration_pb2.Duration(seconds=1),
        load_assignment=endpoints,
    )
    if collector.protocol == "grpc":
        cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Pack(http2_options())
    return cluster


def tracing_for(
    model: ir.MeshModel, workload: ir.Workload, host: ProxyHost
) -> TracingContext | None:
    """Tracing on a workload's connection managers, where the mesh traces and a collector is
    known (the policy's, else the run mode's own)."""
    tracing = model.tracing
    if tracing is None:
        return None
    collector = tracing.collector or host.collector
    if collector is None:
        return None
    settings = (
        tracing.gateway(workload.key)
        if workload.kind == "gateway"
        else ir.GatewayTracing(tracing.sampling, "restart")
    )
    return TracingContext(
        tracing,
        collector,
        workload.kind,
        f"{workload.name}.{workload.namespace}",
        settings,
        bool(workload.jwt_rules),
        split=tracing.split,
    )


def _carried(config: TracingContext) -> list[tuple[custom_tag_pb2.CustomTag, str]]:
    """The connection manager's tags, each with the header it crosses in."""
    tags = fragments.connection_tags(config.tracing, config.kind, config.verified_tokens)
    return [
        (tag, _CARRIED_TAG + "".join(c if c.isalnum() else "-" for c in tag.tag.lower()))
        for tag in tags
    ]


def _set(header: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=header, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def split_routes(config: TracingContext, routes: Iterable[rc.Route]) -> list[rc.Route]:
    """A split sidecar's routes: to its internal listener, a sampled parent's requests and a
    share of those with neither a parent nor a split gateway's UNSAMPLED mark at the mesh's
    rate (Envoy's draw, as the tracer's own would be), each of `routes` twinned under its name;
    then `routes` (to the application). Every route drops a caller's carried-tag headers
    (before setting its own) and the mark: a span's tags are the sidecar's facts, and the
    application sees the same request either way."""
    tags = _carried(config)
    dropped = [header for _, header in tags] + [UNSAMPLED]
    carried = [_set(header, tag.value) for tag, header in tags]
    share = percent_pb2.FractionalPercent(
        numerator=round(config.tracing.sampling * 10_000),
        denominator=percent_pb2.FractionalPercent.MILLION,
    )
    routes = list(routes)
    out: list[rc.Route] = []
    for parent in (_SAMPLED_PARENT, _NO_PARENT):
        for route in routes:
            twin = rc.Route(
                name=route.name,
                match=route.match,
                route=rc.RouteAction(cluster=TRACED_INBOUND, timeout=route.route.timeout),
                request_headers_to_add=carried,
                request_headers_to_remove=dropped,
            )
            twin.match.headers.append(parent)
            if parent is _NO_PARENT:
                twin.match.headers.append(_NOT_MARKED)
                twin.match.runtime_fraction.default_value.CopyFrom(share)
            out.append(twin)
    for route in routes:
        plain = rc.Route()
        plain.CopyFrom(route)
        plain.request_headers_to_remove.extend(dropped)
        out.append(plain)
    return out


@lru_cache(maxsize=1024)
def traced_inbound_tracing(config: TracingContext) -> hcm.HttpConnectionManager.Tracing:
    """The internal listener's tracing: every request that reaches it (split_routes chose
    them), its tags from what carried_tags took out of their headers."""
    out = hcm.HttpConnectionManager.Tracing()
    out.CopyFrom(connection_tracing(config))
    out.random_sampling.value = 100.0
    del out.custom_tags[:]
    for tag, _ in _carried(config):
        out.custom_tags.append(
            custom_tag_pb2.CustomTag(
                tag=tag.tag, value=f"%DYNAMIC_METADATA({_CARRIED_METADATA}:{tag.tag})%"
            )
        )
    return out


@lru_cache(maxsize=1024)
def carried_tags(config: TracingContext) -> tuple[hcm.HttpFilter, ...]:
    """The internal listener's first filter: the carried tags out of their headers (which the
    application then never sees) into metadata, which the span reads as it ends (a request
    header the route removed would be gone by then)."""
    rules = [
        header_to_metadata_pb2.Config.Rule(
            header=header,
            on_header_present=header_to_metadata_pb2.Config.KeyValuePair(
                metadata_namespace=_CARRIED_METADATA, key=tag.tag
            ),
            remove=True,
        )
        for tag, header in _carried(config)
    ]
    if not rules:
        return ()
    return (
        hcm.HttpFilter(
            name="envoy.filters.http.header_to_metadata",
            typed_config=pack(header_to_metadata_pb2.Config(request_rules=rules)),
        ),
    )


@lru_cache(maxsize=64)
def traced_inbound_cluster(trailers: bool, name: str = TRACED_INBOUND) -> cluster_pb2.Cluster:
    """A split proxy's way to its internal listener `name`, in the caller's protocol (HTTP/2
    for gRPC; `trailers`: HTTP/1.1 trailers pass, a generation's usage record)."""
    address = address_pb2.Address(
        envoy_internal_address=address_pb2.EnvoyInternalAddress(server_listener_name=name)
    )
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration_pb2.Duration(seconds=1),
        load_assignment=static_endpoints(name, [address]),
    )
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Pack(
        downstream_protocol(trailers)
    )
    return cluster


# The split gateway's filter that takes what the internal listener's answer carries back into
# metadata: off on its chain, on for the twins' routes (trace_id_to_metadata).
TRACED_ANSWER_FILTER = "meshfn.traced_answer"


@lru_cache(maxsize=1)
def _traced_answer_rules() -> header_to_metadata_pb2.Config:
    rules = [
        header_to_metadata_pb2.Config.Rule(
            header=header,
            on_header_present=header_to_metadata_pb2.Config.KeyValuePair(
                metadata_namespace=namespace, key=key
            ),
            remove=True,
        )
        for header, _, (namespace, key) in _TRACED_ANSWER
    ]
    return header_to_metadata_pb2.Config(response_rules=rules)


@lru_cache(maxsize=1)
def trace_id_to_metadata() -> hcm.HttpFilter:
    """A split gateway's first filter: what its internal listener's answer carries back
    (_TRACED_ANSWER: the trace id, the upstream cluster, the response flags and the upstream
    connection there), out of the answer (the client never sees them) into the metadata its
    access logs read. Disabled on the chain and enabled by the twins' routes (_twin_answer):
    a request the gateway did not sample never makes it (docs/benchmarks.md#tracing)."""
    return hcm.HttpFilter(
        name=TRACED_ANSWER_FILTER, typed_config=pack(_traced_answer_rules()), disabled=True
    )


@lru_cache(maxsize=1)
def _twin_answer() -> any_pb2.Any:
    """A twin's route turns trace_id_to_metadata on, with its configuration."""
    return pack(rc.FilterConfig(config=pack(_traced_answer_rules())))


def split_gateway_routes(
    config: TracingContext, table: route_pb2.RouteConfiguration
) -> route_pb2.RouteConfiguration:
    return _split_gateway_routes(config, Same(table))


@lru_cache(maxsize=1024)
def _split_gateway_routes(
    config: TracingContext, same: Same[route_pb2.RouteConfiguration]
) -> route_pb2.RouteConfiguration:
    """A split gateway listener's route table, which its internal listener reads too (one
    resource: the two never disagree). Each route that goes upstream gets a twin, matched by the
    same conditions, which carries the request to the internal listener with the key of the
    route it stands for and the span's tags from verified facts (carried_tags); everything else
    about the route stays on the twin (its filters' per-route settings, metadata and header
    changes, its timeouts), while retries, clusters and rewrites happen once, on the route of
    that key (under the same name, looked up by the key before the others), which only the
    internal listener matches: the gateway's own listener drops the key from clients before it
    routes (client_context_headers). One draw per request decides which list of routes it
    walks (_by_draw): the twins, else the routes themselves, which trace nothing, mark what
    they send UNSAMPLED and drop a trace id an upstream's answer might carry."""
    tags = _carried(config)
    carried = [_set(header, tag.value) for tag, header in tags]
    dropped = [header for _, header in tags]
    name = traced_gateway_name(same.message.name)
    out = route_pb2.RouteConfiguration()
    out.CopyFrom(same.message)
    for host in out.virtual_hosts:
        routes = list(host.routes)
        del host.routes[:]
        keyed: dict[str, rc.Route] = {}
        drawn: list[tuple[rc.Route, rc.Route | None, int]] = []
        for route in routes:
            if not route.HasField("route"):  # a direct response or a redirect: no upstream
                drawn.append((route, None, 0))
                continue
            key = hashlib.sha256(route.SerializeToString(deterministic=True)).hexdigest()[:24]
            keyed[key] = _traced_route(route, key)
            twin = rc.Route()
            twin.CopyFrom(route)
            twin.ClearField("tracing")
            twin.route.CopyFrom(rc.RouteAction(cluster=name))
            for field in ("timeout", "idle_timeout"):
                if route.route.HasField(field):
                    getattr(twin.route, field).CopyFrom(getattr(route.route, field))
            twin.request_headers_to_remove.extend([*dropped, UNSAMPLED])
            twin.request_headers_to_add.extend([*carried, _set(_TRACED_ROUTE, key)])
            twin.typed_per_filter_config[TRACED_ANSWER_FILTER].CopyFrom(_twin_answer())
            plain = rc.Route()
            plain.CopyFrom(route)
            plain.ClearField("tracing")
            plain.request_headers_to_remove.extend(dropped)
            plain.request_headers_to_add.append(_set(UNSAMPLED, "1"))
            plain.response_headers_to_remove.extend(header for header, _, _ in _TRACED_ANSWER)
            drawn.append((plain, twin, _per_ten_thousand(route.tracing.random_sampling)))
        host.matcher.CopyFrom(_by_key(keyed, _by_draw(drawn)))
    return out


def _by_key(keyed: dict[str, rc.Route], rest: matcher_pb2.Matcher.OnMatch) -> matcher_pb2.Matcher:
    """A virtual host's routes as a matcher: the route of a twin's key, looked up by it (one
    header read on the gateway's own listener, which never has one), else `rest`."""
    key = http_inputs_pb2.HttpRequestHeaderMatchInput(header_name=_TRACED_ROUTE)
    return matcher_pb2.Matcher(
        matcher_tree=matcher_pb2.Matcher.MatcherTree(
            input=xds_extension_pb2.TypedExtensionConfig(
                name="traced-route", typed_config=pack(key)
            ),
            exact_match_map=matcher_pb2.Matcher.MatcherTree.MatchMap(
                map={
                    name: matcher_pb2.Matcher.OnMatch(
                        action=xds_extension_pb2.TypedExtensionConfig(
                            name=route.name, typed_config=pack(route)
                        )
                    )
                    for name, route in keyed.items()
                }
            ),
        ),
        on_no_match=rest,
    )


def _by_draw(drawn: list[tuple[rc.Route, rc.Route | None, int]]) -> matcher_pb2.Matcher.OnMatch:
    """Which routes a request walks, by one draw from its request id (the gateway's own: it
    drops a client's, client_context_headers) at the highest of the routes' rates per ten
    thousand: under it, the twins of the routes with a rate, each in its route's place (a
    lower rate's twin draws again, its share of that rate, before its route); else the routes
    themselves. A request the gateway does not sample meets that one draw, where a twin before
    each route drew for each one it walked past: ~15 µs of p50 at 1%
    (docs/benchmarks.md#tracing). `drawn`: each route, its twin (None: it has none) and its
    rate."""
    plain = _route_list("routes", [route for route, _, _ in drawn])
    top = max((rate for _, twin, rate in drawn if twin is not None), default=0)
    if top == 0:
        return plain
    under: list[rc.Route] = []
    for route, twin, rate in drawn:
        if twin is None or rate == 0:
            under.append(route)
            continue
        if rate == top:
            under.append(twin)
            continue
        twin.match.runtime_fraction.default_value.CopyFrom(
            percent_pb2.FractionalPercent(
                numerator=round(rate * 1_000_000 / top),
                denominator=percent_pb2.FractionalPercent.MILLION,
            )
        )
        under.extend((twin, route))
    return matcher_pb2.Matcher.OnMatch(
        matcher=matcher_pb2.Matcher(
            matcher_list=matcher_pb2.Matcher.MatcherList(
                matchers=[
                    matcher_pb2.Matcher.MatcherList.FieldMatcher(
                        predicate=_drawn_under(top), on_match=_route_list("traced", under)
                    )
                ]
            ),
            on_no_match=plain,
        )
    )


def _drawn_under(rate: int) -> matcher_pb2.Matcher.MatcherList.Predicate:
    """The request id's hash modulo ten thousand under `rate`."""
    draw = runtime_fraction_pb2.RuntimeFraction(
        runtime_fraction=base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=rate, denominator=percent_pb2.FractionalPercent.TEN_THOUSAND
            )
        )
    )
    return matcher_pb2.Matcher.MatcherList.Predicate(
        single_predicate=matcher_pb2.Matcher.MatcherList.Predicate.SinglePredicate(
            input=_REQUEST_ID,
            custom_match=xds_extension_pb2.TypedExtensionConfig(
                name="envoy.matching.matchers.runtime_fraction", typed_config=pack(draw)
            ),
        )
    )


def _route_list(name: str, routes: list[rc.Route]) -> matcher_pb2.Matcher.OnMatch:
    return matcher_pb2.Matcher.OnMatch(
        action=xds_extension_pb2.TypedExtensionConfig(
            name=name, typed_config=pack(rc.RouteList(routes=routes))
        )
    )


def _per_ten_thousand(share: percent_pb2.FractionalPercent) -> int:
    """A route's sampling as a numerator per ten thousand (fragments.fraction's)."""
    whole: int = {
        percent_pb2.FractionalPercent.HUNDRED: 100,
        percent_pb2.FractionalPercent.TEN_THOUSAND: 10_000,
        percent_pb2.FractionalPercent.MILLION: 1_000_000,
    }[share.denominator]
    return min(10_000, round(int(share.numerator) * 10_000 / whole))


def _traced_route(route: rc.Route, key: str) -> rc.Route:
    """The internal listener's route for the twin of `key`: the route's action, metadata and
    name, its tags, every request traced, and the trace id back in the answer."""
    tracing = rc.Tracing()
    tracing.CopyFrom(route.tracing)
    tracing.random_sampling.CopyFrom(fragments.fraction(100.0))
    return rc.Route(
        name=route.name,
        match=rc.RouteMatch(
            prefix="/",
            headers=[
                rc.HeaderMatcher(
                    name=_TRACED_ROUTE, string_match=string_pb2.StringMatcher(exact=key)
                )
            ],
        ),
        route=route.route,
        metadata=route.metadata,
        tracing=tracing,
        request_headers_to_remove=[_TRACED_ROUTE],
        response_headers_to_add=[_set(header, value) for header, value, _ in _TRACED_ANSWER],
    )
