"""Service -> Cluster (EDS, endpoints over ADS)."""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import protocol_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from meshfn.control_plane import ir

from .common import ads_source, duration, pack
from .security import mtls_socket_match

HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def cluster(service: ir.Service) -> cluster_pb2.Cluster:
    # Keyed without the endpoints: an endpoint change must not produce a new Cluster (Envoy
    # would re-warm it); only the ClusterLoadAssignment changes.
    mtls = any(e.sidecar_port is not None and e.mtls != "DISABLE" for e in service.endpoints)
    return _cluster(
        service.cluster_name,
        service.protocol,
        service.connect_timeout,
        service.identity if mtls else "",
    )


@lru_cache(maxsize=65536)
def _cluster(
    name: str, protocol: str, connect_timeout: timedelta, mtls_peer: str
) -> cluster_pb2.Cluster:
    out = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ads_source()),
        connect_timeout=duration(connect_timeout),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
    )
    if protocol == "grpc":
        options = http_protocol_options_pb2.HttpProtocolOptions(
            explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
                http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
            )
        )
        out.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(pack(options))
    if mtls_peer:
        # Endpoints whose sidecar speaks mTLS carry the match metadata (see endpoints.py); the
        # others (a sidecar in DISABLE mode) get plaintext. Istio's auto-mTLS works the same way.
        out.transport_socket_matches.append(mtls_socket_match(mtls_peer, protocol == "grpc"))
    return out
