"""bench/functions.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_functions_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--cold", "3", "--warm", "50", "--paced-seconds", "0.5", "--wrk-seconds", "1"]
    line, data = run_bench("functions.py", tiny, tmp_path)
    assert re.match(
        r"^functions: cold_p50_ms=[\d.]+ cold_p99_ms=[\d.]+ core_cold_p99_ms=[\d.]+ "
        r"warm_p50_us=\d+ e2e_p99_ms=[\d.]+ pss_per_instance_mb=[\d.]+ ",
        line,
    ), line
    assert len(data["cold_python_ms"]) == 3 and data["paced_envoy_ms"]["n"] == 100
    assert len(data["idle_warm_python_ms"]) == len(data["idle_warm_core_ms"]) == 3
    assert len(data["resume_python_ms"]) == 3
    assert data["summary"]["rps_1w"] > 0 and data["summary"]["rps_2w"] > 0
    # the Envoy -> backend hop over TCP and over the backend's unix socket (as meshfn up runs it)
    assert len(data["hop_p50_us"]["tcp"]) == len(data["hop_p50_us"]["unix"]) == 16
    assert re.search(r" unix_minus_tcp_p50_us=-?\d+ ", line), line
