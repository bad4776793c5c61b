"""Envoy bootstrap: the only configuration Envoy gets from a file. Everything else comes over ADS.

Envoy's admin interface answers anyone who can connect to it, unauthenticated: its
`/config_dump` shows the bootstrap's ADS token (with which an ADS stream yields the workload's
private key), and `/quitquitquit`, `/drain_listeners`, `/logging` change the proxy. On a host
with several users, loopback TCP is shared by all of them, so the Envoys `meshfn up` runs serve
admin on a unix socket in the state directory instead (mode 0600, in a 0700 directory): only
meshfn's own user reaches it, and so do those of `meshfn bootstrap` (an Envoy you run yourself).
A Gateway's explicit `adminPort` (or `meshfn bootstrap --admin-port`) opts in to TCP as well: a
static listener on 127.0.0.1:PORT forwarding to that socket (`admin_tcp_warning` names the risk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    backoff_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    protocol_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.overload.v3 import overload_pb2
from envoy.extensions.bootstrap.internal_listener.v3 import internal_listener_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.resource_monitors.downstream_connections.v3 import (
    downstream_connections_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import duration_pb2, json_format, struct_pb2

from meshfn import ir
from meshfn.common import env
from meshfn.common.processes import open_files_limit
from meshfn.common.unix import SOCKET_MODE, SocketPathTooLong, socket_path
from meshfn.xds.names import CONTROL_PLANE_CLUSTER as XDS_CLUSTER
from meshfn.xds.translate.common import one_endpoint, pipe_address, pipe_endpoints

ADMIN_SOCKET_MODE = SOCKET_MODE
# The opt-in TCP admin (a Gateway's adminPort): a static listener and cluster of these names.
ADMIN_TCP_LISTENER = "meshfn-admin-tcp"
ADMIN_CLUSTER = "meshfn-admin"
# Envoy's OpenTelemetry tracer sends its spans every 5 spans or 5 s by default: at 100%
# sampling that is one OTLP export for every 5 requests, each a gRPC call that costs the Envoy
# and more so the collector far more than the spans in it. Batches of up to 128, at least once a
# second (what a trace list shows lags by that much at most).
RUNTIME = {
    "tracing.opentelemetry.min_flush_spans": 128,
    "tracing.opentelemetry.flush_interval_ms": 1000,
}

# Every Envoy's limit on downstream connections at once (connection_limit): past it, a new
# connection is closed as it is accepted and counted (`downstream_global_cx_overflow`); the
# connections it has keep working. Without one, Envoy warns at start, and a flood runs it out of
# file descriptors, after which it cannot open upstream (or xDS) connections either.
CONNECTIONS_MONITOR = "envoy.resource_monitors.global_downstream_max_connections"
# Descriptors a proxy holds besides its connections: xDS, admin, logs, the trace collector.
FD_RESERVE = 128


def connection_limit() -> int:
    """MESHFN_PROXY_MAX_CONNECTIONS, else half the open-file limit an Envoy started from here
    inherits (each downstream connection may need an upstream one) less FD_RESERVE."""
    value = env.PROXY_MAX_CONNECTIONS.integer()
    if value is not None:
        return value
    return max(64, open_files_limit() // 2 - FD_RESERVE)


def _overload_manager(max_connections: int) -> overload_pb2.OverloadManager:
    monitor = overload_pb2.ResourceMonitor(name=CONNECTIONS_MONITOR)
    monitor.typed_config.Pack(
        downstream_connections_pb2.DownstreamConnectionsConfig(
            max_active_downstream_connections=max_connections
        )
    )
    return overload_pb2.OverloadManager(resource_monitors=[monitor])


class AdminSocketPathTooLong(SocketPathTooLong):
    """The state directory is too deep for a unix socket path."""


def node_file_stem(node_id: str) -> str:
    """A node id as a file name (its bootstrap STATE/envoy/<stem>.json, its admin socket)."""
    return node_id.replace("/", "_").replace("~", "-").replace(":", "-")


def admin_socket_path(state_dir: Path, node_id: str) -> Path:
    """Where an Envoy of `meshfn up` serves its admin interface: STATE/envoy/<node>.sock, or
    STATE/envoy/<digest>.sock when the node's name would not fit in a socket address."""
    try:
        return socket_path(state_dir / "envoy", node_file_stem(node_id), "Envoy's admin socket")
    except SocketPathTooLong as exc:
        raise AdminSocketPathTooLong(exc.errno, exc.strerror) from None


def admin_tcp_warning(opted: str, port: int, remedy: str, proxy: str = "the proxy") -> str:
    """What a TCP admin port exposes; `opted`: who asked for it (a Gateway's adminPort,
    `meshfn bootstrap --admin-port`)."""
    return (
        f"warning: {opted}: its Envoy's admin interface also answers on 127.0.0.1:{port}, "
        "without authentication. Any local user (and any web page that reaches loopback) can "
        "read its configuration, including the ADS token that obtains "
        f"{proxy}'s private key and SPIFFE identity, and drain or stop {proxy}. {remedy} "
        "unless you alone use this host (meshfn itself reaches its Envoys over a private unix "
        "socket in the state directory)."
    )


def admin_port_warning(w: ir.Workload) -> str:
    """What a Gateway's adminPort exposes (it opts in to a TCP admin port)."""
    return admin_tcp_warning(
        f"Gateway {w.namespace}/{w.name} sets adminPort {w.admin_port}",
        w.admin_port,
        "Remove adminPort",
        "the gateway",
    )


def admin_port_warnings(model: ir.MeshModel) -> list[str]:
    """One warning per gateway whose policy opts in to a TCP admin port."""
    return [admin_port_warning(w) for w in model.workloads if w.kind == "gateway" and w.admin_port]


@dataclass(frozen=True)
class ProxyIdentity:
    """Who an Envoy is to the control plane: node.cluster selects the workload's snapshot."""

    node_id: str
    node_cluster: str
    locality: ir.Locality
    admin_port: int  # a TCP admin port besides the socket (a Gateway's adminPort), 0 for none
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


def _admin_over_tcp(port: int, socket: Path) -> tuple[listener_pb2.Listener, cluster_pb2.Cluster]:
    """A listener on 127.0.0.1:`port` whose connections go to the admin socket, unchanged."""
    proxy = tcp_proxy_pb2.TcpProxy(stat_prefix=ADMIN_TCP_LISTENER, cluster=ADMIN_CLUSTER)
    filter_ = listener_components_pb2.Filter(name="envoy.filters.network.tcp_proxy")
    filter_.typed_config.Pack(proxy)
    listener = listener_pb2.Listener(
        name=ADMIN_TCP_LISTENER,
        address=address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address="127.0.0.1", port_value=port)
        ),
        filter_chains=[listener_components_pb2.FilterChain(filters=[filter_])],
        # an operator reaches admin during a flood too (as Envoy's own admin listener)
        ignore_global_conn_limit=True,
    )
    cluster = cluster_pb2.Cluster(
        name=ADMIN_CLUSTER,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=_seconds(1),
        load_assignment=pipe_endpoints(ADMIN_CLUSTER, [str(socket)]),
    )
    return listener, cluster


def bootstrap(
    identity: ProxyIdentity,
    xds_host: str,
    xds_port: int,
    admin_socket: Path,
    max_connections: int | None = None,
) -> bootstrap_pb2.Bootstrap:
    """Admin on `admin_socket` (mode 0600), and on the identity's admin port too when it has
    one (a Gateway's adminPort, `meshfn bootstrap --admin-port`), through a forwarding
    listener: never on TCP alone. At most `max_connections` downstream connections
    (default: connection_limit())."""
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
    listeners: list[listener_pb2.Listener] = []
    clusters = [xds_cluster]
    admin_address = pipe_address(str(admin_socket), ADMIN_SOCKET_MODE)
    if identity.admin_port:
        listener, cluster = _admin_over_tcp(identity.admin_port, admin_socket)
        listeners.append(listener)
        clusters.append(cluster)
    return bootstrap_pb2.Bootstrap(
        bootstrap_extensions=[internal_listeners()],
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
        admin=bootstrap_pb2.Admin(address=admin_address),
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
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=listeners, clusters=clusters
        ),
        layered_runtime=_runtime(),
        overload_manager=_overload_manager(
            connection_limit() if max_connections is None else max_connections
        ),
    )


def internal_listeners() -> extension_pb2.TypedExtensionConfig:
    """Internal listeners (envoy_internal_address): where a sidecar traces at a low sampling
    rate (meshfn.xds.translate.httpfilters.tracing), which ADS may turn on at any time."""
    out = extension_pb2.TypedExtensionConfig(name="envoy.bootstrap.internal_listener")
    out.typed_config.Pack(internal_listener_pb2.InternalListener())
    return out


def _runtime() -> bootstrap_pb2.LayeredRuntime:
    """RUNTIME as a static layer, then an admin layer (an operator's /runtime_modify)."""
    values = struct_pb2.Struct()
    values.update(RUNTIME)
    return bootstrap_pb2.LayeredRuntime(
        layers=[
            bootstrap_pb2.RuntimeLayer(name="meshfn", static_layer=values),
            bootstrap_pb2.RuntimeLayer(
                name="admin", admin_layer=bootstrap_pb2.RuntimeLayer.AdminLayer()
            ),
        ]
    )


def bootstrap_json(
    identity: ProxyIdentity,
    xds_host: str,
    xds_port: int,
    admin_socket: Path,
    max_connections: int | None = None,
) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(
        bootstrap(identity, xds_host, xds_port, admin_socket, max_connections),
        preserving_proto_field_name=True,
    )
    return result
