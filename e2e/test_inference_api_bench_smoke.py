"""bench/inference_api.py runs end to end (tiny sizes) and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_inference_api_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--seconds", "1", "--rounds", "1", "--requests", "20"]
    line, data = run_bench("inference_api.py", tiny, tmp_path)
    assert re.match(
        r"^inference_api: batch_rps_ratio=[\d.]+ batch_p99_ratio=[\d.]+ "
        r"binary_vs_json_us=-?\d+ grpc_vs_rest_us=-?\d+ ",
        line,
    ), line
    assert len(data["batching"]["on"]) == len(data["batching"]["off"]) == 1
    assert set(data["client_p50_us"]) == set(data["wire_p50_us"]) == {"json", "binary", "grpc"}
    # batching really merged requests: some guest calls ran more than one row
    assert data["batch_rows"]["max_rows_per_call"] > 1, data["batch_rows"]
