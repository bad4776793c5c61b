"""The benchmark script runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_xds_push_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--changes", "5", "--services", "20", "--clients", "20", "30", "--fanout-changes", "2"]
    tiny += ["--large-clients", "40", "--large-changes", "2"]
    line, data = run_bench("xds_push.py", tiny, tmp_path)
    assert re.match(
        r"^xds_push: visible_p50_ms=[\d.]+ visible_p99_ms=[\d.]+ clients=20 converge_max_ms=\d+ cp_peak_rss_mb=\d+ ",
        line,
    ), line
    assert "converge_max_ms@30=" in line
    assert all(len(r["converge_ms"]) == 2 for r in data["fanout"])
    assert len(data["visible"]["visible_ms"]) == 5
    assert [r["clients"] for r in data["fanout"]] == [20, 30]
    assert re.search(
        r" converge_max_ms@40=\d+ cp_peak_rss_mb@40=\d+ clients_cpu_pct@40=\d+ cp_cpu_pct@40=\d+ ",
        line,
    ), line
    large = data["large"]
    assert large["clients"] == 40 and large["protocol"] == "delta"
    assert large["connections"] == "one per client" and len(large["converge_ms"]) == 2


def test_failover_bench_smoke(tmp_path: Path) -> None:
    line, data = run_bench("failover.py", ["--repeats", "1"], tmp_path)
    assert re.match(
        r"^failover: detect_ms=\d+ failed=\d+ sent=\d+ breaker_trip_ms=\d+ repeats=1"
        r" breaker_eval_ms=[\d.]+ eval_vs_sort=[\d.]+$",
        line,
    ), line
    (kill,) = data["kills"]
    assert kill["sent"] > 0 and kill["detect_ms"] > 0  # something completed after the kill
    assert kill["window_ms"] >= 1000  # the window lasts until the move held for a second
    assert len(data["trips_ms"]) == 1
    assert data["evaluation"]["samples"] > 100_000 and data["evaluation"]["sort_ms"] > 0


def test_zero_trust_bench_smoke(tmp_path: Path) -> None:
    line, data = run_bench("zero_trust.py", ["--requests", "200", "--rounds", "2"], tmp_path)
    assert re.match(
        r"^zero_trust: p50_overhead_us=-?\d+ p99_overhead_us=-?\d+ cpu_per_req_us=\d+ "
        r"certs_per_s=\d+ cpu_overhead_us=-?\d+ secure_p50_us=\d+ plain_p50_us=\d+$",
        line,
    ), line
    assert len(data["rounds"]["secure"]) == len(data["rounds"]["plain"]) == 2
    # schedstat CPU: not a multiple of 10 ms ticks
    assert all(r["cpu_per_req_us"] > 0 for r in data["rounds"]["secure"])
