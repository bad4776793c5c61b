"""jwt_authn: RequestAuthentication rules as Envoy JWT providers, and the clusters Envoy fetches
remote JWKS through.

Istio's semantics: a token that is present must be valid for one provider (401, an audience
mismatch 403), a request without one passes and authorization decides. Each provider also
writes the claims meshfn's wasm filters read as headers (`internal_headers.claim_headers`).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import urlsplit

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, http_uri_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2
from google.protobuf import duration_pb2, empty_pb2

from meshfn import ir

from ...fragments.messages import pack
from ...fragments.plugins import JWT_PAYLOAD  # the verified payload: RBAC and audit read it
from ...names import CLUSTER
from ..common import one_endpoint
from ..resources import Resources
from ..security import TLS_SOCKET
from .base import FilterContext, HttpFilter
from .internal_headers import claim_headers

JWT_FILTER = "envoy.filters.http.jwt_authn"
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"
JWT_CACHE_SIZE = 1000  # verified tokens kept per Envoy worker and provider


class JwtAuthn(HttpFilter[tuple[ir.JwtRule, ...]]):
    def config(self, ctx: FilterContext) -> tuple[ir.JwtRule, ...] | None:
        return ctx.jwt_rules or None

    def http_filters(
        self, ctx: FilterContext, config: tuple[ir.JwtRule, ...]
    ) -> Iterable[hcm.HttpFilter]:
        # A gateway that sheds by priority routes on the verified payload (routes.py): jwt_authn
        # clears the route cache once it wrote the payload, so the route is matched again.
        shed = ctx.qos is not None and ctx.qos.shed
        return (jwt_filter(config, claim_headers(ctx), shed),)

    def resources(
        self, ctx: FilterContext, config: tuple[ir.JwtRule, ...], overlay: ir.Overlay
    ) -> Resources:
        return {
            CLUSTER: {cluster.name: cluster for cluster in map(jwks_cluster, jwks_uris(config))}
        }


def provider_name(rule: ir.JwtRule) -> str:
    source = rule.jwks_uri or hashlib.sha256((rule.jwks or "").encode()).hexdigest()[:12]
    return "jwt-" + hashlib.sha256(f"{rule.issuer}|{source}".encode()).hexdigest()[:12]


def jwks_cluster_name(uri: str) -> str:
    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"jwks|{parts.scheme}://{parts.hostname}:{port}"


@lru_cache(maxsize=1024)
def jwks_cluster(uri: str) -> cluster_pb2.Cluster:
    """The cluster Envoy fetches a remote JWKS through (an IP literal: STATIC; a name: DNS)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
        kind = cluster_pb2.Cluster.STATIC
    except ValueError:
        kind = cluster_pb2.Cluster.STRICT_DNS
    name = jwks_cluster_name(uri)
    cluster = cluster_pb2.Cluster(
        name=name,
        type=kind,
        connect_timeout=duration_pb2.Duration(seconds=2),
        load_assignment=one_endpoint(name, host, port),
    )
    if parts.scheme == "https":
        context = tls_pb2.UpstreamTlsContext(
            sni=host,
            common_tls_context=tls_pb2.CommonTlsContext(
                validation_context=common_pb2.CertificateValidationContext(
                    trusted_ca=base_pb2.DataSource(filename=SYSTEM_CA)
                )
            ),
        )
        cluster.transport_socket.CopyFrom(
            base_pb2.TransportSocket(name=TLS_SOCKET, typed_config=pack(context))
        )
    return cluster


def _provider(
    rule: ir.JwtRule,
    claim_headers: tuple[tuple[str, str], ...] = (),
    clear_route_cache: bool = False,
) -> jwt.JwtProvider:
    """`claim_headers` ((header, claim) pairs, e.g. the audit filter's in jwt_headers mode) are
    added to the rule's own claim_to_headers and win over a rule entry for the same header."""
    ours = {header for header, _ in claim_headers}
    provider = jwt.JwtProvider(
        issuer=rule.issuer,
        audiences=list(rule.audiences),
        from_headers=[jwt.JwtHeader(name=n, value_prefix=p) for n, p in rule.from_headers],
        from_params=list(rule.from_params),
        forward=rule.forward,
        payload_in_metadata=JWT_PAYLOAD,
        claim_to_headers=[
            jwt.JwtClaimToHeader(header_name=h, claim_name=c)
            for h, c in rule.claim_to_headers
            if h.lower() not in ours
        ]
        + [jwt.JwtClaimToHeader(header_name=h, claim_name=c) for h, c in claim_headers],
        clock_skew_seconds=rule.clock_skew_seconds,
        require_expiration=rule.require_expiration,
        # Each worker keeps the tokens it verified (expiry still checked on every hit): a
        # client's repeated token costs no ES256/RS256 verification per request.
        jwt_cache_config=jwt.JwtCacheConfig(jwt_cache_size=JWT_CACHE_SIZE),
        clear_route_cache=clear_route_cache,
    )
    if rule.max_lifetime_seconds is not None:
        provider.max_lifetime.CopyFrom(duration_pb2.Duration(seconds=rule.max_lifetime_seconds))
    if rule.jwks is not None:
        provider.local_jwks.CopyFrom(base_pb2.DataSource(inline_string=rule.jwks))
    else:
        assert rule.jwks_uri is not None
        provider.remote_jwks.CopyFrom(
            jwt.RemoteJwks(
                http_uri=http_uri_pb2.HttpUri(
                    uri=rule.jwks_uri,
                    cluster=jwks_cluster_name(rule.jwks_uri),
                    timeout=duration_pb2.Duration(seconds=5),
                ),
                cache_duration=duration_pb2.Duration(seconds=300),
                async_fetch=jwt.JwksAsyncFetch(),
            )
        )
    return provider


@lru_cache(maxsize=1024)
def jwt_filter(
    rules: tuple[ir.JwtRule, ...],
    claim_headers: tuple[tuple[str, str], ...] = (),
    clear_route_cache: bool = False,
) -> hcm.HttpFilter:
    """`claim_headers`: (header, claim) pairs every provider writes (see `_provider`);
    `clear_route_cache`: routes match on the verified payload."""
    providers = {provider_name(r): _provider(r, claim_headers, clear_route_cache) for r in rules}
    # A token that is present must be valid for one provider (else 401); a missing token passes
    # here and authorization decides (Istio semantics).
    requirement = jwt.JwtRequirement(
        requires_any=jwt.JwtRequirementOrList(
            requirements=[jwt.JwtRequirement(provider_name=n) for n in sorted(providers)]
            + [jwt.JwtRequirement(allow_missing=empty_pb2.Empty())]
        )
    )
    config = jwt.JwtAuthentication(
        providers=providers,
        rules=[jwt.RequirementRule(match=rc.RouteMatch(prefix="/"), requires=requirement)],
    )
    return hcm.HttpFilter(name=JWT_FILTER, typed_config=pack(config))


def jwks_uris(rules: tuple[ir.JwtRule, ...]) -> list[str]:
    return sorted({r.jwks_uri for r in rules if r.jwks_uri is not None})
