"""bench/generative.py runs end to end (tiny sizes: one and two streams, a few tokens, one
round, two pairs at one stream in blocks of two and again stream by stream; streamInterval 4
paired at the top; two bare proxies as the floor beside mesh and direct, plain and with mutual
TLS between them) and prints its one
summary line; its figures are consistent with each other. Again with `--placed`: the proxies
and the backends on CPUs apart."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from meshfn_e2e import run_bench


@pytest.mark.parametrize("placed", [False, True], ids=["free", "placed"])
def test_generative_bench_smoke(tmp_path: Path, placed: bool) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    where = {"proxy_cpus": allowed[:1], "backend_cpus": allowed[-1:]}
    tiny = [
        "--tokens",
        "8",
        "--rounds",
        "1",
        "--pairs",
        "2",
        "--block",
        "2",
        "--concurrency",
        "1,2",
    ]
    if placed:
        tiny += ["--placed", f"{allowed[0]}:{allowed[-1]}"]
    line, data = run_bench("generative.py", tiny, tmp_path, timeout=900)
    assert data["placed"] == (where if placed else None)
    assert re.match(
        r"^generative: ttft_p50_ms=[\d.]+ ttft_p99_ms=[\d.]+ itl_p50_ms=[\d.]+ "
        r"itl_p99_ms=[\d.]+ mesh_ttft_added_ms=-?[\d.]+ tokens_per_s=[\d.]+ "
        r"batched_tokens_ratio=[\d.]+$",
        line,
    ), line
    figures = data["figures"]
    assert set(figures) == {
        "mesh", "direct", "floor", "floor_mtls", "mesh_joined", "direct_joined", "bench_batched", "bench_unbatched",
        "bench_accounted", "mesh_alternating", "direct_alternating",
    }  # fmt: skip
    assert set(figures["mesh_alternating"]) == set(figures["direct_alternating"]) == {"1"}
    assert set(data["one_stream_alternating_added_ms"]) == {"ttft", "itl"}
    assert set(figures["mesh"]) == set(figures["direct"]) == {"1", "2"}
    assert set(figures["floor"]) == set(figures["floor_mtls"]) == {"1", "2"}
    assert set(figures["bench_unbatched"]) == {"2"}  # batching is compared at the top only
    # streamInterval 4 through the mesh and straight, paired at the top level
    assert set(figures["mesh_joined"]) == set(figures["direct_joined"]) == {"2"}
    assert set(data["joined"]["mesh_added_ms"]) == {"ttft", "itl"}
    assert data["joined"]["streams"] == 2 and data["joined"]["mesh_tokens_ratio"] > 0
    # what the mesh adds is paired with the same backends straight: both kinds, every level
    assert set(data["mesh_added_ms"]) == {"1", "2"}
    assert data["summary"]["mesh_ttft_added_ms"] == data["mesh_added_ms"]["1"]["ttft"]
    # and the floors, two bare proxies to the same backends (plain, mutual TLS), against both
    for key in (
        "floor_added_ms",
        "mesh_over_floor_ms",
        "mtls_floor_added_ms",
        "mesh_over_mtls_floor_ms",
    ):
        assert set(data[key]) == {"1", "2"} and all(
            set(v) == {"ttft", "itl"} for v in data[key].values()
        )
    # the direct ways go to the backends the gateway sent a warm-up's streams to
    backends = data["direct_backends"]
    assert set(backends) == {"tiny-lm", "tiny-lm-joined"} and all(backends.values())
    for per in figures.values():
        for f in per.values():
            assert f["ttft_p99_ms"] >= f["ttft_p50_ms"] > 0 and f["tokens_per_s"] > 0
