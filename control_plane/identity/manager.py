"""Keeps every workload's certificate fresh and tells the control plane when to push.

Certificates are re-issued at half their lifetime, when the CA has rotated to a new root (so
workloads migrate during the overlap), or when the root that signed them is retired. The CA's
files are the control channel for `meshfn ca rotate|retire`: a change to roots.json is picked
up on the next tick.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from .ca import CertificateAuthority, IssuedCertificate
from .credentials import Credentials
from .spiffe import SpiffeId

log = logging.getLogger("meshfn.identity")


class IdentityManager:
    def __init__(self, state_dir: Path, trust_domain: str, ttl: dt.timedelta) -> None:
        self.directory = state_dir / "ca" / trust_domain
        self.trust_domain = trust_domain
        self.ttl = ttl
        self.ca = CertificateAuthority(self.directory, trust_domain)
        self._certs: dict[str, IssuedCertificate] = {}
        self._lock = threading.Lock()
        self._roots_stat = self._stat()
        self.issued_total = 0

    def _stat(self) -> tuple[int, int]:
        st = (self.directory / "roots.json").stat()
        return (st.st_mtime_ns, st.st_size)

    def reload_roots_if_changed(self) -> bool:
        """Pick up `meshfn ca rotate|retire` done by another process."""
        stat = self._stat()
        if stat == self._roots_stat:
            return False
        self.ca = CertificateAuthority(self.directory, self.trust_domain)
        self._roots_stat = stat
        log.info("CA roots changed on disk: trusting %s", ", ".join(self.ca.root_fingerprints()))
        return True

    def ensure(self, spiffe_ids: Iterable[str], now: dt.datetime | None = None) -> list[str]:
        """Issue or renew what is due; return the SPIFFE IDs that got a new certificate."""
        now = now or dt.datetime.now(dt.UTC)
        wanted = {i for i in spiffe_ids if i}
        roots = self.ca.root_fingerprints()
        renewed = []
        with self._lock:
            for spiffe_id in sorted(wanted):
                cert = self._certs.get(spiffe_id)
                due = cert is None or now >= cert.renew_at() or cert.issuer_fingerprint != roots[-1]
                if due:
                    self._certs[spiffe_id] = self.ca.issue(SpiffeId.parse(spiffe_id), self.ttl, now)
                    self.issued_total += 1
                    renewed.append(spiffe_id)
            for stale in set(self._certs) - wanted:
                del self._certs[stale]
        if renewed:
            log.info("issued certificates for %s", ", ".join(renewed))
        return renewed

    def credentials(self, spiffe_id: str) -> Credentials | None:
        with self._lock:
            cert = self._certs.get(spiffe_id)
        if cert is None:
            return None
        return Credentials(
            certificate_pem=cert.certificate_pem,
            private_key_pem=cert.private_key_pem,
            trust_bundle_pem=self.ca.trust_bundle_pem(),
        )

    def certificate(self, spiffe_id: str) -> IssuedCertificate | None:
        with self._lock:
            return self._certs.get(spiffe_id)

    def next_renewal(self) -> dt.datetime | None:
        with self._lock:
            return min((c.renew_at() for c in self._certs.values()), default=None)
