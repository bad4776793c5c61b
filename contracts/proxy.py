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

`WHOLE_SMALL_BODIES` is the first HTTP filter of each of them: a request whose Content-Length
is at most WHOLE_BODY_BYTES is read whole before any filter decides on it. Envoy answers a
request it refuses from its headers (a 401, a 403, a rate limit's or a shed's 429) at once, and
an HTTP/1.1 connection whose request body was not read is then closed (Envoy does not drain
it). Under the load that rate limits and shedding exist for, every refusal cost the client a
new connection and the proxy its set-up and tear-down: measured with wrk, 32 connections, all
refused by a local rate limit, Envoy took 156 us per request and served 6.1k req/s with a
connection per request; with the small body read first, 72 us and 13.3k req/s on 33
connections. Larger bodies and chunked ones (no Content-Length: gRPC) still stream.
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


WHOLE_BODY_BYTES = 64 << 10
# RE2, matched whole: a decimal Content-Length of 0..65536 (WHOLE_BODY_BYTES).
SMALL_CONTENT_LENGTH = (
    "[0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-6]"
)
WHOLE_SMALL_BODIES: dict[str, Any] = {
    "name": "meshfn.whole_small_bodies",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
        "extension_config": {
            "name": "envoy.filters.http.buffer",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                "max_request_bytes": WHOLE_BODY_BYTES,
            },
        },
        # skipped unless the Content-Length is small (absent: chunked, or HTTP/2 without one)
        "xds_matcher": {
            "matcher_list": {
                "matchers": [
                    {
                        "predicate": {
                            "not_matcher": {
                                "single_predicate": {
                                    "input": {
                                        "name": "content-length",
                                        "typed_config": {
                                            "@type": "type.googleapis.com/"
                                            "envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
                                            "header_name": "content-length",
                                        },
                                    },
                                    "value_match": {
                                        "safe_regex": {
                                            "google_re2": {},
                                            "regex": SMALL_CONTENT_LENGTH,
                                        }
                                    },
                                }
                            }
                        },
                        "on_match": {
                            "action": {
                                "name": "skip",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters."
                                    "common.matcher.action.v3.SkipFilter"
                                },
                            }
                        },
                    }
                ]
            }
        },
    },
}
