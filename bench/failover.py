"""Failover benchmark: real Envoy, real upstreams in three localities, `meshfn serve`.

(1) Kill the gateway's local upstream under steady load: time until every answer comes from the
    next locality (detect_ms), and requests that failed while moving (failed of sent).
(2) Inject latency into the primary: time until the drift breaker has tripped the route
    (breaker_trip_ms, from the control plane's status).
Each is repeated; medians are reported. Prints one line:
  failover: detect_ms=… failed=… sent=… breaker_trip_ms=…
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from xds_push import MESHFN, free_ports, stop

from meshfn.control_plane.runtime.envoy import envoy_binary

HERE = Path(__file__).resolve().parent
LOCALITIES = {
    "a": "eu-west/eu-west-1a/n1",
    "b": "eu-west/eu-west-1b/n2",
    "c": "us-east/us-east-1a/n3",
}


def policies(ports: dict[str, int]) -> str:
    def loc(text: str) -> str:
        region, zone, node = text.split("/")
        return f"{{region: {region}, zone: {zone}, node: {node}}}"

    endpoints = ", ".join(
        f"{{address: 127.0.0.1, port: {ports[n]}, locality: {loc(LOCALITIES[n])}}}" for n in "abc"
    )
    return f"""\
apiVersion: meshfn.io/v1alpha1
kind: Mesh
metadata: {{name: failover}}
spec: {{trustDomain: bench.local, ports: {{xds: {ports["xds"]}, admin: {ports["admin"]}}}}}
---
apiVersion: meshfn.io/v1alpha1
kind: Gateway
metadata: {{name: edge}}
spec:
  adminPort: {ports["envoy_admin"]}
  locality: {loc(LOCALITIES["a"])}
  listeners: [{{name: http, port: {ports["listener"]}}}]
---
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {{name: model}}
spec: {{port: 1, endpoints: [{endpoints}]}}
---
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {{name: model-lite}}
spec: {{port: 2, endpoints: [{{address: 127.0.0.1, port: {ports["lite"]}}}]}}
---
apiVersion: meshfn.io/v1alpha1
kind: FallbackPolicy
metadata: {{name: model}}
spec:
  service: model
  locality: {{}}
  outlierDetection: {{consecutiveGatewayErrors: 1, consecutive5xxErrors: 3, interval: 100ms, baseEjectionTime: 30s}}
  # A passing health check un-ejects a revived endpoint; a dead one stays out.
  healthCheck: {{path: /health, interval: 250ms, timeout: 500ms, unhealthyThreshold: 2}}
  chain: [model-lite]
  driftBreaker: {{threshold: 40, minSamples: 10, window: 1s, baselineWindow: 10s, recoverAfter: 1s, probePercent: 10}}
---
apiVersion: meshfn.io/v1alpha1
kind: Route
metadata: {{name: model}}
spec:
  destination: {{service: model}}
  retries: {{attempts: 3, retryOn: [connect-failure, refused-stream, reset, gateway-error]}}
"""


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
    name: str, ports: dict[str, int], work: Path, service: str
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "meshfn.control_plane.runtime.upstream",
         "--service", service, "--port", str(ports[name]), "--locality", LOCALITIES.get(name, ""),
         "--delay-file", str(work / f"delay-{name}")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def wait_until(what: str, probe: Any, timeout: float = 30) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if probe():
                return time.monotonic()
        except (OSError, ValueError, KeyError, http.client.HTTPException):
            pass
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "failover.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshfn-failover-") as tmp:
        work = Path(tmp)
        names = ["xds", "admin", "envoy_admin", "listener", "a", "b", "c", "lite"]
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        (work / "p").mkdir()
        (work / "p" / "mesh.yaml").write_text(policies(ports))
        for name in ("a", "b", "c", "lite"):
            (work / f"delay-{name}").write_text("0")
        upstreams = {
            n: start_upstream(
                n, ports, work, "default/model-lite" if n == "lite" else "default/model"
            )
            for n in ("a", "b", "c", "lite")
        }
        serve = subprocess.Popen(
            [MESHFN, "serve", "--policies", str(work / "p"), "--state-dir", str(work / "s"),
             "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        admin = f"http://127.0.0.1:{ports['admin']}"
        envoy = None
        load = None
        try:
            wait_until(
                "control plane", lambda: urllib.request.urlopen(admin + "/healthz", timeout=1)
            )
            config = work / "envoy.json"
            config.write_text(
                subprocess.run(
                    [MESHFN, "bootstrap", "edge.default", "--policies", str(work / "p"),
                     "--state-dir", str(work / "s")],
                    capture_output=True, text=True, check=True,
                ).stdout
            )  # fmt: skip
            envoy = subprocess.Popen(
                [str(envoy_binary()), "-c", str(config), "--disable-hot-restart",
                 "--concurrency", "2", "--log-level", "error"],
            )  # fmt: skip
            local, next_locality = f"127.0.0.1:{ports['a']}", f"127.0.0.1:{ports['b']}"

            def serving(endpoint: str) -> bool:
                recent = load.window(time.monotonic() - 0.3, time.monotonic()) if load else []
                return bool(recent) and all(who == endpoint for _, _, who in recent)

            load = Load(ports["listener"])
            wait_until("traffic on the local endpoint", lambda: serving(local), 60)
            kills = []
            for _ in range(args.repeats):
                time.sleep(1.0)
                killed = time.monotonic()
                upstreams["a"].send_signal(signal.SIGKILL)
                upstreams["a"].wait()
                time.sleep(2.0)
                moved = load.window(killed, killed + 2.0)
                stray = [t for t, status, who in moved if who != next_locality]
                kills.append(
                    {
                        "detect_ms": (max(stray) - killed) * 1000 if stray else 0.0,
                        "failed": sum(1 for _, status, _ in moved if status != 200),
                        "sent": len(moved),
                        "failures": [(status, who) for _, status, who in moved if status != 200],
                    }
                )
                upstreams["a"] = start_upstream("a", ports, work, "default/model")
                wait_until("traffic back on the local endpoint", lambda: serving(local), 30)
            trips = []
            for _ in range(args.repeats):
                time.sleep(2.0)  # baseline of fast answers
                injected = time.monotonic()
                for n in "abc":
                    (work / f"delay-{n}").write_text("100")

                def tripped() -> bool:
                    with urllib.request.urlopen(admin + "/debug/status", timeout=2) as response:
                        routes = json.loads(response.read())["routes"]
                    return bool(routes["default/model"]["state"] == "degraded")

                trips.append((wait_until("the breaker", tripped, 20) - injected) * 1000)
                for n in "abc":
                    (work / f"delay-{n}").write_text("0")
                wait_until("recovery", lambda: not tripped(), 30)
        finally:
            if load is not None:
                load.close()
            for proc in [envoy, serve, *upstreams.values()]:
                if proc is not None:
                    stop(proc)
    result = {
        "kills": kills,
        "detect_ms": statistics.median(k["detect_ms"] for k in kills),
        "failed": sum(k["failed"] for k in kills),
        "sent": sum(k["sent"] for k in kills),
        "breaker_trip_ms": statistics.median(trips),
        "trips_ms": trips,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(
        f"failover: detect_ms={result['detect_ms']:.0f} failed={result['failed']} "
        f"sent={result['sent']} breaker_trip_ms={result['breaker_trip_ms']:.0f} "
        f"repeats={args.repeats}",
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    main()
