"""Small builders shared by the per-type translators."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from envoy.config.core.v3 import address_pb2, config_source_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2

M = TypeVar("M")


class Same(Generic[M]):
    """A message as a cache key by identity: what a memoised builder returned stands for its
    inputs, so what is built from it can be memoised too (protobuf messages do not hash)."""

    __slots__ = ("message",)

    def __init__(self, message: M) -> None:
        self.message = message

    def __hash__(self) -> int:
        return id(self.message)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.message is self.message


def socket_address(address: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=address, port_value=port)
    )


def pipe_address(path: str, mode: int = 0) -> address_pb2.Address:
    """A unix socket address (`mode`: the file mode Envoy gives a socket it listens on)."""
    return address_pb2.Address(pipe=address_pb2.Pipe(path=path, mode=mode))


def static_endpoints(
    cluster_name: str, addresses: Iterable[address_pb2.Address]
) -> endpoint_pb2.ClusterLoadAssignment:
    """The load assignment of a cluster defined in place (not over EDS)."""
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster_name,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(address=address)
                    )
                    for address in addresses
                ]
            )
        ],
    )


def one_endpoint(cluster_name: str, address: str, port: int) -> endpoint_pb2.ClusterLoadAssignment:
    """The load assignment of a cluster defined in place with one endpoint."""
    return static_endpoints(cluster_name, [socket_address(address, port)])


def pipe_endpoints(cluster_name: str, paths: Iterable[str]) -> endpoint_pb2.ClusterLoadAssignment:
    """The load assignment of a cluster defined in place whose endpoints are unix sockets."""
    return static_endpoints(cluster_name, (pipe_address(path) for path in paths))


def ads_source() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.ApiVersion.V3,
    )
