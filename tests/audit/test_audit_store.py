"""The audit store on BOTH backends (SQLite and a real PostgreSQL server, where each component
connects as its own role): chains per journal, signed cross-checkpoints made and stored by the
signer and kept in a witness, tamper detection that names journal and record (a truncated tail,
a rewritten record and a re-signed history each by name), retention witnessed by the signer,
queries, racing writers, and erasure by crypto-shredding."""

from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from meshfn.audit import Checkpoint, layout, offline, open_store, verify
from meshfn.audit.cli import audit_app
from meshfn.audit.postgres import PostgresStore
from meshfn.audit.record import canonical
from meshfn.audit.signer import Signer
from meshfn.audit.sqlite import SqliteStore
from meshfn.audit.store import (
    CONTROL_CHAIN,
    JournalPosition,
    StoreConflict,
    StoreError,
)
from meshfn.audit.witness import FileWitness
from meshfn.testing.audit import Raw, Trail
from meshfn.testing.postgres import PostgresServer, bin_dir

SUBJECTS = [hashlib.sha256(f"subject-{i}".encode()).hexdigest() for i in range(3)]


def rec(i: int, **kw: Any) -> dict[str, Any]:
    base = {
        "v": 2,
        "id": f"req-{i}",
        "time": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}.000000Z",
        "method": "GET",
        "path": f"/p/{i}",
        "status": 200 if i % 5 else 503,
        "route": "default/a" if i % 2 else "default/b",
        "subject": SUBJECTS[i % 3],
        "salt_id": "s-1",
    }
    base.update(kw)
    return base


@pytest.fixture
def trail(location: str, tmp_path: Path) -> Any:
    t = Trail(location, tmp_path)
    yield t
    t.close()


def fill(trail: Trail, n: int, chain: str = "edge", every: int = 10) -> None:
    for start in range(0, n, every):
        trail.store.append(
            [rec(i) for i in range(start + 1, min(n, start + every) + 1)], chain=chain
        )
        trail.checkpoint()


def rows(trail: Trail, chain: str = "edge") -> list[list[Any]]:
    return [[s, b, p, h] for s, b, p, h in trail.store.records_after(chain, 0)]


def rewrite(trail: Trail, new_rows: list[list[Any]], chain: str = "edge") -> None:
    """What an attacker with write access to the database can do."""
    raw = Raw(trail.location)
    raw.run("DELETE FROM records WHERE chain = ?", (chain,))
    for seq, body, prev, digest in new_rows:
        raw.run(
            "INSERT INTO records (chain, seq, record, prev, hash) VALUES (?, ?, ?, ?, ?)",
            (chain, seq, body, prev, digest),
        )
    if raw.postgres:  # a careful attacker also fills in the query columns (SQLite generates them)
        raw.run(
            "UPDATE records SET time = record::json ->> 'time', subject = record::json ->>"
            " 'subject', status = (record::json ->> 'status')::int, route = record::json ->>"
            " 'route' WHERE chain = ?",
            (chain,),
        )
    raw.close()


def test_records_and_checkpoints_are_append_only(trail: Trail) -> None:
    """The triggers, even for the owner (on PostgreSQL the collectors' role is refused most of
    this before a trigger runs: test_audit_roles)."""
    fill(trail, 20)
    for sql in (
        "UPDATE records SET record = '{}' WHERE seq = 3",
        "DELETE FROM records WHERE seq = 3",
        "DELETE FROM records",
        "UPDATE checkpoints SET body = 'x' WHERE n = 1",
        "DELETE FROM checkpoints WHERE n = 1",
    ):
        with pytest.raises(StoreError, match="append-only"):
            trail.owner._count(sql)
    for sql, why in (
        ("UPDATE chains SET anchor_seq = 5 WHERE chain = 'edge'", "signer witnessed"),
        ("DELETE FROM chains WHERE chain = 'edge'", "never deleted"),
        ("INSERT INTO chains (chain, anchor_seq, anchor_hash) VALUES ('x', 3, ?)", "record 0"),
    ):
        with pytest.raises(StoreError, match=why):
            trail.owner._count(sql, (b"\x00" * 32,) if "?" in sql else ())
    assert trail.store.count() == 20 and trail.verify().ok


def test_chain_links_each_record_to_the_previous_hash(trail: Trail) -> None:
    fill(trail, 25)
    all_rows = rows(trail)
    assert [r[0] for r in all_rows] == list(range(1, 26))
    genesis = offline.chain_genesis(trail.store.store_id, "edge")
    assert all_rows[0][2] == genesis
    for before, row in itertools.pairwise(all_rows):
        assert row[2] == before[3]
        assert row[3] == hashlib.sha256(row[2] + row[1].encode()).digest()
    report = trail.verify()
    assert report.ok, report.problems
    assert report.records == 25 and report.checkpoints == 3 and report.witnessed == 3
    assert report.chains["edge"].signed_seq == 25 and report.unsigned_tail == 0


def test_cross_checkpoints_cover_every_chain_and_link_up(trail: Trail) -> None:
    trail.store.append([rec(1), rec(2)], chain="a")
    trail.store.append([rec(3)], chain="b")
    first = trail.checkpoint()
    assert first is not None and first.heads.keys() == {"a", "b"}
    assert trail.checkpoint() is None  # nothing new: nothing signed
    trail.store.append([rec(4)], chain="b")
    second = trail.checkpoint()
    assert second is not None and second.heads == {"b": (2, second.heads["b"][1])}
    assert second.doc["prev"] == first.digest
    witnessed, bad = trail.witness.read()
    assert [c.body for c in witnessed] == [first.body, second.body] and not bad


def test_unsigned_tail_is_reported(trail: Trail) -> None:
    fill(trail, 10)
    trail.store.append([rec(11), rec(12)], chain="edge")
    report = trail.verify()
    assert report.ok and report.unsigned_tail == 2


def test_edited_record_is_named(trail: Trail) -> None:
    fill(trail, 30)
    all_rows = rows(trail)
    all_rows[11][1] = all_rows[11][1].replace('"status":200', '"status":201')
    rewrite(trail, all_rows)
    assert trail.problems() == [("edited", "edge", 12)]
    assert "journal edge: record 12 does not match its hash" in trail.verify().problems[0].detail


def test_rewritten_chain_is_caught_at_the_checkpoint(trail: Trail) -> None:
    fill(trail, 30)
    all_rows = rows(trail)
    all_rows[11][1] = all_rows[11][1].replace('"status":200', '"status":201')
    for i in range(11, 30):  # the whole rest of the chain recomputed
        all_rows[i][2] = all_rows[i - 1][3]
        all_rows[i][3] = hashlib.sha256(all_rows[i][2] + all_rows[i][1].encode()).digest()
    rewrite(trail, all_rows)
    assert trail.problems() == [("rewritten", "edge", 20), ("rewritten", "edge", 30)]
    first, then = (p.detail for p in trail.verify().problems)
    assert "a record in 11-20 was changed and the chain re-hashed after it" in first, first
    assert "at or before 20" in then, then


def test_deleted_record_is_named(trail: Trail) -> None:
    fill(trail, 30)
    all_rows = rows(trail)
    rewrite(trail, all_rows[:6] + all_rows[8:])
    report = trail.verify()
    assert [(p.kind, p.chain, p.seq) for p in report.problems] == [("deleted", "edge", 7)]
    assert "records 7-8 are missing" in report.problems[0].detail


def test_truncated_tail_with_its_checkpoints_is_named_by_the_witness(trail: Trail) -> None:
    """The attack of the issue: drop the triggers, delete the newest 11 of 41 records with
    their checkpoints. The store alone still looks whole; the witness does not."""
    fill(trail, 30)
    trail.store.append([rec(i) for i in range(31, 42)], chain="edge")
    trail.checkpoint()
    raw = Raw(trail.location)
    raw.run("DELETE FROM records WHERE chain = 'edge' AND seq > 30")
    raw.run("DELETE FROM checkpoints WHERE n > 3")
    raw.close()
    assert trail.verify(witness=False).ok  # why the witness exists
    report = trail.verify()
    assert [(p.kind, p.chain, p.seq) for p in report.problems] == [("truncated", "edge", 31)]
    assert "journal edge: records 31-41 are missing from its end" in report.problems[0].detail


def test_a_whole_journal_deleted_is_named(trail: Trail) -> None:
    fill(trail, 10, chain="a")
    fill(trail, 10, chain="b")
    raw = Raw(trail.location)
    raw.run("DELETE FROM records WHERE chain = 'b'")
    raw.run("DELETE FROM chains WHERE chain = 'b'")
    raw.close()
    report = trail.verify()
    assert [(p.kind, p.chain) for p in report.problems] == [("truncated", "b")]
    assert "all its records (up to 10) are gone" in report.problems[0].detail


def test_resigned_history_is_named(trail: Trail, tmp_path: Path) -> None:
    """A writer who also stole the key rewrites a record and signs the history again: the
    checkpoints verify, the witness contradicts them. With another key: named too."""
    fill(trail, 20)
    all_rows = rows(trail)
    all_rows[4][1] = all_rows[4][1].replace("/p/5", "/p/forged")
    for i in range(4, 20):
        all_rows[i][2] = all_rows[i - 1][3] if i else all_rows[i][2]
        all_rows[i][3] = hashlib.sha256(all_rows[i][2] + all_rows[i][1].encode()).digest()
    rewrite(trail, all_rows)
    raw = Raw(trail.location)
    raw.run("DELETE FROM checkpoints")
    raw.close()
    store_id = trail.store.store_id
    for thief in (trail.key, Ed25519PrivateKey.generate()):
        raw = Raw(trail.location)
        raw.run("DELETE FROM checkpoints")
        prev = offline.checkpoint_genesis(store_id).hex()
        for n, seq in enumerate((10, 20), 1):
            doc = {
                "type": offline.CHECKPOINT_TYPE,
                "v": 2,
                "store": store_id,
                "n": n,
                "time": "2026-01-01T00:00:00.000000Z",
                "prev": prev,
                "chains": {"edge": [seq, all_rows[seq - 1][3].hex()]},
            }
            body = canonical(doc)
            raw.run(
                "INSERT INTO checkpoints (n, body, signature, key_id, created) VALUES"
                " (?, ?, ?, ?, ?)",
                (n, body.decode(), thief.sign(body), offline.key_id(thief.public_key()), "x"),
            )
            prev = offline.checkpoint_digest(body)
        raw.close()
        found = trail.problems()
        assert ("resigned", None, None) in found, found
        assert ("rewritten", "edge", 10) in found and ("rewritten", "edge", 20) in found
    assert trail.verify(witness=False).problems[0].kind == "resigned"  # the foreign key


@pytest.mark.parametrize("forge_links", [False, True])
def test_inserted_record_is_named(trail: Trail, forge_links: bool) -> None:
    fill(trail, 30)
    all_rows = rows(trail)
    body = canonical(rec(999, path="/forged")).decode()
    prev = all_rows[9][3] if forge_links else b"\x00" * 32
    all_rows.insert(10, [0, body, prev, hashlib.sha256(prev + body.encode()).digest()])
    for i, row in enumerate(all_rows):
        row[0] = i + 1
    rewrite(trail, all_rows)
    assert trail.problems()[0] == ("inserted", "edge", 11)


def test_reordered_records_are_named(trail: Trail) -> None:
    fill(trail, 30)
    all_rows = rows(trail)
    all_rows[14][1:], all_rows[15][1:] = all_rows[15][1:], all_rows[14][1:]
    rewrite(trail, all_rows)
    assert trail.problems() == [("reordered", "edge", 15)]


def test_forged_signature_and_unwitnessed_checkpoint(trail: Trail) -> None:
    fill(trail, 20)
    raw = Raw(trail.location)
    raw.run("UPDATE checkpoints SET signature = ? WHERE n = 1", (b"\x01" * 64,))
    raw.close()
    assert ("signature", None, None) in trail.problems()
    # a checkpoint signed with the right key but never shown to the witness
    elsewhere = trail.witness.path.parent.parent / "elsewhere" / "w.jsonl"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(trail.witness.path.read_bytes())  # a copy that then goes its own way
    other = Trail(trail.location, elsewhere.parent)
    other.signer = Signer(other.signer_store, trail.key, FileWitness(elsewhere))
    trail.store.append([rec(21)], chain="edge")
    other.checkpoint()
    assert ("unwitnessed", None, None) in trail.problems()
    other.close()


def test_signer_refuses_a_chain_rewritten_under_it(trail: Trail) -> None:
    fill(trail, 10)
    all_rows = rows(trail)
    all_rows[9][1] = all_rows[9][1].replace("/p/10", "/p/x")
    all_rows[9][3] = hashlib.sha256(all_rows[9][2] + all_rows[9][1].encode()).digest()
    rewrite(trail, all_rows)
    trail.store.append([rec(11)], chain="edge")
    trail.store.append([rec(1)], chain="other")
    result = trail.signer.sign()
    assert result.refused == ["journal edge: record 10 differs from the one signed"]
    assert result.checkpoint is not None and result.checkpoint.heads.keys() == {"other"}
    raw = Raw(trail.location)
    raw.run("DELETE FROM records WHERE chain = 'other'")
    raw.close()
    assert any("the store ends at record 0" in r for r in trail.signer.sign().refused)


def test_checkpoints_the_store_lost_are_stored_again(trail: Trail) -> None:
    """Witnessed, but gone from the store (the signer died between its witness and its
    insert): the signer's next answer stores it again, before the new one."""
    trail.store.append([rec(1)], chain="edge")
    lost = trail.signer.sign()
    raw = Raw(trail.location)
    raw.run("DELETE FROM checkpoints")
    raw.close()
    assert trail.store.last_checkpoint() == 0
    trail.store.append([rec(2)], chain="edge")
    result = trail.signer.sign()
    assert [c.n for c in result.checkpoints] == [lost.checkpoints[0].n, lost.checkpoints[0].n + 1]
    assert trail.verify().ok and trail.verify().checkpoints == 2


def test_a_signer_restart_continues_from_its_witness(trail: Trail) -> None:
    fill(trail, 10)
    again = Signer(trail.reader, trail.key, trail.witness)
    assert again.n == 1 and again.heads["edge"][0] == 10
    with pytest.raises(Exception, match="not signed by this key"):
        Signer(trail.reader, Ed25519PrivateKey.generate(), trail.witness)


def test_retention_keeps_the_rest_verifiable(location: str, tmp_path: Path) -> None:
    """The signer (1-day retention) witnesses the prune, the store deletes that much; what
    stays verifies from the witnessed starting point."""
    trail = Trail(location, tmp_path, retention_days=1)
    try:
        fill(trail, 30)
        fill(trail, 5, chain="other")
        now = time.time()
        assert trail.prune(now=now) == 0  # nothing is a day old yet
        assert trail.prune(now=now + 2 * 86400) == 35  # every checkpoint is: up to the newest
        assert trail.prune(now=now + 2 * 86400) == 0  # witnessed once
        (prune,) = [c for c in trail.witness.read()[0] if c.prune]
        assert prune.prune.keys() == {"edge", "other"} and prune.prune["edge"][0] == 30
        assert prune.retention_days == 1 and not prune.heads
        trail.store.append([rec(31), rec(32)], chain="edge")
        trail.checkpoint()
        report = trail.verify(now=now + 2 * 86400)
        assert report.ok, report.problems
        assert report.chains["edge"].anchor_seq == 30 and report.chains["edge"].first_seq == 31
        assert report.chains["edge"].pruned_seq == 30 and report.retention_days == 1
        assert report.records == 2
        with pytest.raises(Exception, match=r"retention is 1 day\(s\)"):
            trail.prune(days=0)
    finally:
        trail.close()


def test_early_deletion_disguised_as_retention(trail: Trail) -> None:
    fill(trail, 30)
    all_rows = rows(trail)
    rewrite(trail, all_rows[20:])
    raw = Raw(trail.location)
    raw.run(
        "UPDATE chains SET anchor_seq = 20, anchor_hash = ? WHERE chain = 'edge'",
        (all_rows[19][3],),
    )
    raw.close()
    assert trail.problems() == [("deleted", "edge", 1)]
    assert "records 1-20 were removed, but no prune the signer witnessed covers them" in (
        trail.verify().problems[0].detail
    )
    raw = Raw(trail.location)
    raw.run("UPDATE chains SET anchor_hash = ? WHERE chain = 'edge'", (b"\x00" * 32,))
    raw.close()
    assert ("deleted", "edge", 1) in trail.problems()


def test_query_filters(trail: Trail) -> None:
    fill(trail, 100)
    fill(trail, 3, chain="other")
    store = trail.store
    assert len(store.query(limit=None)) == 103
    assert len(store.query(chain="other", limit=None)) == 3
    assert {r["status"] for r in store.query(status=503, limit=None)} == {503}
    assert len(store.query(status=503, chain="edge", limit=None)) == 20
    assert len(store.query(status_class=5, chain="edge", limit=None)) == 20
    assert len(store.query(status_class=2, route="default/a", chain="edge", limit=None)) == 40
    by_hash = store.query(subject=SUBJECTS[1].upper(), chain="edge", limit=None)
    assert len(by_hash) == 34 and len({r["subject"] for r in by_hash}) == 1
    pseudonym = by_hash[0]["subject"]
    assert len(pseudonym) == 32 and pseudonym not in SUBJECTS
    assert len(store.query(subject=pseudonym, chain="edge", limit=None)) == 34
    got = store.query(
        since="2026-01-01T00:00:10.000000Z",
        until="2026-01-01T00:00:20.000000Z",
        chain="edge",
        limit=None,
    )
    assert [r["id"] for r in got] == [f"req-{i}" for i in range(10, 20)]
    assert len(store.query(limit=7)) == 7


def test_the_store_never_holds_the_filters_subject_hash(trail: Trail) -> None:
    fill(trail, 30)
    assert all(r["subject"] not in SUBJECTS for r in trail.store.query(limit=None))
    assert trail.verify().ok


def test_racing_writers_store_each_batch_once(location: str) -> None:
    """Two collectors (two store objects) on one journal: the second's batch conflicts and
    stores nothing; after re-reading the position it goes on from there."""
    a, b = open_store(location), open_store(location)
    assert a.journal_position("n") is None and b.journal_position("n") is None
    a.append([rec(1), rec(2)], JournalPosition("n", "/j", 7, 100))
    with pytest.raises(StoreConflict):
        b.append([rec(1), rec(2)], JournalPosition("n", "/j", 7, 100))
    assert b.journal_position("n") == JournalPosition("n", "/j", 7, 100)
    b.append([rec(3)], JournalPosition("n", "/j", 7, 150))
    with pytest.raises(StoreConflict):  # a's view is stale now
        a.append([rec(3)], JournalPosition("n", "/j", 7, 150))
    assert [r["id"] for r in a.query(limit=None)] == ["req-1", "req-2", "req-3"]
    assert [r["seq"] for r in a.query(limit=None)] == [1, 2, 3]
    with pytest.raises(StoreConflict):  # same chain, no position: the (chain, seq) key clashes
        a._heads["n"] = (2, b"\x00" * 32)
        a.append([rec(9)], chain="n")
    a.close()
    b.close()


def test_the_control_chain_has_many_writers(location: str) -> None:
    """The control plane, the CLI and the console all append access records to @control, each
    through its own store object: none may trip over another's head."""
    a, b = open_store(location), open_store(location)
    try:
        assert a.append([{"v": 2, "event": "access", "n": 1}], chain=CONTROL_CHAIN) == 1
        assert b.append([{"v": 2, "event": "access", "n": 2}], chain=CONTROL_CHAIN) == 2
        assert a.append([{"v": 2, "event": "access", "n": 3}], chain=CONTROL_CHAIN) == 3
        assert [r["n"] for r in b.query(chain=CONTROL_CHAIN, limit=None)] == [1, 2, 3]
    finally:
        a.close()
        b.close()


def test_reserved_chain_names(trail: Trail) -> None:
    with pytest.raises(StoreError, match="meshfn's own"):
        trail.store.append([rec(1)], chain="@x")


# ------------------------------------------------------------------ erasure


def _database_bytes(trail: Trail, pg: PostgresServer | None) -> bytes:
    """Everything a reader of the database's files, or of a backup taken now, could see: for
    PostgreSQL the database's files, a dump, and the write-ahead log."""
    if not trail.location.startswith("postgresql://"):
        path = Path(trail.location)
        return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))
    assert pg is not None
    dump = subprocess.run(
        [str(bin_dir() / "pg_dump"), trail.location], capture_output=True, check=True
    ).stdout
    (oid,) = Raw(trail.location).run(
        "SELECT oid FROM pg_database WHERE datname = current_database()"
    )[0]
    files = b"".join(p.read_bytes() for p in (pg.data / "base" / str(oid)).iterdir() if p.is_file())
    wal = b"".join(p.read_bytes() for p in (pg.data / "pg_wal").iterdir() if p.is_file())
    return dump + files + wal


def test_erasure_leaves_the_records_unlinkable_and_verifiable(
    trail: Trail, request: pytest.FixtureRequest
) -> None:
    pg = request.getfixturevalue("pg") if trail.location.startswith("postgresql") else None
    fill(trail, 30)
    target = SUBJECTS[1]
    pseudonym = trail.store.query(subject=target, limit=1)[0]["subject"]
    before = trail.store.count()
    trail.store._rows("SELECT 1")  # any reader would do: the erasure must not wait for it
    done = trail.owner.erase(target)
    assert done is not None and done.records == 10 and not done.residue
    assert trail.store.query(subject=target, limit=None) == []
    assert trail.store.pseudonyms(target) == []
    # the records are all still there, unchanged, and verify
    assert trail.store.count() == before + 1
    assert len(trail.store.query(subject=pseudonym, limit=None)) == 10
    trail.checkpoint()
    assert trail.verify().ok, trail.verify().problems
    # the erasure is a record of its own: who, the destroyed pseudonym (random, and now linked
    # to no one), how many records; never the subject's HMAC
    (erasure,) = trail.store.query(chain=CONTROL_CHAIN, limit=None)
    assert erasure["event"] == "erasure" and erasure["records"] == 10
    assert erasure["pseudonyms"] == [pseudonym] and target not in json.dumps(erasure)
    assert done.hashes == (target,) and done.pseudonyms == (pseudonym,)
    # nothing in the database files (or a dump) links the pseudonym to the subject any more
    data = _database_bytes(trail, pg)
    assert target.encode() not in data and bytes.fromhex(target) not in data
    assert SUBJECTS[0].encode() in data  # the others' keys are still there: the test can see
    # new requests of the same subject get a new pseudonym
    trail.store.append([rec(1, subject=target)], chain="edge")
    fresh = trail.store.query(subject=target, limit=None)
    assert len(fresh) == 1 and fresh[0]["subject"] != pseudonym


def test_erasure_outlasts_a_reader_that_still_sees_the_row(
    pg: PostgresServer, tmp_path: Path
) -> None:
    """A transaction older than the erasure still sees the deleted row, and VACUUM FULL keeps
    what it can see: the erasure rewrites the table again once that reader has ended, so no
    file keeps the row (and says so when a reader outlives its patience)."""
    import threading

    import psycopg

    trail = Trail(pg.database(), tmp_path)
    try:
        fill(trail, 9)
        target = SUBJECTS[2]
        reader = psycopg.connect(trail.location)
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM subjects").fetchall()  # its snapshot has the row
        reader.execute("COMMIT")
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM records").fetchall()  # an old snapshot, no lock
        threading.Timer(1.0, reader.close).start()
        started = time.monotonic()
        done = trail.owner.erase(target)  # the owner erases (roles.py)
        assert done is not None and done.residue == (), done
        assert time.monotonic() - started >= 0.9  # it waited for the reader
        assert target.encode() not in _database_bytes(trail, pg)
        # a reader that never ends: said, with what to run
        stubborn = psycopg.connect(trail.location)
        stubborn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        stubborn.execute("SELECT count(*) FROM records").fetchall()
        store = trail.owner
        assert isinstance(store, PostgresStore)
        store.shred_patience = 1.0
        try:
            leftover = store.erase(SUBJECTS[1])
            assert leftover is not None
        finally:
            stubborn.close()
        assert any("VACUUM FULL subjects" in line for line in leftover.residue), leftover
    finally:
        trail.close()


def test_erasing_an_unknown_subject_changes_nothing(trail: Trail) -> None:
    fill(trail, 10)
    heads = trail.store.heads()
    assert trail.owner.erase("ee" * 32) is None
    assert trail.owner.erase("ee" * 16) is None
    assert trail.store.heads() == heads and trail.store.query(chain=CONTROL_CHAIN) == []
    with pytest.raises(StoreError, match="64 hex"):
        trail.owner.erase("not-a-subject")


def test_erasure_by_pseudonym(trail: Trail) -> None:
    fill(trail, 9)
    pseudonym = trail.store.query(subject=SUBJECTS[0], limit=1)[0]["subject"]
    done = trail.owner.erase(pseudonym)
    assert done is not None and done.records == 3
    assert trail.store.query(subject=SUBJECTS[0]) == []


def test_a_collector_forgets_erased_pseudonyms(location: str) -> None:
    """A second writer (another collector) had the pseudonym cached: after the erasure it
    must not reuse it."""
    writer, eraser = open_store(location), open_store(location)
    writer.append([rec(1, subject=SUBJECTS[0])], chain="a")
    old = writer.query(subject=SUBJECTS[0])[0]["subject"]
    assert eraser.erase(SUBJECTS[0]) is not None
    writer.append([rec(2, subject=SUBJECTS[0])], chain="a")
    new = writer.query(subject=SUBJECTS[0])
    assert len(new) == 1 and new[0]["subject"] != old
    writer.close()
    eraser.close()


# ------------------------------------------------------------------ SQLite only


def test_full_store_refuses_and_keeps_nothing_half_written(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "audit.db", max_bytes=64 * 1024)
    big = "x" * 1500
    stored = 0
    with pytest.raises(StoreError, match="full"):
        for i in range(1, 1000):
            store.append([rec(i, path=big)], JournalPosition("n", "/j", 1, i))
            stored = i
    assert store.count() == stored
    assert store.journal_position("n") == JournalPosition("n", "/j", 1, stored)
    assert store.head("n")[0] == stored
    store.set_max_bytes(10 * 1024 * 1024)  # room again: the chain continues seamlessly
    store.append([rec(stored + 1)], chain="n")
    assert store.count() == stored + 1
    assert verify(store, Ed25519PrivateKey.generate().public_key()).ok
    store.close()


def test_not_an_audit_store(tmp_path: Path) -> None:
    bogus = tmp_path / "x.db"
    bogus.write_bytes(b"hello, not sqlite" * 100)
    with pytest.raises(StoreError, match=r"not an audit store|cannot open"):
        SqliteStore(bogus)
    with pytest.raises(StoreError, match="no audit store"):
        SqliteStore(tmp_path / "missing.db", readonly=True)
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError):
        SqliteStore(tmp_path / "dir.db")
    old = tmp_path / "v1.db"
    with sqlite3.connect(old) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('schema', '1')")
    with pytest.raises(StoreError, match="schema 1"):
        SqliteStore(old)


def test_readonly_store_refuses_writes(tmp_path: Path) -> None:
    SqliteStore(tmp_path / "a.db").close()
    ro = SqliteStore(tmp_path / "a.db", readonly=True)
    with pytest.raises(StoreError, match="read-only"):
        ro.append([rec(4)])
    with pytest.raises(StoreError, match="read-only"):
        ro.add_checkpoint(Checkpoint(b"{}", b"", ""))
    ro.close()


def test_unreachable_postgres_is_a_store_error(pg: PostgresServer) -> None:
    with pytest.raises(StoreError, match="cannot connect"):
        open_store("postgresql://meshfn@127.0.0.1:1/nope")
    dsn = pg.database()
    store = open_store(dsn)
    raw = Raw(dsn)
    raw.run(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = 'meshfn-audit'"
    )
    raw.close()
    with pytest.raises(StoreError):
        store.append([rec(1)], chain="a")
    store.append([rec(1)], chain="a")  # reconnects on the next call
    assert store.count() == 1
    store.close()


def test_query_columns_edited_to_hide_a_record_are_named(trail: Trail) -> None:
    """PostgreSQL's query columns are filled by the writer: verify checks they agree; SQLite's
    are generated from the record (they cannot be written)."""
    fill(trail, 10)
    raw = Raw(trail.location)
    if not raw.postgres:
        with pytest.raises(sqlite3.OperationalError, match="generated column"):
            raw.run("UPDATE records SET route = 'default/other' WHERE seq = 4")
        return
    raw.run("UPDATE records SET route = 'default/other', status = 201 WHERE seq = 4")
    raw.close()
    assert trail.problems() == [("edited", "edge", 4)]


def test_signer_refuses_a_next_record_that_does_not_link(trail: Trail) -> None:
    fill(trail, 10)
    body = canonical(rec(11)).decode()
    raw = Raw(trail.location)
    raw.run(
        "INSERT INTO records (chain, seq, record, prev, hash) VALUES ('edge', 11, ?, ?, ?)",
        (body, b"\x00" * 32, hashlib.sha256(b"\x00" * 32 + body.encode()).digest()),
    )
    raw.run("DELETE FROM records WHERE chain = 'edge' AND seq = 10")
    raw.close()
    assert trail.signer.sign().refused == ["journal edge: record 10, which was signed, is gone"]
    raw = Raw(trail.location)
    raw.run("INSERT INTO records (chain, seq, record, prev, hash) VALUES ('edge', 10, ?, ?, ?)",
            tuple(rows(trail)[0][1:]))  # fmt: skip
    raw.close()
    found = trail.signer.sign().refused
    assert found == ["journal edge: record 10 differs from the one signed"], found


def _forge_history(trail: Trail, thief: Ed25519PrivateKey, heads: dict[int, bytes]) -> None:
    """Replace the store's checkpoints by ones signed with `thief` over `heads` (seq -> hash)."""
    raw = Raw(trail.location)
    raw.run("DELETE FROM checkpoints")
    prev = offline.checkpoint_genesis(trail.store.store_id).hex()
    for n, (seq, digest) in enumerate(sorted(heads.items()), 1):
        body = canonical(
            {
                "type": offline.CHECKPOINT_TYPE,
                "v": 2,
                "store": trail.store.store_id,
                "n": n,
                "time": "2026-01-01T00:00:00.000000Z",
                "prev": prev,
                "chains": {"edge": [seq, digest.hex()]},
            }
        )
        raw.run(
            "INSERT INTO checkpoints (n, body, signature, key_id, created) VALUES (?, ?, ?, ?, ?)",
            (n, body.decode(), thief.sign(body), offline.key_id(thief.public_key()), "x"),
        )
        prev = offline.checkpoint_digest(body)
    raw.close()


@pytest.mark.parametrize("attack", ["truncated", "rewritten", "resigned"])
def test_meshfn_audit_verify_names_each_attack(location: str, tmp_path: Path, attack: str) -> None:
    """The three attacks of the issue through `meshfn audit verify` on both stores: exit 1,
    each named with its journal and record; the store alone (no witness) is fooled by two."""
    trail = Trail(location, tmp_path)
    try:
        fill(trail, 40)
        trail.store.append([rec(41)], chain="edge")
        trail.checkpoint()
        all_rows = rows(trail)
        if attack == "truncated":  # the newest 11 of 41 with their checkpoints
            raw = Raw(trail.location)
            raw.run("DELETE FROM records WHERE chain = 'edge' AND seq > 30")
            raw.run("DELETE FROM checkpoints WHERE n > 3")
            raw.close()
        else:  # record 15 changed, the chain re-hashed after it
            all_rows[14][1] = all_rows[14][1].replace('"/p/15"', '"/p/forged"')
            for i in range(14, len(all_rows)):
                all_rows[i][2] = all_rows[i - 1][3]
                all_rows[i][3] = hashlib.sha256(all_rows[i][2] + all_rows[i][1].encode()).digest()
            rewrite(trail, all_rows)
            if attack == "resigned":  # ... and signed again with the stolen key
                _forge_history(trail, trail.key, {s: all_rows[s - 1][3] for s in (10, 20, 30)})
    finally:
        trail.close()
    keys = ["--public-key", str(layout.public_key_path(tmp_path))]
    witness = ["--witness", str(tmp_path / "audit-witness" / "checkpoints.jsonl")]
    runner = CliRunner()
    result = runner.invoke(audit_app, ["verify", "--store", location, *keys, *witness])
    assert result.exit_code == 1, result.output
    expected = {
        "truncated": "truncated: seq 31: journal edge: records 31-41 are missing from its end",
        "rewritten": "rewritten: seq 20: journal edge: record 20 differs from what checkpoint 2"
        " signed: a record in 11-20 was changed",
        "resigned": "resigned: checkpoint 1 in the store differs from the witnessed checkpoint 1",
    }[attack]
    assert expected in result.output, result.output
    as_json = runner.invoke(
        audit_app, ["verify", "--store", location, *keys, *witness, "--json"]
    ).output
    assert attack in {p["kind"] for p in json.loads(as_json)["problems"]}
    alone = runner.invoke(audit_app, ["verify", "--store", location, *keys, "--no-witness"])
    # without the witness a tail deleted with its checkpoints, and a history re-signed with the
    # stolen key, look whole; the rewrite under the old checkpoints does not
    assert alone.exit_code == (1 if attack == "rewritten" else 0), alone.output


def test_chains_walked_in_worker_processes_report_the_same(
    trail: Trail, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify with a worker process per chain (what the CLI does for large stores) finds
    exactly what the walk in one process finds, in the same order."""
    for chain in ("a", "b", "c"):
        fill(trail, 20, chain=chain)
    raw = Raw(trail.location)
    raw.run("UPDATE records SET record = replace(record, '/p/7', '/p/x') WHERE chain='b' AND seq=7")
    raw.run("DELETE FROM records WHERE chain = 'c' AND seq = 12")
    raw.close()
    serial = trail.verify()
    module = sys.modules["meshfn.audit.verify"]
    monkeypatch.setattr(module, "_PARALLEL_RECORDS", 0)

    def not_here(*_: object) -> None:
        raise AssertionError("walked in this process, not in the workers")

    monkeypatch.setattr(module, "_walk", not_here)  # the spawned workers import their own
    parallel = verify(trail.store, trail.public_key, trail.witness, workers=2)
    assert [(p.kind, p.chain, p.seq) for p in serial.problems] == [
        ("edited", "b", 7),
        ("deleted", "c", 12),
    ]
    assert parallel.as_dict() == serial.as_dict()
