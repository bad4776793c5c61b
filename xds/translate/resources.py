"""Type URLs and the translator's output shape."""

from __future__ import annotations

from google.protobuf.message import Message

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

# type_url -> resource name -> message. Messages may be shared between translations (they are
# memoised on IR objects): treat them as immutable.
Resources = dict[str, dict[str, Message]]
