"""SPIFFE IDs: spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ID = re.compile(r"^spiffe://([a-z0-9._-]+)/ns/([a-z0-9-]+)/sa/([a-z0-9-]+)$")


@dataclass(frozen=True, order=True)
class SpiffeId:
    trust_domain: str
    namespace: str
    service_account: str

    def __str__(self) -> str:
        return f"spiffe://{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"

    @property
    def principal(self) -> str:
        """Istio's principal spelling: the SPIFFE ID without `spiffe://`."""
        return str(self)[len("spiffe://") :]

    @classmethod
    def parse(cls, text: str) -> SpiffeId:
        match = _ID.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not spiffe://<trust-domain>/ns/<namespace>/sa/<account>")
        return cls(*match.groups())
