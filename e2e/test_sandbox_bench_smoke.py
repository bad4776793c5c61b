"""bench/sandbox.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from meshfn_e2e import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_sandbox_bench_smoke(tmp_path: Path) -> None:
    line, data = run_bench("sandbox.py", ["--rounds", "2", "--seconds", "1"], tmp_path, timeout=230)
    number = r"\d+\.\d\d"
    match = re.fullmatch(rf"sandbox: rps_ratio={number} p99_ratio={number} layers=([a-z,]+)", line)
    assert match, line
    assert data["summary"] == line
    # never claims a layer that is not there: what the line names is what the JSON shows
    assert match.group(1) == ",".join(data["layers"])
    assert ("egress" in data["layers"]) == data["egress"]["attached"]
    for function in ("iris", "digits"):
        part = data["throughput"][function]
        assert len(part["rounds_rps"]["confined"]) == len(part["rounds_rps"]["unconfined"]) == 2
        assert min(part["rounds_rps"]["confined"] + part["rounds_rps"]["unconfined"]) > 0
    memory = data["exec_memory"]
    # loaded from the code cache, every function's code is a file mapping; wasmtime adds no
    # anonymous executable memory (in-process compilation, for contrast, does)
    assert all(m["cwasm"] >= 1 for m in memory["loaded"])
    assert all(m["anonymous"] == memory["after_start"]["anonymous"] for m in memory["loaded"])
    contrast = memory["contrast"]
    assert contrast["from_cwasm"]["anonymous"] == contrast["start"]["anonymous"]
    assert contrast["compiled_in_process"]["anonymous"] > contrast["from_cwasm"]["anonymous"]
    assert memory["confined_survived"] is True
