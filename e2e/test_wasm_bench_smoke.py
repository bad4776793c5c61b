"""bench/filters.py runs end to end (tiny sizes), prints its one summary line and writes JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCH = Path(__file__).resolve().parents[1] / "bench" / "filters.py"


def test_filters_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "filters.json"
    result = subprocess.run(
        [sys.executable, "-P", str(BENCH), "--requests", "20", "--rounds", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    number = r"-?\d+(\.\d+)?"
    assert re.fullmatch(
        rf"filters: audit_cpu_us={number} degrade_cpu_us={number} both_cpu_us={number} "
        rf"both_p50_overhead_us={number} two_plugins_cpu_us={number} both_full_cpu_us={number}",
        line,
    ), line
    data = json.loads(out.read_text())
    assert set(data["configs"]) == {
        "bare",
        "none",
        "audit",
        "degrade",
        "both",
        "two_plugins",
        "both_full",
        "both_trigger",
        "audit_metadata",
    }
    assert all(len(v) == 2 for v in data["cpu_us_paired_differences"].values())
    assert data["configs"]["none"]["cpu_us_median"] > 0
