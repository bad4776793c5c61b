"""The audit store: one interface, two databases (SQLite embedded, PostgreSQL in a cluster).

Layout (the same tables on both):
- `records`: one hash chain PER JOURNAL (`chain` = the journal's source, a proxy's node id).
  Row `(chain, seq)` holds the canonical record, the previous hash and its own hash
  `h_seq = SHA-256(h_{seq-1} || canonical(record))` (offline.link), starting at
  `offline.chain_genesis(store_id, chain)`. Query columns are generated from the record JSON,
  so they can never disagree with what the chain covers; `verify` still checks every row's
  columns against its record, whatever the table's column definitions (a rebuilt table with
  ordinary columns could say anything).
- `checkpoints`: ed25519-signed documents naming the newest (seq, hash) of every chain that moved
  since the previous one, each linked to its predecessor (offline.py), with the retention the
  signer applies. Signed AND inserted by the signer (signer.py), which is not the writer and
  publishes each one to a witness outside the DB first. A checkpoint may witness a prune
  (`prune`: chain -> the record up to which retention may delete): the only thing that lets a
  chain's anchor move (a trigger checks it; `verify` checks it again against the witness).
- `journals`: how far each journal has been stored, written in the same transaction as the
  records read up to there. The update is a compare-and-swap on the position this store object
  last saw, so of two collectors racing on one journal exactly one stores each line, and a
  collector restarted mid-batch resumes where the last committed batch ended.
- `chains`: every chain ever written, with its retention anchor (records up to `anchor_seq` were
  deleted by retention; `anchor_hash` is the hash there, as a witnessed prune names it).
- `subjects`: the per-subject pseudonyms (crypto-shredding, see `erase`): records carry a random
  pseudonym, never the filter's HMAC of the subject; erasing a subject destroys its row.

Why a chain per journal and not one global order: a global order makes every insert of every
collector serialise on one head row, so the store's write rate is one transaction at a time
across the cluster; per-journal chains have one writer each (the compare-and-swap above), take
no lock shared between collectors, and name the journal of any break. The checkpoints bind the
chains together (a cross-checkpoint covers all of them), so dropping a whole chain or one
chain's tail is detected like a truncated single chain.

Append-only in the database itself (triggers), so a mistake cannot edit the trail; whoever
drops them is an attacker, and `verify` (verify.py) is for that case. On PostgreSQL each
component connects as its own role (roles.py): collectors cannot sign, insert checkpoints or drop
the triggers; the signer can only insert checkpoints; readers only read.

Retention is not the store's: the signer holds the retention setting, signs it into every
checkpoint and witnesses every prune (retention.py); the store only deletes what a witnessed
prune covers (`apply_prune`).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .checkpoint import Checkpoint, now_iso
from .offline import canonical, chain_genesis, link

SCHEMA = 3
# Schema 2 (before prunes were witnessed) is migrated in place by its owner (`migrate`).
MIGRATABLE = "2"
DEFAULT_RETENTION_DAYS = 730
DEFAULT_CHAIN = "local"
# Written by meshfn itself (erasures), never by a journal: sources may not start with "@".
CONTROL_CHAIN = "@control"
_PSEUDONYM = re.compile(r"^[0-9a-f]{32}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")

Row = tuple[Any, ...]
RecordRow = tuple[str, int, str, bytes, bytes, dict[str, Any]]
# seq, record, prev, hash, and whether the row's query columns agree with its record
VerifyRow = tuple[int, str, bytes, bytes, bool]
_QUERY_TAGS = ('"time":', '"subject":', '"status":', '"route":')
_json_string = json.encoder.encode_basestring_ascii


class StoreError(RuntimeError):
    """The store cannot be opened or written (full, read-only, unreachable, not a store...)."""


class StoreConflict(StoreError):
    """Another writer stored this journal's lines (or this chain's next records) first: reload
    the position and go on from there; nothing was written."""


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
class Anchor:
    """Where a chain starts after retention: records up to `seq` are gone, `hash` was theirs."""

    seq: int
    hash: bytes


@dataclass(frozen=True)
class Erasure:
    records: int  # records that carried the subject's pseudonym
    seq: int  # the erasure record in the control chain
    residue: tuple[str, ...] = ()  # what the database could not scrub (see _shred)
    pseudonyms: tuple[str, ...] = ()  # the destroyed pseudonyms (named by the erasure record)
    # The filter's HMACs of the subject the destroyed rows held: what must now go from the
    # journals too (collector.erase, access.redact_journals). Returned, never stored.
    hashes: tuple[str, ...] = ()


def query_columns(record: dict[str, Any]) -> tuple[str | None, str | None, int | None, str | None]:
    """time, subject, status, route as the query columns hold them: what the record says (a
    value of another type than the column's is NULL there, which verify reports)."""
    time_, subject, status, route = (
        record.get("time"),
        record.get("subject"),
        record.get("status"),
        record.get("route"),
    )
    return (
        time_ if type(time_) is str else None,
        subject if type(subject) is str else None,
        status if type(status) is int and -(2**31) <= status < 2**31 else None,
        route if type(route) is str else None,
    )


# The tables of both backends ({blob}, {int}, {serial}, {offset}: each backend's spelling).
TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chains (
    chain TEXT PRIMARY KEY,
    anchor_seq {int} NOT NULL DEFAULT 0,
    anchor_hash {blob} NOT NULL,
    anchor_checkpoint {int}
);
CREATE TABLE IF NOT EXISTS records (
    id {serial} PRIMARY KEY,
    chain TEXT NOT NULL,
    seq {int} NOT NULL,
    record TEXT NOT NULL,
    prev {blob} NOT NULL,
    hash {blob} NOT NULL,
    {query_columns}
);
CREATE UNIQUE INDEX IF NOT EXISTS records_chain_seq ON records (chain, seq);
CREATE INDEX IF NOT EXISTS records_time ON records (time);
CREATE INDEX IF NOT EXISTS records_subject ON records (subject);
CREATE INDEX IF NOT EXISTS records_route ON records (route);
CREATE TABLE IF NOT EXISTS checkpoints (
    n {int} PRIMARY KEY,
    body TEXT NOT NULL,
    signature {blob} NOT NULL,
    key_id TEXT NOT NULL,
    created TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_created ON checkpoints (created);
CREATE TABLE IF NOT EXISTS journals (
    source TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    inode {int} NOT NULL,
    {offset} {int} NOT NULL,
    fingerprint TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS subjects (
    salt_id TEXT NOT NULL,
    hash TEXT NOT NULL,
    pseudonym TEXT NOT NULL UNIQUE,
    PRIMARY KEY (salt_id, hash)
);
CREATE INDEX IF NOT EXISTS subjects_hash ON subjects (hash);
"""


def columns_agree(body: str, columns: tuple[Any, ...]) -> bool:
    """Whether a row's query columns (time, subject, status, route) say what its canonical
    record says, without parsing it: each value appears there as `"key":<JSON>` after `{` or
    `,` and before `,` or `}` (sorted keys, no spaces, ASCII; inside a string every quote is
    escaped, so `"key":` there is never matched). NULL: the key is absent or null."""
    for tag, value in zip(_QUERY_TAGS, columns, strict=True):
        at = body.find(tag)
        while at > 0 and body[at - 1] not in "{,":
            at = body.find(tag, at + 1)
        start = at + len(tag)
        if value is None:
            if at >= 0 and not body.startswith("null", start):
                return False
            continue
        text = _json_string(value) if type(value) is str else str(value)
        if at < 0 or not body.startswith(text, start):
            return False
        if body[start + len(text) : start + len(text) + 1] not in (",", "}"):
            return False
    return True


class AuditStore(ABC):
    """What collectors, the signer, the CLI and the console use. Thread-safe; one open store
    per process and database. `SqliteStore` and `PostgresStore` differ only in SQL dialect,
    connections and bulk insert; every rule (chain, compare-and-swap, retention, pseudonyms,
    erasure, verification) lives here, once."""

    location: str  # for messages (a DSN's password redacted)
    # what open_store() needs to open this store again, e.g. in a verify worker process (a DSN
    # may carry a password: never print it)
    open_location: str
    readonly: bool
    _store_id: str | None = None

    def __init__(self, *, readonly: bool) -> None:
        self.readonly = readonly
        self._lock = threading.RLock()
        self._heads: dict[str, tuple[int, bytes]] = {}
        self._positions: dict[str, JournalPosition | None] = {}
        self._pseudonyms: dict[tuple[str, str], str] = {}
        self._erasures: str | None = None

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    def _write(self) -> contextlib.AbstractContextManager[None]:
        """One write transaction (serialised with other writers where the backend must)."""

    @abstractmethod
    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        """Run one statement (`?` placeholders) and return its rows (empty for writes)."""

    @abstractmethod
    def _count(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Run one write statement and return how many rows it changed."""

    @abstractmethod
    def _insert_records(self, rows: list[RecordRow]) -> None:
        """Bulk-insert (chain, seq, record, prev, hash, the record as a dict) rows inside the
        current transaction."""

    @abstractmethod
    def _lock_erasures(self, exclusive: bool) -> str:
        """Read the erasure counter, serialising appends (shared) against erasures (exclusive)."""

    @abstractmethod
    def _shred(self) -> list[str]:
        """After an erasure committed: make the deleted rows unrecoverable from the database's
        files (and so from backups taken from now on). Returns what could not be done."""

    @abstractmethod
    def _migrate(self) -> None:
        """Inside a write transaction: bring a schema-2 store's triggers to this schema."""

    @abstractmethod
    def close(self) -> None: ...

    def _start_chain(self, chain: str, genesis: bytes) -> None:
        """Record a chain's first use (its anchor: the genesis hash), inside the transaction
        that stores its first records."""
        self._rows(
            "INSERT INTO chains (chain, anchor_seq, anchor_hash) VALUES (?, 0, ?)"
            " ON CONFLICT(chain) DO NOTHING",
            (chain, genesis),
        )

    def _upsert(self, table: str, keys: Sequence[str], values: dict[str, Any]) -> None:
        columns = list(values)
        updates = ", ".join(f"{c}=excluded.{c}" for c in columns if c not in keys)
        self._rows(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
            f" ON CONFLICT({', '.join(keys)}) DO UPDATE SET {updates}",
            list(values.values()),
        )

    def _must_write(self) -> None:
        if self.readonly:
            raise StoreError(f"{self.location}: opened read-only")

    # ------------------------------------------------------------------ meta

    def _init_meta(self) -> None:
        with self._write():
            have: dict[Any, Any] = dict(self._rows("SELECT key, value FROM meta"))
            if "store_id" not in have:
                for key, value in (
                    ("schema", str(SCHEMA)),
                    ("store_id", secrets.token_hex(16)),
                    ("created", now_iso()),
                    ("erasures", "0"),
                ):
                    self._rows(
                        "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO NOTHING",
                        (key, value),
                    )

    def _schema(self) -> str | None:
        row = self._rows("SELECT value FROM meta WHERE key='schema'")
        return str(row[0][0]) if row else None

    def _check_schema(self) -> None:
        found = self._schema()
        if found is None:
            raise StoreError(f"{self.location}: not an audit store (no schema)")
        if found == MIGRATABLE:
            raise StoreError(
                f"{self.location}: an audit store of schema {found}, this meshfn reads schema"
                f" {SCHEMA}: migrate it in place with `meshfn audit init --store STORE` (as the"
                " store's owner; `meshfn up` does it on start)"
            )
        if found != str(SCHEMA):
            raise StoreError(
                f"{self.location}: an audit store of schema {found}, this meshfn reads"
                f" schema {SCHEMA}: keep it (the meshfn that wrote it still verifies it) and"
                " start a new store"
            )

    def migrate(self) -> bool:
        """Bring a schema-2 store to this schema (its owner only: new triggers, and the
        retention the store kept itself dropped: the signer's is signed). True if it did."""
        self._must_write()
        with self._lock, self._write():
            if self._schema() != MIGRATABLE:
                return False
            self._migrate()
            self._count("DELETE FROM meta WHERE key IN ('retention_days', 'checkpoint_floor')")
            self._count("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA),))
        return True

    def meta(self, key: str) -> str:
        with self._lock:
            rows = self._rows("SELECT value FROM meta WHERE key=?", (key,))
        if not rows:
            raise StoreError(f"{self.location}: meta {key} missing")
        return str(rows[0][0])

    @property
    def store_id(self) -> str:
        if self._store_id is None:
            self._store_id = self.meta("store_id")
        return self._store_id

    # ------------------------------------------------------------------ chains

    def chains(self) -> dict[str, Anchor]:
        """Every chain with its retention anchor (seq 0 and the genesis hash if none)."""
        with self._lock:
            rows = self._rows("SELECT chain, anchor_seq, anchor_hash FROM chains ORDER BY chain")
        return {str(c): Anchor(int(s), bytes(h)) for c, s, h in rows}

    def head(self, chain: str = DEFAULT_CHAIN) -> tuple[int, bytes]:
        """(seq, hash) of the chain's newest record, or its anchor when it has none."""
        with self._lock:
            return self._read_head(chain)

    def heads(self) -> dict[str, tuple[int, bytes]]:
        """Every chain's head, read fresh (what the signer checkpoints)."""
        with self._lock:
            return {chain: self._read_head(chain, fresh=True) for chain in self.chains()}

    def _read_head(self, chain: str, fresh: bool = False) -> tuple[int, bytes]:
        if fresh or chain not in self._heads:
            # max() on the (chain, seq) index, then one lookup: ORDER BY ... LIMIT 1 let
            # PostgreSQL without statistics sort the whole chain
            rows = self._rows(
                "SELECT seq, hash FROM records WHERE chain=?"
                " AND seq=(SELECT MAX(seq) FROM records WHERE chain=?)",
                (chain, chain),
            )
            if rows:
                self._heads[chain] = (int(rows[0][0]), bytes(rows[0][1]))
            else:
                anchor = self._rows(
                    "SELECT anchor_seq, anchor_hash FROM chains WHERE chain=?", (chain,)
                )
                self._heads[chain] = (
                    (int(anchor[0][0]), bytes(anchor[0][1]))
                    if anchor
                    else (0, chain_genesis(self.store_id, chain))
                )
        return self._heads[chain]

    def _pages(self, columns: str, chain: str, seq: int, batch: int) -> Iterator[list[Row]]:
        """`columns` of the chain's records after `seq`, in order, in batches (keyset
        pagination: no cursor stays open between them); the first column is seq."""
        while True:
            with self._lock:
                rows = self._rows(
                    f"SELECT {columns} FROM records WHERE chain=? AND seq>? ORDER BY seq LIMIT ?",
                    (chain, seq, batch),
                )
            yield rows
            if len(rows) < batch:
                return
            seq = int(rows[-1][0])

    def records_after(
        self, chain: str, seq: int, batch: int = 5000
    ) -> Iterator[tuple[int, str, bytes, bytes]]:
        """(seq, record, prev, hash) of the chain's records after `seq`, in order."""
        for rows in self._pages("seq, record, prev, hash", chain, seq, batch):
            yield from rows

    def checked_records_after(self, chain: str, seq: int, batch: int = 5000) -> Iterator[VerifyRow]:
        """`records_after`, and whether each row's query columns agree with its record."""
        for rows in self.record_batches(chain, seq, batch):
            yield from rows

    def record_batches(self, chain: str, seq: int, batch: int = 5000) -> Iterator[list[VerifyRow]]:
        """The rows of `checked_records_after` in batches as the database returns them (both
        drivers return ints, str and bytes for these columns). The query columns are read as
        the table holds them and checked against the record (columns_agree), whatever the
        table's column definitions say: a table rebuilt with ordinary columns is caught."""
        for rows in self._pages(
            "seq, record, prev, hash, time, subject, status, route", chain, seq, batch
        ):
            yield [(r[0], r[1], r[2], r[3], columns_agree(r[1], r[4:])) for r in rows]

    # ------------------------------------------------------------------ writing

    def append(
        self,
        records: Sequence[dict[str, Any]],
        position: JournalPosition | None = None,
        chain: str | None = None,
    ) -> int:
        """Chain and store `records` (in chain `chain`, default: the position's source) and,
        atomically, the journal position they were read up to. The position is compared with
        the one this store last read or wrote for that source: if another writer moved it,
        StoreConflict and nothing is stored. Subject hashes become pseudonyms (see `erase`).
        Returns the chain's new head seq. Raises StoreError and stores nothing on failure."""
        self._must_write()
        chain = chain or (position.source if position is not None else DEFAULT_CHAIN)
        if chain.startswith("@") and chain != CONTROL_CHAIN:
            raise StoreError(f"chain names starting with '@' are meshfn's own: {chain!r}")
        # A journal's chain has one writer (the compare-and-swap on its position); the control
        # chain has several (the control plane, CLI commands, the console): its head is read in
        # the transaction, and a racing writer's rows only mean "try again".
        tries = 3 if chain == CONTROL_CHAIN and position is None else 1
        for attempt in range(tries):
            with self._lock:
                try:
                    with self._write():
                        return self._append(records, position, chain)
                except BaseException as exc:
                    self._heads.pop(chain, None)
                    if position is not None:
                        self._positions.pop(position.source, None)
                    # pseudonyms made in the rolled-back transaction were never stored: a record
                    # carrying one later would be linked to no subject
                    self._pseudonyms.clear()
                    if not isinstance(exc, StoreConflict) or attempt + 1 == tries:
                        raise
        raise AssertionError("unreachable")

    def _append(
        self, records: Sequence[dict[str, Any]], position: JournalPosition | None, chain: str
    ) -> int:
        if records:
            epoch = self._lock_erasures(exclusive=False)
            if epoch != self._erasures:  # someone erased a subject: forget every pseudonym
                self._pseudonyms.clear()
                self._erasures = epoch
            records = self._pseudonymise(records)
        if position is not None:
            self._move_position(position)
        seq, prev = self._read_head(chain, fresh=chain == CONTROL_CHAIN)
        if seq == 0 and records:
            self._start_chain(chain, prev)
        rows = []
        for record in records:
            body = canonical(record)
            digest = link(prev, body)
            seq += 1
            rows.append((chain, seq, body.decode("ascii"), prev, digest, record))
            prev = digest
        if rows:
            self._insert_records(rows)  # a racing writer's rows make the (chain, seq) key clash
        self._heads[chain] = (seq, prev)
        return seq

    def _move_position(self, position: JournalPosition) -> None:
        if position.source not in self._positions:
            self._positions[position.source] = self._load_position(position.source)
        seen = self._positions[position.source]
        values = (position.path, position.inode, position.offset, position.fingerprint)
        if seen is None:
            changed = self._count(
                "INSERT INTO journals (source, path, inode, offset, fingerprint)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT(source) DO NOTHING",
                (position.source, *values),
            )
        else:
            changed = self._count(
                "UPDATE journals SET path=?, inode=?, offset=?, fingerprint=?"
                " WHERE source=? AND inode=? AND offset=? AND fingerprint=?",
                (*values, seen.source, seen.inode, seen.offset, seen.fingerprint),
            )
        if changed != 1:
            raise StoreConflict(
                f"journal {position.source}: another collector stored it first (position moved"
                " since this collector read it)"
            )
        self._positions[position.source] = position

    def _load_position(self, source: str) -> JournalPosition | None:
        rows = self._rows(
            "SELECT source, path, inode, offset, fingerprint FROM journals WHERE source=?",
            (source,),
        )
        if not rows:
            return None
        s, p, i, o, f = rows[0]
        return JournalPosition(str(s), str(p), int(i), int(o), str(f))

    def journal_positions(self) -> list[JournalPosition]:
        """Every journal's stored position (what an offline erasure checks its redactions
        against)."""
        with self._lock:
            rows = self._rows("SELECT source FROM journals ORDER BY source")
        return [p for (source,) in rows if (p := self.journal_position(str(source))) is not None]

    def journal_position(self, source: str) -> JournalPosition | None:
        """The stored position, read fresh (and remembered as what the next append moves)."""
        with self._lock:
            found = self._load_position(source)
            self._positions[source] = found
            return found

    def add_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep a checkpoint the signer made (its witness already has it)."""
        self._must_write()
        with self._lock, self._write():
            self._rows(
                "INSERT INTO checkpoints (n, body, signature, key_id, created)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT(n) DO NOTHING",
                (
                    checkpoint.n,
                    checkpoint.body.decode("ascii"),
                    checkpoint.signature,
                    checkpoint.key_id,
                    checkpoint.time,
                ),
            )

    def last_checkpoint(self) -> int:
        with self._lock:
            rows = self._rows("SELECT MAX(n) FROM checkpoints")
        return int(rows[0][0] or 0)

    def checkpoints(self, since_n: int = 0) -> list[Checkpoint]:
        with self._lock:
            rows = self._rows(
                "SELECT body, signature, key_id FROM checkpoints WHERE n>? ORDER BY n", (since_n,)
            )
        return [Checkpoint(str(b).encode("ascii"), bytes(s), str(k)) for b, s, k in rows]

    # ------------------------------------------------------------------ subjects

    def _pseudonymise(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        wanted = {
            (str(r.get("salt_id") or ""), str(r["subject"]))
            for r in records
            if isinstance(r.get("subject"), str) and _HASH.match(r["subject"])
        }
        missing = [key for key in wanted if key not in self._pseudonyms]
        for salt_id, digest in missing:
            self._rows(
                "INSERT INTO subjects (salt_id, hash, pseudonym) VALUES (?, ?, ?)"
                " ON CONFLICT(salt_id, hash) DO NOTHING",
                (salt_id, digest, secrets.token_hex(16)),
            )
            found = self._rows(
                "SELECT pseudonym FROM subjects WHERE salt_id=? AND hash=?", (salt_id, digest)
            )
            self._pseudonyms[(salt_id, digest)] = str(found[0][0])
        out = []
        for record in records:
            subject = record.get("subject")
            if isinstance(subject, str) and _HASH.match(subject):
                key = (str(record.get("salt_id") or ""), subject)
                out.append({**record, "subject": self._pseudonyms[key]})
            else:
                out.append(record)
        return out

    def pseudonyms(self, subject: str) -> list[str]:
        """The pseudonyms records carry for a subject given as the filter's HMAC (64 hex digits,
        any salt) or as a pseudonym (32 hex digits, returned as is)."""
        subject = subject.lower()
        if _PSEUDONYM.match(subject):
            return [subject]
        if not _HASH.match(subject):
            raise StoreError("a subject is 64 hex digits (HMAC) or 32 (pseudonym)")
        with self._lock:
            rows = self._rows("SELECT pseudonym FROM subjects WHERE hash=?", (subject,))
        return [str(r[0]) for r in rows]

    def erase(
        self,
        subject: str,
        now: float | None = None,
        principal: str | None = None,
        via: str | None = None,
    ) -> Erasure | None:
        """GDPR Art. 17 by crypto-shredding: delete the subject's pseudonym row, so the records
        that carry the pseudonym (unchanged: the chain still verifies) can no longer be linked
        to the subject, not even with the salt and the raw subject, here or in backups taken
        from now on. Appends an erasure record to the control chain: who erased (`principal`,
        `via`), when, the destroyed pseudonyms and how many records carried them; never the
        subject or its HMAC. `subject`: the filter's HMAC (64 hex) or a pseudonym (32 hex).
        None: no such subject, nothing changed. The journals still hold the HMAC: the
        collector (online) or access.redact_journals (offline) redacts them."""
        self._must_write()
        subject = subject.lower()
        column = "pseudonym" if _PSEUDONYM.match(subject) else "hash"
        if column == "hash" and not _HASH.match(subject):
            raise StoreError("a subject is 64 hex digits (HMAC) or 32 (pseudonym)")
        with self._lock:
            with self._write():
                self._lock_erasures(exclusive=True)
                rows = self._rows(
                    f"SELECT salt_id, hash, pseudonym FROM subjects WHERE {column}=?", (subject,)
                )
                if not rows:
                    return None
                pseudonyms = [str(r[2]) for r in rows]
                count = 0
                for pseudonym in pseudonyms:
                    count += int(
                        self._rows("SELECT COUNT(*) FROM records WHERE subject=?", (pseudonym,))[0][
                            0
                        ]
                    )
                self._count(f"DELETE FROM subjects WHERE {column}=?", (subject,))
                epoch = str(
                    int(self._rows("SELECT value FROM meta WHERE key='erasures'")[0][0]) + 1
                )
                self._count("UPDATE meta SET value=? WHERE key='erasures'", (epoch,))
                event: dict[str, Any] = {
                    "v": 2,
                    "event": "erasure",
                    "action": "erase",
                    "time": now_iso(now),
                    "records": count,
                    "pseudonyms": sorted(pseudonyms),
                }
                if principal is not None:
                    event["principal"] = principal
                if via is not None:
                    event["via"] = via
                seq = self._append([event], None, CONTROL_CHAIN)
            self._pseudonyms.clear()
            self._erasures = None
            hashes = tuple(sorted({str(r[1]) for r in rows}))
            return Erasure(count, seq, tuple(self._shred()), tuple(sorted(pseudonyms)), hashes)

    # ------------------------------------------------------------------ retention

    def apply_prune(self, points: dict[str, tuple[int, bytes, int]]) -> int:
        """Delete what prunes the signer witnessed cover: `points` maps a chain to (seq, hash,
        checkpoint n), records up to seq go and the chain starts after them. The anchor moves
        first (a trigger lets it move only to a point that stored checkpoint n's `prune` names;
        the delete trigger lets only what lies before the anchor go). Returns how many records
        were deleted."""
        self._must_write()
        with self._lock:
            anchors = self.chains()
            deleted = 0
            with self._write():
                for chain, (seq, digest, n) in sorted(points.items()):
                    anchor = anchors.get(chain)
                    if anchor is None or seq <= anchor.seq:
                        continue
                    self._count(
                        "UPDATE chains SET anchor_seq=?, anchor_hash=?, anchor_checkpoint=?"
                        " WHERE chain=?",
                        (seq, digest, n, chain),
                    )
                    deleted += self._count(
                        "DELETE FROM records WHERE chain=? AND seq<=?", (chain, seq)
                    )
                    self._heads.pop(chain, None)
            return deleted

    # ------------------------------------------------------------------ reading

    def count(self, chain: str | None = None) -> int:
        with self._lock:
            if chain is None:
                return int(self._rows("SELECT COUNT(*) FROM records")[0][0])
            return int(self._rows("SELECT COUNT(*) FROM records WHERE chain=?", (chain,))[0][0])

    def query(
        self,
        *,
        since: str | None = None,
        until: str | None = None,
        subject: str | None = None,
        status: int | None = None,
        status_class: int | None = None,
        route: str | None = None,
        chain: str | None = None,
        limit: int | None = 100,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]:
        """Records matching every given filter, in the order they were stored (`newest_first`:
        the reverse, so `limit` keeps the newest), each with its `chain` and `seq`. Times are ISO 8601 UTC strings as the records carry them
        (`2026-01-31T12:00:00.000000Z`); `until` is exclusive. `subject`: the filter's HMAC of
        the subject (64 hex) or a pseudonym (32 hex)."""
        where, args = [], []
        for clause, value in (
            ("time >= ?", since),
            ("time < ?", until),
            ("status = ?", status),
            ("route = ?", route),
            ("chain = ?", chain),
        ):
            if value is not None:
                where.append(clause)
                args.append(value)
        if subject is not None:
            names = self.pseudonyms(subject)
            if not names:
                return []
            where.append(f"subject IN ({', '.join('?' * len(names))})")
            args.extend(names)
        if status_class is not None:
            where.append("status >= ? AND status < ?")
            args.extend([status_class * 100, status_class * 100 + 100])
        sql = "SELECT chain, seq, record FROM records"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC" if newest_first else " ORDER BY id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        with self._lock:
            rows = self._rows(sql, args)
        return [{"chain": str(c), "seq": int(s), **json.loads(body)} for c, s, body in rows]

    def unlinked(self, sample: int = 5) -> tuple[int, list[tuple[str, int]]]:
        """Records whose subject is a pseudonym the subjects table no longer maps (an erasure
        does that, and records it): how many, and the first few (chain, seq). Counted per
        pseudonym on the subject index, so it costs a scan of the index, not of the records."""
        with self._lock:
            gone = self._rows(
                "SELECT g.subject, g.n FROM (SELECT subject, COUNT(*) AS n FROM records"
                " WHERE subject IS NOT NULL GROUP BY subject) g WHERE length(g.subject) = 32"
                " AND NOT EXISTS (SELECT 1 FROM subjects s WHERE s.pseudonym = g.subject)"
            )
            if not gone:
                return 0, []
            names = [str(p) for p, _ in gone][:sample]
            rows = self._rows(
                f"SELECT chain, seq FROM records WHERE subject IN ({', '.join('?' * len(names))})"
                " ORDER BY id LIMIT ?",
                (*names, sample),
            )
        return sum(int(n) for _, n in gone), [(str(c), int(q)) for c, q in rows]

    def erased(self) -> int:
        """How many records the erasure records of the control chain say they unlinked."""
        return sum(
            int(r.get("records") or 0)
            for r in self.query(chain=CONTROL_CHAIN, limit=None)
            if r.get("event") == "erasure"
        )

    def records_since(self, chain: str, since: str) -> int | None:
        """The first seq of `chain` whose record time is at or after `since`."""
        with self._lock:
            rows = self._rows(
                "SELECT MIN(seq) FROM records WHERE chain=? AND time >= ?", (chain, since)
            )
        return int(rows[0][0]) if rows and rows[0][0] is not None else None
