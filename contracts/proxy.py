"""What every meshfn proxy's HTTP connection manager does to a request before any filter or
route sees it, in Envoy's protobuf JSON (HttpConnectionManager fields). One definition: the xDS
translator merges it into each gateway and sidecar connection manager, the Istio renderer into
istiod's (an EnvoyFilter on gateways and inbound sidecars), so both modes match.

- An authorization rule must see the path the application acts on (Istio's
  DECODE_AND_MERGE_SLASHES, Envoy's edge-proxy advice): %2F and %5C are decoded (an application
  that decodes them would otherwise serve /a/b to a rule that saw /a%2Fb), then dot segments
  are resolved (RFC 3986, encoded unreserved characters decoded) and repeated slashes merged.
- Headers with underscores are dropped: servers that map `x_meshfn_tenant` and
  `x-meshfn-tenant` to one name (CGI, WSGI) would let a caller forge what the mesh strips.
- A request's headers must arrive within 10 s (Envoy waits forever by default: a slow-headers
  client holds a connection for free), and one HTTP/2 connection carries at most 100 streams at
  once (Envoy's default is 2^31).

Sidecars do all of it too: a caller can reach one directly.
"""

from __future__ import annotations

from typing import Any

REQUEST_HYGIENE: dict[str, Any] = {
    "normalize_path": True,
    "merge_slashes": True,
    "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
    "common_http_protocol_options": {"headers_with_underscores_action": "DROP_HEADER"},
    "request_headers_timeout": "10s",
    "http2_protocol_options": {"max_concurrent_streams": 100},
}
