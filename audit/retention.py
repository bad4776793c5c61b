"""Retention as the signer applies it and `verify` checks it, from signed checkpoints alone.

The store's writer decides nothing here. The signer holds the retention setting (`meshfn audit
signer --retention-days`), signs it into every checkpoint (`retention_days`), and witnesses each
prune as a checkpoint of its own (`prune`: chain -> [seq, hash], records up to seq may go). It
witnesses a prune only up to a head that a checkpoint older than the retention signed (`due`).
The store moves a chain's anchor only to a witnessed prune point (a trigger), and `verify`
holds every anchor to the witness: a start that no witnessed prune names is a deletion, and a
witnessed prune that its own signed retention did not allow is reported too (`early`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from .checkpoint import Checkpoint, now_iso, parse_iso


@dataclass(frozen=True)
class PrunePoint:
    """A prune the signer witnessed: records of `chain` up to `seq` (hash `hash`) may go."""

    chain: str
    seq: int
    hash: str
    n: int  # the checkpoint that witnessed it
    time: str
    retention_days: int


def prune_points(checkpoints: Iterable[Checkpoint]) -> dict[str, list[PrunePoint]]:
    """Every witnessed prune, per chain, oldest first."""
    out: dict[str, list[PrunePoint]] = {}
    for checkpoint in checkpoints:
        days = checkpoint.retention_days
        for chain, (seq, digest) in checkpoint.prune.items():
            out.setdefault(chain, []).append(
                PrunePoint(chain, seq, digest, checkpoint.n, checkpoint.time, days or 0)
            )
    return out


def cutoff(days: int, now: float) -> str:
    """The time (records' format) before which a checkpoint is older than `days`."""
    return now_iso(now - timedelta(days=days).total_seconds())


def due(
    checkpoints: Iterable[Checkpoint], days: int, now: float, pruned: dict[str, int]
) -> dict[str, tuple[int, str]]:
    """Per chain, the newest head signed by a checkpoint older than `days`, where it lies
    beyond what is already pruned (`pruned`: chain -> seq): what a prune may now remove."""
    before = cutoff(days, now)
    newest: dict[str, tuple[int, str]] = {}
    for checkpoint in checkpoints:
        if checkpoint.time >= before:
            continue
        for chain, head in checkpoint.heads.items():
            if head[0] > newest.get(chain, (0, ""))[0]:
                newest[chain] = head
    return {chain: head for chain, head in newest.items() if head[0] > pruned.get(chain, 0)}


def early(checkpoints: Iterable[Checkpoint]) -> Iterator[tuple[PrunePoint, str]]:
    """Witnessed prunes that the retention signed with them did not allow, and why (only a
    holder of the signing key could have made one: the signer never does)."""
    signed: dict[tuple[str, int], tuple[str, int, str]] = {}  # (chain, seq) -> hash, n, time
    for checkpoint in checkpoints:
        days = checkpoint.retention_days or 0
        for chain, (seq, digest) in checkpoint.prune.items():
            point = PrunePoint(chain, seq, digest, checkpoint.n, checkpoint.time, days)
            head = signed.get((chain, seq))
            if head is None or head[0] != digest:
                yield point, f"names record {seq}, which no earlier checkpoint signed as it"
            elif parse_iso(head[2]) > parse_iso(checkpoint.time) - days * 86400 + 1:
                yield (
                    point,
                    f"record {seq} was signed by checkpoint {head[1]} ({head[2]}), younger than"
                    f" the {days}-day retention signed with the prune",
                )
        for chain, (seq, digest) in checkpoint.heads.items():
            signed[(chain, seq)] = (digest, checkpoint.n, checkpoint.time)
