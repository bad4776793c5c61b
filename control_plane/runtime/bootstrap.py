"""Envoy bootstrap: the only configuration Envoy gets from a file. Everything else comes over ADS."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    backoff_pb2,
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    protocol_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import duration_pb2, json_format, struct_pb2

from meshfn import ir
from meshfn.xds.names import CONTROL_PLANE_CLUSTER as XDS_CLUSTER
from meshfn.xds.translate.common import one_endpoint


@dataclass(frozen=True)
class ProxyIdentity:
    """Who an Envoy is to the control plane: node.cluster selects the workload's snapshot."""

    node_id: str
    node_cluster: str
    locality: ir.Locality
    admin_port: int  # 0: Envoy picks one and writes it to the admin address file
    xds_protocol: Literal["delta", "sotw"]
    authorization: str = field(default="", repr=False)  # bootstrap token (see identity/)

    @classmethod
    def for_workload(
        cls, workload: ir.Workload, authorization: str, instance: int = 0
    ) -> ProxyIdentity:
        return cls(
            node_id=f"{workload.node_cluster}~{instance}",
            node_cluster=workload.node_cluster,
            locality=workload.locality,
            admin_port=workload.admin_port,
            xds_protocol=workload.xds_protocol,
            authorization=authorization,
        )


def _seconds(value: float) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromNanoseconds(int(value * 1e9))
    return out


def bootstrap(identity: ProxyIdentity, xds_host: str, xds_port: int) -> bootstrap_pb2.Bootstrap:
    h2 = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions(
                # Detect a dead control plane within seconds, not at TCP timeout.
                connection_keepalive=protocol_pb2.KeepaliveSettings(
                    interval=_seconds(10), timeout=_seconds(5)
                )
            )
        )
    )
    xds_cluster = cluster_pb2.Cluster(
        name=XDS_CLUSTER,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=_seconds(1),
        load_assignment=one_endpoint(XDS_CLUSTER, xds_host, xds_port),
    )
    xds_cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].Pack(h2)
    ads_source = config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.ApiVersion.V3,
    )
    locality = identity.locality
    return bootstrap_pb2.Bootstrap(
        node=base_pb2.Node(
            id=identity.node_id,
            cluster=identity.node_cluster,
            locality=base_pb2.Locality(
                region=locality.region, zone=locality.zone, sub_zone=locality.sub_zone
            ),
            metadata=struct_pb2.Struct(
                fields={"meshfn.io/managed": struct_pb2.Value(bool_value=True)}
            ),
        ),
        admin=bootstrap_pb2.Admin(
            address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(
                    address="127.0.0.1", port_value=identity.admin_port
                )
            )
        ),
        dynamic_resources=bootstrap_pb2.Bootstrap.DynamicResources(
            ads_config=config_source_pb2.ApiConfigSource(
                api_type=config_source_pb2.ApiConfigSource.DELTA_GRPC
                if identity.xds_protocol == "delta"
                else config_source_pb2.ApiConfigSource.GRPC,
                transport_api_version=config_source_pb2.ApiVersion.V3,
                set_node_on_first_message_only=True,
                grpc_services=[
                    grpc_service_pb2.GrpcService(
                        initial_metadata=[
                            base_pb2.HeaderValue(key="authorization", value=identity.authorization)
                        ]
                        if identity.authorization
                        else [],
                        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                            cluster_name=XDS_CLUSTER,
                            # Reconnect quickly after a control-plane restart (default: 0.5-30 s).
                            retry_policy=base_pb2.RetryPolicy(
                                retry_back_off=backoff_pb2.BackoffStrategy(
                                    base_interval=_seconds(0.1), max_interval=_seconds(2)
                                )
                            ),
                        ),
                    )
                ],
            ),
            cds_config=ads_source,
            lds_config=ads_source,
        ),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(clusters=[xds_cluster]),
    )


def bootstrap_json(identity: ProxyIdentity, xds_host: str, xds_port: int) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(
        bootstrap(identity, xds_host, xds_port), preserving_proto_field_name=True
    )
    return result
