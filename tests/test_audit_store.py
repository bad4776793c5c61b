"""The audit store: hash chain, signed checkpoints, tamper detection that names the record,
retention, queries, and a full store that refuses instead of losing records."""

from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from meshfn.control_plane.audit import signing
from meshfn.control_plane.audit.record import canonical, from_log_line, trace_id
from meshfn.control_plane.audit.store import AuditStore, JournalPosition, StoreError

Row = list[Any]


def rec(i: int, **kw: Any) -> dict[str, Any]:
    base = {
        "v": 1,
        "id": f"req-{i}",
        "time": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}.000000Z",
        "method": "GET",
        "path": f"/p/{i}",
        "status": 200 if i % 5 else 503,
        "route": "a" if i % 2 else "b",
        "subject": (f"{i % 3:064x}"),
    }
    base.update(kw)
    return base


@pytest.fixture
def store(tmp_path: Path) -> AuditStore:
    s = AuditStore(tmp_path / "audit.db")
    yield s
    s.close()


def fill(store: AuditStore, n: int, checkpoint_every: int = 10) -> None:
    for start in range(0, n, checkpoint_every):
        store.append([rec(i) for i in range(start + 1, min(n, start + checkpoint_every) + 1)])
        store.checkpoint()


def rows(path: Path) -> list[Row]:
    with sqlite3.connect(path) as db:
        return [
            list(r) for r in db.execute("SELECT seq, record, prev, hash FROM records ORDER BY seq")
        ]


def attacker(path: Path) -> sqlite3.Connection:
    """Write access to the file: the append-only triggers are the first thing to go."""
    db = sqlite3.connect(path)
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    return db


def rewrite(path: Path, new_rows: list[Row]) -> None:
    """What an attacker with write access to the file can do."""
    with attacker(path) as db:
        db.execute("DELETE FROM records")
        db.executemany(
            "INSERT INTO records (seq, record, prev, hash) VALUES (?, ?, ?, ?)", new_rows
        )


def problems(store: AuditStore) -> list[tuple[str, int | None]]:
    return [(p.kind, p.seq) for p in store.verify().problems]


def test_records_and_checkpoints_are_append_only(store: AuditStore) -> None:
    fill(store, 20)
    with sqlite3.connect(store.path) as db:
        for sql in (
            "UPDATE records SET record = '{}' WHERE seq = 3",
            "DELETE FROM records WHERE seq = 3",
            "DELETE FROM records",
            "UPDATE checkpoints SET signature = x'00' WHERE seq = 10",
            "DELETE FROM checkpoints WHERE seq = 10",
        ):
            with pytest.raises(sqlite3.IntegrityError, match="append-only"):
                db.execute(sql)
    assert store.count() == 20 and store.verify().ok


def test_chain_links_each_record_to_the_previous_hash(store: AuditStore) -> None:
    fill(store, 25)
    all_rows = rows(store.path)
    assert [r[0] for r in all_rows] == list(range(1, 26))
    for before, row in itertools.pairwise(all_rows):
        assert row[2] == before[3]
        assert row[3] == hashlib.sha256(row[2] + row[1].encode()).digest()
    assert json.loads(all_rows[0][1]) == rec(1)
    assert all_rows[0][1].encode() == canonical(rec(1))
    report = store.verify()
    assert report.ok and report.records == 25 and report.checkpoints == 3
    assert report.last_checkpoint_seq == 25 and report.unsigned_tail == 0


def test_unsigned_tail_is_reported(store: AuditStore) -> None:
    fill(store, 10)
    store.append([rec(11), rec(12)])
    report = store.verify()
    assert report.ok and report.unsigned_tail == 2


def test_edited_record_is_named(store: AuditStore) -> None:
    fill(store, 30)
    all_rows = rows(store.path)
    all_rows[11][1] = all_rows[11][1].replace('"status":200', '"status":201')
    rewrite(store.path, all_rows)
    assert problems(store) == [("edited", 12)]


def test_edit_with_recomputed_hash_is_caught_by_the_chain_and_checkpoint(store: AuditStore) -> None:
    fill(store, 30)
    all_rows = rows(store.path)
    all_rows[11][1] = all_rows[11][1].replace('"status":200', '"status":201')
    all_rows[11][3] = hashlib.sha256(all_rows[11][2] + all_rows[11][1].encode()).digest()
    rewrite(store.path, all_rows)
    found = problems(store)
    assert ("deleted", 13) in found  # the record that preceded 13 is not the one it chained to
    # rewriting the whole rest of the chain still contradicts the signed checkpoints
    for i in range(12, 30):
        all_rows[i][2] = all_rows[i - 1][3]
        all_rows[i][3] = hashlib.sha256(all_rows[i][2] + all_rows[i][1].encode()).digest()
    rewrite(store.path, all_rows)
    assert problems(store) == [("checkpoint", 20), ("checkpoint", 30)]


def test_deleted_record_is_named(store: AuditStore) -> None:
    fill(store, 30)
    all_rows = rows(store.path)
    rewrite(store.path, all_rows[:6] + all_rows[8:])
    assert problems(store) == [("deleted", 7)]
    report = store.verify()
    assert "records 7-8 are missing" in report.problems[0].detail


def test_deleted_and_renumbered_is_named(store: AuditStore) -> None:
    fill(store, 30)
    all_rows = rows(store.path)
    del all_rows[6]
    for i, row in enumerate(all_rows):
        row[0] = i + 1
    rewrite(store.path, all_rows)
    found = problems(store)
    assert found[0] == ("deleted", 7)
    assert ("deleted", 30) in found  # checkpoint 30 signed a record that no longer exists


def test_deleted_tail_covered_by_a_checkpoint(store: AuditStore) -> None:
    fill(store, 30)
    rewrite(store.path, rows(store.path)[:25])
    assert problems(store) == [("deleted", 30)]


@pytest.mark.parametrize("forge_links", [False, True])
def test_inserted_record_is_named(store: AuditStore, forge_links: bool) -> None:
    fill(store, 30)
    all_rows = rows(store.path)
    fake = rec(999, path="/forged").copy()
    body = canonical(fake).decode()
    prev = all_rows[9][3] if forge_links else b"\x00" * 32
    all_rows.insert(10, [0, body, prev, hashlib.sha256(prev + body.encode()).digest()])
    for i, row in enumerate(all_rows):
        row[0] = i + 1
    rewrite(store.path, all_rows)
    found = problems(store)
    assert found[0] == ("inserted", 11), found


def test_reordered_records_are_named(store: AuditStore) -> None:
    fill(store, 30)
    all_rows = rows(store.path)
    all_rows[14][1:], all_rows[15][1:] = all_rows[15][1:], all_rows[14][1:]
    rewrite(store.path, all_rows)
    assert problems(store) == [("reordered", 15)]


def test_forged_checkpoint_signature(store: AuditStore) -> None:
    fill(store, 20)
    with attacker(store.path) as db:
        db.execute("UPDATE checkpoints SET signature = ? WHERE seq = 10", (b"\x01" * 64,))
    assert problems(store) == [("signature", 10)]


def test_verify_needs_the_right_public_key(store: AuditStore, tmp_path: Path) -> None:
    fill(store, 10)
    other = AuditStore(tmp_path / "other.db")
    key = signing.load_public(signing.public_path(other.key_path))
    assert [p.kind for p in store.verify(key).problems] == ["signature"]
    other.close()


def test_retention_keeps_the_rest_verifiable(store: AuditStore) -> None:
    fill(store, 30)
    now = time.time()
    assert store.apply_retention(days=730, now=now) == 0
    deleted = store.apply_retention(days=1, now=now + 2 * 86400)
    assert deleted == 30  # every checkpoint is old enough: up to the newest
    store.append([rec(31), rec(32)])
    store.checkpoint()
    report = store.verify(now=now + 2 * 86400)
    assert report.ok, report.problems
    assert report.anchor_seq == 30 and report.first_seq == 31 and report.records == 2


def test_retention_stops_at_a_checkpoint(store: AuditStore) -> None:
    fill(store, 25)
    with attacker(store.path) as db:  # only checkpoint 10 is old
        db.execute("UPDATE checkpoints SET created = '2020-01-01T00:00:00.000000Z' WHERE seq = 10")
    # re-sign checkpoint 10 with its new date so the test exercises retention, not forgery
    key = store._key
    assert key is not None
    message = store._checkpoint_message(10, rows(store.path)[9][3], "2020-01-01T00:00:00.000000Z")
    with attacker(store.path) as db:
        db.execute("UPDATE checkpoints SET signature = ? WHERE seq = 10", (key.sign(message),))
    assert store.apply_retention(days=730) == 10
    assert store.verify().ok
    assert [r["seq"] for r in store.query(limit=None)][:2] == [11, 12]


def test_early_deletion_disguised_as_retention(store: AuditStore) -> None:
    fill(store, 30)
    checkpoint = rows(store.path)[19][3]
    all_rows = rows(store.path)[20:]
    rewrite(store.path, all_rows)
    with attacker(store.path) as db:
        db.execute("UPDATE meta SET value = '20' WHERE key = 'anchor_seq'")
        db.execute("UPDATE meta SET value = ? WHERE key = 'anchor_hash'", (checkpoint.hex(),))
    assert problems(store) == [("retention", 20)]
    with attacker(store.path) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'anchor_hash'", ("00" * 32,))
    assert ("retention", 20) in problems(store)


def test_query_filters(store: AuditStore) -> None:
    fill(store, 100)
    assert len(store.query(limit=None)) == 100
    assert {r["status"] for r in store.query(status=503, limit=None)} == {503}
    assert len(store.query(status=503, limit=None)) == 20
    assert len(store.query(status_class=5, limit=None)) == 20
    assert len(store.query(status_class=2, route="a", limit=None)) == 40
    subject = f"{1:064x}"
    assert all(r["subject"] == subject for r in store.query(subject=subject.upper(), limit=None))
    assert len(store.query(subject=subject, limit=None)) == 34
    got = store.query(
        since="2026-01-01T00:00:10.000000Z", until="2026-01-01T00:00:20.000000Z", limit=None
    )
    assert [r["id"] for r in got] == [f"req-{i}" for i in range(10, 20)]
    assert len(store.query(limit=7)) == 7


def test_full_store_refuses_and_keeps_nothing_half_written(tmp_path: Path) -> None:
    store = AuditStore(tmp_path / "audit.db", max_bytes=64 * 1024)
    big = "x" * 1500
    stored = 0
    with pytest.raises(StoreError, match="full"):
        for i in range(1, 1000):
            store.append([rec(i, path=big)], JournalPosition("n", "/j", 1, i))
            stored = i
    assert store.count() == stored
    assert store.journal_position("n") == JournalPosition("n", "/j", 1, stored)
    assert store.head()[0] == stored
    store.set_max_bytes(10 * 1024 * 1024)  # room again: the chain continues seamlessly
    store.append([rec(stored + 1)])
    store.checkpoint()
    assert store.verify().ok and store.count() == stored + 1
    store.close()


def test_not_an_audit_store(tmp_path: Path) -> None:
    bogus = tmp_path / "x.db"
    bogus.write_bytes(b"hello, not sqlite" * 100)
    with pytest.raises(StoreError, match=r"not an audit store|cannot open"):
        AuditStore(bogus)
    with pytest.raises(StoreError, match="no audit store"):
        AuditStore(tmp_path / "missing.db", readonly=True)
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError):
        AuditStore(tmp_path / "dir.db")


def test_readonly_store_refuses_writes(store: AuditStore) -> None:
    fill(store, 3)
    ro = AuditStore(store.path, readonly=True)
    assert ro.count() == 3 and ro.verify().ok
    with pytest.raises(StoreError, match="read-only"):
        ro.append([rec(4)])
    ro.close()


# ------------------------------------------------------------------ records from log lines


def test_record_from_access_log_line() -> None:
    state = json.dumps(
        {
            "v": 1,
            "subject": "AB" * 32,
            "salt_id": "k",
            "subject_source": "jwt_authn",
            "tenant": "t",
            "body": "hashed",
            "body_sha256": "cd" * 32,
            "trace_id": "ef" * 16,
        }
    )
    line = json.dumps(
        {
            "id": "abc",
            "time": "2026-01-01T00:00:00.000001Z",
            "method": "POST",
            "authority": "h",
            "path": "/x" * 2000,
            "status": 200,
            "duration_us": "1234",
            "duration_ms": 1,
            "upstream_cluster": "c",
            "route": "r",
            "principal": None,
            "flags": "-",
            "audit": state,
        }
    ).encode()
    r = from_log_line(line, "edge~0")
    assert r["audited"] and r["subject"] == "ab" * 32 and r["body_sha256"] == "cd" * 32
    assert r["duration_us"] == 1234 and r["status"] == 200 and r["principal"] is None
    assert r["flags"] is None and r["source"] == "edge~0" and len(r["path"]) == 2048
    assert r["truncated"] == ["path"]


BARE_FIELDS = {"audit_v": "1", "salt_id": "k1", "subject_source": "jwt_headers"}


def test_bare_filter_state_with_its_access_log_fields() -> None:
    """jwt_headers mode without body hashing: the filter state is the subject (or null) and
    Envoy writes the other audit fields next to it (filters.access_log_format)."""
    entry = {"status": 200, "audit": "AB" * 32, "tenant": "acme", **BARE_FIELDS}
    r = from_log_line(json.dumps(entry).encode(), "n")
    assert r["audited"] and r["subject"] == "ab" * 32 and r["tenant"] == "acme"
    assert r["salt_id"] == "k1" and r["subject_source"] == "jwt_headers"
    assert r["body"] == "off" and r["body_sha256"] is None and "error" not in r
    r = from_log_line(json.dumps({**entry, "audit": "null", "tenant": None}).encode(), "n")
    assert r["audited"] and r["subject"] is None and r["tenant"] is None
    assert r["salt_id"] == "k1" and "error" not in r
    # an all-digit subject is still a subject, not a JSON number
    r = from_log_line(json.dumps({**entry, "audit": "1" * 64}).encode(), "n")
    assert r["subject"] == "1" * 64
    # tenant: capped and flagged like the filter's; a non-string claim as compact JSON
    r = from_log_line(json.dumps({**entry, "tenant": "t" * 300}).encode(), "n")
    assert r["tenant"] == "t" * 128 and r["truncated"] == ["tenant"]
    r = from_log_line(json.dumps({**entry, "tenant": {"a": [1]}}).encode(), "n")
    assert r["tenant"] == '{"a":[1]}'
    canonical(r)


def test_non_string_fields_are_kept_as_json() -> None:
    """An object where the id belongs (a fuzzer's line) crashed the parser with TypeError:
    every text field takes whatever JSON value a hostile line puts there."""
    line = {"id": {"id": "x"}, "path": ["/a"], "method": 7, "status": 200, "audit": None}
    r = from_log_line(json.dumps(line).encode(), "n")
    assert r["id"] == '{"id":"x"}' and r["path"] == '["/a"]' and r["method"] == "7"
    canonical(r)


def test_integers_past_64_bits_are_dropped() -> None:
    """A duration of 10**31 (a fuzzer's line) does not fit the stores' BIGINT and failed the
    insert of its whole batch: such a number is no number."""
    big = {"status": "200", "duration_us": 8 * 10**31, "audit": None}
    r = from_log_line(json.dumps(big).encode(), "n")
    assert r["status"] == 200 and r["duration_us"] is None
    r = from_log_line(json.dumps({**big, "duration_us": str(2**63)}).encode(), "n")
    assert r["duration_us"] is None
    r = from_log_line(json.dumps({**big, "duration_us": 2**63 - 1}).encode(), "n")
    assert r["duration_us"] == 2**63 - 1


def test_not_audited_lines_ignore_the_bare_fields() -> None:
    """A request the filter never saw (jwt_authn or the codec answered first) has no filter
    state: the constant fields Envoy logs anyway do not make it look audited."""
    r = from_log_line(json.dumps({"status": 401, "audit": None, **BARE_FIELDS}).encode(), "n")
    assert not r["audited"] and r["salt_id"] is None and r["subject_source"] is None
    assert "error" not in r


@pytest.mark.parametrize("state", ["ab" * 31, "zz" * 32, "ab" * 33, "Null", '"' + "ab" * 32 + '"'])
def test_bad_bare_filter_state_is_flagged(state: str) -> None:
    r = from_log_line(json.dumps({"status": 200, "audit": state, **BARE_FIELDS}).encode(), "n")
    assert r["error"] and not r["audited"] and r["subject"] is None


@pytest.mark.parametrize("fields", [{}, {"audit_v": "2"}, {"audit_v": 1}])
def test_bare_filter_state_without_its_fields_is_flagged(fields: dict[str, Any]) -> None:
    r = from_log_line(json.dumps({"status": 200, "audit": "ab" * 32, **fields}).encode(), "n")
    assert r["error"] == "audit filter state without its access log fields"
    assert not r["audited"] and r["subject"] is None


@pytest.mark.parametrize(
    "line", [b"", b"{", b"[1]", b"\xff\xfe", b'"str"', b"{" * 10000, b"[" * 100000]
)
def test_unparseable_line_is_kept_not_dropped(line: bytes) -> None:
    r = from_log_line(line, "n")
    assert r["error"] and r["raw_sha256"] == hashlib.sha256(line).hexdigest()
    canonical(r)  # always storable


def test_bad_filter_state_is_flagged() -> None:
    r = from_log_line(
        json.dumps({"status": "503", "audit": "{oops", "duration_ms": "7"}).encode(), "n"
    )
    assert r["error"] == "audit filter state is not JSON" and not r["audited"]
    assert r["status"] == 503 and r["duration_us"] == 7000


@pytest.mark.parametrize(
    ("traceparent", "b3", "expected"),
    [
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            None,
            "0af7651916cd43dd8448eb211c80319c",
        ),
        (
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            None,
            "0af7651916cd43dd8448eb211c80319c",
        ),
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None, None),
        ("00-0af7651916cd43dd8448eb211c80319c", None, None),
        ("00-0af7651916cd43dd8448eb211c8031zz-b7ad6b7169203331-01", None, None),
        ("zz" * 64, "463ac35c9f6413ad", "463ac35c9f6413ad"),
        (None, "463ac35c9f6413ad48485a3953bb6124", "463ac35c9f6413ad48485a3953bb6124"),
        (None, "463ac35c9f6413a", None),
        (None, "\ufffd" * 16, None),
        (None, None, None),
    ],
)
def test_trace_id(traceparent: str | None, b3: str | None, expected: str | None) -> None:
    assert trace_id(traceparent, b3) == expected
    line = json.dumps({"traceparent": traceparent, "b3_trace_id": b3}).encode()
    assert from_log_line(line, "n")["trace_id"] == expected
