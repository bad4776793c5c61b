"""Open a store by where it lives: the one place that knows both backends."""

from __future__ import annotations

from pathlib import Path

from .postgres import PostgresStore
from .sqlite import SqliteStore
from .store import AuditStore


def is_postgres(location: str | Path) -> bool:
    """`postgresql://...` (or `postgres://`, or a libpq `key=value` string)."""
    text = str(location)
    return text.startswith(("postgresql://", "postgres://")) or ("=" in text and " " in text)


def open_store(
    location: str | Path,
    *,
    readonly: bool = False,
    max_bytes: int | None = None,
) -> AuditStore:
    """`postgresql://...` (or `postgres://`, or a libpq `key=value` string): PostgreSQL;
    anything else: an SQLite file."""
    if is_postgres(location):
        return PostgresStore(str(location), readonly=readonly)
    return SqliteStore(Path(location), readonly=readonly, max_bytes=max_bytes)
