"""Least privilege in the PostgreSQL audit store (issue 41, item 4), on a real server: each
component connects as its own role with exactly its grants (`meshfn audit init`): the signer's
role cannot insert a record, the collectors' cannot insert a checkpoint, neither can change a
trigger or another's rows, and readers only read. Every other PostgreSQL test of the audit trail
runs its collector, signer and verify as these roles too (meshfn.testing.audit.Trail)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from meshfn.audit import roles
from meshfn.audit.cli import audit_app
from meshfn.audit.postgres import PostgresStore
from meshfn.audit.record import canonical
from meshfn.audit.store import StoreError
from meshfn.testing.audit import Trail
from meshfn.testing.postgres import PostgresServer, with_user

RECORD = canonical({"v": 2, "status": 200}).decode()


@pytest.fixture
def trail(pg: PostgresServer, tmp_path: Path) -> Iterator[Trail]:
    t = Trail(pg.database(), tmp_path)
    t.store.append([{"v": 2, "status": 200, "time": "2026-01-01T00:00:00.000000Z"}], chain="a")
    t.checkpoint()
    yield t
    t.close()


def refused(dsn: str, sql: str, *args: object) -> str:
    """Run `sql` as the DSN's role; the error it gets (the test fails if it is allowed)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute(sql.encode(), args)
        except psycopg.Error as exc:
            return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"allowed: {sql}")


def test_the_signer_cannot_insert_a_record(trail: Trail) -> None:
    digest = hashlib.sha256(b"\x00" * 32 + RECORD.encode()).digest()
    error = refused(
        trail.roles["signer"],
        "INSERT INTO records (chain, seq, record, prev, hash) VALUES ('a', 2, %s, %s, %s)",
        RECORD,
        b"\x00" * 32,
        digest,
    )
    assert error.startswith("InsufficientPrivilege") and "records" in error, error
    for sql in (
        "UPDATE chains SET anchor_seq = 1",
        "DELETE FROM records",
        "UPDATE journals SET inode = 1",
        "INSERT INTO subjects VALUES ('s', 'h', 'p')",
        "UPDATE meta SET value = '0' WHERE key = 'erasures'",
        "DROP TRIGGER records_append_only ON records",
    ):
        assert "InsufficientPrivilege" in refused(trail.roles["signer"], sql), sql


def test_the_collector_cannot_insert_a_checkpoint(trail: Trail) -> None:
    (body, signature, key_id) = psycopg.connect(trail.roles["reader"]).execute(
        "SELECT body, signature, key_id FROM checkpoints WHERE n = 1"
    ).fetchone() or ("", b"", "")
    error = refused(
        trail.roles["collector"],
        "INSERT INTO checkpoints (n, body, signature, key_id, created) VALUES (2, %s, %s, %s, 'x')",
        body,
        signature,
        key_id,
    )
    assert error.startswith("InsufficientPrivilege") and "checkpoints" in error, error
    for sql, why in (
        ("UPDATE records SET record = '{}'", "InsufficientPrivilege"),
        ("UPDATE records SET status = 403", "InsufficientPrivilege"),
        ("DELETE FROM checkpoints", "InsufficientPrivilege"),
        ("DELETE FROM subjects", "InsufficientPrivilege"),
        ("UPDATE subjects SET pseudonym = 'x'", "InsufficientPrivilege"),
        ("UPDATE meta SET value = '0' WHERE key = 'retention_days'", "InsufficientPrivilege"),
        ("DELETE FROM chains", "InsufficientPrivilege"),
        ("TRUNCATE records", "InsufficientPrivilege"),
        ("DROP TRIGGER records_append_only ON records", "InsufficientPrivilege"),
        ("ALTER TABLE records DISABLE TRIGGER ALL", "InsufficientPrivilege"),
        ("SET session_replication_role = replica", "InsufficientPrivilege"),
        # what it may do is fenced by the triggers: no delete past a witnessed prune, no
        # anchor moved to where no witnessed prune says
        ("DELETE FROM records", "RaiseException"),
        ("UPDATE chains SET anchor_seq = 1", "RaiseException"),
    ):
        assert refused(trail.roles["collector"], sql).startswith(why), sql


def test_readers_only_read(trail: Trail) -> None:
    for sql in (
        "INSERT INTO records (chain, seq, record, prev, hash) VALUES ('a', 9, '{}', '', '')",
        "INSERT INTO checkpoints (n, body, signature, key_id, created) VALUES (9, '', '', '', '')",
        "UPDATE journals SET inode = 1",
        "DELETE FROM subjects",
        "INSERT INTO chains (chain, anchor_seq, anchor_hash) VALUES ('z', 0, '')",
    ):
        assert "InsufficientPrivilege" in refused(trail.roles["reader"], sql), sql
    with psycopg.connect(trail.roles["reader"]) as conn:
        assert conn.execute("SELECT COUNT(*) FROM records").fetchone() == (1,)


def test_the_components_work_with_exactly_their_grants(trail: Trail) -> None:
    """The collector appends and advances a journal, the signer checkpoints and witnesses a
    prune, the collector deletes what it covers, verify reads as a reader: all as roles."""
    from meshfn.audit.store import JournalPosition

    trail.store.append([{"v": 2, "status": 201}], JournalPosition("a", "/j", 1, 10))
    trail.store.append([{"v": 2, "status": 202}], JournalPosition("a", "/j", 1, 20))
    assert trail.checkpoint() is not None
    assert trail.prune() == 0  # younger than the signer's 730 days: nothing
    later = time.time() + 800 * 86400
    assert trail.prune(now=later) == 3  # the chains' anchors move (trigger), records go
    assert trail.verify(now=later).ok
    with pytest.raises(StoreError, match="permission denied"):
        trail.store.add_checkpoint(trail.witness.read()[0][0])
    subject = "ab" * 32
    trail.store.append([{"v": 2, "status": 203, "subject": subject}], chain="b")
    with pytest.raises(StoreError, match="permission denied"):
        trail.store.erase(subject)  # the owner's
    assert trail.owner.erase(subject) is not None


def test_init_refuses_roles_that_would_bypass_the_grants(pg: PostgresServer) -> None:
    store = PostgresStore(pg.database())
    try:
        for given, why in (
            ([roles.Role("collector", "meshfn")], "superuser"),
            ([roles.Role("collector", "x"), roles.Role("signer", "x")], "a role of its own"),
            ([roles.Role("reader", "nobody_here")], "does not exist"),
        ):
            with pytest.raises(StoreError, match=why):
                roles.init_roles(store, given)
        with store.session() as conn:
            conn.execute("CREATE ROLE meshfn_audit_owner_test LOGIN")
            conn.execute("ALTER TABLE records OWNER TO meshfn_audit_owner_test")
        with pytest.raises(StoreError, match="owns the audit tables"):
            roles.init_roles(store, [roles.Role("collector", "meshfn_audit_owner_test")])
    finally:
        store.close()
    with pytest.raises(StoreError, match="names no user"):
        roles.role_of("signer", "postgresql://127.0.0.1/db")


def test_meshfn_audit_init_on_postgresql(pg: PostgresServer) -> None:
    """As the chart's job runs it: the owner's DSN, each role as a DSN with its password."""
    owner = pg.database()
    dsns = {
        kind: f"{with_user(owner, f'meshfn_audit_init_{kind}')} password=pw-{kind}"
        for kind in roles.KINDS
    }
    runner = CliRunner()
    result = runner.invoke(audit_app, ["init", "--store", owner, "--create-roles",
                                       "--collector", dsns["collector"],
                                       "--signer", dsns["signer"]])  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "role collector meshfn_audit_init_collector: SELECT on meta" in text
    assert "role signer meshfn_audit_init_signer: SELECT on meta, chains, records," in text
    assert "INSERT on checkpoints" in text
    assert "warning: no role given for reader" in text
    # the collector's role now works as a store; the signer's may not create the schema
    PostgresStore(with_user(owner, "meshfn_audit_init_collector")).close()
    other = pg.database()
    with pytest.raises(StoreError, match=r"run `meshfn audit init --store OWNER_DSN`"):
        PostgresStore(with_user(other, "meshfn_audit_init_signer"))
    again = runner.invoke(audit_app, ["init", "--store", owner, "--reader", "nobody_at_all"])
    assert again.exit_code == 2 and "does not exist" in again.output, again.output


def test_init_on_sqlite_has_no_roles(tmp_path: Path) -> None:
    runner = CliRunner()
    db = str(tmp_path / "a.db")
    result = runner.invoke(audit_app, ["init", "--store", db])
    assert result.exit_code == 0 and "schema ready" in result.output, result.output
    result = runner.invoke(audit_app, ["init", "--store", db, "--signer", "s"])
    assert result.exit_code == 2 and "SQLite store has no roles" in result.output


def test_a_missing_schema_is_explained_to_a_role(pg: PostgresServer) -> None:
    dsn = pg.database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE ROLE meshfn_audit_bare LOGIN")
    with pytest.raises(StoreError, match="may not create it"):
        PostgresStore(with_user(dsn, "meshfn_audit_bare"))


def test_an_auditor_records_its_reads_and_writes_nothing_else(trail: Trail, tmp_path: Path) -> None:
    """Issue 40: a query by subject (and an export) must leave an access record, which the
    readers' role cannot write: the auditors' role reads, and appends to the control chain
    through meshfn_audit_append_control only, a record that links to its head and nothing else."""
    subject = hashlib.sha256(b"alice").hexdigest()
    trail.owner.append(
        [{"v": 2, "subject": subject, "time": "2026-01-01T00:00:01.000000Z"}], chain="a"
    )
    runner = CliRunner()
    as_reader = runner.invoke(
        audit_app, ["query", "--store", trail.roles["reader"], "--subject", subject, "--json"]
    )
    assert as_reader.exit_code == 2, as_reader.output
    assert "must be recorded in the trail" in as_reader.output
    assert "permission denied" in as_reader.output
    as_auditor = runner.invoke(
        audit_app, ["query", "--store", trail.roles["auditor"], "--subject", subject, "--json"]
    )
    assert as_auditor.exit_code == 0 and len(as_auditor.output.splitlines()) == 1, as_auditor.output
    (access,) = trail.reader.query(chain="@control", limit=None)
    assert access["action"] == "query" and access["records"] == 1 and subject not in str(access)
    again = runner.invoke(
        audit_app, ["query", "--store", trail.roles["auditor"], "--subject", subject, "--json"]
    )
    assert again.exit_code == 0  # the next one links to the first
    assert trail.verify().ok, trail.verify().problems
    # nothing else: no journal's chain, no forged link, no other table
    (head_seq, head_hash) = trail.reader.head("@control")
    error = refused(
        trail.roles["auditor"],
        "INSERT INTO records (chain, seq, record, prev, hash) VALUES ('a', 9, %s, %s, %s)",
        RECORD, b"\x00" * 32, b"\x00" * 32,
    )  # fmt: skip
    assert error.startswith("InsufficientPrivilege"), error
    bad = hashlib.sha256(b"\x01" * 32 + RECORD.encode()).digest()
    error = refused(
        trail.roles["auditor"],
        "SELECT meshfn_audit_append_control(%s, %s, %s, %s, 'x')",
        head_seq + 1, RECORD, b"\x01" * 32, bad,
    )  # fmt: skip
    assert "link to the head of the control chain" in error, error
    error = refused(
        trail.roles["auditor"],
        "SELECT meshfn_audit_append_control(%s, %s, %s, %s, 'x')",
        head_seq + 1, RECORD, head_hash, b"\x02" * 32,
    )  # fmt: skip
    assert "hash as the chain links it" in error, error
    for sql in ("UPDATE meta SET value = '0'", "DELETE FROM subjects", "DELETE FROM records"):
        assert "InsufficientPrivilege" in refused(trail.roles["auditor"], sql), sql
    assert "InsufficientPrivilege" in refused(
        trail.roles["reader"],
        "SELECT meshfn_audit_append_control(1, 'x', ''::bytea, ''::bytea, 'x')",
    )
