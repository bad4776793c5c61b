"""The benchmark script runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_xds_push_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--changes", "5", "--services", "20", "--clients", "20", "30", "--fanout-changes", "2"]
    line, data = run_bench("xds_push.py", tiny, tmp_path)
    assert re.match(
        r"^xds_push: visible_p50_ms=[\d.]+ visible_p99_ms=[\d.]+ clients=20 converge_p99_ms=\d+ cp_rss_mb=\d+ ",
        line,
    ), line
    assert "converge_p99_ms@30=" in line
    assert len(data["visible"]["visible_ms"]) == 5
    assert [r["clients"] for r in data["fanout"]] == [20, 30]
