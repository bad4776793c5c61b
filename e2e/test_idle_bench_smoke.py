"""bench/idle.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_idle_bench_smoke(tmp_path: Path) -> None:
    args = ["--requests", "20", "--settle", "1", "--seconds", "2"]
    line, data = run_bench("idle.py", args, tmp_path, timeout=600)
    assert re.fullmatch(
        r"idle: backend_cpu_ms_s=[\d.]+ mlserver_cpu_ms_s=[\d.]+ cpu_vs_mlserver=[\d.]+"
        r" backend_wakeups_s=[\d.]+ mlserver_wakeups_s=[\d.]+ mesh_cpu_ms_s=[\d.]+"
        r" mesh_wakeups_s=[\d.]+",
        line,
    ), line
    servers, mesh = data["servers"], data["mesh"]
    assert servers["backend"]["processes"] == 1 and servers["mlserver"]["processes"] >= 1
    # meshfn up's processes, each counted once: its control plane, 5 Envoys, 3 backends
    assert mesh["control_plane"]["processes"] == 1
    assert mesh["envoys"]["processes"] >= 2 and mesh["backends"]["processes"] >= 1
    parts = ("control_plane", "envoys", "backends", "others")
    assert mesh["all"]["processes"] == sum(mesh[p]["processes"] for p in parts if p in mesh)
    assert mesh["all"]["cpu_ms_s"] > 0
