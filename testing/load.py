"""Load for the benchmarks and their smoke tests: closed-loop with wrk (C, so the client costs
little of the shared 2-vCPU machine), requests/s and latency percentiles of one POST; and the
tenants' open and closed loops (aiohttp, a process each) of the QoS benchmarks."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}
# One flower for the iris example function: the benchmarks' small JSON request.
IRIS = json.dumps(
    {
        "inputs": [
            {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}
        ]
    }
).encode()
# A blank-ish 8x8 digit for the digits example (an ONNX function).
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
    requests: int = 0  # answers counted (every one of them 2xx)


def _lua_string(data: bytes) -> str:
    """Any bytes as a Lua string literal (decimal escapes; wrk sends the bytes as they are)."""
    return '"' + "".join(f"\\{b}" for b in data) + '"'


# wrk's own error count (`summary.errors.status`) holds only answers >= 400: a 3xx passes, and
# socket errors (connect, read, write, timeout) are counted apart and never fail anything. Each
# thread counts every answer outside 2xx itself (`response`, in its own Lua state); `done`, in
# the main state, adds them up with the socket errors on one line for `wrk()` to check.
_WRK_ACCOUNTING = """
local threads = {}
function setup(thread)
  table.insert(threads, thread)
end
function init(args)
  not2xx = 0
end
function response(status, headers, body)
  if status < 200 or status > 299 then
    not2xx = not2xx + 1
  end
end
function done(summary, latency, requests)
  local not2xx = 0
  for _, thread in ipairs(threads) do
    not2xx = not2xx + thread:get("not2xx")
  end
  local e = summary.errors
  io.write(string.format(
    "MESHFN-WRK requests=%d not2xx=%d connect=%d read=%d write=%d timeout=%d status=%d\\n",
    summary.requests, not2xx, e.connect, e.read, e.write, e.timeout, e.status))
end
"""
_WRK_COUNTS = re.compile(
    r"^MESHFN-WRK requests=(\d+) not2xx=(\d+) connect=(\d+) read=(\d+) write=(\d+) "
    r"timeout=(\d+) status=(\d+)$",
    re.M,
)


def wrk_failures(out: str) -> tuple[int, dict[str, int]]:
    """From wrk's output with the accounting script: (answers, {what: count} of everything that
    went wrong: `not2xx` answers of any status outside 200-299, and each kind of socket error)."""
    match = _WRK_COUNTS.search(out)
    if match is None:
        raise SystemExit(f"unexpected wrk output (no accounting line):\n{out}")
    requests, *counts = (int(g) for g in match.groups())
    names = ("not2xx", "connect", "read", "write", "timeout", "status")
    return requests, {n: c for n, c in zip(names, counts, strict=True) if c and n != "status"}


def wrk(
    url: str,
    body: bytes,
    seconds: float,
    connections: int,
    tmp: Path,
    headers: dict[str, str] | None = None,
    threads: int = 1,
) -> WrkResult:
    """POST `body` to `url` over `connections` keep-alive connections for `seconds`. Any answer
    outside 2xx (3xx included) and any socket error (connect, read, write, timeout) fails the
    run: a benchmark of errors, or of requests that never got an answer, measures nothing."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk (needed for the throughput figures)")
    script = tmp / "post.lua"
    lines = ['wrk.method = "POST"', f"wrk.body = {_lua_string(body)}"]
    for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
        lines.append(f"wrk.headers[{_lua_string(name.encode())}] = {_lua_string(value.encode())}")
    script.write_text("\n".join(lines) + "\n" + _WRK_ACCOUNTING)
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
    requests, failures = wrk_failures(out)
    if failures or not requests:
        what = ", ".join(f"{n}={c}" for n, c in failures.items()) or "no answer at all"
        raise SystemExit(f"wrk: {what} (of {requests} answers) from {url}:\n{out}")
    return WrkResult(
        rps=float(_find(r"Requests/sec:\s+([\d.]+)", out)),
        p50_ms=_latency(out, "50%"),
        p99_ms=_latency(out, "99%"),
        requests=requests,
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


# ---------------------------------------------------------------- tenants' load (processes)


async def _open_loop(
    url: str, headers: dict[str, str], rate: float, seconds: float, body: bytes = IRIS
) -> dict[str, Any]:
    """`rate` POSTs/s for `seconds`, each sent on schedule whatever the others do; the
    latency (ms) of each 200 and the count of every status (0: no answer: a refused, reset or
    timed-out connection). Latencies are of 200s only: what was not answered 200 is in
    `statuses` (and `not_200`), for the caller to show and judge."""
    import aiohttp

    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    statuses[response.status] += 1
                    if response.status == 200:
                        latencies.append((time.perf_counter() - started) * 1000)
            except (aiohttp.ClientError, TimeoutError):
                statuses[0] += 1

        tasks = []
        start = time.perf_counter()
        count = int(rate * seconds)
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    not_200 = count - statuses[200]
    return {
        "latencies_ms": latencies,
        "statuses": dict(statuses),
        "sent": count,
        "not_200": not_200,
    }


async def _closed_loop(
    url: str, headers: dict[str, str], connections: int, seconds: float, body: bytes = IRIS
) -> dict[str, Any]:
    """`connections` clients, each sending its next POST when the last one is answered; the
    count of every status, of each 429's `limit` and of where it was refused (`scope`)."""
    import aiohttp

    statuses: Counter[int] = Counter()
    limits: Counter[str] = Counter()
    scopes: Counter[str] = Counter()
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            while time.perf_counter() < deadline:
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        reply = await response.read()
                        statuses[response.status] += 1
                        if response.status == 429:
                            refusal = json.loads(reply)
                            limits[refusal.get("limit", "?")] += 1
                            scopes[refusal.get("scope", "?")] += 1
                except (aiohttp.ClientError, TimeoutError):
                    statuses[0] += 1

        await asyncio.gather(*(client() for _ in range(connections)))
    return {"statuses": dict(statuses), "limits": dict(limits), "scopes": dict(scopes)}


def _worker(kind: str, args: tuple[Any, ...], out: Queue[Any]) -> None:
    runner = _open_loop if kind == "open" else _closed_loop
    out.put(asyncio.run(runner(*args)))


def run_loads(*loads: tuple[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Each load ("open", (url, headers, rate, seconds[, body])) or ("closed", (url, headers,
    connections, seconds[, body])) in a process of its own (its event loop is not the measured
    one's), all at once; their results in order."""
    ctx = multiprocessing.get_context("fork")
    queues = [ctx.Queue() for _ in loads]
    procs = [
        ctx.Process(target=_worker, args=(kind, args, q))
        for (kind, args), q in zip(loads, queues, strict=True)
    ]
    for proc in procs:
        proc.start()
    results = [q.get(timeout=600) for q in queues]
    for proc in procs:
        proc.join(timeout=30)
    return results


# ---------------------------------------------------------------- steady load (a thread)


@dataclass(frozen=True)
class Answer:
    sent: float  # time.time() when sent
    status: int  # 0: no answer (refused, reset, timed out)
    version: str  # the answering version (x-meshfn-model-version), "" if none
    ms: float


class SteadyLoad:
    """`rate` POSTs/s on schedule (open loop) from a thread of its own, until `stop()`; every
    answer kept with its status and the version that gave it (the rollout tests and
    bench/rollout.py: a rollout's steps must not cost a request)."""

    def __init__(
        self,
        url: str,
        body: bytes | list[bytes],
        rate: float,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`body`: the request, or requests sent in turn."""
        import threading

        self.url, self.rate = url, rate
        self.bodies = body if isinstance(body, list) else [body]
        self.headers = {"content-type": "application/json", **(headers or {})}
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        self._thread.join(timeout=60)
        return list(self.answers)

    async def _run(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=10)
        connector = aiohttp.TCPConnector(limit=256)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def one(body: bytes) -> None:
                sent, started = time.time(), time.perf_counter()
                status, version = 0, ""
                try:
                    async with session.post(self.url, data=body, headers=self.headers) as response:
                        await response.read()
                        status = response.status
                        version = response.headers.get("x-meshfn-model-version", "")
                except (aiohttp.ClientError, TimeoutError):
                    pass
                ms = (time.perf_counter() - started) * 1000
                self.answers.append(Answer(sent, status, version, ms))

            tasks = []
            start = time.perf_counter()
            i = 0
            while not self._stop.is_set():
                delay = start + i / self.rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(self.bodies[i % len(self.bodies)])))
                i += 1
            await asyncio.gather(*tasks)
