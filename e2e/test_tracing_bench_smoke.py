"""bench/tracing.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_tracing_bench_smoke(tmp_path: Path) -> None:
    args = ["--rounds", "1", "--requests", "100", "--span-requests", "500", "--floor-rounds", "2"]
    line, data = run_bench("tracing.py", args, tmp_path, timeout=600)
    assert re.fullmatch(
        r"tracing: off_p50_us=\d+ p1_added_us=-?[\d.]+ p100_added_us=-?[\d.]+"
        r" backend_span_us=[\d.]+",
        line,
    ), line
    (measured,) = data["rounds"]
    assert set(measured) == {"p1", "p100"}
    for traced, compared in measured.items():
        assert set(compared) == {"off", traced, "off_mesh"} and compared["off_mesh"] == "a"
    # the phases differ in tracing alone: switching reloads the backends, restarts nothing
    assert data["backends_restarted"] is False
    # the collector works at 100% (spans arrive), and hardly at all with tracing off
    at100 = measured["p100"]
    assert at100["p100"]["control_plane_cpu_us"] > at100["off"]["control_plane_cpu_us"]
    assert data["summary"]["backend_span_us"] > 0 and set(data["summary"]["goals_met"]) == {
        "p1_added_us",
        "p100_added_us",
    }
    # the floor: a bare proxy with the gateway's own tracer at 1% and at 100% against one
    # without, each compared as the meshes are
    assert len(data["floor"]) == 2 and all(set(r) == {"p1", "p100"} for r in data["floor"])
    for traced in ("p1", "p100"):
        assert all(set(r[traced]) == {"off", traced} for r in data["floor"])
        assert all(r[traced][k]["envoy_cpu_us"] > 0 for r in data["floor"] for k in r[traced])
        for key in (f"floor_{traced}_added_us", f"floor_{traced}_added_cpu_us"):
            assert isinstance(data["summary"][key], float)
