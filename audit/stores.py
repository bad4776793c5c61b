"""Open a store by where it lives: the one place that knows both backends."""

from __future__ import annotations

from pathlib import Path

from .postgres import PostgresStore
from .sqlite import SqliteStore
from .store import DEFAULT_RETENTION_DAYS, AuditStore


def open_store(
    location: str | Path,
    *,
    readonly: bool = False,
    retention_days: int = DEFAULT_RETENTION_DAYS,
    max_bytes: int | None = None,
) -> AuditStore:
    """`postgresql://...` (or `postgres://`, or a libpq `key=value` string): PostgreSQL;
    anything else: an SQLite file."""
    text = str(location)
    if text.startswith(("postgresql://", "postgres://")) or ("=" in text and " " in text):
        return PostgresStore(text, readonly=readonly, retention_days=retention_days)
    return SqliteStore(
        Path(text), readonly=readonly, retention_days=retention_days, max_bytes=max_bytes
    )
