"""Small builders shared by the per-type translators."""

from __future__ import annotations

from envoy.config.core.v3 import address_pb2, config_source_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2


def socket_address(address: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=address, port_value=port)
    )


def one_endpoint(cluster_name: str, address: str, port: int) -> endpoint_pb2.ClusterLoadAssignment:
    """The load assignment of a cluster defined in place (not over EDS) with one endpoint."""
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster_name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(
                            address=socket_address(address, port)
                        )
                    )
                ]
            )
        ],
    )


def ads_source() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.ApiVersion.V3,
    )
