"""What a workload's proxy gets from the mesh CA: its certificate and key, and the trust bundle."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Credentials:
    """One workload's certificate and key, and the trust bundle. Never printed."""

    certificate_pem: str
    private_key_pem: str
    trust_bundle_pem: str

    def __repr__(self) -> str:
        return "Credentials(<redacted>)"
