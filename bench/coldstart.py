"""Benchmark of cold starts users see, reactive vs predictive warm-up, and multi-process
throughput (bench/coldstart.py).

The Python function is the hand-written iris (functions/testing/iris-py, served as `iris`); the
core function is digits, an ONNX model compiled to a core module (ABI v2).

Measures, on loopback with real backend processes (a short idle TTL, 200 ms):
  traces      three request traces replayed against the Python function (iris), each against
              three functions of the same artifact at once, one `warmup.mode: reactive`, one
              `predictive`, and `kept`: reactive with its code kept (`codeTtl: 1h`, the lever
              that skips deserializing) (same run, same machine load):
                periodic  a request every T (> TTL) with uniform jitter of +-10%
                bursty    on/off: bursts of requests 20 ms apart, random off periods > TTL
                poisson   exponential gaps with a mean of 2 x TTL (below the TTL rate)
              per request: latency and whether it found no warm instance (the backend's
              cold-request count, read from /meshfn/functions after each request);
              per function: instance-seconds kept warm (the memory cost). `*_cold_pct` leave
              out each trace's first LEARNING requests (the predictor's learning; the JSON's
              `cold_pct_all` keeps them). `cold_max_ms`: the slowest of the reactive
              functions' cold requests (each finds no instance, and its function's code went
              at the idle TTL: with the defaults the process-wide code cache still has it
              deserialized, so instantiate + first call), `cold_kept_*` the kept ones' (the
              same, the function's own code). A maximum, not a p99: the traces hold ~100 cold
              requests (`cold_samples`), too few for one; the sequence below has the p99s
  sequence    `--cold-samples` cold requests alone (300 by default: enough for a p99, the
              third slowest; with fewer `*_p99_ms` is the maximum), one at a time, each
              function alone on its backend: one whose code went at the idle TTL, with the code
              cache off
              (`seq_cold_*`: a full cold start, deserialize too) and with the defaults
              (`seq_cached_*`), and one that keeps its code (`seq_kept_*`):
              latency, and the CPU time and run-queue wait (schedstat: time runnable but not
              running, i.e. waiting for a core; summed: two threads can wait at once) of the
              backend's threads that worked for it.
              On the shared 2-core machine the end-to-end tail is that wait, not the work
  throughput  requests/s (wrk, closed loop, 8 connections) for a core function (digits: called
              on the event loop) and the Python function (iris), with `processes: 1` and
              `processes: 2`; plus the levers: guest calls with the thread hop
              (MESHFN_INLINE_CORE=0 MESHFN_INLINE_PYTHON=0: `inline_over_hop` for core,
              `py_inline_over_hop` for Python) and the event loop (asyncio vs uvloop)
  levers      in this process, per function (iris, digits), medians of `--lever-samples`:
              deserializing the .cwasm (what a process-wide code cache would save: the same as
              a longer codeTtl), the same after posix_fadvise(WILLNEED) of the file,
              instantiating, the first and second call of a fresh instance, and the first call
              of an instance pre-faulted by one `metadata` call (what the warm pool and the
              predicted warm-ups now do); and with wasmtime's pooling instance allocator
              (`pooled_*`: slots reused, POOL_KEEP_RESIDENT of each memory kept resident and
              reset when an instance closes), instantiating, the first call, closing
Prints one summary line and writes bench/results/coldstart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from meshfn.inference.devtools import RawHttp, get_json
from meshfn.inference.examples import publish_examples
from meshfn.testing import load
from meshfn.testing.ports import free_port
from meshfn.testing.processes import Proc, Processes, http_ok, wait_for

RESULTS = Path(__file__).resolve().parent / "results"
PY = sys.executable
IRIS = load.IRIS
DIGITS = load.DIGITS
pct = load.pct
TTL = 0.2
TRACES = ("periodic", "bursty", "poisson")
# The first requests of a trace, which no predictor can foresee (warmup.py MIN_GAPS idle gaps,
# so MIN_GAPS + 1 requests): the summary's cold_pct is over the rest (the JSON has both).
LEARNING = 4
MODES = ("reactive", "kept", "predictive")
# The replays are offset, so that their requests do not compete for the same moment (a cold
# load beside a warm request slows both).
OFFSET = {"reactive": 0.0, "kept": 0.115, "predictive": 0.23}
KEPT = {"codeTtl": "1h"}  # the kept mode's code stays loaded past the idle TTL


def backend(
    procs: Processes,
    tmp: Path,
    registry: Path,
    key: Path,
    name: str,
    functions: list[dict[str, Any]],
    processes: int = 1,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    settings: dict[str, Any] | None = None,
) -> tuple[Proc, int]:
    config = {
        "registry": str(registry),
        "trustedKeys": [str(key)],
        "workers": 2,
        "processes": processes,
        "functions": functions,
        **(settings or {}),
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    port = free_port()
    argv = [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(path),
            "--port", str(port), "--log-level", "warning", *(extra or [])]  # fmt: skip
    proc = procs.start(name, argv, env)
    url = f"http://127.0.0.1:{port}/v2/health/ready"
    wait_for(url, lambda: http_ok(url), 90, every=0.05, proc=proc)
    seen: set[int] = set()

    def all_ready() -> bool:  # every process answers (each verifies on its own at start)
        document = get_json(port, "/meshfn/functions")
        if document["ready"]:
            seen.add(document["pid"])
        return len(seen) >= processes

    wait_for(f"{processes} processes ready", all_ready, 90, every=0.02, proc=proc)
    return proc, port


def make_traces(n: int, period: float, rng: random.Random) -> dict[str, list[float]]:
    """Send times (seconds from the start) of each trace."""
    periodic, t = [], 0.0
    for _ in range(n):
        periodic.append(t)
        t += period * (1 + rng.uniform(-0.1, 0.1))
    bursty, t = [], 0.0
    while len(bursty) < n:
        for k in range(5):
            bursty.append(t + 0.02 * k)
        t += 0.08 + rng.uniform(2.5 * TTL, 5 * TTL)
    poisson, t = [], 0.0
    for _ in range(n):
        poisson.append(t)
        t += rng.expovariate(1 / (2 * TTL))
    return {"periodic": periodic, "bursty": bursty[:n], "poisson": poisson}


def cold_count(status: RawHttp, function: str) -> tuple[int, float]:
    code, body = status.request("GET", "/meshfn/functions")
    assert code == 200, body
    for f in json.loads(body)["functions"]:
        if f["name"] == function:
            return int(f["cold_requests"]), float(f["warm_instance_seconds"])
    raise SystemExit(f"{function} missing from /meshfn/functions")


def replay(
    port: int, function: str, times: list[float], out: dict[str, Any], offset: float = 0.0
) -> None:
    client, status = RawHttp("127.0.0.1", port), RawHttp("127.0.0.1", port)
    raw = client.encode("POST", f"/v2/models/{function}/infer", IRIS)
    latencies, colds = [], []
    cold_before, warm_before = cold_count(status, function)
    start = time.perf_counter() + offset
    try:
        for due in times:
            delay = start + due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t = time.perf_counter()
            code, reply = client.send(raw)
            latencies.append((time.perf_counter() - t) * 1000)
            assert code == 200, reply
            cold, warm = cold_count(status, function)
            colds.append(cold > cold_before)
            cold_before = cold
        steady = colds[LEARNING:]
        out.update(
            latency_ms=latencies,
            cold=colds,
            warm_instance_s=warm - warm_before,
            cold_pct_all=100 * sum(colds) / len(colds),
            cold_pct=100 * sum(steady) / max(1, len(steady)),
        )
    finally:
        client.close()
        status.close()


def trace_functions() -> list[dict[str, Any]]:
    out = []
    for trace in TRACES:
        for mode in MODES:
            warmup = "reactive" if mode == "kept" else mode
            out.append(
                {
                    "name": f"iris-{trace}-{mode}",
                    "version": "1",
                    "artifact": "iris-py@1",
                    "idleTtl": f"{int(TTL * 1000)}ms",
                    "pool": {"minIdle": 0, "maxIdle": 2},
                    "warmup": {"mode": warmup, "maxWarmIdle": "1s", "memoryBudget": 128},
                    **(KEPT if mode == "kept" else {}),
                }
            )
    return out


def run_traces(port: int, traces: dict[str, list[float]]) -> dict[str, Any]:
    """One trace after the other, each replayed against both modes at once."""
    results: dict[str, Any] = {f"{t}-{m}": {} for t in TRACES for m in MODES}
    for t in TRACES:
        threads = [
            threading.Thread(
                target=replay,
                args=(port, f"iris-{t}-{m}", traces[t], results[f"{t}-{m}"], OFFSET[m]),
            )
            for m in MODES
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for key, value in results.items():
        if "cold_pct" not in value:
            raise SystemExit(f"trace {key} failed (see the traceback above)")
    for f in get_json(port, "/meshfn/functions")["functions"]:
        key = f["name"].removeprefix("iris-")
        if key in results:
            results[key]["warmup"] = f["warmup"]
    return results


def schedstat_ns(pid: int) -> dict[str, tuple[int, int]]:
    """Per thread of a process: CPU time and run-queue wait so far (ns; /proc schedstat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu, wait = (task / "schedstat").read_text().split()[:2]
        except OSError:  # the thread ended
            continue
        out[task.name] = (int(cpu), int(wait))
    return out


def request_split(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> tuple[float, float]:
    """CPU time and run-queue wait (ms) between two `schedstat_ns` of the threads that worked
    for the request (>= 0.1 ms of CPU: the event loop and the worker; not the epoch ticker,
    whose ticks take microseconds but wait for a core like anything else)."""
    cpu = wait = 0
    for tid, (cpu2, wait2) in after.items():
        cpu1, wait1 = before.get(tid, (0, 0))
        if cpu2 - cpu1 >= 100_000:
            cpu, wait = cpu + cpu2 - cpu1, wait + wait2 - wait1
    return cpu / 1e6, wait / 1e6


def cold_sequence(
    procs: Processes, tmp: Path, registry: Path, key: Path, samples: int
) -> dict[str, dict[str, list[float]]]:
    """Cold requests alone, one at a time (see the module doc): per kind, every request's
    latency and the backend's CPU time and run-queue wait while it ran (ms)."""
    ttl = {"idleTtl": "50ms", "pool": {"minIdle": 0, "maxIdle": 1}}
    # (backend settings, kinds), each function alone on its backend (functions of one artifact
    # share its code while one holds it): "cold" with the process-wide code cache off (a full
    # cold start: deserialize too), "cached" with the defaults (its code went at the code TTL
    # and comes back from the code cache), "kept" keeping its own code (codeTtl)
    backends = [
        ({"codeCache": {"maxEntries": 0}}, {"cold": ttl}),
        ({}, {"cached": ttl}),
        ({}, {"kept": {**ttl, **KEPT}}),
    ]
    out: dict[str, dict[str, list[float]]] = {}
    for n, (settings, kinds) in enumerate(backends):
        functions = [
            {"name": f"iris-{kind}", "version": "1", "artifact": "iris-py@1", **spec}
            for kind, spec in kinds.items()
        ]
        proc, port = backend(
            procs, tmp, registry, key, f"sequence-{n}", functions, settings=settings
        )
        out.update({k: {"ms": [], "cpu_ms": [], "wait_ms": []} for k in kinds})
        client, status = RawHttp("127.0.0.1", port), RawHttp("127.0.0.1", port)
        try:
            for _ in range(samples):
                for kind in kinds:
                    function = f"iris-{kind}"
                    raw = client.encode("POST", f"/v2/models/{function}/infer", IRIS)
                    before, _ = cold_count(status, function)
                    time.sleep(0.12)  # past the idle TTL and the reaper's next pass
                    threads = schedstat_ns(proc.pid)
                    t = time.perf_counter()
                    code, reply = client.send(raw)
                    ms = (time.perf_counter() - t) * 1000
                    cpu, wait = request_split(threads, schedstat_ns(proc.pid))
                    assert code == 200, reply
                    assert cold_count(status, function)[0] == before + 1, "not cold"
                    out[kind]["ms"].append(ms)
                    out[kind]["cpu_ms"].append(cpu)
                    out[kind]["wait_ms"].append(wait)
        finally:
            client.close()
            status.close()
            assert proc.stop() == 0, "backend did not exit 0 on SIGTERM"
    return out


THROUGHPUT_FUNCTIONS = [
    {"name": "iris", "version": "1", "artifact": "iris-py@1", "pool": {"minIdle": 2, "maxIdle": 4},
     "limits": {"maxConcurrency": 256}},
    {"name": "digits", "version": "1", "pool": {"minIdle": 2, "maxIdle": 4},
     "limits": {"maxConcurrency": 256}},
]  # fmt: skip


def throughput(
    procs: Processes,
    tmp: Path,
    registry: Path,
    key: Path,
    seconds: int,
    rounds: int,
    loops: list[str],
) -> list[dict[str, dict[str, float]]]:
    """Every configuration's backend runs at once (idle ones cost nothing); each round runs wrk
    against digits and iris on each in turn, so a pair compared in one round saw the same
    machine load (the machine is shared: minute-to-minute load swings dwarf the effects)."""
    # name: (processes, event loop, guest calls inline); the hop lever on the first loop
    configs = {f"{n}p-{loop}": (n, loop, True) for loop in loops for n in (1, 2)}
    configs["1p-hop"] = (1, loops[0], False)
    ports = {}
    started = []
    for name, (processes, loop, inline) in configs.items():
        hop = {"MESHFN_INLINE_CORE": "0", "MESHFN_INLINE_PYTHON": "0"}
        env = None if inline else {**os.environ, **hop}
        proc, port = backend(procs, tmp, registry, key, f"rps-{name}", THROUGHPUT_FUNCTIONS,
                             processes, ["--loop", loop], env)  # fmt: skip
        ports[name] = port
        started.append(proc)
        for function, body in (("digits", DIGITS), ("iris", IRIS)):
            for _ in range(4 * processes):  # load the code in every process
                client = RawHttp("127.0.0.1", port)
                client.request("POST", f"/v2/models/{function}/infer", body)
                client.close()
    out = []
    try:
        for _ in range(rounds):
            results: dict[str, dict[str, float]] = {}
            for name, port in ports.items():
                results[name] = {}
                for function, body in (("digits", DIGITS), ("iris", IRIS)):
                    url = f"http://127.0.0.1:{port}/v2/models/{function}/infer"
                    results[name][function] = load.wrk(url, body, seconds, 8, tmp).rps
                if name in (f"1p-{loops[0]}", "1p-hop"):  # the hop's cost is latency
                    results[name]["digits_seq_p50_us"] = statistics.median(
                        load.sequential(port, "/v2/models/digits/infer", DIGITS, 300, 30)
                    )
            out.append(results)
    finally:
        for proc in started:
            assert proc.stop() == 0, "backend did not exit 0 on SIGTERM"
    return out


# The pooling allocator lever: instance slots reused, with this much of each linear memory
# left resident (reset in place) when an instance goes, for the next instance of the module.
POOL_KEEP_RESIDENT = 8 << 20


def pooled_engine() -> Any:
    """The backend's engine configuration with wasmtime's pooling instance allocator (not
    in wasmtime-py's Config: its C API through `_ffi`)."""
    import wasmtime
    from wasmtime import _ffi

    from meshfn.inference.engine import new_config

    config = new_config()
    pooling = _ffi.wasmtime_pooling_allocation_config_new()
    for setter, value in (
        ("total_memories", 64),
        ("total_tables", 256),
        ("total_core_instances", 256),
        ("total_component_instances", 64),
        ("max_memory_size", 256 << 20),
        ("max_core_instance_size", 1 << 20),
        ("max_component_instance_size", 1 << 20),
        ("max_memories_per_component", 8),
        ("max_tables_per_component", 64),
        ("max_core_instances_per_component", 64),
        ("table_elements", 100_000),
        ("linear_memory_keep_resident", POOL_KEEP_RESIDENT),
        ("max_unused_warm_slots", 16),
    ):
        getattr(_ffi, f"wasmtime_pooling_allocation_config_{setter}_set")(pooling, value)
    _ffi.wasmtime_pooling_allocation_strategy_set(config.ptr(), pooling)
    _ffi.wasmtime_pooling_allocation_config_delete(pooling)
    return wasmtime.Engine(config)


def _guest_request(kind: str, metadata: dict[str, Any], body: bytes) -> Any:
    """A request body as the backend hands it to this kind of guest (its own classes)."""
    from meshfn.inference.kserve import Signature, parse_http
    from meshfn.inference.tensorio import TensorIO

    request = parse_http(body, Signature.from_metadata(metadata), None)
    if kind == "onnx":
        return TensorIO(metadata, 64 << 20, "bench").call(request)
    return request.guest_json(metadata.get("raw_inputs") is True)


def levers(registry: Path, key: Path, samples: int) -> dict[str, dict[str, float]]:
    """Cold-path levers, timed in this process (see the module doc)."""
    from meshfn.inference import signing
    from meshfn.inference.engine import EpochTicker, new_engine
    from meshfn.inference.host import component_linker, load_precompiled
    from meshfn.inference.registry import Registry

    engine = new_engine()
    ticker = EpochTicker(engine).start()
    linker = component_linker(engine)
    pooled = pooled_engine()
    pooled_ticker = EpochTicker(pooled).start()
    pooled_linker = component_linker(pooled)
    trusted = signing.TrustedKeys.from_paths([key])
    out: dict[str, dict[str, float]] = {}
    try:
        # the Python function is the hand-written iris (iris-py); digits is a compiled model
        for name, artifact, body in (("iris", "iris-py", IRIS), ("digits", "digits", DIGITS)):
            verified = Registry(registry).verify(artifact, "1", trusted)
            request = _guest_request(verified.kind, verified.metadata, body)
            times: dict[str, list[float]] = {}

            def since(what: str, started: float, times: dict[str, list[float]] = times) -> None:
                times.setdefault(what, []).append((time.perf_counter() - started) * 1000)

            def cycle(art: Any, prefix: str = "", request: Any = request) -> None:
                """A fresh instance: instantiate, call twice, close, each timed."""
                t = time.perf_counter()
                fresh = art.instantiate(64 << 20)
                since(f"{prefix}instantiate", t)
                for call in ("first_call", "second_call"):
                    t = time.perf_counter()
                    fresh.call(request, 1000)
                    since(f"{prefix}{call}", t)
                t = time.perf_counter()
                fresh.close()  # a pooled instance's memory is reset here, off the request path
                since(f"{prefix}close", t)

            for _ in range(samples):
                t = time.perf_counter()
                art = load_precompiled(engine, verified.kind, verified.cwasm, linker)
                since("deserialize", t)
                cycle(art)
                faulted = art.instantiate(64 << 20)
                faulted.metadata()
                t = time.perf_counter()
                faulted.call(request, 1000)
                since("prefaulted_first_call", t)
                faulted.close()
                fd = os.open(verified.cwasm, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    t = time.perf_counter()
                    load_precompiled(engine, verified.kind, verified.cwasm, linker)
                    since("deserialize_after_fadvise", t)
                finally:
                    os.close(fd)
            art = load_precompiled(pooled, verified.kind, verified.cwasm, pooled_linker)
            for _ in range(samples):
                cycle(art, "pooled_")
            out[name] = {k: statistics.median(v) for k, v in times.items()}
    finally:
        ticker.stop()
        pooled_ticker.stop()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-coldstart-"))
    procs = Processes(tmp)
    try:
        _, key = publish_examples(tmp / "registry", include_testing=True)
        registry = tmp / "registry"
        data: dict[str, Any] = {"ttl_s": TTL, "period_s": args.period, "requests": args.n}
        data["loadavg_before"] = os.getloadavg()
        proc, port = backend(procs, tmp, registry, key, "traces", trace_functions())
        traces = make_traces(args.n, args.period, random.Random(args.seed))
        data["traces"] = run_traces(port, traces)
        assert proc.stop() == 0, "backend did not exit 0 on SIGTERM"
        data["sequence"] = cold_sequence(procs, tmp, registry, key, args.cold_samples)
        data["levers"] = levers(registry, key, args.lever_samples)
        rounds = throughput(procs, tmp, registry, key, args.wrk_seconds, args.rounds, args.loops)
        data["rps_rounds"] = rounds
        data["rps"] = {
            config: {
                fn: statistics.median(r[config][fn] for r in rounds) for fn in rounds[0][config]
            }
            for config in rounds[0]
        }
        return data
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=60, help="requests per trace")
    parser.add_argument("--period", type=float, default=0.5, help="periodic trace: T (s)")
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--wrk-seconds", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="throughput rounds (medians)")
    parser.add_argument("--lever-samples", type=int, default=30)
    parser.add_argument(
        "--cold-samples", type=int, default=300, help="sequence: per kind (>= 300 for a p99)"
    )
    parser.add_argument(
        "--loops", nargs="+", default=["uvloop", "asyncio"], help="event loops to measure"
    )
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = parser.parse_args()
    data = run(args)
    traces = data["traces"]

    def cold_pct(trace: str, mode: str) -> float:
        return float(traces[f"{trace}-{mode}"]["cold_pct"])

    warm = {m: sum(traces[f"{t}-{m}"]["warm_instance_s"] for t in TRACES) for m in MODES}

    def cold_latency(mode: str) -> list[float]:
        return [
            ms
            for t in TRACES
            for ms, cold in zip(
                traces[f"{t}-{mode}"]["latency_ms"], traces[f"{t}-{mode}"]["cold"], strict=True
            )
            if cold
        ]

    sequence = {}
    for kind, series in data["sequence"].items():
        worst = max(range(len(series["ms"])), key=series["ms"].__getitem__, default=None)
        sequence[kind] = {
            "samples": len(series["ms"]),
            "p50_ms": statistics.median(series["ms"]),
            "p99_ms": pct(series["ms"], 0.99),
            "cpu_p50_ms": statistics.median(series["cpu_ms"]),
            "wait_p50_ms": statistics.median(series["wait_ms"]),
            "wait_p99_ms": pct(series["wait_ms"], 0.99),
            # the slowest request's split: how much of it was waiting for a core
            "slowest": {k: v[worst] for k, v in series.items()} if worst is not None else {},
        }
        series.clear()
        series.update(sequence[kind])
    base = data["rps"][f"1p-{args.loops[0]}"]
    two = data["rps"][f"2p-{args.loops[0]}"]

    def ratio(fn: str, over: str, under: str) -> float:  # median of same-round ratios
        return statistics.median(r[over][fn] / r[under][fn] for r in data["rps_rounds"])

    first = args.loops[0]
    summary = {
        **{f"{t}_cold_pct": cold_pct(t, "predictive") for t in TRACES},
        **{f"{t}_reactive_cold_pct": cold_pct(t, "reactive") for t in TRACES},
        "warm_instance_s_ratio": warm["predictive"] / max(1e-9, warm["reactive"]),
        "warm_instance_s": warm,
        "cold_p50_ms": statistics.median(cold_latency("reactive") or [0.0]),
        "cold_max_ms": max(cold_latency("reactive"), default=0.0),
        "cold_samples": len(cold_latency("reactive")),
        "cold_kept_p50_ms": statistics.median(cold_latency("kept") or [0.0]),
        "cold_kept_max_ms": max(cold_latency("kept"), default=0.0),
        "cold_kept_samples": len(cold_latency("kept")),
        **{
            f"seq_{kind}_{k}": v
            for kind, d in sequence.items()
            for k, v in d.items()
            if k not in ("slowest", "samples")
        },
        "core_rps_1p": base["digits"],
        "core_rps_2p": two["digits"],
        "core_rps_2p_ratio": ratio("digits", f"2p-{first}", f"1p-{first}"),
        "py_rps_1p": base["iris"],
        "py_rps_2p_ratio": ratio("iris", f"2p-{first}", f"1p-{first}"),
        "core_hop_rps_1p": data["rps"]["1p-hop"]["digits"],
        "py_deserialize_ms": data["levers"]["iris"]["deserialize"],
        "py_first_call_ms": data["levers"]["iris"]["first_call"],
        "py_prefaulted_first_call_ms": data["levers"]["iris"]["prefaulted_first_call"],
        **{
            f"py_{lever}_ms": data["levers"]["iris"][lever]
            for lever in (
                "instantiate",
                "close",
                "pooled_instantiate",
                "pooled_first_call",
                "pooled_close",
            )
        },
        "inline_over_hop": ratio("digits", f"1p-{first}", "1p-hop"),
        "py_inline_over_hop": ratio("iris", f"1p-{first}", "1p-hop"),
        "core_seq_p50_us": base["digits_seq_p50_us"],
        "core_seq_p50_us_hop": data["rps"]["1p-hop"]["digits_seq_p50_us"],
        "inline_latency_ratio": ratio("digits_seq_p50_us", f"1p-{first}", "1p-hop"),
        **(
            {
                "uvloop_over_asyncio_core": ratio("digits", "1p-uvloop", "1p-asyncio"),
                "uvloop_over_asyncio_py": ratio("iris", "1p-uvloop", "1p-asyncio"),
            }
            if {"asyncio", "uvloop"} <= set(args.loops)
            else {}
        ),
    }
    for trace in TRACES:
        for mode in MODES:
            entry = traces[f"{trace}-{mode}"]
            xs = entry.pop("latency_ms")
            # a trace's ~60 requests: too few for a p99, so the slowest
            entry["latency_ms"] = {"p50": statistics.median(xs), "max": max(xs)}
            entry["cold"] = sum(entry["cold"])
    data["summary"] = summary
    data["machine"] = {
        "cpus": os.cpu_count(),
        "loadavg_before": data.pop("loadavg_before"),
        "loadavg_after": os.getloadavg(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (args.json or RESULTS / "coldstart.json").write_text(json.dumps(data, indent=1))
    s = summary
    print(
        f"coldstart: periodic_cold_pct={s['periodic_cold_pct']:.1f} "
        f"bursty_cold_pct={s['bursty_cold_pct']:.1f} poisson_cold_pct={s['poisson_cold_pct']:.1f} "
        f"warm_instance_s_ratio={s['warm_instance_s_ratio']:.2f} cold_max_ms={s['cold_max_ms']:.2f} "
        f"core_rps_1p={s['core_rps_1p']:.0f} core_rps_2p_ratio={s['core_rps_2p_ratio']:.2f} "
        f"py_rps_2p_ratio={s['py_rps_2p_ratio']:.2f} "
        f"reactive_periodic_cold_pct={s['periodic_reactive_cold_pct']:.1f} "
        f"reactive_bursty_cold_pct={s['bursty_reactive_cold_pct']:.1f} "
        f"reactive_poisson_cold_pct={s['poisson_reactive_cold_pct']:.1f} "
        f"py_rps_1p={s['py_rps_1p']:.0f} inline_over_hop={s['inline_over_hop']:.2f} "
        f"py_inline_over_hop={s['py_inline_over_hop']:.2f} "
        f"core_seq_p50_us={s['core_seq_p50_us']:.0f} inline_latency_ratio={s['inline_latency_ratio']:.2f} "
        f"py_deserialize_ms={s['py_deserialize_ms']:.2f} py_first_call_ms={s['py_first_call_ms']:.2f} "
        f"py_prefaulted_first_call_ms={s['py_prefaulted_first_call_ms']:.2f} "
        f"py_instantiate_ms={s['py_instantiate_ms']:.2f} "
        f"py_pooled_instantiate_ms={s['py_pooled_instantiate_ms']:.2f} "
        f"py_pooled_first_call_ms={s['py_pooled_first_call_ms']:.2f} "
        f"py_close_ms={s['py_close_ms']:.2f} py_pooled_close_ms={s['py_pooled_close_ms']:.2f} "
        f"cold_p50_ms={s['cold_p50_ms']:.2f} cold_kept_p50_ms={s['cold_kept_p50_ms']:.2f} "
        f"cold_kept_max_ms={s['cold_kept_max_ms']:.2f} "
        + " ".join(
            f"seq_{kind}_{k}={s[f'seq_{kind}_{k}']:.2f}"
            for kind in ("cold", "cached", "kept")
            for k in ("p50_ms", "p99_ms", "cpu_p50_ms", "wait_p50_ms", "wait_p99_ms")
        )
        + f" load1={data['machine']['loadavg_after'][0]:.1f}"
        + (
            f" uvloop_over_asyncio_core={s['uvloop_over_asyncio_core']:.2f}"
            f" uvloop_over_asyncio_py={s['uvloop_over_asyncio_py']:.2f}"
            if "uvloop_over_asyncio_core" in s
            else ""
        )
    )


if __name__ == "__main__":
    main()
