"""Identity: the CA (persistence, 0600 files, rotation with overlap), workload certificates, the
renewal schedule, bootstrap tokens and the local JWT issuer."""

from __future__ import annotations

import datetime as dt
import json
import stat
from pathlib import Path

import jwt
import pytest
from cryptography import x509

from meshfn.control_plane.identity.bootstrap_token import BootstrapTokens
from meshfn.control_plane.identity.ca import CertificateAuthority
from meshfn.control_plane.identity.issuer import LocalIssuer
from meshfn.control_plane.identity.manager import IdentityManager
from meshfn.control_plane.identity.spiffe import SpiffeId

TD = "test.local"
EDGE = SpiffeId(TD, "ingress", "edge")


def test_ca_persists_with_private_files(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca", TD)
    for path in (tmp_path / "ca").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert CertificateAuthority(tmp_path / "ca", TD).root_fingerprints() == ca.root_fingerprints()


def test_ca_refuses_world_readable_keys(tmp_path: Path) -> None:
    CertificateAuthority(tmp_path / "ca", TD)
    key = next((tmp_path / "ca").glob("*.key"))
    key.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        CertificateAuthority(tmp_path / "ca", TD)


def test_workload_certificate_carries_the_spiffe_id(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca", TD)
    issued = ca.issue(EDGE, dt.timedelta(hours=1))
    cert = x509.load_pem_x509_certificate(issued.certificate_pem.encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [str(EDGE)]
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(hours=1, minutes=1)
    root = x509.load_pem_x509_certificate(ca.trust_bundle_pem().encode())
    cert.verify_directly_issued_by(root)
    assert "PRIVATE" not in repr(issued)
    with pytest.raises(ValueError, match="outside trust domain"):
        ca.issue(SpiffeId("other.local", "a", "b"), dt.timedelta(hours=1))


def test_rotation_keeps_both_roots_until_retired(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca", TD)
    old = ca.root_fingerprints()
    new = ca.rotate()
    assert ca.root_fingerprints() == [*old, new]
    assert ca.trust_bundle_pem().count("BEGIN CERTIFICATE") == 2
    assert ca.issue(EDGE, dt.timedelta(hours=1)).issuer_fingerprint == new
    assert ca.retire() == old
    assert ca.root_fingerprints() == [new]


def test_manager_renews_at_half_life_and_after_rotation(tmp_path: Path) -> None:
    manager = IdentityManager(tmp_path, TD, dt.timedelta(minutes=10))
    now = dt.datetime.now(dt.UTC)
    assert manager.ensure([str(EDGE)], now) == [str(EDGE)]
    assert manager.ensure([str(EDGE)], now + dt.timedelta(minutes=3)) == []
    assert manager.ensure([str(EDGE)], now + dt.timedelta(minutes=6)) == [str(EDGE)]
    # Another process rotates the CA (meshfn ca rotate): picked up, everything re-issued.
    CertificateAuthority(tmp_path / "ca" / TD, TD).rotate()
    assert manager.reload_roots_if_changed()
    assert manager.ensure([str(EDGE)], now + dt.timedelta(minutes=6)) == [str(EDGE)]
    credentials = manager.credentials(str(EDGE))
    assert credentials is not None and credentials.trust_bundle_pem.count("BEGIN CERTIFICATE") == 2
    assert "PRIVATE" not in repr(credentials)
    # Workloads that disappear lose their certificates.
    assert manager.ensure([], now) == [] and manager.credentials(str(EDGE)) is None


def test_bootstrap_tokens_bind_to_the_workload(tmp_path: Path) -> None:
    tokens = BootstrapTokens(tmp_path / "key")
    header = tokens.header("edge.ingress")
    assert tokens.verify("edge.ingress", header)
    assert not tokens.verify("model.default", header)  # another workload's secrets: no
    assert not tokens.verify("edge.ingress", None)
    assert not tokens.verify("edge.ingress", header.replace("Bearer ", "Basic "))
    assert not tokens.verify("edge.ingress", header[:-2] + "AA")
    assert BootstrapTokens(tmp_path / "key").header("edge.ingress") == header  # persisted
    assert BootstrapTokens(tmp_path / "other").header("edge.ingress") != header


def test_local_issuer_tokens_verify_against_its_jwks(tmp_path: Path) -> None:
    issuer = LocalIssuer(tmp_path / "issuer")
    token = issuer.issue("alice", ["meshfn"], {"tenant": "acme"}, dt.timedelta(minutes=5))
    jwks = jwt.PyJWKSet.from_dict(issuer.jwks())
    key = jwks[jwt.get_unverified_header(token)["kid"]]
    claims = jwt.decode(token, key.key, algorithms=["ES256"], audience="meshfn")
    assert claims["sub"] == "alice" and claims["tenant"] == "acme"
    assert claims["exp"] - claims["iat"] == 300
    kid = issuer.rotate()
    assert [k["kid"] for k in issuer.jwks()["keys"]][-1] == kid and len(issuer.jwks()["keys"]) == 2
    assert all("d" not in k for k in json.loads(json.dumps(issuer.jwks()))["keys"])  # public only
