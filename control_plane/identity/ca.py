"""The mesh CA: a root created on first run and persisted, workload certificates with SPIFFE IDs.

Rotation keeps the previous root trusted during an overlap: the trust bundle holds every root
that is not retired, new certificates come from the newest root, and `retire` drops the old
roots once every workload has been re-issued (Envoy validates against the bundle, so both
generations are accepted in between).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshfn.common.files import read_private, write_private

from .spiffe import SpiffeId

ROOT_LIFETIME = dt.timedelta(days=3650)
CLOCK_SKEW = dt.timedelta(minutes=1)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class IssuedCertificate:
    spiffe_id: str
    certificate_pem: str  # leaf only; the root is in the trust bundle
    private_key_pem: str
    serial: int
    not_before: dt.datetime
    not_after: dt.datetime
    issuer_fingerprint: str

    def __repr__(self) -> str:  # never let a private key reach a log line
        return (
            f"IssuedCertificate({self.spiffe_id!r}, serial={self.serial:x}, "
            f"not_after={self.not_after.isoformat()})"
        )

    def renew_at(self) -> dt.datetime:
        """Half-way through the lifetime, like SPIRE and Istio."""
        return self.not_before + (self.not_after - self.not_before) / 2


@dataclass(frozen=True)
class _Root:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def fingerprint(self) -> str:
        return self.cert.fingerprint(hashes.SHA256()).hex()[:16]


class CertificateAuthority:
    """File-backed CA under `directory` (embedded mode: .meshfn/ca/)."""

    def __init__(self, directory: Path, trust_domain: str) -> None:
        self.directory = directory
        self.trust_domain = trust_domain
        self._lock = threading.Lock()
        self._roots: list[_Root] = []  # oldest first; the last one signs
        self._load_or_create()

    # ------------------------------------------------------------------ persistence

    def _index_path(self) -> Path:
        return self.directory / "roots.json"

    def _load_or_create(self) -> None:
        index = self._index_path()
        if not index.exists():
            self._roots = [self._new_root(1)]
            self._save()
            return
        names = json.loads(index.read_text())["roots"]
        roots = []
        for name in names:
            key = serialization.load_pem_private_key(
                read_private(self.directory / f"{name}.key"), password=None
            )
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{name}.key is not an EC private key")
            cert = x509.load_pem_x509_certificate((self.directory / f"{name}.crt").read_bytes())
            roots.append(_Root(key, cert))
        if not roots:
            raise ValueError(f"{index} lists no roots")
        self._roots = roots

    def _save(self) -> None:
        names = []
        for root in self._roots:
            name = f"root-{root.fingerprint}"
            names.append(name)
            key_pem = root.key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            write_private(self.directory / f"{name}.key", key_pem)
            write_private(
                self.directory / f"{name}.crt", root.cert.public_bytes(serialization.Encoding.PEM)
            )
        write_private(self._index_path(), json.dumps({"roots": names}, indent=2).encode())

    def _new_root(self, generation: int) -> _Root:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshfn"),
                x509.NameAttribute(
                    NameOID.COMMON_NAME, f"meshfn root CA {self.trust_domain} #{generation}"
                ),
            ]
        )
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + ROOT_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return _Root(key, cert)

    # ------------------------------------------------------------------ operations

    def trust_bundle_pem(self) -> str:
        with self._lock:
            return "".join(
                r.cert.public_bytes(serialization.Encoding.PEM).decode() for r in self._roots
            )

    def root_fingerprints(self) -> list[str]:
        with self._lock:
            return [r.fingerprint for r in self._roots]

    def root_pems(self) -> dict[str, str]:
        """Fingerprint -> certificate PEM of every trusted root, oldest first."""
        with self._lock:
            return {
                r.fingerprint: r.cert.public_bytes(serialization.Encoding.PEM).decode()
                for r in self._roots
            }

    def rotate(self) -> str:
        """Start signing with a new root; the old ones stay trusted until `retire`."""
        with self._lock:
            root = self._new_root(len(self._roots) + 1)
            self._roots.append(root)
            self._save()
            return root.fingerprint

    def retire(self) -> list[str]:
        """Stop trusting every root but the newest."""
        with self._lock:
            retired = [r.fingerprint for r in self._roots[:-1]]
            self._roots = self._roots[-1:]
            self._save()
            return retired

    def issue(
        self,
        spiffe_id: SpiffeId,
        ttl: dt.timedelta,
        now: dt.datetime | None = None,
        with_san: bool = True,
        root: str | None = None,
    ) -> IssuedCertificate:
        """A leaf certificate for `spiffe_id` (URI SAN), usable for both TLS client and server,
        signed by the trusted root with fingerprint `root` (default: the newest)."""
        if spiffe_id.trust_domain != self.trust_domain:
            raise ValueError(f"{spiffe_id} is outside trust domain {self.trust_domain!r}")
        with self._lock:
            candidates = [r for r in self._roots if root in (None, r.fingerprint)]
            if not candidates:
                raise ValueError(f"root {root} is not trusted by this CA")
            signer = candidates[-1]
        key = ec.generate_private_key(ec.SECP256R1())
        start = (now or _now()) - CLOCK_SKEW
        serial = x509.random_serial_number()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshfn")]))
            .issuer_name(signer.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(start)
            .not_valid_after(start + CLOCK_SKEW + ttl)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.key.public_key()),
                critical=False,
            )
        )
        if with_san:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(str(spiffe_id))]),
                critical=True,
            )
        cert = builder.sign(signer.key, hashes.SHA256())
        return IssuedCertificate(
            spiffe_id=str(spiffe_id),
            certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
            private_key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ).decode(),
            serial=serial,
            not_before=cert.not_valid_before_utc,
            not_after=cert.not_valid_after_utc,
            issuer_fingerprint=signer.fingerprint,
        )
