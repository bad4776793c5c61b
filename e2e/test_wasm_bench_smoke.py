"""bench/filters.py runs end to end (tiny sizes), prints its one summary line and writes JSON."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from meshfn_e2e import run_bench

pytestmark = pytest.mark.e2e


def test_filters_bench_smoke(tmp_path: Path) -> None:
    line, data = run_bench("filters.py", ["--requests", "20", "--rounds", "2"], tmp_path)
    number = r"-?\d+(\.\d+)?"
    assert re.fullmatch(
        rf"filters: audit_cpu_us={number} degrade_cpu_us={number} both_cpu_us={number} "
        rf"both_p50_overhead_us={number} both_subjects_cpu_us={number} "
        rf"two_plugins_cpu_us={number} both_full_cpu_us={number}",
        line,
    ), line
    assert set(data["configs"]) == {
        "bare",
        "none",
        "audit",
        "degrade",
        "both",
        "both_subjects",
        "two_plugins",
        "both_full",
        "both_trigger",
        "audit_metadata",
    }
    assert all(len(v) == 2 for v in data["cpu_us_paired_differences"].values())
    assert data["configs"]["none"]["cpu_us_median"] > 0
