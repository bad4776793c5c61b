"""bench/models.py runs end to end (tiny sizes: two models, two conformance cases, one short
round against a real MLServer) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_models_bench_smoke(tmp_path: Path) -> None:
    tiny = [
        "--models", "logreg-iris", "cnn-digits", "--calls", "50", "--cold-samples", "3",
        "--conformance", "test_relu,test_add", "--seconds", "1", "--warmup", "0.5",
        "--rounds", "1", "--no-python-guest",
    ]  # fmt: skip
    # the first run creates MLServer's virtual environment (pip, minutes); later runs reuse it
    line, data = run_bench("models.py", tiny, tmp_path, timeout=1800)
    assert re.match(
        r"^models: ops_conformance=2/2 wasm_vs_ort_p50_ratio=[\d.]+ wasm_vs_ort_cold_ratio=[\d.]+ "
        r"rps_vs_mlserver=[\d.]+ p99_vs_mlserver=[\d.]+ max_abs_err=[\d.e+-]+$",
        line,
    ), line
    assert [r["model"] for r in data["in_process"]] == ["logreg-iris", "cnn-digits"]
    assert all(r["max_abs_err"] < 1e-4 and not r.get("label_mismatch") for r in data["in_process"])
    server = data["server"]
    assert server["agreed_rows"] > 30  # both servers labelled the held-out rows alike
    assert server["mlserver"]["settings.json"]["parallel_workers"] == 0
    assert set(server["median"]) == set(server["wrk"]) == {"meshfn", "mlserver"}
    assert all(m["rps"] > 0 and m["p99_ms"] >= m["p50_ms"] for m in server["median"].values())
