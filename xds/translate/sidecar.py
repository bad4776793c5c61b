"""A sidecar: the server-side Envoy in front of one endpoint. mTLS per PeerAuthentication,
then JWT and authorization, then the local application."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.listener.tls_inspector.v3 import tls_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import duration_pb2

from meshfn import ir

from .. import names
from ..fragments.messages import pack
from ..names import CLUSTER, INBOUND_LISTENER, LISTENER, TRACED_INBOUND
from . import httpfilters
from .clusters import HTTP_PROTOCOL_OPTIONS, http1_trailers, http2_options
from .common import one_endpoint, pipe_endpoints, socket_address
from .host import ProxyHost
from .httpfilters import FilterContext, tracing
from .listeners import HCM, traced_internal_listener
from .resources import Resources, merge
from .security import client_cert_details, downstream_mtls, with_request_hygiene


def local_cluster_name(inbound: ir.Inbound) -> str:
    return names.local_cluster_name(inbound.app_port)


def _local_route(name: str, cluster: str, match: rc.RouteMatch) -> rc.Route:
    # Timeouts and retries belong to the caller's route; the sidecar only forwards to its own
    # application.
    return rc.Route(
        name=name,
        match=match,
        route=rc.RouteAction(cluster=cluster, timeout=duration_pb2.Duration(seconds=0)),
    )


def _local_routes(inbound: ir.Inbound) -> list[rc.Route]:
    """Everything to the application's port; with a gRPC port, gRPC requests there (after
    the same filter chain: one authentication, authorization and audit for both)."""
    routes = [_local_route("local", local_cluster_name(inbound), rc.RouteMatch(prefix="/"))]
    if inbound.grpc_app_port is not None:
        grpc = rc.RouteMatch(
            prefix="/",
            headers=[
                rc.HeaderMatcher(
                    name="content-type",
                    string_match=string_pb2.StringMatcher(prefix="application/grpc"),
                )
            ],
        )
        routes.insert(
            0, _local_route("local-grpc", names.local_cluster_name(inbound.grpc_app_port), grpc)
        )
    return routes


@lru_cache(maxsize=4096)
def inbound_listener(inbound: ir.Inbound, filters: FilterContext) -> listener_pb2.Listener:
    routes = _local_routes(inbound)
    if filters.tracing is not None and filters.tracing.split:
        routes = tracing.split_routes(filters.tracing, routes)
    route_config = route_pb2.RouteConfiguration(
        name=INBOUND_LISTENER,
        virtual_hosts=[rc.VirtualHost(name="inbound", domains=["*"], routes=routes)],
        request_headers_to_remove=httpfilters.request_headers_to_remove(filters),
    )

    def chain(tls: bool) -> listener_components_pb2.FilterChain:
        manager = with_request_hygiene(
            hcm.HttpConnectionManager(
                stat_prefix=f"inbound_{inbound.port}",
                codec_type=hcm.HttpConnectionManager.AUTO,
                route_config=route_config,
                **client_cert_details(),
            )
        )
        if inbound.functions:  # a stream's usage record (a trailer) goes on to the gateway
            manager.http_protocol_options.enable_trailers = True
        httpfilters.build_connection_manager(manager, filters)
        out = listener_components_pb2.FilterChain(
            filters=[listener_components_pb2.Filter(name=HCM, typed_config=pack(manager))]
        )
        if tls:
            out.transport_socket.CopyFrom(downstream_mtls())
        return out

    listener = listener_pb2.Listener(
        name=INBOUND_LISTENER, address=socket_address(inbound.address, inbound.port)
    )
    if inbound.mtls == "STRICT":
        listener.filter_chains.append(chain(tls=True))
    elif inbound.mtls == "DISABLE":
        listener.filter_chains.append(chain(tls=False))
    else:  # PERMISSIVE: TLS clients get mTLS, plaintext clients are served too
        listener.listener_filters.append(
            listener_components_pb2.ListenerFilter(
                name="envoy.filters.listener.tls_inspector",
                typed_config=pack(tls_inspector_pb2.TlsInspector()),
            )
        )
        tls_chain = chain(tls=True)
        tls_chain.filter_chain_match.transport_protocol = "tls"
        listener.filter_chains.append(tls_chain)
        listener.default_filter_chain.CopyFrom(chain(tls=False))
    return listener


@lru_cache(maxsize=1024)
def traced_inbound_listener(
    inbound: ir.Inbound, config: httpfilters.TracingContext | None
) -> listener_pb2.Listener:
    """The internal listener where a split sidecar traces (httpfilters.tracing): the tracer
    and the router, to the same application routes. The outer listener authenticated,
    authorized and audited the request, and told the application who called
    (x-forwarded-client-cert), which passes. Every sidecar has it, whatever its tracing (none:
    no tracer): a connection still on an older configuration of the outer listener (Envoy lets
    it finish while the listener drains) may route a request here after the split has ended."""
    manager = hcm.HttpConnectionManager(
        stat_prefix=f"inbound_traced_{inbound.port}",
        codec_type=hcm.HttpConnectionManager.AUTO,
        route_config=route_pb2.RouteConfiguration(
            name=TRACED_INBOUND,
            virtual_hosts=[
                rc.VirtualHost(name="inbound", domains=["*"], routes=_local_routes(inbound))
            ],
        ),
        forward_client_cert_details=hcm.HttpConnectionManager.ALWAYS_FORWARD_ONLY,
        preserve_external_request_id=True,
    )
    if inbound.functions:
        manager.http_protocol_options.enable_trailers = True
    return traced_internal_listener(TRACED_INBOUND, manager, config)


@lru_cache(maxsize=4096)
def local_cluster(
    address: str, port: int, http2: bool, sockets: tuple[str, ...] = (), trailers: bool = False
) -> cluster_pb2.Cluster:
    """The sidecar's cluster for its application: address:port, or the application's unix
    sockets (`ProxyHost.app_sockets`, one endpoint per serving process) where it has them;
    `trailers`: HTTP/1.1 trailers pass (a generative function's usage record)."""
    name = names.local_cluster_name(port)
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration_pb2.Duration(seconds=1),
        load_assignment=pipe_endpoints(name, sockets)
        if sockets
        else one_endpoint(name, address, port),
    )
    if http2:
        cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Pack(http2_options())
    elif trailers:
        cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Pack(http1_trailers())
    return cluster


def local_clusters(inbound: ir.Inbound, host: ProxyHost) -> dict[str, cluster_pb2.Cluster]:
    def cluster(port: int, http2: bool) -> cluster_pb2.Cluster:
        sockets = host.app_socket(inbound.address, port)
        return local_cluster(inbound.address, port, http2, sockets, inbound.functions)

    clusters = [cluster(inbound.app_port, inbound.protocol == "grpc")]
    if inbound.grpc_app_port is not None:
        clusters.append(cluster(inbound.grpc_app_port, True))
    return {c.name: c for c in clusters}


def sidecar_resources(
    workload: ir.Workload, filters: FilterContext, overlay: ir.Overlay, host: ProxyHost
) -> Resources:
    inbound = workload.inbound
    assert inbound is not None
    out: Resources = {
        LISTENER: {INBOUND_LISTENER: inbound_listener(inbound, filters)},
        CLUSTER: local_clusters(inbound, host),
    }
    out[LISTENER][TRACED_INBOUND] = traced_inbound_listener(inbound, filters.tracing)
    out[CLUSTER][TRACED_INBOUND] = tracing.traced_inbound_cluster(inbound.functions)
    merge(out, httpfilters.resources(filters, overlay))
    return out
