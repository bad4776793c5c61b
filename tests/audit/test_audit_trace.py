"""Audit records carry the trace their request was in, and `meshfn audit query --trace ID`
finds them (the record's trace from Envoy's %TRACE_ID%, else the traceparent header)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshfn.audit import layout
from meshfn.audit.cli import audit_app
from meshfn.audit.record import from_log_line
from meshfn.testing.audit import Trail

runner = CliRunner()
TRACED = "4bf92f3577b34da6a3ce929d0e0e4736"
HEADER = "0af7651916cd43dd8448eb211c80319c"


def _line(**fields: str) -> bytes:
    return json.dumps({"id": "r", "status": "200", **fields}).encode()


def test_the_record_takes_the_proxys_trace_before_any_header() -> None:
    traceparent = f"00-{HEADER}-b7ad6b7169203331-01"
    record = from_log_line(_line(trace_id=TRACED, traceparent=traceparent), "gw")
    assert record["trace_id"] == TRACED
    # tracing off: Envoy writes "-"; the headers stand in
    assert from_log_line(_line(trace_id="-", traceparent=traceparent), "gw")["trace_id"] == HEADER
    assert from_log_line(_line(trace_id="0" * 32), "gw")["trace_id"] is None
    assert from_log_line(_line(trace_id="zz" * 16), "gw")["trace_id"] is None


@pytest.fixture
def store(tmp_path: Path) -> Path:
    db = layout.store_path(tmp_path)
    trail = Trail(db, tmp_path)
    trail.store.append(
        [
            {
                "v": 2,
                "time": f"2026-01-01T00:00:{i:02d}.000000Z",
                "path": f"/p{i}",
                "status": 200,
                "trace_id": TRACED if i in (3, 7) else f"{i + 1:032x}",
            }
            for i in range(10)
        ],
        chain="models.default:15101",
    )
    trail.close()
    return db


def _query(db: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(audit_app, ["query", "--store", str(db), *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_audit_query_finds_the_records_of_a_trace(store: Path) -> None:
    code, output = _query(store, "--json", "--trace", TRACED.upper())
    assert code == 0, output
    assert [json.loads(line)["path"] for line in output.splitlines()] == ["/p3", "/p7"]
    code, output = _query(store, "--json", "--trace", "f" * 32)
    assert code == 0 and output.strip() == ""


@pytest.mark.parametrize("bad", ["xyz", "%", "4bf92f3577b34da6a3ce929d0e0e473%", "a" * 33])
def test_a_malformed_trace_id_is_refused(store: Path, bad: str) -> None:
    code, output = _query(store, "--trace", bad)
    assert code == 2 and "32 hex digits" in output and "Traceback" not in output
