"""`meshfn audit verify|query|erase|export|verify-export|prune` on real stores laid out as
`meshfn up` lays them out (store, signer key and witness in their own directories): exit codes,
messages that name the broken journal and record, erasure, exports verified offline by the
standalone checker, and clear errors (never a traceback) for bad input."""

from __future__ import annotations

import ast
import csv
import hmac
import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshfn.audit import layout, offline
from meshfn.audit.cli import audit_app, parse_time
from meshfn.testing.audit import Raw, Trail
from meshfn.testing.postgres import PostgresServer

runner = CliRunner()
SALT = "ab" * 16


def subject_of(raw: str) -> str:
    return hmac.new(bytes.fromhex(SALT), raw.encode(), "sha256").hexdigest()


def make_store(state: Path, n: int = 20, location: str | None = None) -> Path:
    """STATE/audit/audit.db with its signer key, witness and subject salt, as `meshfn up`
    (or the PostgreSQL database `location`, with the key and witness in STATE)."""
    store = layout.store_path(state)
    trail = Trail(location or store, state)
    salt = state / "audit" / "subject.salt"
    salt.parent.mkdir(parents=True, exist_ok=True)
    salt.write_text(SALT + "\n")
    salt.chmod(0o600)
    trail.store.append(
        [
            {
                "v": 2,
                "time": f"2026-01-01T00:00:{i:02d}.000000Z",
                "method": "GET",
                "path": f"/p{i}",
                "status": 503 if i % 4 == 0 else 200,
                "route": "default/a" if i % 2 else "default/function-iris",
                "subject": subject_of("alice") if i < 5 else None,
                "salt_id": "s",
                "tenant": "t",
                "duration_us": 10,
            }
            for i in range(n)
        ],
        chain="models.default:15101",
    )
    trail.checkpoint()
    trail.close()
    return store


def audit(*args: str) -> tuple[int, str]:
    result = runner.invoke(audit_app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_verify_ok_and_tampered(tmp_path: Path) -> None:
    db = make_store(tmp_path)
    code, output = audit("verify", "--store", str(db))
    assert code == 0, output
    assert "ok: 20 record(s) in 1 chain(s), chains intact, 1 signed checkpoint(s)" in output
    assert "witness" in output and "checkpoints.jsonl: 1 checkpoint(s)" in output
    raw = Raw(str(db))
    raw.run("UPDATE records SET record = replace(record, '/p7', '/p8') WHERE seq = 8")
    raw.run("DELETE FROM records WHERE seq = 12")
    raw.close()
    code, output = audit("verify", "--store", str(db))
    assert code == 1
    assert "edited: seq 8: journal models.default:15101: record 8 does not match its hash" in output
    assert "deleted: seq 12: journal models.default:15101: records 12 are missing" in output
    assert "TAMPERED: 2 problem(s)" in output
    code, output = audit("verify", "--store", str(db), "--json")
    report = json.loads(output)
    assert code == 1 and not report["ok"]
    assert [(p["kind"], p["chain"], p["seq"]) for p in report["problems"]] == [
        ("edited", "models.default:15101", 8),
        ("deleted", "models.default:15101", 12),
    ]


def test_verify_names_a_truncated_tail_only_with_the_witness(tmp_path: Path) -> None:
    db = make_store(tmp_path)
    raw = Raw(str(db))
    raw.run("DELETE FROM records WHERE seq > 15")
    raw.run("DELETE FROM checkpoints")
    raw.close()
    code, output = audit("verify", "--store", str(db), "--no-witness")
    assert code == 0 and "NO WITNESS" in output and "note: no witness checked" in output
    code, output = audit("verify", "--store", str(db))
    assert code == 1
    assert "truncated: seq 16: journal models.default:15101: records 16-20 are missing" in output


def test_verify_errors_are_clear(tmp_path: Path) -> None:
    code, output = audit("verify", "--store", str(tmp_path / "none.db"), "--no-witness")
    assert code == 2 and "give --public-key" in output
    db = make_store(tmp_path / "state")
    bad_key = tmp_path / "key.pem"
    bad_key.write_text("not a key")
    code, output = audit("verify", "--store", str(db), "--public-key", str(bad_key))
    assert code == 2 and "cannot load the audit public key" in output
    key = layout.public_key_path(tmp_path / "state")
    code, output = audit("verify", "--store", str(tmp_path / "x.db"), "--public-key", str(key))
    assert code == 2 and "--witness" in output
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"x" * 4096)
    code, output = audit("verify", "--store", str(junk), "--public-key", str(key), "--no-witness")
    assert code == 2 and "error:" in output
    code, output = audit(
        "verify", "--store", "postgresql://meshfn@127.0.0.1:1/x", "--public-key", str(key),
        "--no-witness",
    )  # fmt: skip
    assert code == 2 and "cannot connect" in output


def test_query_filters(tmp_path: Path) -> None:
    db = make_store(tmp_path)

    def q(*args: str) -> list[dict[str, object]]:
        code, output = audit("query", "--store", str(db), "--json", *args)
        assert code == 0, output
        return [json.loads(line) for line in output.splitlines()]

    assert len(q()) == 20
    assert [r["seq"] for r in q("--status", "503")] == [1, 5, 9, 13, 17]
    assert (
        len(q("--status", "5xx")) == 5 and len(q("--status", "2xx", "--route", "default/a")) == 10
    )
    assert len(q("--route", "default/function-iris")) == 10
    assert len(q("--subject-raw", "alice")) == 5  # the salt `meshfn up` keeps beside the store
    assert len(q("--subject-raw", "alice", "--salt", SALT)) == 5
    assert len(q("--subject", subject_of("alice").upper())) == 5
    pseudonym = str(q("--subject-raw", "alice")[0]["subject"])
    assert len(q("--subject", pseudonym)) == 5
    assert q("--chain", "other") == []
    got = q("--since", "2026-01-01T00:00:05Z", "--until", "2026-01-01 00:00:08")
    assert [r["path"] for r in got] == ["/p5", "/p6", "/p7"]
    assert len(q("--limit", "3")) == 3
    code, output = audit("query", "--store", str(db), "--status", "503")
    assert code == 0 and "5 record(s)" in output and "/p4" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--status", "abc"], "use a status code"),
        (["--since", "yesterday"], "is not a time"),
        (["--subject", "xyz"], "64 hex digits"),
        (["--subject-raw", "a", "--salt", "zz"], "needs --salt"),
        (["--subject-raw", "a", "--salt", SALT, "--subject", "ab" * 32], "not both"),
        (["--limit", "0"], "limit"),
    ],
)
def test_query_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    db = make_store(tmp_path, 2)
    code, output = audit("query", "--store", str(db), *args)
    assert code == 2, output
    assert message in output and "Traceback" not in output


def test_erase(tmp_path: Path) -> None:
    db = make_store(tmp_path)
    code, output = audit("erase", "--store", str(db), "--subject-raw", "mallory")
    assert code == 0 and "nothing to erase" in output and "(recorded)" in output
    code, output = audit("erase", "--store", str(db), "--subject-raw", "alice")
    assert code == 0, output
    assert "erased: 5 record(s) can no longer be linked" in output and "@control" in output
    code, output = audit("query", "--store", str(db), "--json", "--subject-raw", "alice")
    assert code == 0 and output.strip() == ""
    code, output = audit("erase", "--store", str(db), "--subject-hash", subject_of("alice"))
    assert code == 0 and "nothing to erase" in output
    code, output = audit("erase", "--store", str(db))
    assert code == 2 and "give --subject-raw or --subject-hash" in output
    code, output = audit("erase", "--store", str(db), "--subject-hash", "nothex")
    assert code == 2 and "64 hex digits" in output
    # every attempt is recorded: who, the destroyed pseudonym, how many records; never alice
    code, output = audit("query", "--store", str(db), "--accessed", "--json")
    rows = [json.loads(line) for line in output.splitlines()]
    assert [(r["event"], r["action"], r["records"]) for r in rows] == [  # newest first
        ("access", "erase", 0),  # alice again: nothing left to erase
        ("access", "query", 0),  # the query after the erasure: nothing came back
        ("erasure", "erase", 5),
        ("access", "erase", 0),  # mallory: unknown
    ]
    assert all(r["via"] == "cli" and r["principal"].startswith("local:") for r in rows)
    assert len(rows[2]["pseudonyms"]) == 1 and "alice" not in output
    assert subject_of("alice") not in output
    # the erasure and access records are not signed yet; everything else still verifies
    code, output = audit("verify", "--store", str(db))
    assert code == 0 and "4 record(s) after it not yet signed" in output, output


def test_erase_redacts_the_journals_left_in_the_state_directory(tmp_path: Path) -> None:
    """No control plane running: the CLI overwrites the subject's HMAC in every journal file
    (the current one and a rotated one), keeps the stored position's fingerprint in step, and
    leaves everyone else's lines alone."""
    from meshfn.audit.collector import AuditCollector
    from meshfn.audit.stores import open_store
    from meshfn.contracts.journal import ERASED_SUBJECT, journal_path

    db = make_store(tmp_path)
    journal = journal_path(tmp_path, "edge.ingress")
    journal.parent.mkdir(parents=True, exist_ok=True)

    def line(i: int, who: str) -> str:
        state = json.dumps({"subject": subject_of(who), "salt_id": "s", "tenant": "t"})
        return json.dumps({"id": f"r{i}", "time": f"2026-01-02T00:00:{i:02d}.000000Z",
                           "method": "GET", "path": f"/j{i}", "status": 200, "audit": state})  # fmt: skip

    rotated = journal.with_name(journal.name + ".1700000000000")
    rotated.write_text("".join(line(i, "alice") + "\n" for i in range(2)))
    journal.write_text("".join(line(i, ("alice", "bob")[i % 2]) + "\n" for i in range(2, 8)))
    store = open_store(str(db))
    collector = AuditCollector(store)
    collector.watch(journal, "edge.ingress")
    assert collector._tick()  # the first lines stored (the subject's among them)
    store.close()
    with journal.open("a") as out:  # written after the collector stopped: not stored yet
        out.write(line(8, "alice") + "\n")
    code, output = audit("erase", "--store", str(db), "--subject-raw", "alice")
    assert code == 0 and "6 copy(ies) of the subject's HMAC overwritten" in output, output
    assert "erased: 8 record(s)" in output  # 5 of the store, 3 the collector stored
    assert subject_of("alice") not in journal.read_text() + rotated.read_text()
    assert journal.read_text().count(subject_of("bob")) == 3  # the others' lines untouched
    assert journal.read_text().count(ERASED_SUBJECT) == 4
    # the next collector goes on where the last stopped: nothing twice, the new line erased
    store = open_store(str(db))
    collector = AuditCollector(store)
    collector.watch(journal, "edge.ingress")
    assert collector._tick()
    rows = store.query(chain="edge.ingress", limit=None)
    assert [r["path"] for r in rows] == [f"/j{i}" for i in range(2, 9)]
    assert rows[-1]["subject"] is None and rows[-1]["subject_erased"] is True
    assert store.pseudonyms(subject_of("alice")) == []
    store.close()


def test_offline_checker_needs_nothing_of_meshfn() -> None:
    source = Path(offline.__file__).read_text()
    imported = {
        (node.module or "").split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
    } | {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert imported <= {"__future__", *sys.stdlib_module_names, "cryptography"}, imported


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_export_verifies_offline_and_tampering_shows(tmp_path: Path, fmt: str) -> None:
    db = make_store(tmp_path / "state")
    export = tmp_path / f"export.{fmt}"
    code, output = audit(
        "export", "--store", str(db), "--since", "2026-01-01T00:00:05Z", "--format", fmt,
        "--out", str(export),
    )  # fmt: skip
    assert code == 0 and "exported 15 record(s)" in output, output
    checker = tmp_path / "auditor" / "offline.py"  # a copy, away from meshfn
    checker.parent.mkdir()
    shutil.copy(offline.__file__, checker)
    key = layout.public_key_path(tmp_path / "state")

    def check(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-I", str(checker), str(path), "--public-key", str(key)],
            capture_output=True,
            text=True,
            cwd=checker.parent,
            check=False,
        )

    done = check(export)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 15 record(s) in 1 chain(s) (models.default:15101 6-20)" in done.stdout
    code, output = audit("verify-export", str(export), "--public-key", str(key))
    assert code == 0 and "ok: 15 record(s)" in output
    if fmt == "csv":
        with export.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert rows[1]["type"] == "checkpoint" and rows[2]["path"] == "/p5"
    # an edited record, a cut export, a foreign key
    text = export.read_text()
    edited = tmp_path / f"edited.{fmt}"
    edited.write_text(text.replace('path"":""/p9' if fmt == "csv" else 'path\\":\\"/p9', "XX", 1))
    assert edited.read_text() != text
    assert "(edited)" in check(edited).stdout
    lines = text.splitlines(keepends=True)
    cut = tmp_path / f"cut.{fmt}"
    cut.write_text("".join(lines[:-3]))
    done = check(cut)
    assert done.returncode == 1 and "which no checkpoint signed" in done.stdout
    other = make_store(tmp_path / "other")
    code, output = audit(
        "verify-export",
        str(export),
        "--public-key",
        str(layout.public_key_path(other.parent.parent)),
    )
    assert code == 1 and "signature invalid" in output


def test_prune(tmp_path: Path) -> None:
    """Every prune goes through the signer, which decides how far from its own retention."""
    db = make_store(tmp_path)
    code, output = audit("prune", "--store", str(db))
    assert code == 2 and "every prune is witnessed by the signer" in output, output
    code, output = audit("prune", "--store", "postgresql://x@127.0.0.1:1/db")
    assert code == 2 and "give --signer" in output, output
    trail = Trail(db, tmp_path, retention_days=0)  # the signer restarted with 0 days
    try:
        with trail.serving(layout.signer_socket(tmp_path)):
            code, output = audit("prune", "--store", str(db), "--days", "36500")
            assert code == 0 and "nothing new to prune" in output, output
            assert "deleted 0 record(s)" in output
            code, output = audit("prune", "--store", str(db))
            assert code == 0 and "deleted 20 record(s)" in output, output
            assert "witnessed a prune in checkpoint 2 (retention 0 day(s)): journal" in output
    finally:
        trail.close()
    # retention with 0 days is legitimate only because the signer was set so: verify says so
    code, output = audit("verify", "--store", str(db))
    assert code == 0, output
    assert "retention: 0 day(s), as the signer signed it" in output
    assert "retention changed from 730 to 0 day(s) at checkpoint 2" in output


def test_collect_bad_journal_argument(tmp_path: Path) -> None:
    code, output = audit("collect", "--store", str(tmp_path / "a.db"), "--journal", "nopath")
    assert code == 2 and "SOURCE=PATH" in output


def test_parse_time() -> None:
    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert parse_time("2026-01-31") == "2026-01-31T00:00:00.000000Z"
    assert parse_time("2026-01-31T12:00:00+02:00") == "2026-01-31T10:00:00.000000Z"
    assert parse_time("90m", now) == "2026-03-01T10:30:00.000000Z"
    assert parse_time("7d", now) == "2026-02-22T12:00:00.000000Z"


def test_collect_serves_metrics_and_stops_cleanly(tmp_path: Path) -> None:
    import signal
    import time
    import urllib.request

    from meshfn.testing.ports import free_port

    journal = tmp_path / "j.jsonl"
    journal.write_bytes(b'{"id": "a", "status": 200}\n{broken\n')
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "meshfn.audit.cli", "collect", "--store",
         str(tmp_path / "a.db"), "--journal", f"n={journal}", "--metrics-port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        text = ""
        for _ in range(200):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            except OSError:
                text = ""
            if 'meshfn_audit_records_stored_total{source="n"} 2.0' in text:
                break
            time.sleep(0.05)
        assert 'meshfn_audit_records_stored_total{source="n"} 2.0' in text, text
        assert "meshfn_audit_parse_errors_total 1.0" in text
        assert "meshfn_audit_store_up 1.0" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "no --signer" in err and "stored as an unparsed record" in err


def test_every_command_on_postgresql(pg: PostgresServer, tmp_path: Path) -> None:
    """query, erase, verify, export on a PostgreSQL store: the key, witness and salt given as
    options (nothing lies beside a database), the same answers as on SQLite."""
    dsn = pg.database()
    state = tmp_path / "state"
    make_store(state, location=dsn)
    key = ["--public-key", str(layout.public_key_path(state))]
    witness = ["--witness", str(layout.witness_path(state))]
    code, output = audit("verify", "--store", dsn, *key, *witness)
    assert code == 0 and "ok: 20 record(s) in 1 chain(s)" in output, output
    code, output = audit("verify", "--store", dsn, *key)
    assert code == 2 and "--witness" in output
    code, output = audit("query", "--store", dsn, "--json", "--subject-raw", "alice")
    assert code == 2 and "needs --salt" in output  # no salt beside a database
    code, output = audit(
        "query", "--store", dsn, "--json", "--subject-raw", "alice", "--salt", SALT
    )
    assert code == 0 and len(output.splitlines()) == 5, output
    code, output = audit("erase", "--store", dsn, "--subject-raw", "mallory", "--salt", SALT)
    assert code == 0 and "nothing to erase" in output
    code, output = audit("erase", "--store", dsn, "--subject-raw", "alice", "--salt", SALT)
    assert code == 0 and "erased: 5 record(s)" in output, output
    assert "warning" not in output  # the database kept nothing (testing.postgres: wal_recycle off)
    code, output = audit(
        "query", "--store", dsn, "--json", "--subject-raw", "alice", "--salt", SALT
    )
    assert code == 0 and output.strip() == ""
    code, output = audit("query", "--store", dsn, "--json", "--chain", "@control")
    control = [json.loads(line) for line in output.splitlines()]
    (erasure,) = [r for r in control if r["event"] == "erasure"]
    assert erasure["records"] == 5 and len(erasure["pseudonyms"]) == 1
    assert [r["action"] for r in control] == ["query", "erase", "erase", "query"]
    assert subject_of("alice") not in output and "alice" not in output
    code, output = audit("verify", "--store", dsn, *key, *witness)
    assert code == 0 and "4 record(s) after it not yet signed" in output, output
    export = tmp_path / "export.jsonl"
    code, output = audit(
        "export", "--store", dsn, "--since", "2026-01-01T00:00:00Z", "--out", str(export), *key
    )
    assert code == 0 and "exported 20 record(s)" in output, output
    code, output = audit("verify-export", str(export), *key)
    assert code == 0 and "ok: 20 record(s)" in output, output
