"""Service -> Cluster (EDS, endpoints over ADS), with outlier detection, circuit breakers, a
retry budget and active health checks; fallback chains as aggregate clusters."""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2, health_check_pb2, protocol_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3 import (
    client_side_weighted_round_robin_pb2 as wrr_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from meshfn import ir
from meshfn.contracts.qos import LoadBalancer

from ..fragments.messages import duration, pack
from ..names import (
    cluster_name,
    fallback_cluster_name,
    function_cluster_name,
    version_cluster_name,
)
from .common import ads_source
from .security import mtls_socket_match

HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
AGGREGATE = "envoy.clusters.aggregate"


def cluster(service: ir.Service, name: str | None = None) -> cluster_pb2.Cluster:
    """The service's cluster (`name` overrides the cluster name, for per-priority tiers)."""
    # Keyed without the endpoints: an endpoint change must not produce a new Cluster (Envoy
    # would re-warm it); only the ClusterLoadAssignment changes.
    mtls = any(e.sidecar_port is not None and e.mtls != "DISABLE" for e in service.endpoints)
    return _cluster(
        name or cluster_name(service.key),
        codec(service),
        service.connect_timeout,
        service.identity if mtls else "",
        service.traffic,
        service.load_balancer,
        service.shed,
        service.functions,
    )


def function_cluster(
    base: cluster_pb2.Cluster, function: str, limits: ir.PriorityLimits
) -> cluster_pb2.Cluster:
    """The twin of an EDS cluster for one Function's routes at a shedding gateway: the same
    endpoints (the same EDS resource: the ADS server sends it again when a twin appears, see
    xds Handler.rewarm), with the function's own per-priority limits."""
    out = cluster_pb2.Cluster()
    out.CopyFrom(base)
    out.name = function_cluster_name(base.name, function)
    if out.HasField("eds_cluster_config"):
        out.eds_cluster_config.service_name = base.eds_cluster_config.service_name or base.name
    thresholds = out.circuit_breakers.thresholds
    breakers = priority_breakers(limits)
    for mine, theirs in zip(breakers.thresholds, thresholds, strict=False):
        _keep_others(theirs, mine)
    out.circuit_breakers.CopyFrom(breakers)
    return out


def version_cluster(base: cluster_pb2.Cluster, function: str, version: str) -> cluster_pb2.Cluster:
    """The twin of a cluster for one version of a rolled-out Function: the same endpoints (the
    same EDS resource) and settings, under a name that says the version, so the gateway's
    statistics and access-log entries tell the versions apart."""
    out = cluster_pb2.Cluster()
    out.CopyFrom(base)
    out.name = version_cluster_name(base.name, function, version)
    if out.HasField("eds_cluster_config"):
        out.eds_cluster_config.service_name = base.eds_cluster_config.service_name or base.name
    return out


def _keep_others(
    base: circuit_breaker_pb2.CircuitBreakers.Thresholds,
    into: circuit_breaker_pb2.CircuitBreakers.Thresholds,
) -> None:
    """A FallbackPolicy's retry and connection limits stay beside the shedding thresholds."""
    into.max_retries.CopyFrom(base.max_retries)
    if base.HasField("max_connections"):
        into.max_connections.CopyFrom(base.max_connections)
    if base.HasField("retry_budget"):
        into.retry_budget.CopyFrom(base.retry_budget)


def priority_breakers(limits: ir.PriorityLimits) -> circuit_breaker_pb2.CircuitBreakers:
    """Envoy's routing priorities as QoS classes: DEFAULT (the lower classes) may have at most
    `limits.default` requests in flight or waiting for a connection, HIGH `limits.high`; past
    that Envoy answers at once (response flag UO), and the listener's local reply makes it the
    backend's shed 429 (fragments.qos.shed_replies). Retries stay unlimited (UNLIMITED_RETRIES)."""
    return circuit_breaker_pb2.CircuitBreakers(
        thresholds=[
            circuit_breaker_pb2.CircuitBreakers.Thresholds(
                priority=priority,
                max_requests=_u32(limit),
                max_pending_requests=_u32(limit),
                max_retries=_u32(UNLIMITED_RETRIES),
            )
            for priority, limit in (
                (base_pb2.DEFAULT, limits.default),
                (base_pb2.HIGH, limits.high),
            )
        ]
    )


def codec(service: ir.Service) -> str:
    """The upstream codec: HTTP/1.1, HTTP/2 (gRPC), or "mixed": an HTTP service whose
    endpoints also take gRPC (grpcPort) gets each request in the client's own protocol."""
    if service.protocol == "http" and service.speaks_grpc:
        return "mixed"
    return service.protocol


def http2_options() -> http_protocol_options_pb2.HttpProtocolOptions:
    return http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )


def http1_trailers() -> http_protocol_options_pb2.HttpProtocolOptions:
    """HTTP/1.1 upstream with trailers decoded (a generation's usage record follows its
    stream as a trailer; without this Envoy drops it)."""
    return http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions(enable_trailers=True)
        )
    )


def downstream_protocol(trailers: bool) -> http_protocol_options_pb2.HttpProtocolOptions:
    """Upstream in the protocol the request came in (HTTP/2 for gRPC, HTTP/1.1 for the rest;
    `trailers`: HTTP/1.1 trailers decoded, as http1_trailers)."""
    return http_protocol_options_pb2.HttpProtocolOptions(
        use_downstream_protocol_config=http_protocol_options_pb2.HttpProtocolOptions.UseDownstreamHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions(enable_trailers=trailers),
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions(),
        )
    )


def _u32(value: int | None) -> wrappers_pb2.UInt32Value | None:
    return wrappers_pb2.UInt32Value(value=value) if value is not None else None


# Envoy allows 3 concurrent retries per cluster by default: when an endpoint dies under load,
# the 4th request retrying at that moment fails with UO (measured in bench/failover.py). Routes
# already bound retries per request, so like Istio the cluster-wide limit is off unless a
# FallbackPolicy sets circuitBreakers.maxRetries or a retryBudget.
UNLIMITED_RETRIES = 0xFFFFFFFF


def _breakers(b: ir.CircuitBreakers | None) -> circuit_breaker_pb2.CircuitBreakers:
    thresholds = circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=base_pb2.DEFAULT,
        max_retries=_u32(
            UNLIMITED_RETRIES if b is None or b.max_retries is None else b.max_retries
        ),
    )
    if b is not None:
        thresholds.MergeFrom(
            circuit_breaker_pb2.CircuitBreakers.Thresholds(
                max_connections=_u32(b.max_connections),
                max_pending_requests=_u32(b.max_pending_requests),
                max_requests=_u32(b.max_requests),
            )
        )
        if b.retry_budget_percent is not None:
            thresholds.retry_budget.CopyFrom(
                circuit_breaker_pb2.CircuitBreakers.Thresholds.RetryBudget(
                    budget_percent=percent_pb2.Percent(value=b.retry_budget_percent),
                    min_retry_concurrency=_u32(b.retry_budget_min_concurrency),
                )
            )
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[thresholds])


@lru_cache(maxsize=65536)
def _cluster(
    name: str,
    protocol: str,
    connect_timeout: timedelta,
    mtls_peer: str,
    traffic: ir.TrafficPolicy | None,
    balancer: LoadBalancer | None = None,
    shed: ir.PriorityLimits | None = None,
    trailers: bool = False,
) -> cluster_pb2.Cluster:
    out = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ads_source()),
        connect_timeout=duration(connect_timeout),
        circuit_breakers=_breakers(None),
    )
    if balancer == "weighted-round-robin":
        out.load_balancing_policy.CopyFrom(weighted_round_robin())
    elif balancer == "least-request":
        out.lb_policy = cluster_pb2.Cluster.LEAST_REQUEST
    else:
        out.lb_policy = cluster_pb2.Cluster.ROUND_ROBIN
    if protocol == "grpc":
        out.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(pack(http2_options()))
    elif protocol == "mixed":
        out.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(
            pack(downstream_protocol(trailers))
        )
    elif trailers:
        out.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(pack(http1_trailers()))
    if mtls_peer:
        # Endpoints whose sidecar speaks mTLS carry the match metadata (see endpoints.py); the
        # others (a sidecar in DISABLE mode) get plaintext. Istio's auto-mTLS works the same way.
        out.transport_socket_matches.append(mtls_socket_match(mtls_peer, protocol))
    if traffic is not None:
        _apply_traffic(out, traffic)
    if shed is not None:  # the FallbackPolicy's request limits are folded in (policy.qos)
        breakers = priority_breakers(shed)
        _keep_others(out.circuit_breakers.thresholds[0], breakers.thresholds[0])
        out.circuit_breakers.CopyFrom(breakers)
    return out


def _apply_traffic(out: cluster_pb2.Cluster, traffic: ir.TrafficPolicy) -> None:
    if traffic.outlier is not None:
        o = traffic.outlier
        out.outlier_detection.CopyFrom(
            outlier_detection_pb2.OutlierDetection(
                consecutive_5xx=wrappers_pb2.UInt32Value(value=o.consecutive_5xx or 1_000_000),
                enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(
                    value=100 if o.consecutive_5xx else 0
                ),
                consecutive_gateway_failure=wrappers_pb2.UInt32Value(
                    value=o.consecutive_gateway or 1_000_000
                ),
                enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(
                    value=100 if o.consecutive_gateway else 0
                ),
                interval=duration(o.interval),
                base_ejection_time=duration(o.base_ejection_time),
                max_ejection_percent=wrappers_pb2.UInt32Value(value=o.max_ejection_percent),
                enforcing_success_rate=wrappers_pb2.UInt32Value(value=0),
            )
        )
    if traffic.breakers is not None:
        out.circuit_breakers.CopyFrom(_breakers(traffic.breakers))
    if traffic.health_check is not None:
        h = traffic.health_check
        out.health_checks.append(
            health_check_pb2.HealthCheck(
                timeout=duration(h.timeout),
                interval=duration(h.interval),
                unhealthy_threshold=wrappers_pb2.UInt32Value(value=h.unhealthy_threshold),
                healthy_threshold=wrappers_pb2.UInt32Value(value=h.healthy_threshold),
                http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path=h.path),
                no_traffic_interval=duration(h.interval),
            )
        )


@lru_cache(maxsize=65536)
def fallback_cluster(
    members: tuple[str, ...], breakers: ir.CircuitBreakers | None = None
) -> cluster_pb2.Cluster:
    """Envoy's aggregate cluster: the first member with healthy hosts takes the traffic. Routes
    target it, so the retry limits (maxRetries, retryBudget) of the service whose chain it is
    belong here; connection limits act in the members' own pools."""
    return cluster_pb2.Cluster(
        name=fallback_cluster_name(members),
        connect_timeout=duration(timedelta(seconds=1)),
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        cluster_type=cluster_pb2.Cluster.CustomClusterType(
            name=AGGREGATE, typed_config=pack(aggregate_pb2.ClusterConfig(clusters=list(members)))
        ),
        circuit_breakers=_breakers(breakers),
    )


WRR = "envoy.load_balancing_policies.client_side_weighted_round_robin"


@lru_cache(maxsize=1)
def weighted_round_robin() -> cluster_pb2.LoadBalancingPolicy:
    """Envoy's client_side_weighted_round_robin: each endpoint weighted by requests per second
    over utilisation, from the ORCA load report on its responses (endpoint-load-metrics).
    Weights apply after 1 s of reports (Envoy's default blackout is 10 s: too slow to follow a
    backend that slows down), are recomputed every 0.5 s, and expire after 30 s without one."""
    config = wrr_pb2.ClientSideWeightedRoundRobin(
        blackout_period=duration_pb2.Duration(seconds=1),
        weight_update_period=duration_pb2.Duration(nanos=500_000_000),
        weight_expiration_period=duration_pb2.Duration(seconds=30),
    )
    return cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=extension_pb2.TypedExtensionConfig(
                    name=WRR, typed_config=pack(config)
                )
            )
        ]
    )
