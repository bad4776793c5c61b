"""Where proxies write their audit journals: the translator points Envoy's file access log there
and the collector reads from there, so both take the path from here."""

from __future__ import annotations

from pathlib import Path


def journal_dir(state_dir: Path) -> Path:
    return state_dir / "audit" / "journal"


def journal_path(state_dir: Path, node: str) -> Path:
    """Where a proxy's audit journal lives in embedded mode (Envoy writes, we read)."""
    safe = node.replace("/", "_").replace("~", "-")
    return journal_dir(state_dir) / f"{safe}.jsonl"


# What an erasure writes over a subject's HMAC in the journals (`meshfn audit erase`): as long as
# the HMAC (64 hex digits), so every byte offset the collector has stored stays valid, and no hex
# digit in it, so it can never be taken for a subject. The collector stores such a line's subject
# as null with `subject_erased: true`.
ERASED_SUBJECT = "erased".ljust(64, "-")
