"""A sidecar: the server-side Envoy in front of one endpoint. mTLS per PeerAuthentication,
then JWT and authorization, then the local application."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import protocol_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.listener.tls_inspector.v3 import tls_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import duration_pb2

from meshfn import ir

from .. import names
from ..names import CLUSTER, INBOUND_LISTENER, LISTENER
from . import httpfilters
from .clusters import HTTP_PROTOCOL_OPTIONS
from .common import one_endpoint, pack, socket_address
from .httpfilters import FilterContext
from .listeners import HCM
from .resources import Resources, merge
from .security import client_cert_details, downstream_mtls


def local_cluster_name(inbound: ir.Inbound) -> str:
    return names.local_cluster_name(inbound.app_port)


@lru_cache(maxsize=4096)
def inbound_listener(inbound: ir.Inbound, filters: FilterContext) -> listener_pb2.Listener:
    route_config = route_pb2.RouteConfiguration(
        name=INBOUND_LISTENER,
        virtual_hosts=[
            rc.VirtualHost(
                name="inbound",
                domains=["*"],
                routes=[
                    rc.Route(
                        name="local",
                        match=rc.RouteMatch(prefix="/"),
                        # Timeouts and retries belong to the caller's route; the sidecar only
                        # forwards to its own application.
                        route=rc.RouteAction(
                            cluster=local_cluster_name(inbound),
                            timeout=duration_pb2.Duration(seconds=0),
                        ),
                    )
                ],
            )
        ],
        request_headers_to_remove=httpfilters.request_headers_to_remove(filters),
    )

    def chain(tls: bool) -> listener_components_pb2.FilterChain:
        manager = hcm.HttpConnectionManager(
            stat_prefix=f"inbound_{inbound.port}",
            codec_type=hcm.HttpConnectionManager.AUTO,
            route_config=route_config,
            **client_cert_details(),
        )
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


@lru_cache(maxsize=4096)
def local_cluster(inbound: ir.Inbound) -> cluster_pb2.Cluster:
    name = local_cluster_name(inbound)
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration_pb2.Duration(seconds=1),
        load_assignment=one_endpoint(name, inbound.address, inbound.app_port),
    )
    if inbound.protocol == "grpc":
        options = http_protocol_options_pb2.HttpProtocolOptions(
            explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
                http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
            )
        )
        cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Pack(options)
    return cluster


def sidecar_resources(
    workload: ir.Workload, filters: FilterContext, overlay: ir.Overlay
) -> Resources:
    inbound = workload.inbound
    assert inbound is not None
    out: Resources = {
        LISTENER: {INBOUND_LISTENER: inbound_listener(inbound, filters)},
        CLUSTER: {local_cluster_name(inbound): local_cluster(inbound)},
    }
    merge(out, httpfilters.resources(filters, overlay))
    return out
