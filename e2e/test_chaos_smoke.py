"""bench/chaos.py's short run (20 s of faults, every kind at least once): the whole mesh rides
out a control-plane kill, a backend kill, a sidecar kill, CA and leaf rotation, a collector
restart, valid and invalid reloads, cut control-plane streams and a full audit disk, with no
failed request, every answered request audited exactly once, a verifying chain, nothing left
running and nothing left attached."""

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
    return {
        "failures": data.get("failures"),
        "failure_times_s": data.get("failure_times_s"),
        "faults": timeline,
        "gateway_upstream_stats": data.get("gateway_upstream_stats"),
    }


def test_chaos_soak_short(tmp_path: Path) -> None:
    line, data = run_bench("chaos.py", ["--seconds", "20", "--seed", "7"], tmp_path, timeout=240)
    if not re.match(
        r"^chaos: sent=\d+ failed=0 audit_missing=0 audit_duplicates=0 sidecar_records_lost=\d+ "
        r"executed_twice=\d+ "
        r"chain=ok max_recovery_ms=\d+ cp_rss_growth=[\d.]+ ",
        line,
    ):  # pytest.fail: an assert's message would be cut short, and this one is the diagnosis
        pytest.fail(f"{line}\n{json.dumps(why(data), indent=1)}", pytrace=False)
    assert {f["kind"] for f in data["faults"]} == KINDS
    assert all(f["recovery_ms"] is not None for f in data["faults"])
    assert data["fault_errors"] == [] and data["leftover_processes"] == []
    assert data["ebpf_left"] == [] and data["ebpf_problems"] == []
    assert data["audit"]["verify_ok"] and data["audit"]["records"] >= data["sent"]
    assert data["sent"] > 2000  # 200 requests/s through the whole run
