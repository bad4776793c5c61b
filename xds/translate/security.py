"""Zero trust in Envoy terms: SDS secrets, mTLS transport sockets, jwt_authn and RBAC filters.

Semantics follow Istio where they apply: a RequestAuthentication rejects invalid tokens (401) but
lets requests without a token through, and authorization decides (403); DENY policies are
checked first; once any ALLOW policy selects a workload, requests no ALLOW rule matches are
denied. Certificates and the trust bundle reach Envoy over ADS as the secrets "default" and
"ROOTCA", so rotation never restarts Envoy.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable
from functools import lru_cache
from typing import Protocol
from urllib.parse import urlsplit

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, http_uri_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.type.matcher.v3 import metadata_pb2, path_pb2, regex_pb2, string_pb2, value_pb2
from google.protobuf import duration_pb2, empty_pb2, struct_pb2, wrappers_pb2

from meshfn import ir

from ..names import CERT_SECRET, ROOT_SECRET
from .common import ads_source, pack, socket_address

JWT_FILTER = "envoy.filters.http.jwt_authn"
JWT_PAYLOAD = "payload"  # jwt_authn metadata key the RBAC rules read claims from
TLS_SOCKET = "envoy.transport_sockets.tls"
TLS_MATCH = {"tlsMode": "mtls"}  # endpoint metadata that selects the mTLS transport socket
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"


class Credentials(Protocol):
    """What the SDS secrets are made of (the identity manager's Credentials has these)."""

    @property
    def certificate_pem(self) -> str: ...
    @property
    def private_key_pem(self) -> str: ...
    @property
    def trust_bundle_pem(self) -> str: ...


# ---------------------------------------------------------------- secrets and TLS


def secrets(credentials: Credentials) -> dict[str, secret_pb2.Secret]:
    return {
        CERT_SECRET: secret_pb2.Secret(
            name=CERT_SECRET,
            tls_certificate=common_pb2.TlsCertificate(
                certificate_chain=base_pb2.DataSource(inline_string=credentials.certificate_pem),
                private_key=base_pb2.DataSource(inline_string=credentials.private_key_pem),
            ),
        ),
        ROOT_SECRET: secret_pb2.Secret(
            name=ROOT_SECRET,
            validation_context=common_pb2.CertificateValidationContext(
                trusted_ca=base_pb2.DataSource(inline_string=credentials.trust_bundle_pem)
            ),
        ),
    }


def _sds(name: str) -> secret_pb2.SdsSecretConfig:
    return secret_pb2.SdsSecretConfig(name=name, sds_config=ads_source())


def _common_tls(peer_spiffe_id: str | None, alpn: tuple[str, ...]) -> tls_pb2.CommonTlsContext:
    default = common_pb2.CertificateValidationContext()
    if peer_spiffe_id is not None:
        default.match_typed_subject_alt_names.append(
            common_pb2.SubjectAltNameMatcher(
                san_type=common_pb2.SubjectAltNameMatcher.URI,
                matcher=string_pb2.StringMatcher(exact=peer_spiffe_id),
            )
        )
    return tls_pb2.CommonTlsContext(
        tls_params=common_pb2.TlsParameters(
            tls_minimum_protocol_version=common_pb2.TlsParameters.TLSv1_2
        ),
        tls_certificate_sds_secret_configs=[_sds(CERT_SECRET)],
        combined_validation_context=tls_pb2.CommonTlsContext.CombinedCertificateValidationContext(
            default_validation_context=default,
            validation_context_sds_secret_config=_sds(ROOT_SECRET),
        ),
        alpn_protocols=list(alpn),
    )


@lru_cache(maxsize=4096)
def upstream_mtls(peer_spiffe_id: str, http2: bool) -> base_pb2.TransportSocket:
    """Client side: present our certificate, accept only the expected peer SPIFFE ID."""
    context = tls_pb2.UpstreamTlsContext(
        common_tls_context=_common_tls(peer_spiffe_id, ("h2",) if http2 else ("http/1.1",))
    )
    return base_pb2.TransportSocket(name=TLS_SOCKET, typed_config=pack(context))


@lru_cache(maxsize=16)
def downstream_mtls() -> base_pb2.TransportSocket:
    """Server side: require a client certificate chaining to the bundle; which SPIFFE IDs may
    call is authorization's business (RBAC), so no SAN pinning here."""
    context = tls_pb2.DownstreamTlsContext(
        common_tls_context=_common_tls(None, ("h2", "http/1.1")),
        require_client_certificate=wrappers_pb2.BoolValue(value=True),
    )
    return base_pb2.TransportSocket(name=TLS_SOCKET, typed_config=pack(context))


def tls_match_metadata() -> base_pb2.Metadata:
    return base_pb2.Metadata(
        filter_metadata={
            "envoy.transport_socket_match": struct_pb2.Struct(
                fields={k: struct_pb2.Value(string_value=v) for k, v in TLS_MATCH.items()}
            )
        }
    )


def mtls_socket_match(peer_spiffe_id: str, http2: bool) -> cluster_pb2.Cluster.TransportSocketMatch:
    return cluster_pb2.Cluster.TransportSocketMatch(
        name="mtls",
        match=struct_pb2.Struct(
            fields={k: struct_pb2.Value(string_value=v) for k, v in TLS_MATCH.items()}
        ),
        transport_socket=upstream_mtls(peer_spiffe_id, http2),
    )


def client_cert_details() -> dict[str, object]:
    """Tell the application who called (x-forwarded-client-cert with the caller's URI SAN)."""
    return {
        "forward_client_cert_details": hcm.HttpConnectionManager.SANITIZE_SET,
        "set_current_client_cert_details": hcm.HttpConnectionManager.SetCurrentClientCertDetails(
            uri=True
        ),
    }


# ---------------------------------------------------------------- JWT


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
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[
                endpoint_components_pb2.LocalityLbEndpoints(
                    lb_endpoints=[
                        endpoint_components_pb2.LbEndpoint(
                            endpoint=endpoint_components_pb2.Endpoint(
                                address=socket_address(host, port)
                            )
                        )
                    ]
                )
            ],
        ),
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


def _provider(rule: ir.JwtRule, claim_headers: tuple[tuple[str, str], ...] = ()) -> jwt.JwtProvider:
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
    )
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
    rules: tuple[ir.JwtRule, ...], claim_headers: tuple[tuple[str, str], ...] = ()
) -> hcm.HttpFilter:
    """`claim_headers`: (header, claim) pairs every provider writes (see `_provider`)."""
    providers = {provider_name(r): _provider(r, claim_headers) for r in rules}
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


# ---------------------------------------------------------------- authorization


def _regex(value: str) -> string_pb2.StringMatcher:
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=value))


def _principal_string(pattern: str) -> string_pb2.StringMatcher:
    """Istio principal pattern ("td/ns/x/sa/y", "*", "prefix*", "*suffix") -> SPIFFE matcher."""
    if pattern == "*":
        return _regex(".+")
    if pattern.endswith("*"):
        return string_pb2.StringMatcher(prefix="spiffe://" + pattern[:-1])
    if pattern.startswith("*"):
        return string_pb2.StringMatcher(suffix=pattern[1:])
    return string_pb2.StringMatcher(exact="spiffe://" + pattern)


def _namespace_string(pattern: str) -> string_pb2.StringMatcher:
    if pattern == "*":
        return _regex("spiffe://[^/]+/ns/[^/]+/sa/[^/]+")
    if pattern.endswith("*"):
        return _regex(f"spiffe://[^/]+/ns/{pattern[:-1]}[^/]*/sa/[^/]+")
    return _regex(f"spiffe://[^/]+/ns/{pattern}/sa/[^/]+")


def _peer(matcher: string_pb2.StringMatcher) -> rbac_pb2.Principal:
    return rbac_pb2.Principal(
        authenticated=rbac_pb2.Principal.Authenticated(principal_name=matcher)
    )


def _claim(claim: str, value: string_pb2.StringMatcher | None) -> rbac_pb2.Principal:
    """A JWT claim (string or list of strings) from jwt_authn's metadata."""
    path = [
        metadata_pb2.MetadataMatcher.PathSegment(key=JWT_PAYLOAD),
        metadata_pb2.MetadataMatcher.PathSegment(key=claim),
    ]

    def meta(matcher: value_pb2.ValueMatcher) -> rbac_pb2.Principal:
        return rbac_pb2.Principal(
            metadata=metadata_pb2.MetadataMatcher(filter=JWT_FILTER, path=path, value=matcher)
        )

    if value is None:
        return meta(value_pb2.ValueMatcher(present_match=True))
    string = value_pb2.ValueMatcher(string_match=value)
    return _or_principals(
        [
            meta(string),
            meta(value_pb2.ValueMatcher(list_match=value_pb2.ListMatcher(one_of=string))),
        ]
    )


def _value_string(pattern: str) -> string_pb2.StringMatcher:
    if pattern == "*":
        return _regex(".*")
    if pattern.endswith("*"):
        return string_pb2.StringMatcher(prefix=pattern[:-1])
    if pattern.startswith("*"):
        return string_pb2.StringMatcher(suffix=pattern[1:])
    return string_pb2.StringMatcher(exact=pattern)


def _request_principal(pattern: str) -> rbac_pb2.Principal:
    """ "iss/sub" (split at the last "/", issuers are URLs), "iss/*" or "*"."""
    if pattern == "*":
        return _claim("iss", None)
    issuer, _, subject = pattern.rpartition("/")
    return _and_principals(
        [
            _claim("iss", string_pb2.StringMatcher(exact=issuer)),
            _claim("sub", None if subject == "*" else string_pb2.StringMatcher(exact=subject)),
        ]
    )


def _or_principals(ids: list[rbac_pb2.Principal]) -> rbac_pb2.Principal:
    return ids[0] if len(ids) == 1 else rbac_pb2.Principal(or_ids=rbac_pb2.Principal.Set(ids=ids))


def _and_principals(ids: list[rbac_pb2.Principal]) -> rbac_pb2.Principal:
    if not ids:
        return rbac_pb2.Principal(any=True)
    return ids[0] if len(ids) == 1 else rbac_pb2.Principal(and_ids=rbac_pb2.Principal.Set(ids=ids))


def _not_principal(inner: rbac_pb2.Principal) -> rbac_pb2.Principal:
    return rbac_pb2.Principal(not_id=inner)


def _or_permissions(rules: list[rbac_pb2.Permission]) -> rbac_pb2.Permission:
    return (
        rules[0]
        if len(rules) == 1
        else rbac_pb2.Permission(or_rules=rbac_pb2.Permission.Set(rules=rules))
    )


def _and_permissions(rules: list[rbac_pb2.Permission]) -> rbac_pb2.Permission:
    if not rules:
        return rbac_pb2.Permission(any=True)
    return (
        rules[0]
        if len(rules) == 1
        else rbac_pb2.Permission(and_rules=rbac_pb2.Permission.Set(rules=rules))
    )


def _principal_field(
    positive: tuple[str, ...], negative: tuple[str, ...], one: Callable[[str], rbac_pb2.Principal]
) -> list[rbac_pb2.Principal]:
    """Values within a field are OR'ed; `not*` fields negate their OR."""
    out = []
    if positive:
        out.append(_or_principals([one(p) for p in positive]))
    if negative:
        out.append(_not_principal(_or_principals([one(p) for p in negative])))
    return out


def _permission_field(
    positive: tuple[str, ...], negative: tuple[str, ...], one: Callable[[str], rbac_pb2.Permission]
) -> list[rbac_pb2.Permission]:
    out = []
    if positive:
        out.append(_or_permissions([one(p) for p in positive]))
    if negative:
        out.append(rbac_pb2.Permission(not_rule=_or_permissions([one(p) for p in negative])))
    return out


def _source(source: ir.SourceMatch) -> rbac_pb2.Principal:
    """Fields of one source are AND'ed."""
    return _and_principals(
        _principal_field(
            source.principals, source.not_principals, lambda p: _peer(_principal_string(p))
        )
        + _principal_field(
            source.namespaces, source.not_namespaces, lambda p: _peer(_namespace_string(p))
        )
        + _principal_field(
            source.request_principals, source.not_request_principals, _request_principal
        )
    )


def _path(pattern: str) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=_value_string(pattern)))


def _method(method: str) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(
        header=rc.HeaderMatcher(name=":method", string_match=string_pb2.StringMatcher(exact=method))
    )


def _operation(operation: ir.OperationMatch) -> rbac_pb2.Permission:
    return _and_permissions(
        _permission_field(operation.paths, operation.not_paths, _path)
        + _permission_field(operation.methods, operation.not_methods, _method)
    )


def _condition(condition: ir.ConditionMatch) -> rbac_pb2.Principal:
    key = condition.key

    def one(value: str) -> rbac_pb2.Principal:
        if key.startswith("request.auth.claims["):
            return _claim(key[len("request.auth.claims[") : -1], _value_string(value))
        if key == "request.auth.audiences":
            return _claim("aud", _value_string(value))
        if key == "request.auth.principal":
            return _request_principal(value)
        if key == "source.principal":
            return _peer(_principal_string(value))
        if key == "source.namespace":
            return _peer(_namespace_string(value))
        assert key.startswith("request.headers[")
        return rbac_pb2.Principal(
            header=rc.HeaderMatcher(
                name=key[len("request.headers[") : -1].lower(), string_match=_value_string(value)
            )
        )

    return _and_principals(_principal_field(condition.values, condition.not_values, one))


def _policy(rule: ir.AuthzRule) -> rbac_pb2.Policy:
    principals = []
    if rule.sources:
        principals.append(_or_principals([_source(s) for s in rule.sources]))
    principals += [_condition(c) for c in rule.conditions]
    permission = (
        _or_permissions([_operation(o) for o in rule.operations])
        if rule.operations
        else rbac_pb2.Permission(any=True)
    )
    return rbac_pb2.Policy(permissions=[permission], principals=[_and_principals(principals)])


@lru_cache(maxsize=1024)
def rbac_filters(policies: tuple[ir.AuthzPolicy, ...]) -> tuple[hcm.HttpFilter, ...]:
    """DENY first, then ALLOW (omitted when no ALLOW policy selects the workload)."""
    out = []
    for action in ("DENY", "ALLOW"):
        selected = [p for p in policies if p.action == action]
        if not selected:
            continue
        rules = rbac_pb2.RBAC(
            action=rbac_pb2.RBAC.DENY if action == "DENY" else rbac_pb2.RBAC.ALLOW,
            policies={
                f"{p.name}[{i}]": _policy(rule) for p in selected for i, rule in enumerate(p.rules)
            },
        )
        config = rbac_filter.RBAC(rules=rules, rules_stat_prefix=f"meshfn_{action.lower()}_")
        out.append(hcm.HttpFilter(name=f"meshfn.authz.{action.lower()}", typed_config=pack(config)))
    return tuple(out)
