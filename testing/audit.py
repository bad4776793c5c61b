"""An audit trail wired as `meshfn up` wires it (store, a read-only store for the signer, the
signer with its own key, a file witness), in one process, for tests and benchmarks; and raw
write access to a store that bypasses its append-only triggers (what an attacker has)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg

from meshfn.audit import Checkpoint, FileWitness, Signer, open_store, signing, verify
from meshfn.audit.verify import VerifyReport


class Trail:
    def __init__(self, location: str | Path, tmp: Path, **store_options: Any) -> None:
        self.location = str(location)
        self.store = open_store(location, **store_options)
        self.key = signing.load_or_create(tmp / "audit-signer" / "checkpoint.key")
        self.public_key = self.key.public_key()
        self.witness = FileWitness(tmp / "audit-witness" / "checkpoints.jsonl")
        self.reader = open_store(location, readonly=True)
        self.signer = Signer(self.reader, self.key, self.witness)

    def checkpoint(self) -> Checkpoint | None:
        result = self.signer.sign()
        for checkpoint in result.checkpoints:
            self.store.add_checkpoint(checkpoint)
        return result.checkpoint

    def verify(self, witness: bool = True, now: float | None = None) -> VerifyReport:
        return verify(self.store, self.public_key, self.witness if witness else None, now)

    def problems(self, witness: bool = True) -> list[tuple[str, str | None, int | None]]:
        return [(p.kind, p.chain, p.seq) for p in self.verify(witness).problems]

    def close(self) -> None:
        self.store.close()
        self.reader.close()


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
