"""The append-only audit store: SQLite in WAL mode, hash-chained, with signed checkpoints.

Each record row holds its canonical JSON, the previous hash and its own hash
`h_i = SHA-256(h_{i-1} || canonical(record_i))`, so every row can be checked alone (was it
edited?) and against its neighbour (was something deleted, inserted or moved?). Periodic
checkpoints sign `(seq, h_seq)` with ed25519: a rewritten chain, or a truncated tail that a
checkpoint had already covered, cannot be made to verify without the private key.

The collector's read position in each Envoy journal is stored in the same transaction as the
records it read, which is what makes ingestion exactly-once across crashes and restarts.
Query columns are generated from the record JSON, so they can never disagree with what the chain
covers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import signing
from .record import canonical

SCHEMA = 1
DEFAULT_RETENTION_DAYS = 730
_MAX_PROBLEMS = 100

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY,
    record TEXT NOT NULL,
    prev BLOB NOT NULL,
    hash BLOB NOT NULL,
    time TEXT GENERATED ALWAYS AS (json_extract(record, '$.time')) VIRTUAL,
    subject TEXT GENERATED ALWAYS AS (json_extract(record, '$.subject')) VIRTUAL,
    status INTEGER GENERATED ALWAYS AS (json_extract(record, '$.status')) VIRTUAL,
    route TEXT GENERATED ALWAYS AS (json_extract(record, '$.route')) VIRTUAL
);
CREATE INDEX IF NOT EXISTS records_time ON records (time);
CREATE INDEX IF NOT EXISTS records_subject ON records (subject);
CREATE TABLE IF NOT EXISTS checkpoints (
    seq INTEGER PRIMARY KEY,
    hash BLOB NOT NULL,
    created TEXT NOT NULL,
    key_id TEXT NOT NULL,
    signature BLOB NOT NULL
);
-- Append-only in the database itself, so a mistake (or a tool) cannot edit the trail: records
-- and checkpoints are never updated, and only retention deletes them, up to the anchor it has
-- just moved. Whoever drops these triggers is an attacker, and `verify` is for that case.
CREATE TRIGGER IF NOT EXISTS records_no_update BEFORE UPDATE ON records
BEGIN SELECT RAISE(ABORT, 'audit records are append-only'); END;
CREATE TRIGGER IF NOT EXISTS records_no_delete BEFORE DELETE ON records
WHEN old.seq > CAST((SELECT value FROM meta WHERE key = 'anchor_seq') AS INTEGER)
BEGIN SELECT RAISE(ABORT, 'audit records are append-only (retention deletes them)'); END;
CREATE TRIGGER IF NOT EXISTS checkpoints_no_update BEFORE UPDATE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'audit checkpoints are append-only'); END;
CREATE TRIGGER IF NOT EXISTS checkpoints_no_delete BEFORE DELETE ON checkpoints
WHEN old.seq >= CAST((SELECT value FROM meta WHERE key = 'anchor_seq') AS INTEGER)
BEGIN SELECT RAISE(ABORT, 'audit checkpoints are append-only'); END;
CREATE TABLE IF NOT EXISTS journals (
    source TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    inode INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    fingerprint TEXT NOT NULL
);
"""


class StoreError(RuntimeError):
    """The store cannot be opened or written (full, read-only, not an audit store, ...)."""


@dataclass(frozen=True)
class JournalPosition:
    """How far the collector has read one Envoy journal file (identified by inode)."""

    source: str
    path: str
    inode: int
    offset: int
    # "<n>:<sha256 of the file's first n bytes>": inode numbers are reused once a file is deleted,
    # the first bytes of a journal are not.
    fingerprint: str = ""


@dataclass(frozen=True)
class Problem:
    kind: str  # edited | deleted | inserted | reordered | checkpoint | signature | retention
    seq: int | None
    detail: str


@dataclass
class VerifyReport:
    records: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    checkpoints: int = 0
    last_checkpoint_seq: int | None = None
    anchor_seq: int = 0
    problems: list[Problem] = field(default_factory=list)
    truncated_problems: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsigned_tail(self) -> int:
        """Records after the last checkpoint: intact as far as the chain shows, but a deleted
        tail this short could not be detected until the next checkpoint covers it."""
        if self.last_seq is None:
            return 0
        return self.last_seq - (self.last_checkpoint_seq or self.anchor_seq)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records": self.records,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "checkpoints": self.checkpoints,
            "last_checkpoint_seq": self.last_checkpoint_seq,
            "anchor_seq": self.anchor_seq,
            "unsigned_tail": self.unsigned_tail,
            "problems": [p.__dict__ for p in self.problems],
            "more_problems_not_shown": self.truncated_problems,
        }


def _now_iso(now: float | None = None) -> str:
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _link(prev: bytes, body: bytes) -> bytes:
    return hashlib.sha256(prev + body).digest()


class AuditStore:
    """One SQLite file. One writer (the collector) at a time; readers (query, verify) any time."""

    def __init__(
        self,
        path: Path,
        *,
        key_path: Path | None = None,
        max_bytes: int | None = None,
        retention_days: int = DEFAULT_RETENTION_DAYS,
        readonly: bool = False,
    ) -> None:
        if retention_days < 0:
            raise StoreError("retention_days must be >= 0")
        self.path = Path(path)
        self.readonly = readonly
        self.retention_days = retention_days
        self._lock = threading.Lock()
        self._key: Ed25519PrivateKey | None = None
        self.key_path = key_path or self.path.with_name(self.path.name + ".key")
        try:
            if readonly:
                if not self.path.exists():
                    raise StoreError(f"{self.path}: no audit store here")
                self._db = sqlite3.connect(
                    f"file:{self.path}?mode=ro", uri=True, check_same_thread=False
                )
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if not self.path.exists():
                    self._create()
                self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                self._db.execute("PRAGMA journal_mode=WAL")
                # NORMAL is enough: a transaction lost to power failure takes its journal offset
                # with it, so the collector reads those lines again.
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute("PRAGMA busy_timeout=5000")
                self._db.executescript(_DDL)
                self._init_meta()
                if max_bytes is not None:
                    self.set_max_bytes(max_bytes)
                self._key = signing.load_or_create(self.key_path)
            self._check_schema()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the audit store: {exc}") from None
        except signing.KeyError_ as exc:
            raise StoreError(str(exc)) from None
        except OSError as exc:
            raise StoreError(f"{self.path}: {exc.strerror or exc}") from None
        self._head: tuple[int, bytes] | None = None

    # ------------------------------------------------------------------ setup

    def _create(self) -> None:
        """A new store appears complete or not at all: built under a temporary name, then
        linked into place (a reader that sees the file always finds the schema; of two writers
        racing to create it, one wins and the other opens the winner's)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
        tmp.unlink(missing_ok=True)
        self._db = sqlite3.connect(tmp, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
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

    def _init_meta(self) -> None:
        with self._tx():
            have = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            if "store_id" not in have:
                store_id = uuid.uuid4().hex
                self._db.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [
                        ("schema", str(SCHEMA)),
                        ("store_id", store_id),
                        ("created", _now_iso()),
                        ("anchor_seq", "0"),
                        ("anchor_hash", self._genesis(store_id).hex()),
                    ],
                )

    def _check_schema(self) -> None:
        try:
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: not an audit store ({exc})") from None
        if row is None or row[0] != str(SCHEMA):
            raise StoreError(f"{self.path}: not an audit store of schema {SCHEMA}")

    def set_max_bytes(self, max_bytes: int) -> None:
        """Cap the database size; past it every append fails with "database or disk is full"
        and the collector keeps the records in the journal until there is room."""
        page = self._db.execute("PRAGMA page_size").fetchone()[0]
        self._db.execute(f"PRAGMA max_page_count={max(1, max_bytes // page)}")

    @staticmethod
    def _genesis(store_id: str) -> bytes:
        return hashlib.sha256(b"meshfn-audit-genesis\0" + store_id.encode()).digest()

    def meta(self, key: str) -> str:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        if row is None:
            raise StoreError(f"{self.path}: meta {key} missing")
        return str(row[0])

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ writing

    def head(self) -> tuple[int, bytes]:
        """(seq, hash) of the newest record, or (anchor seq, anchor hash) when empty."""
        with self._lock:
            return self._read_head()

    def _read_head(self) -> tuple[int, bytes]:
        if self._head is None:
            row = self._db.execute(
                "SELECT seq, hash FROM records ORDER BY seq DESC LIMIT 1"
            ).fetchone()
            if row is None:
                self._head = (int(self.meta("anchor_seq")), bytes.fromhex(self.meta("anchor_hash")))
            else:
                self._head = (int(row[0]), bytes(row[1]))
        return self._head

    def append(
        self, records: Sequence[dict[str, Any]], position: JournalPosition | None = None
    ) -> int:
        """Chain and store `records` and (atomically) the journal position they were read up to.
        Returns the new head seq. Raises StoreError and stores nothing if anything fails."""
        if self.readonly:
            raise StoreError(f"{self.path}: opened read-only")
        with self._lock:
            seq, prev = self._read_head()
            rows = []
            for record in records:
                body = canonical(record)
                digest = _link(prev, body)
                seq += 1
                rows.append((seq, body.decode("ascii"), prev, digest))
                prev = digest
            try:
                with self._tx():
                    self._db.executemany(
                        "INSERT INTO records (seq, record, prev, hash) VALUES (?, ?, ?, ?)", rows
                    )
                    if position is not None:
                        self._db.execute(
                            "INSERT INTO journals (source, path, inode, offset, fingerprint)"
                            " VALUES (?, ?, ?, ?, ?) ON CONFLICT(source) DO UPDATE SET"
                            " path=excluded.path, inode=excluded.inode, offset=excluded.offset,"
                            " fingerprint=excluded.fingerprint",
                            (
                                position.source,
                                position.path,
                                position.inode,
                                position.offset,
                                position.fingerprint,
                            ),
                        )
            except sqlite3.Error as exc:
                self._head = None
                raise StoreError(f"{self.path}: cannot store audit records: {exc}") from None
            self._head = (seq, prev)
            return seq

    def checkpoint(self, now: float | None = None) -> int | None:
        """Sign the current head if it is not signed yet; returns the signed seq."""
        if self._key is None:
            raise StoreError(f"{self.path}: opened read-only")
        with self._lock:
            seq, digest = self._read_head()
            last = self._db.execute("SELECT MAX(seq) FROM checkpoints").fetchone()[0]
            if seq == 0 or (last is not None and last >= seq):
                return None
            created = _now_iso(now)
            message = self._checkpoint_message(seq, digest, created)
            signature = self._key.sign(message)
            kid = signing.key_id(self._key.public_key())
            try:
                with self._tx():
                    self._db.execute(
                        "INSERT INTO checkpoints (seq, hash, created, key_id, signature)"
                        " VALUES (?, ?, ?, ?, ?)",
                        (seq, digest, created, kid, signature),
                    )
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: cannot write a checkpoint: {exc}") from None
            return seq

    def _checkpoint_message(self, seq: int, digest: bytes, created: str) -> bytes:
        store_id = self.meta("store_id")
        return f"meshfn-audit-checkpoint\0{store_id}\0{seq}\0{digest.hex()}\0{created}".encode()

    def journal_position(self, source: str) -> JournalPosition | None:
        with self._lock:
            row = self._db.execute(
                "SELECT source, path, inode, offset, fingerprint FROM journals WHERE source=?",
                (source,),
            ).fetchone()
        if row is None:
            return None
        return JournalPosition(row[0], row[1], int(row[2]), int(row[3]), row[4])

    # ------------------------------------------------------------------ retention

    def apply_retention(self, days: int | None = None, now: float | None = None) -> int:
        """Delete records older than `days` (default: the store's retention) up to the newest
        checkpoint that is itself older than that, so what stays verifies from that checkpoint.
        Returns how many records were deleted."""
        if self.readonly:
            raise StoreError(f"{self.path}: opened read-only")
        days = self.retention_days if days is None else days
        cutoff = _now_iso(
            (time.time() if now is None else now) - timedelta(days=days).total_seconds()
        )
        with self._lock:
            anchor = int(self.meta("anchor_seq"))
            row = self._db.execute(
                "SELECT seq, hash FROM checkpoints WHERE created < ? ORDER BY seq DESC LIMIT 1",
                (cutoff,),
            ).fetchone()
            if row is None or int(row[0]) <= anchor:
                return 0
            seq, digest = int(row[0]), bytes(row[1])
            try:
                with self._tx():
                    # the anchor moves first: the delete triggers allow only what lies before it
                    self._db.execute("UPDATE meta SET value=? WHERE key='anchor_seq'", (str(seq),))
                    self._db.execute(
                        "UPDATE meta SET value=? WHERE key='anchor_hash'", (digest.hex(),)
                    )
                    deleted = self._db.execute(
                        "DELETE FROM records WHERE seq <= ?", (seq,)
                    ).rowcount
                    self._db.execute("DELETE FROM checkpoints WHERE seq < ?", (seq,))
                    self._db.execute(
                        "INSERT INTO meta (key, value) VALUES ('retention_days', ?)"
                        " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                        (str(days),),
                    )
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: retention failed: {exc}") from None
            self._head = None
            return int(deleted)

    # ------------------------------------------------------------------ reading

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM records").fetchone()[0])

    def query(
        self,
        *,
        since: str | None = None,
        until: str | None = None,
        subject: str | None = None,
        status: int | None = None,
        status_class: int | None = None,
        route: str | None = None,
        limit: int | None = 100,
    ) -> list[dict[str, Any]]:
        """Records matching every given filter, oldest first. Times are ISO 8601 UTC strings as
        the records carry them (`2026-01-31T12:00:00.000000Z`); `until` is exclusive."""
        where, args = [], []
        for clause, value in (
            ("time >= ?", since),
            ("time < ?", until),
            ("subject = ?", subject.lower() if subject else None),
            ("status = ?", status),
            ("route = ?", route),
        ):
            if value is not None:
                where.append(clause)
                args.append(value)
        if status_class is not None:
            where.append("status >= ? AND status < ?")
            args.extend([status_class * 100, status_class * 100 + 100])
        sql = "SELECT seq, record FROM records"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [{"seq": int(seq), **json.loads(body)} for seq, body in rows]

    # ------------------------------------------------------------------ verification

    def verify(
        self, public_key: Ed25519PublicKey | None = None, now: float | None = None
    ) -> VerifyReport:
        """Walk the chain and the checkpoints; report every problem found (up to 100)."""
        key = public_key
        if key is None:
            key = signing.load_public(signing.public_path(self.key_path))
        with self._lock:
            return _Verifier(self, key, now).run()


class _Verifier:
    def __init__(self, store: AuditStore, key: Ed25519PublicKey, now: float | None) -> None:
        self.store = store
        self.db = store._db
        self.key = key
        self.now = time.time() if now is None else now
        self.report = VerifyReport()
        self._by_hash: dict[bytes, int] | None = None
        self.reordered: set[int] = set()

    def problem(self, kind: str, seq: int | None, detail: str) -> None:
        if len(self.report.problems) >= _MAX_PROBLEMS:
            self.report.truncated_problems = True
            return
        self.report.problems.append(Problem(kind, seq, detail))

    def seq_of_hash(self, digest: bytes) -> int | None:
        """Which row carries this hash (built once, only when the chain is already broken)."""
        if self._by_hash is None:
            self._by_hash = {
                bytes(h): int(s) for s, h in self.db.execute("SELECT seq, hash FROM records")
            }
        return self._by_hash.get(digest)

    def run(self) -> VerifyReport:
        report = self.report
        anchor_seq = int(self.store.meta("anchor_seq"))
        anchor_hash = bytes.fromhex(self.store.meta("anchor_hash"))
        report.anchor_seq = anchor_seq
        checkpoints = self.check_checkpoints(anchor_seq, anchor_hash)

        expected_seq, expected_prev = anchor_seq + 1, anchor_hash
        hashes_at_checkpoints: dict[int, bytes] = {}
        cursor = self.db.execute("SELECT seq, record, prev, hash FROM records ORDER BY seq")
        while rows := cursor.fetchmany(5000):
            for seq, body, prev, digest in rows:
                report.records += 1
                if report.first_seq is None:
                    report.first_seq = seq
                report.last_seq = seq
                gap = seq > expected_seq
                if gap:
                    span = (
                        f"{expected_seq}"
                        if seq - expected_seq == 1
                        else f"{expected_seq}-{seq - 1}"
                    )
                    self.problem("deleted", expected_seq, f"records {span} are missing")
                if _link(prev, body.encode()) != digest:
                    self.problem(
                        "edited", seq, f"record {seq} does not match its hash (content changed)"
                    )
                if prev != expected_prev and not gap:
                    self.classify_break(seq, prev)
                if seq in checkpoints:
                    hashes_at_checkpoints[seq] = digest
                expected_seq, expected_prev = seq + 1, digest

        for seq, signed in sorted(checkpoints.items()):
            if seq <= anchor_seq:
                continue  # the retention anchor: its records are gone by design
            found = hashes_at_checkpoints.get(seq)
            if found is None:
                if report.last_seq is None or seq > report.last_seq:
                    self.problem(
                        "deleted",
                        seq,
                        f"checkpoint {seq} is signed but the store ends at {report.last_seq}:"
                        " records were deleted from the end",
                    )
            elif found != signed:
                self.problem(
                    "checkpoint",
                    seq,
                    f"record {seq} differs from what checkpoint {seq} signed: the chain up to"
                    " it was rewritten",
                )
        # A row with a made-up `prev` looks like "predecessor gone" until the next row shows the
        # chain skipping over it: then it was inserted, and nothing was deleted.
        inserted = {p.seq for p in report.problems if p.kind == "inserted"}
        report.problems = [
            p
            for p in report.problems
            if not (
                p.kind == "deleted" and p.detail.startswith("the record that") and p.seq in inserted
            )
        ]
        return report

    def classify_break(self, seq: int, prev: bytes) -> None:
        """Row `seq` does not follow the row before it: say how the order was broken."""
        origin = self.seq_of_hash(prev)
        if origin is None:
            self.problem(
                "deleted",
                seq,
                f"the record that preceded {seq} is gone (deleted, or edited together with its"
                " hash)",
            )
        elif origin > seq:
            self.reordered.update((seq, origin))
            self.problem("reordered", seq, f"record {seq} belongs after record {origin}")
        elif origin < seq - 1:
            if all(s in self.reordered for s in range(origin + 1, seq)):
                return  # the rows in between were already reported as moved
            span = f"{origin + 1}" if seq - 1 == origin + 1 else f"{origin + 1}-{seq - 1}"
            self.problem("inserted", origin + 1, f"records {span} were inserted into the chain")
        else:
            self.problem("reordered", seq, f"record {seq} is out of place")

    def check_checkpoints(self, anchor_seq: int, anchor_hash: bytes) -> dict[int, bytes]:
        report = self.report
        valid: dict[int, bytes] = {}
        anchor_ok = anchor_seq == 0 and anchor_hash == AuditStore._genesis(
            self.store.meta("store_id")
        )
        for seq, digest, created, _kid, signature in self.db.execute(
            "SELECT seq, hash, created, key_id, signature FROM checkpoints ORDER BY seq"
        ):
            message = self.store._checkpoint_message(seq, digest, created)
            report.checkpoints += 1
            if not signing.valid(self.key, bytes(signature), message):
                self.problem("signature", seq, f"checkpoint {seq} has an invalid signature")
                continue
            report.last_checkpoint_seq = seq
            valid[seq] = digest
            if seq == anchor_seq and digest == anchor_hash:
                anchor_ok = True
                self.check_retention_age(seq, created)
        if not anchor_ok:
            self.problem(
                "retention",
                anchor_seq,
                f"the chain starts after record {anchor_seq} but no valid signed checkpoint"
                " vouches for that starting point",
            )
        return valid

    def check_retention_age(self, seq: int, created: str) -> None:
        raw = self.db.execute("SELECT value FROM meta WHERE key='retention_days'").fetchone()
        days = int(raw[0]) if raw else self.store.retention_days
        made = datetime.strptime(created, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
        if made.timestamp() > self.now - timedelta(days=days).total_seconds() + 1:
            self.problem(
                "retention",
                seq,
                f"records up to {seq} were removed although checkpoint {seq} ({created}) is"
                f" younger than the {days}-day retention",
            )
