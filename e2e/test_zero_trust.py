"""Zero trust with real Envoys: client -> gateway Envoy -> (mTLS) -> sidecar Envoy -> upstream.

A table of negative cases, each denied with the right outcome (401, 403 or a TLS failure), and
none reaching the upstream (its request counter proves it); plus the positive cases.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import http.client as httpc
import json
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from jwt.algorithms import ECAlgorithm
from meshfn_e2e import Processes, admin_get
from meshfn_e2e import Reply as AdminReply

from meshfn.contracts.proxy import REQUEST_HYGIENE, WHOLE_BODY_BYTES
from meshfn.control_plane.identity.ca import CertificateAuthority, IssuedCertificate
from meshfn.control_plane.identity.spiffe import SpiffeId
from meshfn.testing import policies as p
from meshfn.testing.ports import named_ports, retry_on_port_clash
from meshfn.testing.processes import MESHFN, wait_for

TD = "zt.local"
ISSUER = "https://issuer.test"
LEGACY = "https://legacy.test"  # an issuer whose rule opts out of requireExpiration
NOW = dt.datetime.now(dt.UTC)
TRUSTED_CLIENT_URI = f"URI=spiffe://{TD}/ns/default/sa/trusted-client"
# A client's own x-forwarded-client-cert naming the trusted client (the format Envoy writes).
SPOOFED_XFCC = {"x-forwarded-client-cert": TRUSTED_CLIENT_URI}


@dataclass
class Keys:
    key: ec.EllipticCurvePrivateKey
    kid: str

    def jwk(self) -> dict[str, Any]:
        jwk: dict[str, Any] = json.loads(ECAlgorithm.to_jwk(self.key.public_key()))
        return {**jwk, "kid": self.kid, "alg": "ES256", "use": "sig"}


TRUSTED = Keys(ec.generate_private_key(ec.SECP256R1()), "k1")
UNTRUSTED_SAME_KID = Keys(ec.generate_private_key(ec.SECP256R1()), "k1")
UNKNOWN_KID = Keys(ec.generate_private_key(ec.SECP256R1()), "k-unknown")


def token(
    keys: Keys = TRUSTED,
    iss: str = ISSUER,
    aud: str = "mesh",
    sub: str = "alice",
    exp: dt.timedelta | None = dt.timedelta(minutes=10),
    nbf: dt.timedelta = dt.timedelta(minutes=-1),
    iat: dt.timedelta | None = dt.timedelta(seconds=-1),
    **claims: Any,
) -> str:
    """`exp`/`iat` None: a token without that claim."""
    now = dt.datetime.now(dt.UTC)
    payload = {
        "iss": iss, "aud": aud, "sub": sub, "tenant": "acme", "nbf": int((now + nbf).timestamp()),
        **{k: int((now + v).timestamp()) for k, v in (("exp", exp), ("iat", iat)) if v is not None},
        **claims,
    }  # fmt: skip
    return jwt.encode(payload, keys.key, algorithm="ES256", headers={"kid": keys.kid})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def alg_none() -> str:
    good = token().split(".")
    return f"{_b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{good[1]}."


def hs256_with_public_key() -> str:
    """The classic key-confusion attack: HMAC keyed with the (public) verification key."""
    public = TRUSTED.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    body = token().split(".")[1]
    signature = hmac.new(public, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{_b64(signature)}"


def tampered() -> str:
    header, body, signature = token().split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["tenant"] = "globex"
    return f"{header}.{_b64(json.dumps(claims).encode())}.{signature}"


def zero_trust_policies(ports: dict[str, int], jwks: str) -> str:
    allowed = {
        "principals": [f"{TD}/ns/ingress/sa/edge", f"{TD}/ns/default/sa/trusted-client"],
        "requestPrincipals": [f"{ISSUER}/*", f"{LEGACY}/*"],
    }
    tenant = {"key": "request.auth.claims[tenant]", "values": ["acme"]}
    return p.documents(
        p.mesh("zt", TD, ports["xds"], ports["admin"], identity={"certificateTTL": "20s"}),
        p.gateway(ports["envoy_admin"], ports["listener"], namespace="ingress"),
        p.service("model", ports["app"], [p.endpoint(sidecar=ports["sidecar"])]),
        p.service("keyless", ports["app2"], [p.endpoint(sidecar=ports["sidecar2"])]),
        # The control for the plaintext probe: a sidecar that accepts plaintext beside mTLS.
        p.service("migrating", ports["app3"], [p.endpoint(sidecar=ports["sidecar3"])]),
        p.doc(
            "PeerAuthentication",
            "migrating",
            {"selector": {"service": "migrating"}, "mtls": {"mode": "PERMISSIVE"}},
        ),
        p.route("keyless", "keyless", "/keyless", gateway="ingress/edge"),
        p.route("model", "model", gateway="ingress/edge"),
        p.jwt_authentication(
            "jwt",
            {"service": "model"},
            ISSUER,
            audiences=["mesh"],
            jwks=jwks,
            outputClaimToHeaders=[
                {"header": "x-tenant", "claim": "tenant"},
                {"header": "x-role", "claim": "role"},
            ],
            maxLifetime="1h",
        ),
        p.jwt_authentication(
            "legacy-issuer", {"service": "model"}, LEGACY, jwks=jwks, requireExpiration=False
        ),
        p.jwt_authentication(
            "jwks-down",
            {"service": "keyless"},
            ISSUER,
            jwksUri=f"http://127.0.0.1:{ports['dead']}/jwks.json",
        ),
        p.authorization(
            "allow",
            {"service": "model"},
            [
                {
                    "from": [{"source": allowed}],
                    "to": [{"operation": {"methods": ["GET", "POST"], "paths": ["/v2/*"]}}],
                    "when": [tenant],
                },
                # Open to anyone the mesh lets in, with or without a token.
                {"to": [{"operation": {"methods": ["GET"], "paths": ["/v2/public/*"]}}]},
                # A rule that trusts x-forwarded-client-cert, the header the application is
                # told its caller by: /xfcc/* for whoever that header names as trusted-client
                # (first, as a client would forge it, or last, as the sidecar writes it after
                # By= and Hash=). Safe only because the sidecar replaces a client's header with
                # its own from the TLS peer before authorization reads it: the XFCC tests.
                {
                    "from": [{"source": {"requestPrincipals": [f"{ISSUER}/*"]}}],
                    "to": [{"operation": {"paths": ["/xfcc/*"]}}],
                    "when": [
                        {
                            "key": "request.headers[x-forwarded-client-cert]",
                            "values": [f"{TRUSTED_CLIENT_URI}*", f"*{TRUSTED_CLIENT_URI}"],
                        }
                    ],
                },
            ],
        ),
        p.authorization(
            "deny",
            {"service": "model"},
            [
                {"to": [{"operation": {"paths": ["/v2/admin*"]}}]},
                {"when": [{"key": "request.auth.claims[role]", "values": ["banned"]}]},
            ],
            action="DENY",
        ),
        p.authorization(
            "keyless-needs-a-token",
            {"service": "keyless"},
            [{"from": [{"source": {"requestPrincipals": ["*"]}}]}],
        ),
    )


@dataclass
class Mesh:
    ports: dict[str, int]
    state: Path
    tmp: Path

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.ports['listener']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    def admin_get(self, path: str) -> AdminReply:
        """The control plane's admin port, as its owner (the token in the state directory)."""
        return admin_get(self.admin, path, self.state)

    def ca(self) -> CertificateAuthority:
        return CertificateAuthority(self.state / "ca" / TD, TD)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    names = [
        "xds",
        "admin",
        "envoy_admin",
        "listener",
        "app",
        "sidecar",
        "app2",
        "sidecar2",
        "app3",
        "sidecar3",
        "dead",
    ]
    jwks = json.dumps({"keys": [TRUSTED.jwk()]})

    def start() -> tuple[Processes, Mesh]:
        tmp = tmp_path_factory.mktemp("zt")
        ports = named_ports(*names)
        policies = tmp / "policies"
        policies.mkdir()
        (policies / "mesh.yaml").write_text(zero_trust_policies(ports, jwks))
        procs = Processes(tmp)
        state = tmp / "state"
        argv = [MESHFN, "up", "--policies", str(policies), "--state-dir", str(state)]
        up = procs.start("up", [*argv, "--envoy-concurrency", "1"])
        try:
            wait_for(
                "the mesh",
                lambda: up.check_running() or "Ctrl-C stops everything" in up.output(),
                timeout=40,
            )
            result = Mesh(ports, state, tmp)
            wait_for(
                "a first answer",
                lambda: request(result, "/v2/x", token()).status == 200,
                timeout=20,
            )
        except BaseException:
            procs.stop_all()
            raise
        return procs, result

    procs, result = retry_on_port_clash(start)  # a port taken meanwhile: new ports
    try:
        yield result
    finally:
        procs.stop_all()


@dataclass
class Reply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    mesh: Mesh,
    path: str,
    bearer: str | None = None,
    method: str = "GET",
    headers: dict[str, str] | None = None,
) -> Reply:
    conn = httpc.HTTPConnection(mesh.gateway, timeout=5)
    all_headers = dict(headers or {})
    if bearer is not None:
        all_headers["authorization"] = f"Bearer {bearer}"
    conn.request(method, path, headers=all_headers)
    response = conn.getresponse()
    reply = Reply(response.status, response.read())
    conn.close()
    return reply


def upstream_count(mesh: Mesh) -> int:
    """A positive request's answer carries how many requests the upstream served so far."""
    reply = request(mesh, "/v2/count", token())
    assert reply.status == 200, reply
    count: int = reply.json()["requests"]
    return count


# (name, path, method, token, extra headers, expected status)
GATEWAY_CASES: list[tuple[str, str, str, Callable[[], str | None], dict[str, str], int]] = [
    ("no token", "/v2/x", "GET", lambda: None, {}, 403),
    ("expired", "/v2/x", "GET", lambda: token(exp=dt.timedelta(minutes=-10)), {}, 401),
    (
        "expired beyond the 60s leeway",
        "/v2/x",
        "GET",
        lambda: token(exp=dt.timedelta(seconds=-90)),
        {},
        401,
    ),
    ("not yet valid", "/v2/x", "GET", lambda: token(nbf=dt.timedelta(minutes=10)), {}, 401),
    # requireExpiration (default): a token that never expires is refused.
    ("no exp", "/v2/x", "GET", lambda: token(exp=None), {}, 401),
    ("no exp, no iat", "/v2/x", "GET", lambda: token(exp=None, iat=None), {}, 401),
    # maxLifetime 1h: exp - iat above it is refused, whatever the token's own exp says.
    (
        "lifetime above maxLifetime",
        "/v2/x",
        "GET",
        lambda: token(iat=dt.timedelta(minutes=-1), exp=dt.timedelta(hours=2)),
        {},
        401,
    ),
    # The opt-out is per rule: another issuer's rule does not lend it to this one.
    (
        "no exp, opted-out issuer's key",
        "/v2/x",
        "GET",
        lambda: token(exp=None, iss="https://x.test"),
        {},
        401,
    ),
    ("wrong issuer", "/v2/x", "GET", lambda: token(iss="https://evil.test"), {}, 401),
    # Envoy (and so Istio) answers an audience mismatch with 403, not 401.
    ("wrong audience", "/v2/x", "GET", lambda: token(aud="other"), {}, 403),
    ("alg none", "/v2/x", "GET", alg_none, {}, 401),
    ("HS256 signed with the public key", "/v2/x", "GET", hs256_with_public_key, {}, 401),
    ("tampered payload", "/v2/x", "GET", tampered, {}, 401),
    ("unknown signing key, known kid", "/v2/x", "GET", lambda: token(UNTRUSTED_SAME_KID), {}, 401),
    ("unknown kid", "/v2/x", "GET", lambda: token(UNKNOWN_KID), {}, 401),
    ("garbage token", "/v2/x", "GET", lambda: "not-a-jwt", {}, 401),
    ("truncated signature", "/v2/x", "GET", lambda: token()[:-10], {}, 401),
    ("token in the wrong header", "/v2/x", "GET", lambda: None, {"x-token": token()}, 403),
    ("tenant not allowed by policy", "/v2/x", "GET", lambda: token(tenant="globex"), {}, 403),
    ("claim hits a DENY rule", "/v2/x", "GET", lambda: token(role="banned"), {}, 403),
    ("path hits a DENY rule", "/v2/admin/users", "GET", token, {}, 403),
    ("method not allowed", "/v2/x", "DELETE", token, {}, 403),
    ("path not allowed", "/v1/x", "GET", token, {}, 403),
    # A valid token and the header naming the trusted client, on the path whose rule admits
    # by that header: the sidecar sees the gateway's identity, whatever the client wrote.
    ("spoofed x-forwarded-client-cert", "/xfcc/x", "GET", token, SPOOFED_XFCC, 403),
    ("JWKS URI down: a valid token cannot be verified", "/keyless/x", "GET", token, {}, 401),
    ("JWKS URI down: no token", "/keyless/x", "GET", lambda: None, {}, 403),
]


@pytest.mark.parametrize(
    ("name", "path", "method", "make_token", "headers", "expected"),
    GATEWAY_CASES,
    ids=[c[0] for c in GATEWAY_CASES],
)
def test_denied_through_the_gateway(
    mesh: Mesh,
    name: str,
    path: str,
    method: str,
    make_token: Callable[[], str | None],
    headers: dict[str, str],
    expected: int,
) -> None:
    before = upstream_count(mesh)
    reply = request(mesh, path, make_token(), method, headers)
    assert reply.status == expected, f"{name}: {reply.status} {reply.body[:200]!r}"
    assert upstream_count(mesh) == before + 1, f"{name} reached the upstream"


def test_a_valid_token_in_the_access_token_parameter_is_not_read(mesh: Mesh) -> None:
    """Envoy's jwt_authn, given neither from_headers nor from_params, reads the Authorization
    header and the `access_token` query parameter (Istio's default as well). meshfn always
    names the locations: the Authorization header only (RequestAuthentication `fromHeaders`'
    default), a query parameter only where a rule lists it in `fromParams`. By design: a token
    in a URL ends up in access logs, proxies' logs and browser history. So a valid token in
    `?access_token=` is no token at all: authorization refuses the request (403), where the
    same token in the header is served."""
    bearer = token()
    before = upstream_count(mesh)
    reply = request(mesh, f"/v2/x?access_token={bearer}")
    assert reply.status == 403, reply
    assert upstream_count(mesh) == before + 1, "a token in the URL reached the upstream"
    assert request(mesh, "/v2/x", bearer).status == 200  # the token itself is valid


def test_a_rule_that_opts_out_of_exp_accepts_a_token_without_one(mesh: Mesh) -> None:
    """requireExpiration: false on the legacy issuer's rule: its token without exp reaches the
    upstream; the same token from the default rule's issuer does not (see GATEWAY_CASES)."""
    before = upstream_count(mesh)
    reply = request(mesh, "/v2/x", token(iss=LEGACY, exp=None, iat=None))
    assert reply.status == 200, reply
    assert upstream_count(mesh) == before + 2
    within = request(
        mesh, "/v2/x", token(iat=dt.timedelta(minutes=-59), exp=dt.timedelta(seconds=50))
    )
    assert within.status == 200, within  # exp - iat = 59m50s: within maxLifetime 1h


def test_max_lifetime_bounds_a_token_without_iat_from_now(mesh: Mesh) -> None:
    """Without iat, Envoy's max_lifetime bounds exp - now instead (measured, Envoy 1.40): a
    token that expires within maxLifetime passes, one that expires later does not."""
    assert request(mesh, "/v2/x", token(iat=None, exp=dt.timedelta(minutes=50))).status == 200
    late = request(mesh, "/v2/x", token(iat=None, exp=dt.timedelta(hours=3)))
    assert late.status == 401, late


def test_positive_through_the_gateway(mesh: Mesh) -> None:
    reply = request(mesh, "/v2/models/m/infer", token(), "POST")
    assert reply.status == 200
    body = reply.json()
    assert body["tenant"] == "acme"  # outputClaimToHeaders
    assert f"URI=spiffe://{TD}/ns/ingress/sa/edge" in body["client_cert"]  # caller identity
    # Within the leeway an expired token is still accepted (clock skew).
    assert request(mesh, "/v2/x", token(exp=dt.timedelta(seconds=-30))).status == 200


# ---------------------------------------------------------------- straight to the sidecar


def write_cert(tmp: Path, name: str, cert: IssuedCertificate) -> tuple[Path, Path]:
    crt, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    crt.write_text(cert.certificate_pem)
    key.write_text(cert.private_key_pem)
    return crt, key


def foreign_cert(tmp: Path) -> tuple[Path, Path]:
    """A certificate with the right SPIFFE ID from a CA the mesh does not trust."""
    ca = CertificateAuthority(tmp / "foreign-ca", TD)
    return write_cert(
        tmp, "foreign", ca.issue(SpiffeId(TD, "default", "trusted-client"), dt.timedelta(hours=1))
    )


def self_signed_spiffe(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "me")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"spiffe://{TD}/ns/ingress/sa/edge")]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    crt, pem = tmp / "self.crt", tmp / "self.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return crt, pem


def direct(
    mesh: Mesh,
    cert: tuple[Path, Path] | None,
    bearer: str | None = None,
    path: str = "/v2/x",
    headers: dict[str, str] | None = None,
) -> Reply | str:
    """An HTTPS request straight to the sidecar; returns the reply or the TLS failure."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.check_hostname = False
    bundle = mesh.tmp / "bundle.pem"
    bundle.write_text(mesh.ca().trust_bundle_pem())
    context.load_verify_locations(bundle)
    if cert is not None:
        context.load_cert_chain(*cert)
    conn = httpc.HTTPSConnection(f"127.0.0.1:{mesh.ports['sidecar']}", context=context, timeout=5)
    all_headers = dict(headers or {})
    if bearer:
        all_headers["authorization"] = f"Bearer {bearer}"
    try:
        conn.request("GET", path, headers=all_headers)
        response = conn.getresponse()
        return Reply(response.status, response.read())
    except (ssl.SSLError, ConnectionError, httpc.RemoteDisconnected) as exc:
        return f"tls failure: {type(exc).__name__}"
    finally:
        conn.close()


def issue(mesh: Mesh, account: str, **kwargs: Any) -> IssuedCertificate:
    return mesh.ca().issue(SpiffeId(TD, "default", account), dt.timedelta(hours=1), **kwargs)


SIDECAR_CASES: list[tuple[str, Callable[[Mesh], tuple[Path, Path] | None], str | int]] = [
    ("missing client certificate", lambda m: None, "tls"),
    ("client certificate from another CA", lambda m: foreign_cert(m.tmp), "tls"),
    ("self-signed certificate with a good SPIFFE ID", lambda m: self_signed_spiffe(m.tmp), "tls"),
    (
        "expired client certificate",
        lambda m: write_cert(
            m.tmp, "expired", issue(m, "trusted-client", now=NOW - dt.timedelta(hours=3))
        ),
        "tls",
    ),
    (
        "not yet valid client certificate",
        lambda m: write_cert(
            m.tmp, "future", issue(m, "trusted-client", now=NOW + dt.timedelta(hours=3))
        ),
        "tls",
    ),
    ("wrong SPIFFE ID", lambda m: write_cert(m.tmp, "intruder", issue(m, "intruder")), 403),
    (
        "no SPIFFE ID at all",
        lambda m: write_cert(m.tmp, "nosan", issue(m, "trusted-client", with_san=False)),
        403,
    ),
]


@pytest.mark.parametrize(
    ("name", "make_cert", "expected"), SIDECAR_CASES, ids=[c[0] for c in SIDECAR_CASES]
)
def test_denied_at_the_sidecar(
    mesh: Mesh,
    name: str,
    make_cert: Callable[[Mesh], tuple[Path, Path] | None],
    expected: str | int,
) -> None:
    before = upstream_count(mesh)
    result = direct(mesh, make_cert(mesh), token())
    if expected == "tls":
        assert isinstance(result, str) and result.startswith("tls failure"), f"{name}: {result}"
    else:
        assert isinstance(result, Reply) and result.status == expected, f"{name}: {result}"
    assert upstream_count(mesh) == before + 1, f"{name} reached the upstream"


def plaintext_probe(port: int, bearer: str) -> bytes:
    """A plaintext HTTP/1.1 request with `bearer` to a sidecar port; every byte that comes back
    until the connection ends (b"": closed or reset without a byte)."""
    request = f"GET /v2/x HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bearer}\r\n"
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request.encode() + b"Connection: close\r\n\r\n")
        try:
            while chunk := sock.recv(4096):
                data += chunk
        except ConnectionResetError:
            pass
    return data


def test_plaintext_to_a_strict_port_is_refused(mesh: Mesh) -> None:
    """No TLS, no HTTP: with a valid token (so that authorization has nothing to refuse), a
    plaintext request to the STRICT sidecar gets no HTTP answer at all, not even a 403 (which
    would mean plaintext was served and only authorization said no), and never reaches the
    upstream. The probe can tell: see the PERMISSIVE control below."""
    before = upstream_count(mesh)
    data = plaintext_probe(mesh.ports["sidecar"], token())
    assert b"HTTP/" not in data, data[:300]
    assert upstream_count(mesh) == before + 1


def test_the_plaintext_probe_gets_an_answer_from_a_permissive_port(mesh: Mesh) -> None:
    """The control: the same probe against a PERMISSIVE sidecar (service `migrating`) is
    answered over plaintext, so the STRICT port's silence above is its refusal, not the
    probe's failure."""
    data = plaintext_probe(mesh.ports["sidecar3"], token())
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    assert json.loads(data.partition(b"\r\n\r\n")[2])["service"] == "default/migrating"


def test_a_trusted_client_with_a_token_gets_through(mesh: Mesh) -> None:
    cert = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    result = direct(mesh, cert, token())
    assert isinstance(result, Reply) and result.status == 200, result
    assert isinstance(direct(mesh, cert, None), Reply)
    denied = direct(mesh, cert, None)
    assert isinstance(denied, Reply) and denied.status == 403  # a certificate is not a token


def test_a_spoofed_client_certificate_header_does_not_admit(mesh: Mesh) -> None:
    """The `allow` policy admits /xfcc/* by x-forwarded-client-cert alone (a rule that trusts
    the header). An intruder with a mesh certificate of its own identity and a valid token
    sends the header naming the trusted client: 403, the upstream untouched, because the
    sidecar replaces a client's header with its own, from the TLS peer, before authorization
    reads it. The control: the trusted client's own certificate is admitted by that rule, so
    the rule does read the header, and the header authorization sees names the TLS peer."""
    intruder = write_cert(mesh.tmp, "intruder", issue(mesh, "intruder"))
    trusted = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    before = upstream_count(mesh)
    spoofed = direct(mesh, intruder, token(), "/xfcc/x", SPOOFED_XFCC)
    assert isinstance(spoofed, Reply) and spoofed.status == 403, spoofed
    assert upstream_count(mesh) == before + 1, "the spoofed header reached the upstream"
    admitted = direct(mesh, trusted, token(), "/xfcc/x")
    assert isinstance(admitted, Reply) and admitted.status == 200, admitted
    assert admitted.json()["client_cert"].endswith(TRUSTED_CLIENT_URI), admitted


def test_the_application_is_told_the_tls_peer_not_the_clients_header(mesh: Mesh) -> None:
    """A trusted client sending a header that names another identity (the gateway's): the
    application's x-forwarded-client-cert names the TLS peer and nothing the client wrote
    (neither replaced nor appended to)."""
    trusted = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    edge = f"URI=spiffe://{TD}/ns/ingress/sa/edge"
    reply = direct(mesh, trusted, token(), "/v2/x", {"x-forwarded-client-cert": edge})
    assert isinstance(reply, Reply) and reply.status == 200, reply
    told = reply.json()["client_cert"]
    assert told.endswith(TRUSTED_CLIENT_URI) and "sa/edge" not in told, told


def test_private_keys_never_leave_the_control_plane(mesh: Mesh) -> None:
    dump = mesh.admin_get("/debug/config_dump?node=edge.ingress&format=yaml").body.decode()
    assert "secrets:" in dump and "[redacted]" in dump
    assert "PRIVATE KEY" not in dump
    for path in ("/debug/status", "/debug/snapshots", "/metrics", "/debug/certs?node=edge.ingress"):
        assert "PRIVATE KEY" not in mesh.admin_get(path).body.decode(), path


def test_certificates_rotate_without_a_failed_request(mesh: Mesh) -> None:
    """TTL 20 s: certificates renew every ~10 s. 25 s of requests, none may fail."""
    first = mesh.admin_get(f"/debug/certs?node=model.default:{mesh.ports['sidecar']}").json()
    failures, total = 0, 0
    deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=25)
    conn = httpc.HTTPConnection(mesh.gateway, timeout=5)
    bearer = token()
    while dt.datetime.now(dt.UTC) < deadline:
        conn.request("GET", "/v2/rotate", headers={"authorization": f"Bearer {bearer}"})
        response = conn.getresponse()
        response.read()
        total += 1
        failures += response.status != 200
    conn.close()
    after = mesh.admin_get(f"/debug/certs?node=model.default:{mesh.ports['sidecar']}").json()
    assert after["serial"] != first["serial"], "the sidecar's certificate was not renewed"
    assert total > 200 and failures == 0, f"{failures} of {total} failed"


def test_ca_rotation_with_overlap(mesh: Mesh) -> None:
    """Rotate the root under load; both roots are trusted until retired; 0 failed requests."""
    policies = str(mesh.tmp / "policies")
    state = str(mesh.state)
    node = f"model.default:{mesh.ports['sidecar']}"
    old_client = write_cert(mesh.tmp, "old-root-client", issue(mesh, "trusted-client"))

    def cli(*args: str) -> str:
        done = subprocess.run(
            [MESHFN, *args, "--policies", policies, "--state-dir", state],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout

    cli("ca", "rotate")
    new_root = mesh.ca().root_fingerprints()[-1]
    failures = 0
    conn = httpc.HTTPConnection(mesh.gateway, timeout=5)
    bearer = token()

    def hammer(until: Callable[[], bool], at_least: int = 100, timeout: float = 60) -> int:
        """Requests through the gateway in batches of 20: at least `at_least`, and on until
        `until()` holds (checked between batches); fails if that takes over `timeout` s."""
        nonlocal failures
        count = 0
        deadline = time.monotonic() + timeout
        while count < at_least or not until():
            assert time.monotonic() < deadline, f"not reached in {timeout} s ({count} requests)"
            for _ in range(20):
                conn.request("GET", "/v2/ca", headers={"authorization": f"Bearer {bearer}"})
                response = conn.getresponse()
                response.read()
                failures += response.status != 200
                count += 1
        return count

    def reissued() -> bool:
        document = mesh.admin_get(f"/debug/certs?node={node}").json()
        edge = mesh.admin_get("/debug/certs?node=edge.ingress").json()
        return bool(document["issuer_root"] == new_root == edge["issuer_root"])

    sent = hammer(reissued)
    # During the overlap a certificate from the old root is still accepted.
    overlap = direct(mesh, old_client, token())
    assert isinstance(overlap, Reply) and overlap.status == 200, overlap
    cli("ca", "retire")
    # Under load until the sidecar itself refuses the old root's certificate (its one-root
    # bundle applied), then as much load again on the new root alone.
    sent += hammer(lambda: isinstance(direct(mesh, old_client, token()), str))
    after_retire = hammer(lambda: True, at_least=200)
    assert after_retire >= 200
    sent += after_retire
    assert failures == 0, f"{failures} of {sent} failed during the CA rotation"
    retired = direct(mesh, old_client, token())
    assert isinstance(retired, str), f"a certificate from the retired root was accepted: {retired}"


# ---------------------------------------------------------------- path tricks
# An authorization rule must see the path the application acts on. Each of these spells
# /v2/admin/users (denied by the `deny` policy) in a way that a rule matching the raw path
# would miss, while the application (aiohttp here: it decodes and resolves the path) serves
# /v2/admin/users. Checked at the gateway and straight at the sidecar, which must not rely on
# the gateway having normalised the path for it.

PATH_TRICKS = [
    ("double slash", "/v2//admin/users"),
    ("dot segment", "/v2/./admin/users"),
    ("dot-dot segment", "/v2/x/../admin/users"),
    ("encoded dot-dot", "/v2/x/%2e%2e/admin/users"),
    ("encoded slash", "/v2/x%2F..%2Fadmin/users"),
    ("encoded slash, lower case", "/v2/admin%2fusers"),
    ("encoded backslash", "/v2/x%5C..%5Cadmin/users"),
    ("encoded unreserved letter", "/v2/%61dmin/users"),
]


@pytest.mark.parametrize(("name", "path"), PATH_TRICKS, ids=[c[0] for c in PATH_TRICKS])
def test_path_tricks_are_denied_at_the_gateway(mesh: Mesh, name: str, path: str) -> None:
    before = upstream_count(mesh)
    reply = request(mesh, path, token())
    assert reply.status in (400, 403), f"{name}: {reply}"
    assert upstream_count(mesh) == before + 1, f"{name} reached the upstream"


@pytest.mark.parametrize(("name", "path"), PATH_TRICKS, ids=[c[0] for c in PATH_TRICKS])
def test_path_tricks_are_denied_at_the_sidecar(mesh: Mesh, name: str, path: str) -> None:
    cert = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    before = upstream_count(mesh)
    result = direct(mesh, cert, token(), path)
    assert isinstance(result, Reply) and result.status in (400, 403), f"{name}: {result}"
    assert upstream_count(mesh) == before + 1, f"{name} reached the upstream"


def test_the_application_sees_the_path_the_rules_saw(mesh: Mesh) -> None:
    """An allowed path in a roundabout spelling arrives resolved, at the gateway and the sidecar."""
    cert = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    for path in ("/v2/x/../y", "/v2//y", "/v2/x%2F..%2Fy"):
        reply = request(mesh, path, token())
        assert reply.status == 200 and reply.json()["path"] == "/v2/y", (path, reply)
        direct_reply = direct(mesh, cert, token(), path)
        assert isinstance(direct_reply, Reply) and direct_reply.status == 200, (path, direct_reply)
        assert direct_reply.json()["path"] == "/v2/y", (path, direct_reply)


def test_headers_with_underscores_never_reach_the_application(mesh: Mesh) -> None:
    """`x_tenant` would be `x-tenant` to a server that maps both to one name (CGI, WSGI): the
    mesh sets x-tenant from the verified token, and a caller must not be able to add another."""
    cert = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    spoof = {"x_tenant": "globex", "x_forwarded_client_cert": "URI=spiffe://evil"}
    replies = [request(mesh, "/v2/x", token(), headers=spoof)]
    replies.append(direct(mesh, cert, token(), headers=spoof))
    for reply in replies:
        assert isinstance(reply, Reply) and reply.status == 200, reply
        body = reply.json()
        assert body["tenant"] == "acme"
        assert not [name for name in body["headers"] if "_" in name], body["headers"]


def test_a_claim_header_is_only_ever_the_verified_claim(mesh: Mesh) -> None:
    """outputClaimToHeaders writes x-role only for a token with a role claim: a client's own
    x-role must not reach the application in its place, at the gateway or the sidecar."""
    cert = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    forged = {"x-role": "admin", "x-tenant": "globex"}
    cases = [
        ("/v2/x", token(), {"x-tenant"}),
        ("/v2/x", token(role="analyst"), {"x-tenant", "x-role"}),
        ("/v2/public/x", None, set()),  # no token at all, where authorization allows that
    ]
    for path, bearer, claimed in cases:
        for reply in (
            request(mesh, path, bearer, headers=forged),
            direct(mesh, cert, bearer, path, headers=forged),
        ):
            assert isinstance(reply, Reply) and reply.status == 200, (path, reply)
            body = reply.json()
            assert body["tenant"] == ("acme" if "x-tenant" in claimed else ""), (path, body)
            assert claimed == {"x-tenant", "x-role"} & set(body["headers"]), (path, body)


HEADERS_TIMEOUT_S = float(REQUEST_HYGIENE["request_headers_timeout"].removesuffix("s"))


def raw_connections(mesh: Mesh, timeout: float) -> tuple[socket.socket, socket.socket]:
    """A plain connection to the gateway and an mTLS one (a trusted client) to the sidecar."""
    cert = write_cert(mesh.tmp, "trusted", issue(mesh, "trusted-client"))
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.check_hostname = False
    bundle = mesh.tmp / "bundle.pem"
    bundle.write_text(mesh.ca().trust_bundle_pem())
    context.load_verify_locations(bundle)
    context.load_cert_chain(*cert)
    gateway = socket.create_connection(("127.0.0.1", mesh.ports["listener"]), timeout=timeout)
    sidecar = context.wrap_socket(
        socket.create_connection(("127.0.0.1", mesh.ports["sidecar"]), timeout=timeout)
    )
    return gateway, sidecar


def _exchange(sock: socket.socket, head: str, body: bytes = b"") -> tuple[int, dict[str, str]]:
    """One HTTP/1.1 request on `sock`; the response's status and headers (its body read)."""
    sock.sendall(head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    reader.read(int(headers.get("content-length", "0")))
    return status, headers


@pytest.mark.parametrize("size", [90, WHOLE_BODY_BYTES, WHOLE_BODY_BYTES + 1])
def test_a_refused_request_keeps_its_connection(mesh: Mesh, size: int) -> None:
    """Envoy refuses from the headers (here authorization's 403 for a missing token) and, on
    HTTP/1.1, closes a connection whose request body it has not read. A small body is read
    whole first (contracts.proxy.WHOLE_SMALL_BODIES), so the client's next request goes on the
    same connection (without the filter, the refusal says `connection: close`); past
    WHOLE_BODY_BYTES the body streams as before."""
    body = b"x" * size
    for sock in raw_connections(mesh, 10):
        with sock:
            head = "POST /v2/x HTTP/1.1\r\nhost: x\r\n"
            status, headers = _exchange(sock, head, body)
            assert status == 403, (status, headers)
            if size > WHOLE_BODY_BYTES:  # streamed, not buffered: refused as before (never a 413)
                continue
            assert "connection" not in headers, headers
            status, _ = _exchange(sock, f"{head}authorization: Bearer {token()}\r\n", body)
            assert status == 200


def test_a_client_that_sends_its_headers_slowly_is_cut_off(mesh: Mesh) -> None:
    """Slow headers (slowloris) hold a connection only for the headers timeout, at the gateway
    and at the sidecar (after the mTLS handshake), never for as long as the client likes."""
    gateway, sidecar = raw_connections(mesh, 30)
    started = time.monotonic()
    answers = []
    for sock in (gateway, sidecar):
        sock.sendall(b"GET /v2/x HTTP/1.1\r\nHost: x\r\nx-slow: 1\r\n")  # never finished
    for sock in (gateway, sidecar):
        with sock:
            data = b""
            try:
                while chunk := sock.recv(4096):
                    data += chunk
            except (ConnectionResetError, ssl.SSLError):
                pass
            answers.append((data.split(b"\r\n", 1)[0], time.monotonic() - started))
    for status, after in answers:
        assert status in (b"HTTP/1.1 408 Request Timeout", b""), answers
        # Cut by the headers timeout, not before: a slow machine only makes this later.
        assert after >= HEADERS_TIMEOUT_S - 0.5, answers
        # A functional deadline with a wide margin (2.5x the timeout): a loaded machine delays
        # Envoy's timer a little, a missing timeout holds the connection for the 30 s socket
        # timeout of this client.
        assert after < 2.5 * HEADERS_TIMEOUT_S, answers
