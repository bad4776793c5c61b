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
