"""Failover benchmark: real Envoy, real upstreams in three localities, `meshfn serve`.

(1) Kill the gateway's local upstream under steady load: time from the kill until answers come
    from the next locality only (detect_ms: the last answer from elsewhere, or the first from the
    next locality when there was none), and requests that failed while moving (failed of sent).
    The window lasts until the move has held for a second (up to 30 s, then the run fails:
    nothing is truncated, and "nothing completed" is an error, not detect_ms=0).
(2) Inject latency into the primary: time until the drift breaker has tripped the route
    (breaker_trip_ms, from the control plane's status).
(3) In process: what one evaluation of the drift breaker costs a guarded route at the sample
    cap (health.drift.MAX_SAMPLES, latency-like values over the examples' windows), against
    the p95s taken by sorting the same samples, as the breaker did before (its control plane
    evaluates every route five times a second): breaker_eval_ms and eval_vs_sort.
Each is repeated; medians are reported. Prints one line:
  failover: detect_ms=… failed=… sent=… breaker_trip_ms=… repeats=… breaker_eval_ms=…
  eval_vs_sort=…
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from meshfn import ir
from meshfn.common.adminauth import call_admin, read_owner_token
from meshfn.health import drift
from meshfn.testing import envoy
from meshfn.testing import policies as p
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN, Proc, Processes, meshfn, wait_for

HERE = Path(__file__).resolve().parent
LOCALITIES = {
    "a": "eu-west/eu-west-1a/n1",
    "b": "eu-west/eu-west-1b/n2",
    "c": "us-east/us-east-1a/n3",
}


def policies(ports: dict[str, int]) -> str:
    return p.documents(
        p.mesh("failover", "bench.local", ports["xds"], ports["admin"]),
        p.gateway(ports["envoy_admin"], ports["listener"], locality=p.locality(LOCALITIES["a"])),
        p.service("model", 1, [p.endpoint(ports[n], LOCALITIES[n]) for n in "abc"]),
        p.service("model-lite", 2, [p.endpoint(ports["lite"])]),
        # A passing health check un-ejects a revived endpoint; a dead one stays out.
        p.fallback_policy(
            "model", ["model-lite"], "100ms", ("250ms", "500ms"), recover_after="1s", locality={}
        ),
        p.route(
            "model", "model", retries={"attempts": 3, "retryOn": [*p.RETRY_ON, "gateway-error"]}
        ),
    )


class Load:
    def __init__(self, port: int, threads: int = 4, interval: float = 0.01) -> None:
        self.port, self.interval = port, interval
        self.results: list[tuple[float, int, str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stop.is_set():
            try:
                conn.request("GET", "/v2/x")
                response = conn.getresponse()
                body = response.read()
                status = response.status
                # a failure keeps what it was, for the JSON result
                who = json.loads(body)["endpoint"] if status == 200 else body.decode()[:300]
            except (OSError, http.client.HTTPException, ValueError) as exc:
                status, who = 0, repr(exc)[:300]
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            with self.lock:
                self.results.append((time.monotonic(), status, who))
            time.sleep(self.interval)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)

    def window(self, start: float, end: float) -> list[tuple[float, int, str]]:
        with self.lock:
            return [r for r in self.results if start <= r[0] < end]


def start_upstream(
    procs: Processes, name: str, ports: dict[str, int], work: Path, service: str
) -> Proc:
    return procs.upstream(
        f"upstream-{name}", service, ports[name],
        "--locality", LOCALITIES.get(name, ""), "--delay-file", str(work / f"delay-{name}"),
    )  # fmt: skip


def breaker_evaluation(rounds: int = 21) -> dict[str, float]:
    """Median ms of DriftBreaker.evaluate with MAX_SAMPLES samples against sorting them."""
    settings = ir.Drift(
        threshold_percent=40, min_increase=timedelta(milliseconds=5), min_samples=20,
        window=timedelta(seconds=3), baseline_window=timedelta(minutes=10),
        cold_start_baseline=None, recover_after=timedelta(seconds=10), probe_percent=5,
    )  # fmt: skip
    breaker = drift.DriftBreaker()
    breaker.configure([drift.WatchedRoute("default/r", frozenset({"a.default"}), settings)])
    rng = random.Random(1)
    rate = 400.0  # requests a second: the cap is ~8 minutes of them
    values = [rng.lognormvariate(-6, 0.5) for _ in range(drift.MAX_SAMPLES)]
    for i, seconds in enumerate(values):
        breaker.observe("default/r/0", "a.default", seconds, i / rate)
    now = len(values) / rate
    ours, sort = [], []
    for k in range(rounds):
        started = time.perf_counter()
        breaker.evaluate(now + k * 1e-6)
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        split = len(values) - int(settings.window.total_seconds() * rate)
        for part in (values[split:], values[:split]):  # the window's p95 and the baseline's
            ordered = sorted(part)
            ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        sort.append(time.perf_counter() - started)
    return {
        "samples": len(values),
        "breaker_eval_ms": statistics.median(ours) * 1000,
        "sort_ms": statistics.median(sort) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "failover.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshfn-failover-") as tmp:
        work = Path(tmp)
        ports = named_ports("xds", "admin", "envoy_admin", "listener", "a", "b", "c", "lite")
        (work / "p").mkdir()
        (work / "p" / "mesh.yaml").write_text(policies(ports))
        for name in ("a", "b", "c", "lite"):
            (work / f"delay-{name}").write_text("0")
        procs = Processes(work)
        admin = f"http://127.0.0.1:{ports['admin']}"
        load = None
        try:
            upstreams = {
                n: start_upstream(
                    procs, n, ports, work, "default/model-lite" if n == "lite" else "default/model"
                )
                for n in ("a", "b", "c", "lite")
            }
            serve = procs.start(
                "serve",
                [MESHFN, "serve", "--policies", str(work / "p"), "--state-dir", str(work / "s"),
                 "--log-level", "warning"],
            )  # fmt: skip
            wait_for(
                "control plane",
                lambda: urllib.request.urlopen(admin + "/healthz", timeout=1),
                timeout=30,
                proc=serve,
            )
            bootstrap = meshfn(
                "bootstrap", "edge.default", "--policies", str(work / "p"),
                "--state-dir", str(work / "s"),
            )  # fmt: skip
            if bootstrap.returncode != 0:
                raise RuntimeError(f"meshfn bootstrap failed: {bootstrap.stderr}")
            config = work / "envoy.json"
            config.write_text(bootstrap.stdout)
            procs.start("envoy", envoy.argv(config, concurrency=2, log_level="error"))
            local, next_locality = f"127.0.0.1:{ports['a']}", f"127.0.0.1:{ports['b']}"

            def serving(endpoint: str) -> bool:
                recent = load.window(time.monotonic() - 0.3, time.monotonic()) if load else []
                return bool(recent) and all(who == endpoint for _, _, who in recent)

            load = Load(ports["listener"])
            wait_for("traffic on the local endpoint", lambda: serving(local), 60)
            kills = []
            for _ in range(args.repeats):
                time.sleep(1.0)
                killed = time.monotonic()
                upstreams["a"].send(signal.SIGKILL)
                upstreams["a"].wait()

                def moved_for_a_second(killed: float = killed) -> bool:
                    now = time.monotonic()
                    recent = load.window(max(killed, now - 1.0), now) if load else []
                    return now - killed > 1.0 and len(recent) >= 20 and serving(next_locality)

                wait_for(
                    "answers from the next locality only, for a second", moved_for_a_second, 30
                )
                held = time.monotonic()  # the window ends where the move has held for a second
                moved = load.window(killed, held)
                stray = [t for t, status, who in moved if who != next_locality]
                first_next = min(t for t, _, who in moved if who == next_locality)
                kills.append(
                    {
                        "detect_ms": ((max(stray) if stray else first_next) - killed) * 1000,
                        "failed": sum(1 for _, status, _ in moved if status != 200),
                        "sent": len(moved),
                        "window_ms": (held - killed) * 1000,
                        "failures": [(status, who) for _, status, who in moved if status != 200],
                    }
                )
                upstreams["a"] = start_upstream(procs, "a", ports, work, "default/model")
                wait_for("traffic back on the local endpoint", lambda: serving(local), 30)
            trips = []
            for _ in range(args.repeats):
                time.sleep(2.0)  # baseline of fast answers
                injected = time.monotonic()
                for n in "abc":
                    (work / f"delay-{n}").write_text("100")

                def tripped() -> bool:
                    token = read_owner_token(work / "s")
                    routes = call_admin(admin + "/debug/status", token, timeout=2)["routes"]
                    return bool(routes["default/model"]["state"] == "degraded")

                wait_for("the breaker", tripped, 20)
                trips.append((time.monotonic() - injected) * 1000)
                for n in "abc":
                    (work / f"delay-{n}").write_text("0")
                wait_for("recovery", lambda: not tripped(), 30)
        finally:
            if load is not None:
                load.close()
            procs.stop_all()
    result: dict[str, Any] = {
        "kills": kills,
        "detect_ms": statistics.median(k["detect_ms"] for k in kills),
        "failed": sum(k["failed"] for k in kills),
        "sent": sum(k["sent"] for k in kills),
        "breaker_trip_ms": statistics.median(trips),
        "trips_ms": trips,
        "evaluation": breaker_evaluation(),
    }
    evaluation = result["evaluation"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(
        f"failover: detect_ms={result['detect_ms']:.0f} failed={result['failed']} "
        f"sent={result['sent']} breaker_trip_ms={result['breaker_trip_ms']:.0f} "
        f"repeats={args.repeats} breaker_eval_ms={evaluation['breaker_eval_ms']:.2f} "
        f"eval_vs_sort={evaluation['breaker_eval_ms'] / evaluation['sort_ms']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    main()
