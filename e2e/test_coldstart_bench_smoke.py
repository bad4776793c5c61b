"""bench/coldstart.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_coldstart_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--n", "8", "--period", "0.4", "--wrk-seconds", "1", "--loops", "asyncio",
            "--rounds", "1", "--lever-samples", "2", "--cold-samples", "3"]  # fmt: skip
    line, data = run_bench("coldstart.py", tiny, tmp_path)
    assert re.match(
        r"^coldstart: periodic_cold_pct=[\d.]+ bursty_cold_pct=[\d.]+ poisson_cold_pct=[\d.]+ "
        r"warm_instance_s_ratio=[\d.]+ cold_max_ms=[\d.]+ core_rps_1p=\d+ "
        r"core_rps_2p_ratio=[\d.]+ py_rps_2p_ratio=[\d.]+ .* cold_kept_max_ms=[\d.]+ "
        r"seq_cold_p50_ms=[\d.]+ .*seq_kept_wait_p99_ms=[\d.]+ load1=[\d.]+$",
        line,
    ), line
    traces = data["traces"]
    assert set(traces) == {
        f"{t}-{m}"
        for t in ("periodic", "bursty", "poisson")
        for m in ("reactive", "kept", "predictive")
    }
    # reactive: every periodic request comes after the TTL, so each one is cold (0.4 s: the
    # TTL, 0.2 s, plus the reaper's pass, 0.05 s, plus slack for a loaded machine)
    assert traces["periodic-reactive"]["cold"] == 8
    assert traces["periodic-kept"]["cold"] == 8  # its instances go too; only the code stays
    # the sequence: every request was cold (asserted by the bench), each one timed and split
    # (the slowest one's split kept whole)
    for kind in ("cold", "cached", "kept"):
        seq = data["sequence"][kind]
        assert seq["samples"] == 3 and seq["p50_ms"] > 0 and seq["cpu_p50_ms"] > 0, seq
        assert set(seq["slowest"]) == {"ms", "cpu_ms", "wait_ms"}, seq
        assert seq["slowest"]["ms"] == seq["p99_ms"], seq  # 3 samples: the "p99" is the max
    assert all(v > 0 for v in data["rps"]["2p-asyncio"].values())
