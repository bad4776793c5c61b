"""The cluster audit store: PostgreSQL, written by many collectors at once.

Driver: psycopg 3 (not asyncpg): the store is called from worker threads by synchronous code
(the collector's ticks, the CLI, the signer), which psycopg serves natively without an event
loop per thread; it has COPY for bulk inserts (the collector's batches), server-side
parameters, and a C implementation (`psycopg[binary]`, libpq bundled) that is as fast as
asyncpg for this workload.

Concurrency: each collector writes its own chains; its transaction compare-and-swaps the
journal position and inserts `(chain, seq)` rows that a racing writer's rows would clash with
(UNIQUE), so exactly one of two racing writers commits a batch. Appends take a shared lock on
the erasure counter and an erasure an exclusive one, so a collector never keeps using a
pseudonym that an erasure has just destroyed (advisory locks: a row lock would need UPDATE
on meta, which collectors do not get).

Roles (roles.py): the schema belongs to its owner, who creates and migrates it (`meshfn audit
init`); collectors, the signer and readers connect as their own roles, which may not run DDL,
so this store creates or migrates the schema only when it finds it missing or old and is
allowed to, and otherwise says who must. The triggers are then a second line behind the grants
(a collector's role cannot drop them), not the only one.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import errors

from .store import (
    CONTROL_CHAIN,
    MIGRATABLE,
    SCHEMA,
    TABLES,
    AuditStore,
    RecordRow,
    Row,
    StoreConflict,
    StoreError,
    VerifyRow,
    columns_agree,
    query_columns,
)

# VACUUM VERBOSE's detail line for rows an open snapshot still sees (English messages)
_KEPT = re.compile(r"(\d+) dead row versions? cannot be removed yet")
_SCHEMA_LOCK = (
    0x6D657368666E  # "meshfn": serialises schema creation by collectors starting together
)
_ERASURE_LOCK = 0x6D657368666F  # appends share it, an erasure takes it alone

# Query columns filled by the writer from the record it chains (PostgreSQL parsing the JSON for
# generated columns doubled the cost of an insert); verify checks they agree (columns_agree).
_QUERY_COLUMNS = "time TEXT, subject TEXT, status INTEGER, route TEXT"
_DDL = (
    TABLES.format(
        blob="BYTEA",
        int="BIGINT",
        serial="BIGSERIAL",
        offset='"offset"',
        query_columns=_QUERY_COLUMNS,
    )
    + """
CREATE OR REPLACE FUNCTION meshfn_audit_records_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        RAISE EXCEPTION 'audit records are append-only';
    END IF;
    IF OLD.seq > COALESCE((SELECT anchor_seq FROM chains WHERE chain = OLD.chain), 0) THEN
        RAISE EXCEPTION 'audit records are append-only (retention deletes them)';
    END IF;
    RETURN OLD;
END $$;
CREATE OR REPLACE FUNCTION meshfn_audit_checkpoints_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit checkpoints are append-only';
END $$;
-- A chain starts at record 0, is never deleted, and its anchor moves only to a point that the
-- stored checkpoint it names (anchor_checkpoint: one lookup) lists in its prune (the signer's
-- witnessed prune; only the signer's role inserts checkpoints).
CREATE OR REPLACE FUNCTION meshfn_audit_chains_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'audit chains are never deleted';
    END IF;
    IF TG_OP = 'INSERT' THEN
        IF NEW.anchor_seq <> 0 THEN
            RAISE EXCEPTION 'audit chains start at record 0';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.chain <> OLD.chain OR (
        (NEW.anchor_seq, NEW.anchor_hash) IS DISTINCT FROM (OLD.anchor_seq, OLD.anchor_hash)
        AND NOT EXISTS (
            SELECT 1 FROM checkpoints WHERE n = NEW.anchor_checkpoint
            AND body::jsonb -> 'prune' -> NEW.chain
                = jsonb_build_array(NEW.anchor_seq, encode(NEW.anchor_hash, 'hex')))) THEN
        RAISE EXCEPTION 'audit chains: the anchor moves only to a prune the signer witnessed';
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE FUNCTION meshfn_audit_no_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the audit trail is never truncated';
END $$;
CREATE OR REPLACE TRIGGER records_append_only BEFORE UPDATE OR DELETE ON records
    FOR EACH ROW EXECUTE FUNCTION meshfn_audit_records_guard();
CREATE OR REPLACE TRIGGER checkpoints_append_only BEFORE UPDATE OR DELETE ON checkpoints
    FOR EACH ROW EXECUTE FUNCTION meshfn_audit_checkpoints_guard();
CREATE OR REPLACE TRIGGER chains_guarded BEFORE INSERT OR UPDATE OR DELETE ON chains
    FOR EACH ROW EXECUTE FUNCTION meshfn_audit_chains_guard();
CREATE OR REPLACE TRIGGER records_no_truncate BEFORE TRUNCATE ON records
    FOR EACH STATEMENT EXECUTE FUNCTION meshfn_audit_no_truncate();
CREATE OR REPLACE TRIGGER checkpoints_no_truncate BEFORE TRUNCATE ON checkpoints
    FOR EACH STATEMENT EXECUTE FUNCTION meshfn_audit_no_truncate();
CREATE OR REPLACE TRIGGER chains_no_truncate BEFORE TRUNCATE ON chains
    FOR EACH STATEMENT EXECUTE FUNCTION meshfn_audit_no_truncate();
"""
    + "\n"
)

# The control chain's one way in for a role that may not insert records: the auditor's (roles.py),
# whose reads of personal data must each leave an access record. The function runs with its
# owner's rights, appends to the control chain only, and only a record that links to the chain's
# head (prev is the head's hash, or the genesis for the first; hash = SHA-256(prev || record)):
# an auditor's role can record its reads, not write a journal's chain or a broken link. Part of
# the schema; `meshfn audit init` applies it again (stores created before it had none).
CONTROL_SIGNATURE = "meshfn_audit_append_control(bigint, text, bytea, bytea, text)"
CONTROL_DDL = f"""
CREATE OR REPLACE FUNCTION meshfn_audit_append_control(
    p_seq BIGINT, p_record TEXT, p_prev BYTEA, p_hash BYTEA, p_time TEXT
) RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
    IF p_hash <> sha256(p_prev || convert_to(p_record, 'UTF8')) THEN
        RAISE EXCEPTION 'a control record must hash as the chain links it';
    END IF;
    IF p_seq = 1 THEN
        INSERT INTO chains (chain, anchor_seq, anchor_hash) VALUES ('{CONTROL_CHAIN}', 0, p_prev)
            ON CONFLICT (chain) DO NOTHING;
        IF p_prev <> (SELECT anchor_hash FROM chains WHERE chain = '{CONTROL_CHAIN}') THEN
            RAISE EXCEPTION 'the first control record must link to the chain''s genesis';
        END IF;
    ELSIF p_prev IS DISTINCT FROM (
        SELECT hash FROM records WHERE chain = '{CONTROL_CHAIN}' AND seq = p_seq - 1
    ) THEN
        RAISE EXCEPTION 'a control record must link to the head of the control chain';
    END IF;
    INSERT INTO records (chain, seq, record, prev, hash, time)
        VALUES ('{CONTROL_CHAIN}', p_seq, p_record, p_prev, p_hash, p_time);
END $$;
REVOKE ALL ON FUNCTION {CONTROL_SIGNATURE} FROM PUBLIC;
"""
_DDL += CONTROL_DDL


def _redacted(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "postgresql://(unparseable DSN)"
    host = info.get("host", "")
    port = f":{info['port']}" if info.get("port") else ""
    user = f"{info['user']}@" if info.get("user") else ""
    return f"postgresql://{user}{host}{port}/{info.get('dbname', '')}"


class PostgresStore(AuditStore):
    # How long an erasure waits for transactions older than it to end (_vacuum_subjects).
    shred_patience = 10.0

    def __init__(
        self,
        dsn: str,
        *,
        readonly: bool = False,
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__(readonly=readonly)
        self.dsn = self.open_location = dsn
        self.location = _redacted(dsn)
        self.connect_timeout = connect_timeout
        self._conn: psycopg.Connection[Any] | None = None
        self._tx: psycopg.Transaction | None = None
        with self._lock:
            self._connection()
            if not readonly and self._found_schema() != str(SCHEMA):
                self.create_schema()
            self._check_schema()

    def _found_schema(self) -> str | None:
        """The schema version, or None where there is no audit store yet."""
        exists = self._rows("SELECT to_regclass('meta') IS NOT NULL")
        return self._schema() if exists and exists[0][0] else None

    def create_schema(self) -> None:
        """Create the tables and triggers, or migrate a schema-2 store: the owner's job (other
        roles may not run DDL, and are told who must)."""
        try:
            with self._write():
                self._rows("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
                self._execute_script(_DDL)
            self._init_meta()
            if self._schema() == MIGRATABLE:
                self.migrate()
        except StoreError as exc:
            if "permission denied" not in str(exc) and "must be owner" not in str(exc):
                raise
            raise StoreError(
                f"{self.location}: the audit store's schema is missing or old, and this role"
                " may not create it: run `meshfn audit init --store OWNER_DSN` as the database"
                f" owner first ({exc})"
            ) from None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            try:
                self._conn = psycopg.connect(
                    self.dsn,
                    autocommit=True,
                    connect_timeout=max(1, int(self.connect_timeout)),
                    application_name="meshfn-audit",
                )
                if self.readonly:
                    self._conn.execute("SET default_transaction_read_only = on")
            except psycopg.Error as exc:
                self._conn = None
                raise StoreError(f"{self.location}: cannot connect: {_message(exc)}") from None
        return self._conn

    def _execute_script(self, script: str) -> None:
        with self._errors("cannot create the schema"):
            self._connection().execute(script.encode())

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except errors.UniqueViolation as exc:
            raise StoreConflict(
                f"{self.location}: {what}: another writer was first ({_message(exc)})"
            ) from None
        except psycopg.OperationalError as exc:
            self._drop()
            raise StoreError(f"{self.location}: {what}: {_message(exc)}") from None
        except psycopg.Error as exc:
            raise StoreError(f"{self.location}: {what}: {_message(exc)}") from None

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None
        self._tx = None

    @contextlib.contextmanager
    def session(self) -> Iterator[psycopg.Connection[Any]]:
        """This store's connection inside one transaction (the owner's grants: roles.py)."""
        with self._lock, self._errors("cannot set the roles"):
            conn = self._connection()
            with conn.transaction():
                yield conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        with self._lock, self._errors("cannot store audit records"):
            conn = self._connection()
            with conn.transaction() as tx:
                self._tx = tx
                try:
                    yield
                finally:
                    self._tx = None

    @staticmethod
    def _sql(sql: str) -> bytes:
        return sql.replace("offset", '"offset"').replace("?", "%s").encode()

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._lock, self._errors("query failed"):
            cursor = self._connection().execute(self._sql(sql), tuple(args), prepare=True)
            return cursor.fetchall() if cursor.description else []

    def _count(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._lock, self._errors("write failed"):
            return int(self._connection().execute(self._sql(sql), tuple(args)).rowcount)

    def record_batches(self, chain: str, seq: int, batch: int = 5000) -> Iterator[list[VerifyRow]]:
        """One streamed query (a server-side cursor on its own connection, in one snapshot)
        instead of keyset pages: without fresh statistics the planner sorts every remaining
        row for each LIMIT page, which made a whole-chain read quadratic."""
        try:
            conn = psycopg.connect(self.dsn, connect_timeout=max(1, int(self.connect_timeout)))
        except psycopg.Error as exc:
            raise StoreError(f"{self.location}: cannot connect: {_message(exc)}") from None
        try:
            with self._errors("query failed"), conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                # walk the (chain, seq) index in order; without statistics the planner would
                # sort the whole chain (on disk, for a large one) before the first row
                conn.execute("SET LOCAL enable_sort = off")
                conn.execute("SET LOCAL enable_bitmapscan = off")
                with conn.cursor(name="meshfn_audit_records", binary=True) as cursor:
                    cursor.execute(
                        b"SELECT seq, record, prev, hash, time, subject, status, route FROM records"
                        b" WHERE chain = %s AND seq > %s ORDER BY seq",
                        (chain, seq),
                    )
                    while rows := cursor.fetchmany(batch):
                        yield [(r[0], r[1], r[2], r[3], columns_agree(r[1], r[4:])) for r in rows]
        finally:
            conn.close()

    def _start_chain(self, chain: str, genesis: bytes) -> None:
        if chain != CONTROL_CHAIN:  # the control chain: meshfn_audit_append_control does it
            super()._start_chain(chain, genesis)

    def _insert_records(self, rows: list[RecordRow]) -> None:
        if rows and all(row[0] == CONTROL_CHAIN for row in rows):
            for _, seq, body, prev, digest, record in rows:
                self._rows(
                    "SELECT meshfn_audit_append_control(?, ?, ?, ?, ?)",
                    (seq, body, prev, digest, query_columns(record)[0]),
                )
            return
        with (
            self._errors("cannot store audit records"),
            self._connection().cursor() as cursor,
            cursor.copy(
                "COPY records (chain, seq, record, prev, hash, time, subject, status, route)"
                " FROM STDIN (FORMAT BINARY)"
            ) as copy,
        ):
            copy.set_types(
                ["text", "int8", "text", "bytea", "bytea", "text", "text", "int4", "text"]
            )
            for row in rows:
                copy.write_row((*row[:5], *query_columns(row[5])))

    def _migrate(self) -> None:
        # schema 2's checkpoint guard allowed deletes below a floor the writer set: the DDL
        # above replaced it (CREATE OR REPLACE); the new chain guard came with it
        pass

    def _lock_erasures(self, exclusive: bool) -> str:
        lock = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
        self._rows(f"SELECT {lock}(?)", (_ERASURE_LOCK,))
        return str(self._rows("SELECT value FROM meta WHERE key='erasures'")[0][0])

    def _shred(self) -> list[str]:
        """DELETE leaves the row's bytes in the heap and index pages until they are reused, and
        in the write-ahead log. So, once the erasure has committed:
        1. VACUUM FULL rewrites the subjects table and its indexes without the row. It keeps a
           dead row that a transaction older than the erasure can still see (a reader's
           snapshot: the row versions a reader could still see), so it is repeated, for up to
           10 s, until it reports no such row left;
        2. pg_switch_wal() and CHECKPOINT end the WAL segments that logged the row's insert, and
           PostgreSQL removes them at the checkpoint. With `wal_recycle = on` (its default) it
           renames them for reuse instead, and their old bytes stay until overwritten: set
           `wal_recycle = off` on a server that holds audit stores.
        What could not be done (no privilege: pg_switch_wal and CHECKPOINT need a superuser, or
        the grants the README names) is returned, with the statement to run."""
        left = self._vacuum_subjects()
        for statement, why in (
            ("SELECT pg_switch_wal()", "the write-ahead log segment was not switched"),
            ("CHECKPOINT", "no checkpoint was forced"),
        ):
            try:
                with self._lock, self._errors(statement):
                    self._connection().execute(statement)
            except StoreError as exc:
                left.append(f"{why} ({exc}); run `{statement}` as the table's owner or superuser")
        try:
            recycle = self._rows("SHOW wal_recycle")[0][0]
        except StoreError:
            recycle = "on"
        if recycle != "off":
            left.append(
                "the server recycles write-ahead log segments (wal_recycle = on): the old"
                " segments' bytes, the erased row among them, stay in pg_wal until overwritten;"
                " set wal_recycle = off"
            )
        return left

    def _vacuum_subjects(self) -> list[str]:
        conn = self._connection()
        deadline = time.monotonic() + self.shred_patience
        details: list[str] = []

        def note(diagnostic: psycopg.errors.Diagnostic) -> None:
            details.append(f"{diagnostic.message_primary} {diagnostic.message_detail}")

        while True:
            details.clear()
            conn.add_notice_handler(note)
            try:
                with self._lock, self._errors("VACUUM FULL subjects"):
                    conn.execute("SET lock_timeout = '10s'")
                    try:
                        conn.execute("VACUUM (FULL, VERBOSE) subjects")
                    finally:
                        conn.execute("RESET lock_timeout")
            except StoreError as exc:
                return [
                    f"the subjects table was not rewritten ({exc}); run `VACUUM FULL subjects`"
                    " as the table's owner or superuser"
                ]
            finally:
                conn.remove_notice_handler(note)
            kept = sum(int(m.group(1)) for d in details for m in _KEPT.finditer(d))
            if not kept:
                return []
            if time.monotonic() > deadline:
                return [
                    f"{kept} erased row version(s) stay in the subjects table's files: a"
                    " transaction older than the erasure still runs, and VACUUM FULL keeps what"
                    " its snapshot can see; run `VACUUM FULL subjects` once it has ended"
                ]
            time.sleep(0.2)

    def close(self) -> None:
        with self._lock:
            self._drop()


def _message(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
