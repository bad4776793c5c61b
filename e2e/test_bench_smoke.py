"""The benchmark script runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "xds_push.py"


def test_xds_push_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = subprocess.run(
        [
            sys.executable,
            "-P",
            str(BENCH),
            "--changes",
            "5",
            "--services",
            "20",
            "--clients",
            "20",
            "30",
            "--fanout-changes",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert re.match(
        r"^xds_push: visible_p50_ms=[\d.]+ visible_p99_ms=[\d.]+ clients=20 converge_p99_ms=\d+ cp_rss_mb=\d+ ",
        line,
    ), line
    assert "converge_p99_ms@30=" in line
    data = json.loads(out.read_text())
    assert len(data["visible"]["visible_ms"]) == 5
    assert [r["clients"] for r in data["fanout"]] == [20, 30]
