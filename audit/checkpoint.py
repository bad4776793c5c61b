"""A signed checkpoint as the signer made it: the canonical body (format: offline.py) and the
ed25519 signature over exactly those bytes. Stored in the store, in the witness, in exports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import offline


@dataclass(frozen=True)
class Checkpoint:
    """A signed checkpoint: its canonical body (offline.py format) and the signature over it."""

    body: bytes
    signature: bytes
    key_id: str

    @property
    def doc(self) -> dict[str, Any]:
        return offline.parse_checkpoint(self.body)

    @property
    def n(self) -> int:
        return int(self.doc["n"])

    @property
    def heads(self) -> dict[str, tuple[int, str]]:
        return {c: (int(s), str(h)) for c, (s, h) in self.doc["chains"].items()}

    @property
    def time(self) -> str:
        return str(self.doc["time"])

    @property
    def digest(self) -> str:
        return offline.checkpoint_digest(self.body)

    def as_json(self) -> dict[str, str]:
        return {
            "body": self.body.decode("ascii"),
            "signature": self.signature.hex(),
            "key_id": self.key_id,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Checkpoint:
        return cls(
            str(data["body"]).encode("ascii"),
            bytes.fromhex(str(data["signature"])),
            str(data.get("key_id", "")),
        )
