"""xDS type URLs and the names meshfn gives Envoy resources: the vocabulary that the translator,
the snapshot cache, the ADS server and the control plane's feedback loops (the drift breaker
reads cluster and route names off Envoy's access logs) share. A leaf: no protobuf, and of meshfn
only the names every renderer shares (meshfn.contracts.naming).
"""

from __future__ import annotations

from meshfn.contracts import naming

LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
SECRET = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
EXTENSION = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"  # ECDS

# Make-before-break push order: a resource goes out with or before the resources that use it
# (secrets before listeners and clusters, endpoints before clusters, routes and filter
# configurations before listeners).
PUSH_ORDER = (SECRET, EXTENSION, ENDPOINT, CLUSTER, ROUTE, LISTENER)

SHORT_NAMES = {
    LISTENER: "listeners",
    ROUTE: "routes",
    CLUSTER: "clusters",
    ENDPOINT: "endpoints",
    SECRET: "secrets",
    EXTENSION: "extension_configs",
}

# The static cluster every bootstrap defines for the control plane (ADS, access logs).
CONTROL_PLANE_CLUSTER = "meshfn-xds"
# The cluster Envoy's OpenTelemetry tracer sends spans to (the OTLP collector).
TRACE_COLLECTOR_CLUSTER = "meshfn-otlp"
# The gRPC access-log stream that feeds the drift breaker.
LATENCY_LOG = "meshfn-latency"
# Which requests it carries (CEL, Envoy's access-log filter and Istio's Telemetry filter): those
# sent on an upstream connection. A refusal (a rate limit's or a shed's 429, a 401, a 403) names
# its route's cluster too, but measured nothing: it would pull the breaker's p95 down and hide
# a slow backend, and at saturation most requests are refusals, each serialised and streamed.
# (Measured with Envoy 1.40: a circuit breaker's overflow has an upstream host but no local
# address; a rate limit's refusal neither.)
LATENCY_LOG_FILTER = "has(upstream.local_address)"

# SDS secrets: the workload's certificate and key, and the trust bundle.
CERT_SECRET = "default"
ROOT_SECRET = "ROOTCA"

# A sidecar's listener and the route that forwards to its application.
INBOUND_LISTENER = "inbound"
# Where a split sidecar traces (translate.httpfilters.tracing): an internal listener, and the
# cluster that reaches it, of this one name.
TRACED_INBOUND = "meshfn-traced-inbound"


def traced_gateway_name(listener: str) -> str:
    """Where a split gateway's listener traces: an internal listener, and the cluster that
    reaches it, of this one name."""
    return f"meshfn-traced-{listener}"


# EDS priority levels meshfn assigns by proximity (same node .. anywhere): see translate.endpoints.
PRIORITY_LEVELS = 5


def cluster_name(service_key: str) -> str:
    """Envoy cluster name of a Service ("namespace/name" -> "name.namespace")."""
    namespace, name = service_key.split("/", 1)
    return f"{name}.{namespace}"


def tier_cluster_name(service_key: str, level: int) -> str:
    """One priority level of a service with locality failover, as its own cluster (a member of
    a fallback chain's aggregate)."""
    return f"{cluster_name(service_key)}|p{level}"


def primary_clusters(service_key: str) -> frozenset[str]:
    """Every cluster that can carry a service's own endpoints (itself and its tiers): what an
    access log names as the upstream cluster of a request the service served."""
    own = cluster_name(service_key)
    return frozenset({own, *(tier_cluster_name(service_key, n) for n in range(PRIORITY_LEVELS))})


def function_cluster_name(cluster: str, function: str) -> str:
    """A gateway's twin of `cluster` for one Function's routes: the same endpoints (read from
    the original's EDS resource), with circuit breakers of the function's own (QoS gateway
    shedding)."""
    return f"fn|{function}|{cluster}"


def version_cluster_name(cluster: str, function: str, version: str) -> str:
    """A gateway's twin of `cluster` for one version of a Function in a rollout: the same
    endpoints (the same EDS resource), so its requests, statistics and access-log entries name
    the version (the backend serves the one the route's header names)."""
    return f"version|{function}@{version}|{cluster}"


def fallback_cluster_name(members: tuple[str, ...]) -> str:
    """An aggregate cluster is named by its members: routes can share it, and the name tells a
    reader (and Envoy's stats) the order."""
    return "fallback|" + ">".join(members)


def local_cluster_name(app_port: int) -> str:
    """A sidecar's cluster for its own application."""
    return f"inbound|{app_port}"


def route_config_name(listener_name: str) -> str:
    return listener_name


def route_name(route_key: str, index: int) -> str:
    """Envoy route name of match `index` of a meshfn Route (meshfn.contracts.naming)."""
    return naming.route_name(route_key, index)


def degraded_route_name(route_key: str, index: int) -> str:
    return naming.degraded_route_name(route_key, index)
