"""bench/coldstart.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_coldstart_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--n", "8", "--period", "0.3", "--wrk-seconds", "1", "--loops", "asyncio",
            "--rounds", "1", "--lever-samples", "2"]  # fmt: skip
    line, data = run_bench("coldstart.py", tiny, tmp_path)
    assert re.match(
        r"^coldstart: periodic_cold_pct=[\d.]+ bursty_cold_pct=[\d.]+ poisson_cold_pct=[\d.]+ "
        r"warm_instance_s_ratio=[\d.]+ cold_p99_ms=[\d.]+ core_rps_1p=\d+ "
        r"core_rps_2p_ratio=[\d.]+ py_rps_2p_ratio=[\d.]+ ",
        line,
    ), line
    traces = data["traces"]
    assert set(traces) == {
        f"{t}-{m}" for t in ("periodic", "bursty", "poisson") for m in ("reactive", "predictive")
    }
    # reactive: every periodic request comes after the TTL, so each one is cold
    assert traces["periodic-reactive"]["cold"] == 8
    assert all(v > 0 for v in data["rps"]["2p-asyncio"].values())
