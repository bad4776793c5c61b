"""bench/chaos.py's short run (20 s of faults, every kind at least once): the whole mesh rides
out a control-plane kill, a backend kill, a sidecar kill, CA and leaf rotation, a collector
restart, valid and invalid reloads, cut control-plane streams and a full audit disk, with no
failed request, a verifying chain, nothing left running and nothing left attached, and the
audit trail as bench/chaos.py's audit_check promises: every answered request recorded exactly
once by the gateway (which no fault kills), no journal line stored twice, a sidecar's record
lost only for a request answered just before that sidecar was SIGKILLed (its unflushed
access-log lines), and a request recorded twice by the sidecars only when the gateway retried
it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from meshfn_e2e import run_bench

KINDS = {
    "cp_kill", "backend_kill", "sidecar_kill", "ca_rotation", "collector_restart",
    "policy_valid", "policy_invalid", "stream_drop", "disk_full",
}  # fmt: skip


def why(data: dict[str, object]) -> dict[str, object]:
    """What a failed run needs to be understood (its temp dir may be gone by then): the
    failures, when they came, and the faults around them."""
    faults = data.get("faults")
    timeline = [
        (f["kind"], round(f["at"], 2), f["target"], f["recovery_ms"])
        for f in faults if isinstance(f, dict)
    ] if isinstance(faults, list) else faults  # fmt: skip
    audit = data.get("audit")
    if isinstance(audit, dict):  # the accounting: what was lost or recorded twice, and where
        keys = ("lost", "twice", "unexplained", "examples", "missing")
        audit = {k: v for k, v in audit.items() if k.endswith(keys)}
    return {
        "failures": data.get("failures"),
        "failure_times_s": data.get("failure_times_s"),
        "faults": timeline,
        "gateway_upstream_stats": data.get("gateway_upstream_stats"),
        "audit": audit,
    }


def test_chaos_soak_short(tmp_path: Path) -> None:
    line, data = run_bench("chaos.py", ["--seconds", "20", "--seed", "7"], tmp_path, timeout=240)
    if not re.match(
        r"^chaos: sent=\d+ failed=0 audit_missing=0 audit_duplicates=0 sidecar_records_lost=\d+ "
        r"executed_twice=\d+ "
        r"chain=ok max_recovery_ms=\d+ cp_rss_growth=[\d.]+ gateway_records_lost=0 "
        r"gateway_records_twice=0 sidecar_lost_unexplained=0 gateway_retries=\d+ "
        r"unrecovered_faults=0 ",
        line,
    ):  # pytest.fail: an assert's message would be cut short, and this one is the diagnosis
        pytest.fail(f"{line}\n{json.dumps(why(data), indent=1)}", pytrace=False)
    assert {f["kind"] for f in data["faults"]} == KINDS
    assert all(f["recovery_ms"] is not None for f in data["faults"])
    assert data["fault_errors"] == [] and data["leftover_processes"] == []
    assert data["ebpf_left"] == [] and data["ebpf_problems"] == []
    audit = data["audit"]
    assert audit["verify_ok"] and audit["records"] >= data["sent"]
    # a sidecar executed a request twice only when the gateway retried it
    assert audit["executed_twice"] <= data["gateway_retries"], why(data)
    assert data["sent"] > 2000  # 200 requests/s through the whole run
