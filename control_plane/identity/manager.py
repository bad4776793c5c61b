"""Keeps every workload's certificate fresh and tells the control plane when to push.

Certificates are re-issued at half their lifetime and when the signing root changes. The CA's
files are the control channel for `meshfn ca rotate|retire`: a change to roots.json is picked
up on the next tick. A root change is rolled out only as fast as the proxies follow, because
each proxy applies its secrets on its own stream and time: a leaf from a new root is only valid
to a peer whose trust bundle already holds that root, and a retired root must stay trusted
while a peer still presents a leaf it signed. So:

1. after `rotate`, the new root joins every trust bundle, but the previous root keeps signing
   until every workload's proxies have ACKed a bundle holding the new root;
2. then the new root signs and every leaf is re-issued;
3. after `retire`, the retired roots stay in the bundles until every workload's proxies have
   ACKed a leaf from a remaining root.

A workload that does not ACK (its proxy is down or disconnected) holds a step back for at most
`ROLLOUT_WAIT`; then the step goes ahead, logged with the workloads that lag. The signing root
and the roots being retired are kept in rollout.json, so a restarted control plane carries on
where it was instead of signing with a root the proxies may not trust yet.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshfn.common.files import write_private

from .ca import CertificateAuthority, IssuedCertificate
from .credentials import Credentials
from .spiffe import SpiffeId

log = logging.getLogger("meshfn.identity")


ROLLOUT_WAIT = dt.timedelta(seconds=60)
SENT_KEPT = 8  # secret versions remembered per workload (an ACK may trail a few pushes)


@dataclass(frozen=True)
class _Sent:
    """What one secrets version carried to a workload: the leaf's root and the bundle's."""

    leaf_root: str
    bundle: frozenset[str]


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
        self._sent: dict[str, dict[str, _Sent]] = {}  # workload -> secrets version -> content
        self._pending_since: float | None = None  # monotonic: the current rollout step began
        self._signing, self._retiring = self._load_rollout()
        self._save_rollout()

    # ------------------------------------------------------------------ the rollout

    def _rollout_path(self) -> Path:
        return self.directory / "rollout.json"

    def _load_rollout(self) -> tuple[str, dict[str, str]]:
        """The signing root and the roots being retired, as the last control plane left them.
        Without a record and with several roots, the oldest signs: the proxies may not trust
        a newer one yet, and step 1 moves on as soon as they do."""
        trusted = self.ca.root_fingerprints()
        try:
            saved = json.loads(self._rollout_path().read_text())
            signing, retiring = str(saved["signing"]), dict(saved["retiring"])
        except (OSError, ValueError, KeyError, TypeError):
            return trusted[0], {}
        if signing not in trusted:
            signing = trusted[-1]
        return signing, {fp: str(pem) for fp, pem in retiring.items() if fp not in trusted}

    def _save_rollout(self) -> None:
        document = {"signing": self._signing, "retiring": self._retiring}
        write_private(self._rollout_path(), json.dumps(document, indent=2).encode())

    @property
    def signing_root(self) -> str:
        return self._signing

    def bundle_roots(self) -> list[str]:
        """Every root in the trust bundles: the trusted ones and those still being retired."""
        return [*self._retiring, *self.ca.root_fingerprints()]

    def trust_bundle_pem(self) -> str:
        return "".join([*self._retiring.values(), *self.ca.root_pems().values()])

    def rolling_out(self) -> bool:
        """A root change waits for the proxies (the control plane checks more often then)."""
        return self._signing != self.ca.root_fingerprints()[-1] or bool(self._retiring)

    def sent(self, workload: str, version: str, spiffe_id: str) -> None:
        """Remember what secrets `version` of `workload` carries, to read its ACKs later."""
        cert = self.certificate(spiffe_id)
        if cert is None or not version:
            return
        versions = self._sent.setdefault(workload, {})
        versions[version] = _Sent(cert.issuer_fingerprint, frozenset(self.bundle_roots()))
        while len(versions) > SENT_KEPT:
            del versions[next(iter(versions))]

    def advance(
        self, workloads: Sequence[str], acked: Mapping[str, Sequence[str]], now: float
    ) -> bool:
        """Take the next rollout step once every workload's proxies ACKed what it needs
        (`acked`: workload -> the secrets version each of its streams ACKed), or once
        ROLLOUT_WAIT has passed. True when the signing root or the bundle changed."""
        newest = self.ca.root_fingerprints()[-1]
        if not self.rolling_out():
            self._pending_since = None
            return False
        if self._pending_since is None:
            self._pending_since = now
        waited = now - self._pending_since >= min(ROLLOUT_WAIT, self.ttl / 2).total_seconds()

        def lagging(done: Callable[[_Sent], bool]) -> list[str]:
            out = []
            for workload in workloads:
                states = [self._sent.get(workload, {}).get(v) for v in acked.get(workload, ())]
                if not states or not all(s is not None and done(s) for s in states):
                    out.append(workload)
            return out

        if self._signing != newest:
            behind = lagging(lambda s: newest in s.bundle)
            if behind and not waited:
                return False
            step = f"signing with root {newest}"
            self._signing = newest
        else:
            retiring = set(self._retiring)
            behind = lagging(lambda s: s.leaf_root not in retiring)
            if behind and not waited:
                return False
            step = f"no longer trusting retired root(s) {', '.join(sorted(retiring))}"
            self._retiring = {}
        if behind:
            log.warning(
                "CA rollout: %s although %s did not ACK the previous step within %s",
                step, ", ".join(behind), min(ROLLOUT_WAIT, self.ttl / 2),
            )  # fmt: skip
        else:
            log.info("CA rollout: %s (every proxy ACKed the previous step)", step)
        self._pending_since = now if self.rolling_out() else None
        self._save_rollout()
        return True

    # ------------------------------------------------------------------ certificates

    def _stat(self) -> tuple[int, int]:
        st = (self.directory / "roots.json").stat()
        return (st.st_mtime_ns, st.st_size)

    def reload_roots_if_changed(self) -> bool:
        """Pick up `meshfn ca rotate|retire` done by another process."""
        stat = self._stat()
        if stat == self._roots_stat:
            return False
        before = self.ca.root_pems()
        self.ca = CertificateAuthority(self.directory, self.trust_domain)
        self._roots_stat = stat
        trusted = self.ca.root_fingerprints()
        self._retiring.update({fp: pem for fp, pem in before.items() if fp not in trusted})
        for fp in trusted:
            self._retiring.pop(fp, None)
        if self._signing not in trusted:  # retired before the proxies moved off it
            self._signing = trusted[-1]
        self._pending_since = None
        self._save_rollout()
        log.info(
            "CA roots changed on disk: trusting %s (signing: %s, being retired: %s)",
            ", ".join(trusted), self._signing, ", ".join(self._retiring) or "none",
        )  # fmt: skip
        return True

    def ensure(self, spiffe_ids: Iterable[str], now: dt.datetime | None = None) -> list[str]:
        """Issue or renew what is due; return the SPIFFE IDs that got a new certificate."""
        now = now or dt.datetime.now(dt.UTC)
        wanted = {i for i in spiffe_ids if i}
        signing = self._signing
        renewed = []
        with self._lock:
            for spiffe_id in sorted(wanted):
                cert = self._certs.get(spiffe_id)
                due = cert is None or now >= cert.renew_at() or cert.issuer_fingerprint != signing
                if due:
                    self._certs[spiffe_id] = self.ca.issue(
                        SpiffeId.parse(spiffe_id), self.ttl, now, root=signing
                    )
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
            trust_bundle_pem=self.trust_bundle_pem(),
        )

    def certificate(self, spiffe_id: str) -> IssuedCertificate | None:
        with self._lock:
            return self._certs.get(spiffe_id)

    def next_renewal(self) -> dt.datetime | None:
        with self._lock:
            return min((c.renew_at() for c in self._certs.values()), default=None)
