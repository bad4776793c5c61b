"""Service -> ClusterLoadAssignment, endpoints grouped by locality."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import wrappers_pb2

from meshfn.control_plane import ir

from .common import socket_address
from .security import tls_match_metadata


@lru_cache(maxsize=65536)
def load_assignment(service: ir.Service) -> endpoint_pb2.ClusterLoadAssignment:
    by_locality: dict[ir.Locality, list[ir.Endpoint]] = {}
    for endpoint in service.endpoints:
        by_locality.setdefault(endpoint.locality, []).append(endpoint)
    groups = []
    for locality in sorted(by_locality, key=lambda loc: (loc.region, loc.zone, loc.sub_zone)):
        groups.append(
            endpoint_components_pb2.LocalityLbEndpoints(
                locality=base_pb2.Locality(
                    region=locality.region, zone=locality.zone, sub_zone=locality.sub_zone
                ),
                lb_endpoints=[_lb_endpoint(e) for e in by_locality[locality]],
            )
        )
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=service.cluster_name, endpoints=groups)


def _lb_endpoint(e: ir.Endpoint) -> endpoint_components_pb2.LbEndpoint:
    """Endpoints with a sidecar are reached through it (and over mTLS unless it is DISABLEd)."""
    out = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=socket_address(e.address, e.sidecar_port or e.port)
        ),
        load_balancing_weight=wrappers_pb2.UInt32Value(value=e.weight),
    )
    if e.sidecar_port is not None and e.mtls != "DISABLE":
        out.metadata.CopyFrom(tls_match_metadata())
    return out
