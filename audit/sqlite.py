"""The embedded audit store: one SQLite file in WAL mode (what `meshfn up` uses).

Writers serialise on SQLite's write lock (BEGIN IMMEDIATE), which also orders appends against
erasures. Deleted content is overwritten (secure_delete) and an erasure checkpoints and truncates
the write-ahead log, so a deleted pseudonym survives neither in the file nor in its WAL.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .store import (
    MIGRATABLE,
    TABLES,
    AuditStore,
    RecordRow,
    Row,
    StoreConflict,
    StoreError,
    VerifyRow,
)

# Query columns generated from the record (they cannot disagree with what the chain covers;
# SQLite computes them in-process when the indexes need them).
_QUERY_COLUMNS = """time TEXT GENERATED ALWAYS AS (json_extract(record, '$.time')) VIRTUAL,
    subject TEXT GENERATED ALWAYS AS (json_extract(record, '$.subject')) VIRTUAL,
    status INTEGER GENERATED ALWAYS AS (json_extract(record, '$.status')) VIRTUAL,
    route TEXT GENERATED ALWAYS AS (json_extract(record, '$.route')) VIRTUAL"""
# Append-only records and checkpoints; a chain starts at record 0, is never deleted, and its
# anchor moves only to a point that the stored checkpoint it names (`anchor_checkpoint`, one
# lookup) lists in its `prune` (the signer's witnessed prune: see retention.py), so retention
# deletes only what the signer let go.
_TRIGGERS = (
    """CREATE TRIGGER IF NOT EXISTS records_no_update BEFORE UPDATE ON records
BEGIN SELECT RAISE(ABORT, 'audit records are append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS records_no_delete BEFORE DELETE ON records
WHEN old.seq > COALESCE((SELECT anchor_seq FROM chains WHERE chain = old.chain), 0)
BEGIN SELECT RAISE(ABORT, 'audit records are append-only (retention deletes them)'); END""",
    """CREATE TRIGGER IF NOT EXISTS checkpoints_no_update BEFORE UPDATE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'audit checkpoints are append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS checkpoints_no_delete_ever BEFORE DELETE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'audit checkpoints are append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS chains_start_at_genesis BEFORE INSERT ON chains
WHEN new.anchor_seq <> 0
BEGIN SELECT RAISE(ABORT, 'audit chains start at record 0'); END""",
    """CREATE TRIGGER IF NOT EXISTS chains_no_delete BEFORE DELETE ON chains
BEGIN SELECT RAISE(ABORT, 'audit chains are never deleted'); END""",
    """CREATE TRIGGER IF NOT EXISTS chains_anchor_witnessed BEFORE UPDATE ON chains
WHEN new.chain IS NOT old.chain
  OR ((new.anchor_seq IS NOT old.anchor_seq OR new.anchor_hash IS NOT old.anchor_hash)
      AND NOT EXISTS (
        SELECT 1 FROM checkpoints c, json_each(c.body, '$.prune') p
        WHERE c.n = new.anchor_checkpoint AND p.key = new.chain
          AND json_extract(p.value, '$[0]') = new.anchor_seq
          AND json_extract(p.value, '$[1]') = lower(hex(new.anchor_hash))))
BEGIN
  SELECT RAISE(ABORT, 'audit chains: the anchor moves only to a prune the signer witnessed');
END""",
)
# The records table as meshfn creates it (SQLite keeps the statement's text, without IF NOT
# EXISTS): while the file says exactly this, the query columns are computed from the record on
# every read and cannot disagree with it; any other definition (a table rebuilt with ordinary
# columns, another expression) has verify compare every row.
_TABLES_SQL = TABLES.format(
    blob="BLOB", int="INTEGER", serial="INTEGER", offset="offset", query_columns=_QUERY_COLUMNS
)
_RECORDS_SQL = " ".join(
    re.search(r"CREATE TABLE IF NOT EXISTS (records \(.*?\n\));", _TABLES_SQL, re.S)
    .group(1)  # type: ignore[union-attr]
    .split()
)
# schema 2's checkpoint trigger let the writer delete below a floor it set itself
_OLD_TRIGGERS = ("checkpoints_no_delete",)
_DDL = _TABLES_SQL + ";\n".join(_TRIGGERS) + ";\n"


class SqliteStore(AuditStore):
    def __init__(
        self,
        path: Path,
        *,
        readonly: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        super().__init__(readonly=readonly)
        self.path = Path(path)
        self.location = self.open_location = str(self.path)
        self._in_tx = False
        try:
            if readonly:
                if not self.path.exists():
                    raise StoreError(f"{self.path}: no audit store here")
                self._db = sqlite3.connect(
                    f"file:{self.path}?mode=ro",
                    uri=True,
                    check_same_thread=False,
                    isolation_level=None,
                )
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                if not self.path.exists():
                    self._create()
                self._db = self._connect(self.path)
                self._db.executescript(_DDL)
                self._init_meta()
                if self._schema() == MIGRATABLE:  # the writer owns the file: migrate on open
                    self.migrate()
                if max_bytes is not None:
                    self.set_max_bytes(max_bytes)
            self._check_schema()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the audit store: {exc}") from None
        except OSError as exc:
            raise StoreError(f"{self.path}: {exc.strerror or exc}") from None

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL is enough: a transaction lost to power failure takes its journal offset with
        # it, so the collector reads those lines again.
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=5000")
        db.execute("PRAGMA secure_delete=ON")  # deleted rows (erasures, retention) are zeroed
        return db

    def _create(self) -> None:
        """A new store appears complete or not at all: built under a temporary name, then
        linked into place (a reader that sees the file always finds the schema; of two writers
        racing to create it, one wins and the other opens the winner's)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
        tmp.unlink(missing_ok=True)
        # Owner-only (records carry subjects' pseudonyms); SQLite gives its -wal and -shm
        # files the database file's mode.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self._db = self._connect(tmp)
        try:
            self._db.executescript(_DDL)
            self._init_meta()
        finally:
            self._db.close()
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)

    def set_max_bytes(self, max_bytes: int) -> None:
        """Cap the database size; past it every append fails with "database or disk is full"
        and the collector keeps the records in the journal until there is room."""
        with self._lock:
            page = self._db.execute("PRAGMA page_size").fetchone()[0]
            self._db.execute(f"PRAGMA max_page_count={max(1, max_bytes // page)}")

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.IntegrityError as exc:
            if "UNIQUE" in str(exc):
                raise StoreConflict(
                    f"{self.path}: {what}: another writer was first ({exc})"
                ) from None
            raise StoreError(f"{self.path}: {what}: {exc}") from None
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {what}: {exc}") from None

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        with self._lock, self._errors("cannot store audit records"):
            self._db.execute("BEGIN IMMEDIATE")
            self._in_tx = True
            try:
                yield
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
            finally:
                self._in_tx = False
            self._db.execute("COMMIT")

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._lock, self._errors("query failed"):
            return self._db.execute(sql, tuple(args)).fetchall()

    def _count(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._lock, self._errors("write failed"):
            return int(self._db.execute(sql, tuple(args)).rowcount)

    def record_batches(self, chain: str, seq: int, batch: int = 5000) -> Iterator[list[VerifyRow]]:
        """The base class's rows, each compared with its query columns, unless the records
        table is exactly meshfn's (generated columns: nothing to compare, half the time)."""
        if not self._columns_generated():
            yield from super().record_batches(chain, seq, batch)
            return
        yield from self._pages("seq, record, prev, hash, 1", chain, seq, batch)

    def _columns_generated(self) -> bool:
        found = self._rows("SELECT sql FROM sqlite_master WHERE type='table' AND name='records'")
        return bool(found) and " ".join(str(found[0][0]).split()) == "CREATE TABLE " + _RECORDS_SQL

    def _insert_records(self, rows: list[RecordRow]) -> None:
        with self._errors("cannot store audit records"):
            self._db.executemany(
                "INSERT INTO records (chain, seq, record, prev, hash) VALUES (?, ?, ?, ?, ?)",
                [row[:5] for row in rows],
            )

    def _migrate(self) -> None:
        for name in _OLD_TRIGGERS:
            self._rows(f"DROP TRIGGER IF EXISTS {name}")
        for statement in _TRIGGERS:
            self._rows(statement)

    def _lock_erasures(self, exclusive: bool) -> str:
        # BEGIN IMMEDIATE already serialises every writer of the file
        return str(self._rows("SELECT value FROM meta WHERE key='erasures'")[0][0])

    def _shred(self) -> list[str]:
        """secure_delete zeroed the row in its pages; the WAL still holds the pages as they
        were before: copy the new ones into the file and truncate the log (retried while
        readers hold old snapshots, for up to 10 s)."""
        deadline = time.monotonic() + 10
        while True:
            with self._lock, self._errors("checkpointing the write-ahead log"):
                busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return []
            if time.monotonic() > deadline:
                return [
                    f"{self.path}-wal still holds the erased row: a reader kept an old snapshot"
                    " open; it is overwritten at the next checkpoint"
                ]
            time.sleep(0.05)

    def close(self) -> None:
        with self._lock:
            self._db.close()
