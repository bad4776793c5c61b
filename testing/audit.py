"""An audit trail wired as `meshfn up` wires it (store, the signer with its own key and its own
connection, a file witness, a read-only store for verify), in one process, for tests and
benchmarks; on PostgreSQL each component connects as its own least-privilege role, as in a
cluster; and raw write access to a store that bypasses its append-only triggers (what an
attacker has)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from meshfn.audit import Checkpoint, FileWitness, Signer, open_store, signing, verify
from meshfn.audit.signer import serve, wait_ready
from meshfn.audit.store import DEFAULT_RETENTION_DAYS
from meshfn.audit.stores import is_postgres
from meshfn.audit.verify import VerifyReport

from .postgres import role_dsns


class Trail:
    """`store`: the collectors' (append); `owner`: the owner's (erase); the signer's and the
    reader's connections of their own. On SQLite all are the one file's writer."""

    def __init__(
        self,
        location: str | Path,
        tmp: Path,
        retention_days: int = DEFAULT_RETENTION_DAYS,
        **store_options: Any,
    ) -> None:
        self.location = str(location)
        self.owner = open_store(location, **store_options)
        self.roles = role_dsns(self.location) if is_postgres(location) else {}
        self.store = open_store(self.roles["collector"]) if self.roles else self.owner
        self.signer_store = open_store(self.roles.get("signer", self.location))
        self.reader = open_store(self.roles.get("reader", self.location), readonly=True)
        self.key = signing.load_or_create(tmp / "audit-signer" / "checkpoint.key")
        self.public_key = self.key.public_key()
        self.witness = FileWitness(tmp / "audit-witness" / "checkpoints.jsonl")
        self.signer = Signer(self.signer_store, self.key, self.witness, retention_days)

    def checkpoint(self, now: float | None = None) -> Checkpoint | None:
        """Ask the signer (it stores the checkpoint itself)."""
        return self.signer.sign(now).checkpoint

    def prune(self, days: int | None = None, now: float | None = None) -> int:
        """Retention as the collector applies it: the signer witnesses, the store deletes."""
        return self.store.apply_prune(self.signer.prune(days, now).points)

    @contextlib.contextmanager
    def serving(self, address: str) -> Iterator[str]:
        """This trail's signer answering on `address` (the real protocol, in a thread)."""
        started: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

        async def main() -> None:
            stop = asyncio.Event()
            started.append((asyncio.get_running_loop(), stop))
            await serve(self.signer, address, stop)

        thread = threading.Thread(target=asyncio.run, args=(main(),), name="audit-signer")
        thread.start()
        try:
            wait_ready(address)
            yield address
        finally:
            if started:
                loop, stop = started[0]
                loop.call_soon_threadsafe(stop.set)
            thread.join(10)

    def verify(self, witness: bool = True, now: float | None = None) -> VerifyReport:
        return verify(self.reader, self.public_key, self.witness if witness else None, now)

    def problems(self, witness: bool = True) -> list[tuple[str, str | None, int | None]]:
        return [(p.kind, p.chain, p.seq) for p in self.verify(witness).problems]

    def close(self) -> None:
        for store in {
            id(s): s for s in (self.store, self.owner, self.signer_store, self.reader)
        }.values():
            store.close()


class Raw:
    """SQL on the store's database with the append-only triggers out of the way."""

    def __init__(self, location: str) -> None:
        self.postgres = location.startswith("postgresql://")
        if self.postgres:
            self.pg = psycopg.connect(location, autocommit=True)
            self.pg.execute("SET session_replication_role = replica")  # triggers off
        else:
            self.lite = sqlite3.connect(location, isolation_level=None)
            for (name,) in self.lite.execute(
                "SELECT name FROM sqlite_master WHERE type = 'trigger'"
            ).fetchall():
                self.lite.execute(f"DROP TRIGGER {name}")

    def run(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.postgres:
            cursor = self.pg.execute(sql.replace("?", "%s").encode(), args)
            return [tuple(r) for r in cursor.fetchall()] if cursor.description else []
        return [tuple(r) for r in self.lite.execute(sql, args).fetchall()]

    def close(self) -> None:
        if self.postgres:
            self.pg.close()
        else:
            self.lite.close()
