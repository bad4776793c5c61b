"""The audit trail against its own store's writer (issue 41, item 5): someone who can write the
store (raw SQL with the triggers out of the way, as on SQLite or as the database's owner) but
holds no signing key and cannot write the witness. Each attack the issue lists is reproduced as
a user would, through `meshfn audit`, on both stores, and `meshfn audit verify` (with the public
key and the witness) exits 1 naming it: kind, journal and range. Where the store refuses an
attack before it happens (the signer's retention, the anchor trigger), that is shown too.
On PostgreSQL, verify and query run as the readers' role."""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from meshfn.audit import layout
from meshfn.audit.cli import audit_app
from meshfn.audit.store import StoreError
from meshfn.testing.audit import Raw, Trail

SALT = "cd" * 16
GATEWAY, MODELS = "gateway", "models.default:15101"
FORBIDDEN = 46  # the count of 403s


def subject_of(raw: str) -> str:
    return hmac.new(bytes.fromhex(SALT), raw.encode(), "sha256").hexdigest()


def rec(i: int) -> dict[str, Any]:
    return {
        "v": 2,
        "time": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}.000000Z",
        "method": "POST",
        "path": f"/v2/models/iris/infer?{i}",
        "status": 403 if i < FORBIDDEN else 200,
        "route": "default/function-iris",
        "subject": subject_of("alice") if i % 20 == 0 and i < 100 else subject_of(f"user-{i % 7}"),
        "salt_id": "s",
        "tenant": "t",
    }


@dataclass
class Rig:
    trail: Trail
    state: Path
    reader: str  # where verify and query read: the file, or the readers' role
    # where a query by subject reads (and records that it did): the file, or the auditors' role
    auditor: str

    def audit(self, *args: str) -> tuple[int, str]:
        keys = ["--public-key", str(layout.public_key_path(self.state))]
        witness = ["--witness", str(layout.witness_path(self.state))]
        command, *rest = args
        extra = keys + witness if command == "verify" else []
        store = self.auditor if "--subject-raw" in rest or "--subject" in rest else self.reader
        result = CliRunner().invoke(audit_app, [command, "--store", store, *extra, *rest])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        return result.exit_code, result.output

    def query(self, *filters: str) -> list[dict[str, Any]]:
        code, output = self.audit("query", "--json", "--limit", "100000", *filters)
        assert code == 0, output
        return [json.loads(line) for line in output.splitlines()]

    def raw(self, *statements: str | tuple[str, tuple[Any, ...]]) -> None:
        raw = Raw(self.trail.location)
        try:
            for statement in statements:
                sql, args = statement if isinstance(statement, tuple) else (statement, ())
                raw.run(sql, args)
        finally:
            raw.close()


def make_rig(location: str, tmp_path: Path) -> Rig:
    """100 requests through the models' sidecar (46 refused with 403, 5 of alice's), 20
    through the gateway, all signed and witnessed, laid out as `meshfn up` lays it out."""
    state = tmp_path / "state"
    trail = Trail(location, state)
    trail.store.append([rec(i) for i in range(100)], chain=MODELS)
    trail.store.append([rec(i + 100) for i in range(20)], chain=GATEWAY)
    trail.checkpoint()
    return Rig(
        trail, state, trail.roles.get("reader", location), trail.roles.get("auditor", location)
    )


@pytest.fixture
def rig(location: str, tmp_path: Path) -> Iterator[Rig]:
    made = make_rig(location, tmp_path)
    yield made
    made.trail.close()


def test_the_rig_verifies(rig: Rig) -> None:
    code, output = rig.audit("verify")
    assert code == 0 and "ok: 120 record(s) in 2 chain(s), chains intact" in output, output
    assert len(rig.query("--status", "403")) == FORBIDDEN
    assert len(rig.query("--subject-raw", "alice", "--salt", SALT)) == 5


def test_prune_days_0_is_refused_by_the_signer(rig: Rig, tmp_path: Path) -> None:
    """`meshfn audit prune --days 0` then verify: the signer (730 days) witnesses no such
    prune, so nothing is deleted; the collectors' own deletion with made-up prune points is
    refused by the store (no witnessed prune names them)."""
    with rig.trail.serving(f"unix:{tmp_path / 'signer.sock'}") as address:
        result = CliRunner().invoke(
            audit_app,
            ["prune", "--store", rig.trail.location, "--signer", address, "--days", "0"],
        )
    assert result.exit_code == 2, result.output
    assert "refused" in result.output and "retention is 730 day(s)" in result.output
    head = rig.trail.store.head(MODELS)
    with pytest.raises(StoreError, match="only to a prune the signer witnessed"):
        rig.trail.store.apply_prune({MODELS: (head[0], head[1], 99)})
    code, output = rig.audit("verify")
    assert code == 0 and "ok: 120 record(s) in 2 chain(s)" in output, output


def _head(rig: Rig, chain: str) -> tuple[int, bytes]:
    return rig.trail.store.head(chain)


def test_anchors_moved_and_retention_zeroed_by_sql_is_named_as_deletion(rig: Rig) -> None:
    """Raw SQL moves chains.anchor_seq to each head, sets the store's retention_days to 0 and
    deletes every signed record: verify names each journal's deleted range."""
    statements: list[str | tuple[str, tuple[Any, ...]]] = [
        "DELETE FROM meta WHERE key = 'retention_days'",
        "INSERT INTO meta (key, value) VALUES ('retention_days', '0')",
    ]
    for chain in (MODELS, GATEWAY):
        seq, digest = _head(rig, chain)
        statements += [
            (
                "UPDATE chains SET anchor_seq = ?, anchor_hash = ? WHERE chain = ?",
                (seq, digest, chain),
            ),
            ("DELETE FROM records WHERE chain = ?", (chain,)),
        ]
    rig.raw(*statements)
    assert rig.query() == []
    code, output = rig.audit("verify")
    assert code == 1, output
    for chain, last in ((MODELS, 100), (GATEWAY, 20)):
        assert (
            f"deleted: seq 1: journal {chain}: records 1-{last} were removed, but no prune the"
            " signer witnessed covers them (the signer never witnessed a prune of this"
            " journal): deleted, not retention"
        ) in " ".join(output.split()), output
    assert "TAMPERED: 2 problem(s)" in output


def test_an_anchor_moved_past_a_witnessed_prune_is_named(location: str, tmp_path: Path) -> None:
    """A real prune (1-day retention) reaches record 50; the writer then moves the anchor to
    100 and deletes the rest: only 51-100 are named."""
    state = tmp_path / "state"
    trail = Trail(location, state, retention_days=1)
    try:
        trail.store.append([rec(i) for i in range(50)], chain=MODELS)
        trail.checkpoint(now=1_000_000.0)
        trail.store.append([rec(i) for i in range(50, 100)], chain=MODELS)
        trail.checkpoint()
        assert trail.prune() == 50  # the first checkpoint is decades old
        seq, digest = trail.store.head(MODELS)
        witnessed = trail.witness.read()[0][-1]
        assert witnessed.prune[MODELS][0] == 50
        with pytest.raises(StoreError, match="only to a prune the signer witnessed"):
            trail.store.apply_prune({MODELS: (seq, digest, witnessed.n)})  # it says 50, not 100
        rig = Rig(
            trail, state, trail.roles.get("reader", location), trail.roles.get("auditor", location)
        )
        assert rig.audit("verify")[0] == 0
        rig.raw(
            ("UPDATE chains SET anchor_seq = ?, anchor_hash = ?", (seq, digest)),
            "DELETE FROM records",
        )
        code, output = rig.audit("verify")
    finally:
        trail.close()
    assert code == 1, output
    assert (
        f"deleted: seq 51: journal {MODELS}: records 51-100 were removed, but no prune the"
        " signer witnessed covers them (the newest witnessed prune reaches record 50)"
    ) in " ".join(output.split()), output


def _rebuild_with_ordinary_columns(rig: Rig) -> None:
    """SQLite's query columns are generated: rebuild `records` with ordinary ones (PostgreSQL's
    are ordinary already)."""
    if rig.trail.location.startswith("postgresql://"):
        return
    rig.raw(
        "CREATE TABLE plain (id INTEGER PRIMARY KEY, chain TEXT NOT NULL, seq INTEGER NOT NULL,"
        " record TEXT NOT NULL, prev BLOB NOT NULL, hash BLOB NOT NULL, time TEXT,"
        " subject TEXT, status INTEGER, route TEXT)",
        "INSERT INTO plain SELECT id, chain, seq, record, prev, hash, time, subject, status,"
        " route FROM records",
        "DROP TABLE records",
        "ALTER TABLE plain RENAME TO records",
        "CREATE UNIQUE INDEX records_chain_seq ON records (chain, seq)",
        "CREATE INDEX records_subject ON records (subject)",
    )


def _rebuild_with_a_lying_expression(rig: Rig) -> None:
    """SQLite: generated columns still, but `status` computed to hide the 403s."""
    rig.raw(
        "CREATE TABLE plain (id INTEGER PRIMARY KEY, chain TEXT NOT NULL, seq INTEGER NOT NULL,"
        " record TEXT NOT NULL, prev BLOB NOT NULL, hash BLOB NOT NULL,"
        " time TEXT GENERATED ALWAYS AS (json_extract(record, '$.time')) VIRTUAL,"
        " subject TEXT GENERATED ALWAYS AS (json_extract(record, '$.subject')) VIRTUAL,"
        " status INTEGER GENERATED ALWAYS AS (CASE json_extract(record, '$.status') WHEN 403"
        " THEN 200 ELSE json_extract(record, '$.status') END) VIRTUAL,"
        " route TEXT GENERATED ALWAYS AS (json_extract(record, '$.route')) VIRTUAL)",
        "INSERT INTO plain (id, chain, seq, record, prev, hash) SELECT id, chain, seq, record,"
        " prev, hash FROM records",
        "DROP TABLE records",
        "ALTER TABLE plain RENAME TO records",
        "CREATE UNIQUE INDEX records_chain_seq ON records (chain, seq)",
    )


def test_query_columns_rewritten_to_hide_403s_are_named(rig: Rig) -> None:
    """`records` rebuilt with ordinary columns and `status=200 WHERE status=403`: query
    --status 403 goes from 46 records to 0; verify names every one of them."""
    _rebuild_with_ordinary_columns(rig)
    rig.raw("UPDATE records SET status = 200 WHERE status = 403")
    _forbidden_are_named(rig)


def test_a_generated_column_that_lies_is_named(tmp_path: Path) -> None:
    """SQLite: `records` rebuilt with generated columns still, but a `status` that computes
    200 for a 403: not meshfn's definition, so verify compares every row, and names them."""
    rig = make_rig(str(layout.store_path(tmp_path / "state")), tmp_path)
    try:
        _rebuild_with_a_lying_expression(rig)
        _forbidden_are_named(rig)
    finally:
        rig.trail.close()


def _forbidden_are_named(rig: Rig) -> None:
    assert rig.query("--status", "403") == []
    code, output = rig.audit("verify")
    assert code == 1, output
    for seq in range(1, FORBIDDEN + 1):
        assert (
            f"edited: seq {seq}: journal {MODELS}: record {seq}: its query columns (time,"
            " subject, status, route) disagree with its content"
        ) in " ".join(output.split()), output
    assert f"TAMPERED: {FORBIDDEN} problem(s)" in output


@pytest.mark.parametrize("how", ["column", "link"])
def test_a_subject_hidden_from_subject_raw_is_named(rig: Rig, how: str) -> None:
    """Alice's 5 records disappear from `query --subject-raw alice`: her records' subject
    column blanked (a rebuilt table on SQLite), or her pseudonym's link deleted without an
    erasure. verify names the records either way."""
    hmac_ = subject_of("alice")
    pseudonym = rig.query("--subject-raw", "alice", "--salt", SALT)[0]["subject"]
    if how == "column":
        _rebuild_with_ordinary_columns(rig)
        rig.raw(("UPDATE records SET subject = NULL WHERE subject = ?", (pseudonym,)))
    else:
        rig.raw(("DELETE FROM subjects WHERE hash = ?", (hmac_,)))
    assert rig.query("--subject-raw", "alice", "--salt", SALT) == []
    code, output = rig.audit("verify")
    assert code == 1, output
    text = " ".join(output.split())
    if how == "column":
        for seq in (1, 21, 41, 61, 81):
            assert f"edited: seq {seq}: journal {MODELS}: record {seq}: its query columns" in text
    else:
        assert (
            f"unlinked: seq 1: 5 record(s) carry a pseudonym the store no longer links to its"
            f" subject (e.g. journal {MODELS} record 1, journal {MODELS} record 21, journal"
            f" {MODELS} record 41, journal {MODELS} record 61, journal {MODELS} record 81), but"
            " the erasure records account for 0"
        ) in text, output


def test_a_recorded_erasure_is_not_an_attack(rig: Rig) -> None:
    assert rig.trail.owner.erase(subject_of("alice")) is not None
    rig.trail.checkpoint()
    code, output = rig.audit("verify")
    assert code == 0, output


def test_verify_names_the_unsigned_tail_per_journal(rig: Rig) -> None:
    rig.trail.store.append([rec(i) for i in range(200, 203)], chain=MODELS)
    rig.trail.store.append([rec(300)], chain=GATEWAY)
    code, output = rig.audit("verify")
    assert code == 0, output
    assert "4 record(s) after it not yet signed" in output
    assert f"unsigned: journal {MODELS}: records 101-103 (3) not yet signed" in output
    assert f"unsigned: journal {GATEWAY}: record 21 (1) not yet signed" in output
    # and when something else is wrong too
    rig.raw(("DELETE FROM records WHERE chain = ? AND seq = 7", (MODELS,)))
    code, output = rig.audit("verify")
    assert code == 1 and f"unsigned: journal {GATEWAY}: record 21 (1) not yet signed" in output
