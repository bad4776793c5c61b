"""mTLS in Envoy terms: SDS secrets, transport sockets, the caller's identity for the application.

Certificates and the trust bundle reach Envoy over ADS as the secrets "default" and "ROOTCA", so
rotation never restarts Envoy. Authentication and authorization are HTTP filters
(httpfilters.jwt_authn, httpfilters.rbac).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import json_format, struct_pb2, wrappers_pb2

from meshfn.contracts.proxy import REQUEST_HYGIENE

from ..fragments.messages import pack
from ..names import CERT_SECRET, ROOT_SECRET
from .common import ads_source

TLS_SOCKET = "envoy.transport_sockets.tls"
TLS_MATCH = {"tlsMode": "mtls"}  # endpoint metadata that selects the mTLS transport socket


class Credentials(Protocol):
    """What the SDS secrets are made of (the identity manager's Credentials has these)."""

    @property
    def certificate_pem(self) -> str: ...
    @property
    def private_key_pem(self) -> str: ...
    @property
    def trust_bundle_pem(self) -> str: ...


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


# ALPN per upstream codec; with the downstream's protocol ("mixed": HTTP/1.1 and gRPC to one
# sidecar) none is offered, so each connection pool's protocol decides and the sidecar's codec
# (AUTO) detects it.
_ALPN = {"http": ("http/1.1",), "grpc": ("h2",), "mixed": ()}


@lru_cache(maxsize=4096)
def upstream_mtls(peer_spiffe_id: str, codec: str) -> base_pb2.TransportSocket:
    """Client side: present our certificate, accept only the expected peer SPIFFE ID."""
    context = tls_pb2.UpstreamTlsContext(
        common_tls_context=_common_tls(peer_spiffe_id, _ALPN[codec])
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


def mtls_socket_match(peer_spiffe_id: str, codec: str) -> cluster_pb2.Cluster.TransportSocketMatch:
    return cluster_pb2.Cluster.TransportSocketMatch(
        name="mtls",
        match=struct_pb2.Struct(
            fields={k: struct_pb2.Value(string_value=v) for k, v in TLS_MATCH.items()}
        ),
        transport_socket=upstream_mtls(peer_spiffe_id, codec),
    )


# Parsed once; merged into each connection manager as it is built (listener builders are
# memoised, so this is paid per distinct listener, not per push).
_HYGIENE = json_format.ParseDict(REQUEST_HYGIENE, hcm.HttpConnectionManager())


def with_request_hygiene(manager: hcm.HttpConnectionManager) -> hcm.HttpConnectionManager:
    """`manager` with `contracts.proxy.REQUEST_HYGIENE` merged in (gateways and sidecars)."""
    manager.MergeFrom(_HYGIENE)
    return manager


def client_cert_details() -> dict[str, object]:
    """Tell the application who called (x-forwarded-client-cert with the caller's URI SAN)."""
    return {
        "forward_client_cert_details": hcm.HttpConnectionManager.SANITIZE_SET,
        "set_current_client_cert_details": hcm.HttpConnectionManager.SetCurrentClientCertDetails(
            uri=True
        ),
    }
