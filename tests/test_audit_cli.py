"""`meshfn audit verify|query|prune` on real stores: exit codes, messages that name the broken
record, filters, and clear errors (never a traceback) for bad input."""

from __future__ import annotations

import hmac
import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshfn.control_plane.audit.cli import audit_app, parse_time
from meshfn.control_plane.audit.store import AuditStore

runner = CliRunner()
SALT = "ab" * 16


def make_store(path: Path, n: int = 20) -> None:
    store = AuditStore(path)
    subject = hmac.new(bytes.fromhex(SALT), b"alice", "sha256").hexdigest()
    store.append(
        [
            {
                "v": 1,
                "time": f"2026-01-01T00:00:{i:02d}.000000Z",
                "method": "GET",
                "path": f"/p{i}",
                "status": 503 if i % 4 == 0 else 200,
                "route": "a" if i % 2 else "b",
                "subject": subject if i < 5 else None,
                "tenant": "t",
                "duration_us": 10,
            }
            for i in range(n)
        ]
    )
    store.checkpoint()
    store.close()


def test_verify_ok_and_tampered(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    make_store(db)
    result = runner.invoke(audit_app, ["verify", "--store", str(db)])
    assert result.exit_code == 0, result.output
    assert "ok: 20 record(s) (records 1-20), chain intact" in result.output
    with sqlite3.connect(db) as conn:  # an attacker drops the append-only triggers first
        for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'"):
            conn.execute(f"DROP TRIGGER {name}")
        conn.execute("UPDATE records SET record = replace(record, '/p7', '/p8') WHERE seq = 8")
        conn.execute("DELETE FROM records WHERE seq = 12")
    result = runner.invoke(audit_app, ["verify", "--store", str(db)])
    assert result.exit_code == 1
    assert "edited: seq 8: record 8 does not match its hash" in result.output
    assert "deleted: seq 12: records 12 are missing" in result.output
    assert "TAMPERED: 2 problem(s)" in result.output
    result = runner.invoke(audit_app, ["verify", "--store", str(db), "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 1 and not report["ok"]
    assert [(p["kind"], p["seq"]) for p in report["problems"]] == [("edited", 8), ("deleted", 12)]


def test_verify_errors_are_clear(tmp_path: Path) -> None:
    result = runner.invoke(audit_app, ["verify", "--store", str(tmp_path / "none.db")])
    assert result.exit_code == 2 and "no audit store here" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    db = tmp_path / "audit.db"
    make_store(db)
    bad_key = tmp_path / "key.pem"
    bad_key.write_text("not a key")
    result = runner.invoke(audit_app, ["verify", "--store", str(db), "--public-key", str(bad_key)])
    assert result.exit_code == 2 and "cannot load the audit public key" in result.output
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"x" * 4096)
    result = runner.invoke(audit_app, ["verify", "--store", str(junk)])
    assert result.exit_code == 2 and "error:" in result.output


def test_query_filters(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    make_store(db)

    def q(*args: str) -> list[dict[str, object]]:
        result = runner.invoke(audit_app, ["query", "--store", str(db), "--json", *args])
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in result.output.splitlines()]

    assert len(q()) == 20
    assert [r["seq"] for r in q("--status", "503")] == [1, 5, 9, 13, 17]
    assert len(q("--status", "5xx")) == 5 and len(q("--status", "2xx", "--route", "a")) == 10
    assert len(q("--subject-raw", "alice", "--salt", SALT)) == 5
    subject = hmac.new(bytes.fromhex(SALT), b"alice", "sha256").hexdigest()
    assert len(q("--subject", subject.upper())) == 5
    got = q("--since", "2026-01-01T00:00:05Z", "--until", "2026-01-01 00:00:08")
    assert [r["path"] for r in got] == ["/p5", "/p6", "/p7"]
    assert len(q("--limit", "3")) == 3
    table = runner.invoke(audit_app, ["query", "--store", str(db), "--status", "503"])
    assert table.exit_code == 0 and "5 record(s)" in table.output and "/p4" in table.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--status", "abc"], "use a status code"),
        (["--since", "yesterday"], "is not a time"),
        (["--subject", "xyz"], "64 hex digits"),
        (["--subject-raw", "alice"], "needs --salt"),
        (["--subject-raw", "a", "--salt", SALT, "--subject", "ab" * 32], "not both"),
        (["--limit", "0"], "limit"),
    ],
)
def test_query_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    db = tmp_path / "audit.db"
    make_store(db, 2)
    result = runner.invoke(audit_app, ["query", "--store", str(db), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_prune(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    make_store(db)
    result = runner.invoke(audit_app, ["prune", "--store", str(db), "--days", "730"])
    assert result.exit_code == 0 and "deleted 0 record(s)" in result.output
    result = runner.invoke(audit_app, ["prune", "--store", str(db), "--days", "0"])
    assert result.exit_code == 0 and "deleted 20 record(s)" in result.output
    # retention with 0 days is only legitimate because it was configured: verify says so
    assert runner.invoke(audit_app, ["verify", "--store", str(db)]).exit_code == 0


def test_collect_bad_journal_argument(tmp_path: Path) -> None:
    result = runner.invoke(
        audit_app, ["collect", "--store", str(tmp_path / "a.db"), "--journal", "nopath"]
    )
    assert result.exit_code == 2 and "SOURCE=PATH" in result.output


def test_parse_time() -> None:
    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert parse_time("2026-01-31") == "2026-01-31T00:00:00.000000Z"
    assert parse_time("2026-01-31T12:00:00+02:00") == "2026-01-31T10:00:00.000000Z"
    assert parse_time("90m", now) == "2026-03-01T10:30:00.000000Z"
    assert parse_time("7d", now) == "2026-02-22T12:00:00.000000Z"
