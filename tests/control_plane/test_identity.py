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
MODEL = SpiffeId(TD, "default", "model")
WORKLOADS = {"edge.ingress": str(EDGE), "model.default": str(MODEL)}


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
    # Another process rotates the CA (meshfn ca rotate): picked up, both roots trusted; the
    # old root signs until the proxies ACK the new bundle (test_rollout_*).
    CertificateAuthority(tmp_path / "ca" / TD, TD).rotate()
    assert manager.reload_roots_if_changed()
    credentials = manager.credentials(str(EDGE))
    assert credentials is not None and credentials.trust_bundle_pem.count("BEGIN CERTIFICATE") == 2
    assert "PRIVATE" not in repr(credentials)
    # Workloads that disappear lose their certificates.
    assert manager.ensure([], now) == [] and manager.credentials(str(EDGE)) is None


def _push(manager: IdentityManager, version: str) -> None:
    """What the control plane does per push: issue what is due, record what each carries."""
    manager.ensure(WORKLOADS.values())
    for workload, spiffe_id in WORKLOADS.items():
        manager.sent(workload, version, spiffe_id)


def _leaf_roots(manager: IdentityManager) -> set[str]:
    certs = [manager.certificate(i) for i in WORKLOADS.values()]
    return {c.issuer_fingerprint for c in certs if c is not None}


def test_rollout_moves_only_as_fast_as_every_proxy_acks(tmp_path: Path) -> None:
    manager = IdentityManager(tmp_path, TD, dt.timedelta(hours=1))
    (old,) = manager.ca.root_fingerprints()
    _push(manager, "v1")
    assert not manager.rolling_out() and not manager.advance(list(WORKLOADS), {}, 0)
    new = CertificateAuthority(tmp_path / "ca" / TD, TD).rotate()
    assert manager.reload_roots_if_changed() and manager.rolling_out()
    _push(manager, "v2")  # step 1: the new root in every bundle, leaves still from the old
    assert _leaf_roots(manager) == {old} and manager.bundle_roots() == [old, new]
    # one workload's proxy has not ACKed the bundle with the new root: nothing moves
    assert not manager.advance(
        list(WORKLOADS), {"edge.ingress": ["v2"], "model.default": ["v1"]}, 1
    )
    # a workload with two proxies: both must have ACKed
    acked = {"edge.ingress": ["v2", "v1"], "model.default": ["v2"]}
    assert not manager.advance(list(WORKLOADS), acked, 2)
    assert not manager.advance(list(WORKLOADS), {"edge.ingress": ["v2"]}, 3)  # one not connected
    assert manager.advance(list(WORKLOADS), {w: ["v2"] for w in WORKLOADS}, 4)
    assert manager.signing_root == new and not manager.rolling_out()
    _push(manager, "v3")  # step 2: every leaf re-issued from the new root
    assert _leaf_roots(manager) == {new}
    CertificateAuthority(tmp_path / "ca" / TD, TD).retire()
    assert manager.reload_roots_if_changed() and manager.rolling_out()
    _push(manager, "v4")
    credentials = manager.credentials(str(EDGE))
    assert credentials is not None and credentials.trust_bundle_pem.count("BEGIN CERTIFICATE") == 2
    assert manager.bundle_roots() == [old, new]  # step 3: retired, but still trusted...
    # ...while a proxy may still present a leaf from it (model ACKed v2: an old-root leaf)
    assert not manager.advance(
        list(WORKLOADS), {"edge.ingress": ["v4"], "model.default": ["v2"]}, 5
    )
    assert manager.advance(list(WORKLOADS), {"edge.ingress": ["v4"], "model.default": ["v3"]}, 6)
    assert manager.bundle_roots() == [new] and not manager.rolling_out()
    credentials = manager.credentials(str(EDGE))
    assert credentials is not None and credentials.trust_bundle_pem.count("BEGIN CERTIFICATE") == 1


def test_rollout_step_goes_ahead_after_the_wait_naming_who_lags(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = IdentityManager(tmp_path, TD, dt.timedelta(minutes=10))
    _push(manager, "v1")
    new = CertificateAuthority(tmp_path / "ca" / TD, TD).rotate()
    manager.reload_roots_if_changed()
    _push(manager, "v2")
    acked = {"edge.ingress": ["v2"]}  # model.default is down
    assert not manager.advance(list(WORKLOADS), acked, 100)
    assert not manager.advance(list(WORKLOADS), acked, 159)
    assert manager.advance(list(WORKLOADS), acked, 160)  # ROLLOUT_WAIT: 60 s
    assert manager.signing_root == new
    assert "model.default did not ACK" in caplog.text and "edge.ingress" not in caplog.text


def test_restarted_control_plane_resumes_the_rollout(tmp_path: Path) -> None:
    manager = IdentityManager(tmp_path, TD, dt.timedelta(hours=1))
    (old,) = manager.ca.root_fingerprints()
    new = CertificateAuthority(tmp_path / "ca" / TD, TD).rotate()
    manager.reload_roots_if_changed()
    # a new process (cp restart) still signs with the root every proxy trusts
    restarted = IdentityManager(tmp_path, TD, dt.timedelta(hours=1))
    assert restarted.signing_root == old and restarted.rolling_out()
    _push(restarted, "v1")
    assert _leaf_roots(restarted) == {old}
    assert restarted.advance(list(WORKLOADS), {w: ["v1"] for w in WORKLOADS}, 0)
    CertificateAuthority(tmp_path / "ca" / TD, TD).retire()
    restarted.reload_roots_if_changed()
    again = IdentityManager(tmp_path, TD, dt.timedelta(hours=1))
    assert again.signing_root == new and again.bundle_roots() == [old, new]
    # without any record (rollout.json lost) and several roots, the oldest signs
    (tmp_path / "ca" / TD / "rollout.json").unlink()
    CertificateAuthority(tmp_path / "ca" / TD, TD).rotate()
    assert IdentityManager(tmp_path, TD, dt.timedelta(hours=1)).signing_root == new


def test_retiring_the_signing_root_moves_signing_to_the_newest(tmp_path: Path) -> None:
    manager = IdentityManager(tmp_path, TD, dt.timedelta(hours=1))
    (old,) = manager.ca.root_fingerprints()
    _push(manager, "v1")
    ca = CertificateAuthority(tmp_path / "ca" / TD, TD)
    new = ca.rotate()
    ca.retire()  # before the rollout's first step: the old root cannot sign any more
    assert manager.reload_roots_if_changed()
    assert manager.signing_root == new and manager.bundle_roots() == [old, new]
    _push(manager, "v2")
    assert _leaf_roots(manager) == {new}


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
