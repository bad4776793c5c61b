"""bench/ebpf.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ebpf.py"
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_ebpf_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    tiny = ["--rounds", "2", "--count", "300", "--stream-mib", "4"]
    tiny += ["--mesh-rounds", "2", "--requests", "100", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-P", str(BENCH), *tiny],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    number = r"\d+\.\d\d"
    assert re.fullmatch(
        rf"ebpf: rtt_ratio_same_cpu={number} rtt_ratio_unpinned={number} mesh_p50_ratio={number}",
        line,
    ), line
    data = json.loads(out.read_text())
    assert data["summary"] == line
    parts = [data["same_cpu"], data["unpinned"], data["mesh"], *data["python_loop"].values()]
    for part in parts:
        assert part["p50_us"]["on"] > 0 and part["p50_us"]["off"] > 0
        assert len(part["rounds_p50_us"]["on"]) == len(part["rounds_p50_us"]["off"]) == 2
    for chunk in (65536, 1024):
        assert min(data[f"throughput_{chunk}"]["mib_per_s"].values()) > 0
    assert data["mesh"]["counters"]["messages_redirected"] >= 2 * 2 * 100
    assert data["mesh"]["counters"]["messages_no_peer"] == 0
