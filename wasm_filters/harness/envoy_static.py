"""Static Envoy configs for the filter e2e tests and bench/filters.py.

Everything Envoy-facing is built by the same functions the translator uses
(`meshfn.xds.translate.wasm`), turned into a bootstrap here. Also makes a throwaway
CA with SPIFFE client certificates (mTLS principals) and RS256 JWTs with a matching JWKS.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID
from google.protobuf import json_format
from google.protobuf.message import Message

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"


def to_dict(message: Message) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


# ------------------------------------------------------------------ certificates


@dataclass
class Certs:
    root: Path
    ca: Path
    server_cert: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)

    def client_context(self, name: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.check_hostname = False
        if name is not None:
            cert, key = self.clients[name]
            ctx.load_cert_chain(str(cert), str(key))
        return ctx


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_certs(root: Path, clients: dict[str, str]) -> Certs:
    """A CA, a server cert for 127.0.0.1/localhost and one client cert per {name: SPIFFE URI}."""
    root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshfn e2e ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    certs = Certs(root, root / "ca.pem", root / "server.pem", root / "server.key")
    certs.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(name: str, san: x509.GeneralName | list[x509.GeneralName]) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        names = san if isinstance(san, list) else [san]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = root / f"{name}.pem", root / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return cert_path, key_path

    leaf("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    for name, uri in clients.items():
        certs.clients[name] = leaf(name, x509.UniformResourceIdentifier(uri))
    return certs


def downstream_tls(certs: Certs) -> dict[str, Any]:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": True,
            "common_tls_context": {
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": str(certs.server_cert)},
                        "private_key": {"filename": str(certs.server_key)},
                    }
                ],
                "validation_context": {"trusted_ca": {"filename": str(certs.ca)}},
            },
        },
    }


# ------------------------------------------------------------------ JWT


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class Jwt:
    key: rsa.RSAPrivateKey
    issuer: str = "meshfn-e2e"

    @classmethod
    def new(cls) -> Jwt:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    def jwks(self) -> str:
        numbers = self.key.public_key().public_numbers()
        n = numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")
        e = numbers.e.to_bytes(3, "big")
        jwk = {"kty": "RSA", "alg": "RS256", "use": "sig", "kid": "k1", "n": _b64(n), "e": _b64(e)}
        return json.dumps({"keys": [jwk]})

    def token(self, claims: dict[str, Any], key: rsa.RSAPrivateKey | None = None) -> str:
        header = _b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "k1"}).encode())
        body = {"iss": self.issuer, "exp": 4_000_000_000, **claims}
        payload = _b64(json.dumps(body).encode())
        signing_input = f"{header}.{payload}".encode()
        signature = (key or self.key).sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
        return f"{header}.{payload}.{_b64(signature)}"

    def filter(
        self,
        prefix: str = "/jwt",
        metadata_key: str = "jwt_payload",
        claim_to_headers: list[dict[str, Any]] | None = None,
        forward: bool = False,
    ) -> dict[str, Any]:
        provider: dict[str, Any] = {
            "issuer": self.issuer,
            "local_jwks": {"inline_string": self.jwks()},
            "payload_in_metadata": metadata_key,
            "forward": forward,  # False: jwt_authn removes the token once verified
        }
        if claim_to_headers:
            provider["claim_to_headers"] = claim_to_headers
        return {
            "name": "envoy.filters.http.jwt_authn",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
                "providers": {"e2e": provider},
                "rules": [{"match": {"prefix": prefix}, "requires": {"provider_name": "e2e"}}],
            },
        }


# ------------------------------------------------------------------ bootstrap

ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def route(
    name: str, cluster: str, prefix: str = "/", header: tuple[str, str] | None = None
) -> dict[str, Any]:
    match: dict[str, Any] = {"prefix": prefix}
    if header is not None:
        match["headers"] = [{"name": header[0], "string_match": {"exact": header[1]}}]
    return {"name": name, "match": match, "route": {"cluster": cluster}}


def listener(
    port: int,
    http_filters: list[dict[str, Any]],
    routes: list[dict[str, Any]],
    access_logs: list[dict[str, Any]] | None = None,
    tls: Certs | None = None,
    early: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "e2e",
        "access_log": access_logs or [],
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [*http_filters, ROUTER],
    }
    if early:
        hcm["early_header_mutation_extensions"] = early
    chain: dict[str, Any] = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]
    }
    if tls is not None:
        chain["transport_socket"] = downstream_tls(tls)
    return {
        "name": "main",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [chain],
    }


def bootstrap(
    admin_port: int,
    clusters: dict[str, int],
    listener_config: dict[str, Any] | None = None,
    lds_file: Path | None = None,
) -> dict[str, Any]:
    """Either a static listener or listeners read from `lds_file` (Envoy watches its directory:
    replacing the file is a config push, and a config Envoy refuses is counted as rejected)."""
    config: dict[str, Any] = {
        "node": {"id": "e2e", "cluster": "e2e"},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [listener_config] if listener_config else [],
            "clusters": [
                {
                    "name": name,
                    "connect_timeout": "1s",
                    "load_assignment": {
                        "cluster_name": name,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "127.0.0.1",
                                                    "port_value": port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
                for name, port in clusters.items()
            ],
        },
    }
    if lds_file is not None:
        config["dynamic_resources"] = {
            "lds_config": {
                "path_config_source": {
                    "path": str(lds_file),
                    "watched_directory": {"path": str(lds_file.parent)},
                },
                "resource_api_version": "V3",
            }
        }
    return config


def write_lds(lds_file: Path, listener_config: dict[str, Any], version: str) -> None:
    """Atomically replace the LDS file: Envoy sees a move into its watched directory."""
    doc = {"version_info": version, "resources": [{"@type": LISTENER_TYPE, **listener_config}]}
    tmp = lds_file.with_name(f".{lds_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(lds_file)
