"""The console benchmark runs end to end (a few rounds) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_console_bench_smoke(tmp_path: Path) -> None:
    line, data = run_bench("console.py", ["--rounds", "3"], tmp_path)
    assert re.match(
        r"^console: visible_p50_ms=\d+ visible_max_ms=\d+ reload_p50_ms=\d+ over_reload_p50_ms=-?\d+ rounds=3$",
        line,
    ), line
    assert len(data["visible_ms"]) == 3 and data["browser_problems"] == []
