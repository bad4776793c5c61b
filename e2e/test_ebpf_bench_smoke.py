"""bench/ebpf.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from meshfn_e2e import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_ebpf_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--rounds", "2", "--count", "300", "--stream-mib", "4"]
    tiny += ["--mesh-rounds", "2", "--requests", "100"]
    line, data = run_bench("ebpf.py", tiny, tmp_path, timeout=170)
    number = r"\d+\.\d\d"
    assert re.fullmatch(
        rf"ebpf: rtt_ratio_same_cpu={number} rtt_ratio_unpinned={number} "
        rf"mesh_p50_ratio={number} mesh_unix_p50_ratio={number}",
        line,
    ), line
    assert data["summary"] == line
    parts = [data["same_cpu"], data["unpinned"], data["mesh"], *data["python_loop"].values()]
    for part in parts:
        assert part["p50_us"]["on"] > 0 and part["p50_us"]["off"] > 0
        assert len(part["rounds_p50_us"]["on"]) == len(part["rounds_p50_us"]["off"]) == 2
    for chunk in (65536, 1024):
        assert min(data[f"throughput_{chunk}"]["mib_per_s"].values()) > 0
    assert len(data["mesh"]["rounds_p50_us"]["unix"]) == 2 and data["mesh"]["p50_us"]["unix"] > 0
    assert data["mesh"]["counters"]["messages_redirected"] >= 2 * 2 * 100
    assert data["mesh"]["counters"]["messages_no_peer"] == 0
