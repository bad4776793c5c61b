"""A signed checkpoint as the signer made it: the canonical body (format: offline.py) and the
ed25519 signature over exactly those bytes. Stored in the store, in the witness, in exports."""

from __future__ import annotations

import time as _time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from . import offline


def now_iso(now: float | None = None) -> str:
    moment = datetime.fromtimestamp(_time.time() if now is None else now, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


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
    def retention_days(self) -> int | None:
        """The retention the signer applied when it signed this (None: version 2, unsigned)."""
        days = self.doc.get("retention_days")
        return int(days) if days is not None else None

    @property
    def prune(self) -> dict[str, tuple[int, str]]:
        """The prune the signer witnessed here: chain -> (seq, hash) records up to seq may go."""
        return {c: (int(s), str(h)) for c, (s, h) in self.doc.get("prune", {}).items()}

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
