"""Benchmark of the inference backend (bench/functions.py).

Measures, on loopback with real processes:
  cold start  first request to an unloaded function (scale-to-zero TTL expired), from its
              precompiled .cwasm: Python component (iris-py, the hand-written iris, served as
              `iris`) and core wasm (digits, an ONNX model compiled to ABI v2), p50/p99;
              also the server's own part of it (deserialize + instantiate, `load_*`) and the
              baseline: a loaded function's request after the same idle gap (`*idle_warm*`)
  resume      the Python function's first request after its instances were dropped at the
              idle TTL with its code kept (codeTtl), p50/p99
  warm        sequential keep-alive requests to a loaded function, backend alone, p50/p99
  e2e         paced 200 requests/s through a static Envoy in front of the backend, p99
              (and the same pacing against the backend alone, the baseline of the hop)
  hop         the Envoy -> backend hop over loopback TCP and over the backend's unix socket
              (how a sidecar of `meshfn up` reaches it: no port a local user could call past
              the sidecar): sequential requests to the core function through each of two
              Envoys, each in front of a fresh backend of the same config, alternating in
              `--hop-rounds` rounds; the median of the per-round differences of the p50s
              (unix - tcp, microseconds)
  throughput  requests/s (wrk, closed loop) with 1 and 2 wasm worker threads
  memory      PSS (proportional set size) per additional warm instance of the Python function:
              two functions of the same artifact with warm pools of 4 and 33, each loaded on
              its own; (growth of the larger - growth of the smaller) / (instance difference),
              the instance counts read from the backend's gauges, so the code's load (the
              same in both) cancels out
Prints one summary line and writes bench/results/functions.json.

`--http-stacks` instead compares HTTP servers for the backend (aiohttp, aiohttp+uvloop, uvicorn
with httptools+uvloop, a bare asyncio+httptools server) on the same trivial JSON handler.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from meshfn.common.unix import unix_request
from meshfn.inference.devtools import RawHttp, write_envoy_config
from meshfn.inference.examples import publish_examples
from meshfn.testing import envoy as test_envoy
from meshfn.testing import load
from meshfn.testing.ports import free_port, free_ports
from meshfn.testing.processes import Proc, Processes, http_ok, wait_for

RESULTS = Path(__file__).resolve().parent / "results"
PY = sys.executable
IRIS = load.IRIS
DIGITS = load.DIGITS
pct = load.pct
sequential = load.sequential


def wait_http(url: str, proc: Proc, timeout: float = 60) -> None:
    wait_for(url, lambda: http_ok(url), timeout, every=0.05, proc=proc)


def metric(port: int, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def pss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss in smaps_rollup")


def backend(
    procs: Processes,
    tmp: Path,
    registry: Path,
    key: Path,
    workers: int,
    name: str,
    unix_socket: Path | None = None,
    config_path: Path | None = None,
) -> tuple[Proc, int]:
    """A backend on a free port, or on `unix_socket` instead (then the port returned is 0);
    `config_path`: another config than the one with every function of the measurements."""
    cold = {"idleTtl": "50ms", "pool": {"minIdle": 0, "maxIdle": 1}}
    resume = {**cold, "codeTtl": "1h"}
    config = {
        "registry": str(registry),
        "trustedKeys": [str(key)],
        "workers": workers,
        "functions": [
            {
                "name": "iris",
                "version": "1",
                "artifact": "iris-py@1",
                "pool": {"minIdle": 1, "maxIdle": 4},
            },
            {"name": "digits", "version": "1", "pool": {"minIdle": 1, "maxIdle": 4}},
            {"name": "iris-cold", "version": "1", "artifact": "iris-py@1", **cold},
            {"name": "digits-cold", "version": "1", "artifact": "digits@1", **cold},
            {"name": "iris-resume", "version": "1", "artifact": "iris-py@1", **resume},
            {
                "name": "iris-pool",
                "version": "1",
                "artifact": "iris-py@1",
                "pool": {"minIdle": 33, "maxIdle": 64},
            },
            {
                "name": "iris-pool4",
                "version": "1",
                "artifact": "iris-py@1",
                "pool": {"minIdle": 4, "maxIdle": 64},
            },
        ],
    }
    path = config_path or tmp / f"{name}.json"
    if config_path is None:
        path.write_text(json.dumps(config))
    port = 0 if unix_socket is not None else free_port()
    listen = ["--unix-socket", str(unix_socket)] if unix_socket else ["--port", str(port)]
    proc = procs.start(
        name,
        [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(path), *listen,
         "--log-level", "warning"],
    )  # fmt: skip
    if unix_socket is None:
        wait_http(f"http://127.0.0.1:{port}/v2/health/ready", proc)
    else:

        def ready() -> bool:
            try:
                return unix_request(unix_socket, "/v2/health/ready")[0] == 200
            except OSError:
                return False

        wait_for(str(unix_socket), ready, 60, every=0.05, proc=proc)
    return proc, port


def cold_starts(
    port: int, model: str, warm_model: str, body: bytes, samples: int, resume: bool = False
) -> tuple[list[float], list[float], list[float]]:
    """Client-side latency of requests that hit an unloaded function, the server's own load +
    first instantiate time for each (from the cold-start histogram's sum), and the baseline:
    the same request to a loaded function after the same idle gap and /metrics polls.
    `resume`: the function keeps its code (codeTtl), so its first request after the
    idle TTL only instantiates; the other two lists are then empty.

    An idle server answers its first request slower than one under steady load (idle vCPUs
    wake, caches are cold): measured here 1.1-1.2 ms for a warm core call that takes 0.5 ms
    back to back. The baseline tells that part from what loading adds."""
    label = f'function="{model}@1"'
    gone, counter = (
        ("meshfn_fn_idle_instances", "meshfn_fn_resumes_total")
        if resume
        else ("meshfn_fn_loaded", "meshfn_fn_cold_starts_total")
    )
    out: list[float] = []
    inside: list[float] = []
    idle_warm: list[float] = []
    client = RawHttp("127.0.0.1", port)
    raw = client.encode("POST", f"/v2/models/{model}/infer", body)
    warm_raw = client.encode("POST", f"/v2/models/{warm_model}/infer", body)
    try:
        while len(out) < samples:
            deadline = time.monotonic() + 5
            while metric(port, gone, label) != 0.0:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{model} never scaled to zero")
                time.sleep(0.02)
            before = metric(port, counter, label)
            load_before = metric(port, "meshfn_fn_cold_start_seconds_sum", label)
            t = time.perf_counter()
            status, reply = client.send(raw)
            elapsed = time.perf_counter() - t
            assert status == 200, reply
            if metric(port, counter, label) == before + 1:
                out.append(elapsed * 1000)
                load = metric(port, "meshfn_fn_cold_start_seconds_sum", label) - load_before
                if resume:  # the cold run already measured this function's baseline
                    continue
                inside.append(load * 1000)
                time.sleep(0.06)  # as idle as before a cold request (the TTL is 50 ms)
                metric(port, counter, label)
                metric(port, "meshfn_fn_cold_start_seconds_sum", label)
                t = time.perf_counter()
                status, reply = client.send(warm_raw)
                idle_warm.append((time.perf_counter() - t) * 1000)
                assert status == 200, reply
    finally:
        client.close()
    return out, inside, idle_warm


def hops(
    procs: Processes, tmp: Path, registry: Path, key: Path, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Per round, the p50 (us) of sequential requests to the core function (digits: the least
    guest time, so the hop shows) through an Envoy that reaches its backend over loopback TCP,
    and through one that reaches its backend over a unix socket; two fresh backends of one lean
    config; the order alternates by round."""
    config = tmp / "hop.json"
    config.write_text(
        json.dumps({"registry": str(registry), "trustedKeys": [str(key)], "workers": 2,
                    "functions": [{"name": "digits", "pool": {"minIdle": 2, "maxIdle": 4}}]})
    )  # fmt: skip
    sockets = tmp / "sockets"
    sockets.mkdir(mode=0o700)
    sock = sockets / "backend.sock"
    envoys = {}
    for hop, where in (("tcp", None), ("unix", sock)):
        _, port = backend(procs, tmp, registry, key, 2, f"hop-{hop}", where, config)
        listener, admin = free_ports(2)
        envoy_config = write_envoy_config(
            tmp / f"envoy-{hop}.json", listener, admin, port, backend_socket=where
        )
        envoy = procs.start(f"envoy-{hop}", test_envoy.argv(envoy_config))
        wait_http(f"http://127.0.0.1:{admin}/ready", envoy)
        envoys[hop] = listener
    path = "/v2/models/digits/infer"
    each = max(20, args.warm // args.hop_rounds)
    out: dict[str, list[float]] = {"tcp": [], "unix": []}
    for port in envoys.values():
        sequential(port, path, DIGITS, 200)
    for index in range(args.hop_rounds):
        order = list(envoys.items())
        for hop, port in order if index % 2 == 0 else order[::-1]:
            out[hop].append(statistics.median(sequential(port, path, DIGITS, each)))
    return out


def paced(port: int, path: str, body: bytes, rate: float, seconds: float) -> list[float]:
    """Open-loop at `rate` requests/s on one keep-alive connection: latency from the scheduled
    send time, so a stall also counts for the requests queued behind it."""
    client = RawHttp("127.0.0.1", port)
    raw = client.encode("POST", path, body)
    for _ in range(20):
        client.send(raw)
    times = []
    start = time.perf_counter()
    try:
        for i in range(int(rate * seconds)):
            due = start + i / rate
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            status, reply = client.send(raw)
            times.append((time.perf_counter() - due) * 1000)
            assert status == 200, reply
    finally:
        client.close()
    return times


def wrk(port: int, path: str, body: bytes, seconds: float, connections: int, tmp: Path) -> float:
    return load.wrk(f"http://127.0.0.1:{port}{path}", body, seconds, connections, tmp).rps


def pool_growth(port: int, pid: int, name: str, min_idle: int) -> tuple[float, int]:
    """Load `name` with one request, wait for its warm pool; (PSS growth MiB, instances)."""
    label = f'function="{name}@1"'
    base = pss_mb(pid)
    client = RawHttp("127.0.0.1", port)
    client.request("POST", f"/v2/models/{name}/infer", IRIS)
    client.close()
    deadline = time.monotonic() + 60
    last = -1.0
    while True:  # filled, and no longer changing (the served instance is back too)
        idle = metric(port, "meshfn_fn_idle_instances", label)
        if idle >= min_idle and idle == last:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}'s warm pool never filled")
        last = idle
        time.sleep(0.2)
    busy = metric(port, "meshfn_fn_inflight", label)
    return pss_mb(pid) - base, int(idle + busy)


def instance_memory(port: int, pid: int) -> dict[str, float]:
    small, n_small = pool_growth(port, pid, "iris-pool4", 4)
    large, n_large = pool_growth(port, pid, "iris-pool", 33)
    return {
        "pss_growth_small_mb": small,
        "instances_small": n_small,
        "pss_growth_large_mb": large,
        "instances_large": n_large,
        "per_instance_mb": (large - small) / (n_large - n_small),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-fn-"))
    procs = Processes(tmp)
    try:
        published, key = publish_examples(tmp / "registry", include_testing=True)
        registry = tmp / "registry"
        result: dict[str, Any] = {"published": [p.name for p in published]}
        proc, port = backend(procs, tmp, registry, key, 2, "backend-2w")
        (
            result["cold_python_ms"],
            result["load_python_ms"],
            result["idle_warm_python_ms"],
        ) = cold_starts(port, "iris-cold", "iris", IRIS, args.cold)
        (
            result["cold_core_ms"],
            result["load_core_ms"],
            result["idle_warm_core_ms"],
        ) = cold_starts(port, "digits-cold", "digits", DIGITS, args.cold)
        result["resume_python_ms"], _, _ = cold_starts(
            port, "iris-resume", "iris", IRIS, args.cold, resume=True
        )
        result["warm_python_us"] = sequential(port, "/v2/models/iris/infer", IRIS, args.warm)
        result["warm_core_us"] = sequential(port, "/v2/models/digits/infer", DIGITS, args.warm)
        envoy_port, admin = free_ports(2)
        config = write_envoy_config(tmp / "envoy.json", envoy_port, admin, port)
        envoy = procs.start("envoy", test_envoy.argv(config))
        wait_http(f"http://127.0.0.1:{admin}/ready", envoy)
        result["warm_envoy_us"] = sequential(envoy_port, "/v2/models/iris/infer", IRIS, args.warm)
        result["paced_backend_ms"] = paced(
            port, "/v2/models/iris/infer", IRIS, 200, args.paced_seconds
        )
        result["paced_envoy_ms"] = paced(
            envoy_port, "/v2/models/iris/infer", IRIS, 200, args.paced_seconds
        )
        envoy.stop()
        result["rps_2w"] = wrk(port, "/v2/models/iris/infer", IRIS, args.wrk_seconds, 8, tmp)
        result["rps_2w_core"] = wrk(
            port, "/v2/models/digits/infer", DIGITS, args.wrk_seconds, 8, tmp
        )
        result["memory"] = instance_memory(port, proc.pid)
        assert proc.stop() == 0, "backend did not exit 0 on SIGTERM"
        proc1, port1 = backend(procs, tmp, registry, key, 1, "backend-1w")
        sequential(port1, "/v2/models/iris/infer", IRIS, 50)
        sequential(port1, "/v2/models/digits/infer", DIGITS, 50)
        result["rps_1w"] = wrk(port1, "/v2/models/iris/infer", IRIS, args.wrk_seconds, 8, tmp)
        result["rps_1w_core"] = wrk(
            port1, "/v2/models/digits/infer", DIGITS, args.wrk_seconds, 8, tmp
        )
        assert proc1.stop() == 0, "backend did not exit 0 on SIGTERM"
        result["hop_p50_us"] = hops(procs, tmp, registry, key, args)
        return result
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------- HTTP stack comparison

STACK_BODY = json.dumps(
    {
        "model_name": "m",
        "model_version": "1",
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "data": [1.0]}],
    }
).encode()


def stack_server(stack: str, port: int) -> None:
    """A trivial KServe-shaped handler: read the body, parse it, answer fixed JSON."""
    if stack.startswith("aiohttp"):
        from aiohttp import web

        async def infer(request: web.Request) -> web.Response:
            json.loads(await request.read())
            return web.Response(body=STACK_BODY, content_type="application/json")

        app = web.Application()
        app.router.add_post("/v2/models/{name}/infer", infer)
        if stack == "aiohttp-uvloop":
            import uvloop

            uvloop.install()
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    elif stack == "uvicorn":
        import uvicorn

        async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            body = b""
            more = True
            while more:
                msg = await receive()
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
            json.loads(body)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(STACK_BODY)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": STACK_BODY})

        uvicorn.run(
            asgi,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            http="httptools",
            loop="uvloop",
        )
    elif stack == "httptools":
        import asyncio

        import httptools

        class Proto(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport
                self.parser = httptools.HttpRequestParser(self)
                self.body = b""

            def data_received(self, data: bytes) -> None:
                self.parser.feed_data(data)

            def on_body(self, body: bytes) -> None:
                self.body += body

            def on_message_complete(self) -> None:
                json.loads(self.body)
                self.body = b""
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(STACK_BODY), STACK_BODY)
                )

        async def main() -> None:
            server = await asyncio.get_running_loop().create_server(
                Proto, "127.0.0.1", port, backlog=1024
            )
            await server.serve_forever()

        asyncio.run(main())


def http_stacks(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-http-"))
    procs = Processes(tmp)
    out: dict[str, Any] = {}
    body = IRIS
    try:
        needs = {
            "aiohttp": "aiohttp",
            "aiohttp-uvloop": "uvloop",
            "uvicorn": "uvicorn",
            "httptools": "httptools",
        }
        for stack, module in needs.items():
            if importlib.util.find_spec(module) is None:
                out[stack] = {"unavailable": f"pip install {module} to include it"}
                continue
            port = free_port()
            proc = procs.start(stack, [PY, "-P", __file__, "--stack-server", stack, str(port)])
            deadline = time.monotonic() + 20
            while True:
                try:
                    RawHttp("127.0.0.1", port).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(
                            f"{stack} server did not start (see {tmp}/{stack}.log)"
                        ) from None
                    time.sleep(0.05)
            lat = sequential(port, "/v2/models/m/infer", body, args.warm)
            rps = wrk(port, "/v2/models/m/infer", body, args.wrk_seconds, 8, tmp)
            out[stack] = {"p50_us": statistics.median(lat), "p99_us": pct(lat, 0.99), "rps": rps}
            proc.stop()
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cold",
        type=int,
        default=300,
        help="cold-start samples per function (300: p99 is not just the worst sample)",
    )
    parser.add_argument("--warm", type=int, default=2000, help="sequential warm requests")
    parser.add_argument("--paced-seconds", type=float, default=10.0, help="seconds at 200 req/s")
    parser.add_argument("--wrk-seconds", type=int, default=5)
    parser.add_argument(
        "--hop-rounds", type=int, default=16, help="alternating rounds of the TCP/unix hop"
    )
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    parser.add_argument("--http-stacks", action="store_true", help="compare HTTP servers instead")
    parser.add_argument(
        "--stack-server", nargs=2, metavar=("STACK", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.stack_server:
        stack_server(args.stack_server[0], int(args.stack_server[1]))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.http_stacks:
        data = http_stacks(args)
        (args.json or RESULTS / "functions_http.json").write_text(json.dumps(data, indent=1))
        base = data["aiohttp"]["rps"]
        print(
            "http_stacks: "
            + " ".join(
                f"{k}_p50_us={v['p50_us']:.0f} {k}_rps={v['rps']:.0f} {k}_x={v['rps'] / base:.2f}"
                for k, v in data.items()
                if "rps" in v
            )
        )
        return
    data = run(args)
    cold, core = data["cold_python_ms"], data["cold_core_ms"]
    warm, envoy_warm = data["warm_python_us"], data["warm_envoy_us"]
    summary = {
        "cold_p50_ms": statistics.median(cold),
        "cold_p99_ms": pct(cold, 0.99),
        "core_cold_p50_ms": statistics.median(core),
        "core_cold_p99_ms": pct(core, 0.99),
        "idle_warm_p99_ms": pct(data["idle_warm_python_ms"], 0.99),
        "resume_p50_ms": statistics.median(data["resume_python_ms"]),
        "resume_p99_ms": pct(data["resume_python_ms"], 0.99),
        "core_idle_warm_p50_ms": statistics.median(data["idle_warm_core_ms"]),
        "core_idle_warm_p99_ms": pct(data["idle_warm_core_ms"], 0.99),
        "load_p50_ms": statistics.median(data["load_python_ms"]),
        "load_p99_ms": pct(data["load_python_ms"], 0.99),
        "core_load_p50_ms": statistics.median(data["load_core_ms"]),
        "core_load_p99_ms": pct(data["load_core_ms"], 0.99),
        "warm_p50_us": statistics.median(warm),
        "warm_p99_us": pct(warm, 0.99),
        "core_warm_p50_us": statistics.median(data["warm_core_us"]),
        "envoy_warm_p50_us": statistics.median(envoy_warm),
        "envoy_hop_p50_us": statistics.median(envoy_warm) - statistics.median(warm),
        "unix_minus_tcp_p50_us": statistics.median(
            u - t
            for u, t in zip(data["hop_p50_us"]["unix"], data["hop_p50_us"]["tcp"], strict=True)
        ),
        "hop_tcp_p50_us": statistics.median(data["hop_p50_us"]["tcp"]),
        "hop_unix_p50_us": statistics.median(data["hop_p50_us"]["unix"]),
        "backend_p99_ms_at_200rps": pct(data["paced_backend_ms"], 0.99),
        "e2e_p50_ms": statistics.median(data["paced_envoy_ms"]),
        "e2e_p99_ms": pct(data["paced_envoy_ms"], 0.99),
        "rps_1w": data["rps_1w"],
        "rps_2w": data["rps_2w"],
        "rps_2w_over_1w": data["rps_2w"] / data["rps_1w"],
        "core_rps_1w": data["rps_1w_core"],
        "core_rps_2w": data["rps_2w_core"],
        "pss_per_instance_mb": data["memory"]["per_instance_mb"],
    }
    data["summary"] = summary
    for key in (
        "warm_python_us",
        "warm_core_us",
        "warm_envoy_us",
        "paced_backend_ms",
        "paced_envoy_ms",
    ):
        xs = data[key]  # thousands of samples: keep their distribution, not the list
        data[key] = {
            "n": len(xs),
            "p50": statistics.median(xs),
            "p90": pct(xs, 0.9),
            "p99": pct(xs, 0.99),
            "max": max(xs),
        }
    data["machine"] = {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg()}
    (args.json or RESULTS / "functions.json").write_text(json.dumps(data, indent=1))
    s = summary
    print(
        f"functions: cold_p50_ms={s['cold_p50_ms']:.2f} cold_p99_ms={s['cold_p99_ms']:.2f} "
        f"core_cold_p99_ms={s['core_cold_p99_ms']:.2f} warm_p50_us={s['warm_p50_us']:.0f} "
        f"e2e_p99_ms={s['e2e_p99_ms']:.2f} pss_per_instance_mb={s['pss_per_instance_mb']:.2f} "
        f"core_cold_p50_ms={s['core_cold_p50_ms']:.2f} core_idle_warm_p50_ms={s['core_idle_warm_p50_ms']:.2f} "
        f"core_idle_warm_p99_ms={s['core_idle_warm_p99_ms']:.2f} idle_warm_p99_ms={s['idle_warm_p99_ms']:.2f} "
        f"core_warm_p50_us={s['core_warm_p50_us']:.0f} resume_p50_ms={s['resume_p50_ms']:.2f} "
        f"resume_p99_ms={s['resume_p99_ms']:.2f} "
        f"load_p99_ms={s['load_p99_ms']:.2f} core_load_p99_ms={s['core_load_p99_ms']:.3f} "
        f"envoy_hop_p50_us={s['envoy_hop_p50_us']:.0f} backend_p99_ms_at_200rps={s['backend_p99_ms_at_200rps']:.2f} "
        f"unix_minus_tcp_p50_us={s['unix_minus_tcp_p50_us']:.0f} "
        f"rps_1w={s['rps_1w']:.0f} rps_2w={s['rps_2w']:.0f} core_rps_1w={s['core_rps_1w']:.0f} core_rps_2w={s['core_rps_2w']:.0f}"
    )


if __name__ == "__main__":
    main()
