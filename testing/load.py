"""Closed-loop load with wrk (C, so the client costs little of the shared 2-vCPU machine) for the
benchmarks and their smoke tests: requests/s and latency percentiles of one POST."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
# One flower for the iris example function: the benchmarks' small JSON request.
IRIS = json.dumps(
    {
        "inputs": [
            {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}
        ]
    }
).encode()
# A blank-ish 8x8 digit for the digits example (core wasm).
DIGITS = json.dumps(
    {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [4] * 64}]}
).encode()


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` by rank (the benchmarks' p50/p99; 0 for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def sequential(port: int, path: str, body: bytes, n: int, warmup: int = 50) -> list[float]:
    """Microseconds of `n` back-to-back POSTs on one keep-alive loopback connection (after
    `warmup` untimed ones); every answer must be 200."""
    from meshfn.inference.devtools import RawHttp

    client = RawHttp("127.0.0.1", port)
    raw = client.encode("POST", path, body)
    times = []
    try:
        for _ in range(warmup):
            client.send(raw)
        for _ in range(n):
            started = time.perf_counter()
            status, reply = client.send(raw)
            times.append((time.perf_counter() - started) * 1e6)
            assert status == 200, reply
    finally:
        client.close()
    return times


@dataclass(frozen=True)
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float


def _lua_string(data: bytes) -> str:
    """Any bytes as a Lua string literal (decimal escapes; wrk sends the bytes as they are)."""
    return '"' + "".join(f"\\{b}" for b in data) + '"'


def wrk(
    url: str,
    body: bytes,
    seconds: float,
    connections: int,
    tmp: Path,
    headers: dict[str, str] | None = None,
    threads: int = 1,
) -> WrkResult:
    """POST `body` to `url` over `connections` keep-alive connections for `seconds`; any
    non-2xx response fails the run (a benchmark of errors measures nothing)."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk (needed for the throughput figures)")
    script = tmp / "post.lua"
    lines = ['wrk.method = "POST"', f"wrk.body = {_lua_string(body)}"]
    for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
        lines.append(f"wrk.headers[{_lua_string(name.encode())}] = {_lua_string(value.encode())}")
    lines += [
        "done = function(summary, latency, requests)",
        '  io.write(string.format("NON2XX %d\\n", summary.errors.status))',
        "end",
    ]
    script.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 30,
    ).stdout
    bad = int(_find(r"NON2XX (\d+)", out))
    if bad:
        raise SystemExit(f"wrk saw {bad} non-2xx responses:\n{out}")
    return WrkResult(
        rps=float(_find(r"Requests/sec:\s+([\d.]+)", out)),
        p50_ms=_latency(out, "50%"),
        p99_ms=_latency(out, "99%"),
    )


def _find(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    if match is None:
        raise SystemExit(f"unexpected wrk output (no {pattern!r}):\n{text}")
    return match.group(1)


def _latency(out: str, percentile: str) -> float:
    match = re.search(rf"^\s+{re.escape(percentile)}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
    if match is None:
        raise SystemExit(f"unexpected wrk output (no {percentile} latency):\n{out}")
    return float(match.group(1)) * _UNITS[match.group(2)]
