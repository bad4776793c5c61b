"""bench/fuzz.py runs end to end (two quick targets, 2 s each) and prints its summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_fuzz_bench_smoke(tmp_path: Path) -> None:
    line, data = run_bench("fuzz.py", ["--seconds", "2", "journal", "filter-degrade"], tmp_path)
    assert re.match(
        r"^fuzz: seconds_each=2 findings=0 execs=\d+ \(target=execs/cov\[/edges\]\) "
        r"journal=\d+/\d+ filter-degrade=\d+/\d+/\d+$",
        line,
    ), line
    assert [t["target"] for t in data["targets"]] == ["journal", "filter-degrade"]
    assert all(t["execs"] > 0 and t["coverage"] > 0 for t in data["targets"])
