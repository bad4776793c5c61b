"""xDS push benchmark.

(a) A policy file edit -> the change visible through one real Envoy (`meshfn up`): 300 edits
    by default (`--changes`), median and p99 (the fourth slowest of 300; with fewer edits
    `visible_p99_ms` nears the maximum, and is the maximum below 51). Baseline in the same run:
    one plain request through the same Envoy.
(b) N simulated Envoys (bench/xds_clients.py, own process, pinned to CPU 1) on ADS to `meshfn
    serve` (pinned to CPU 0) with 1000 services (clusters, endpoints, routes); an endpoint edited
    in one policy file -> EVERY stream has received and ACKed the new endpoint (checked per
    stream, by content). Reported for N=1000 and 3000: the median and the maximum over the
    edits (`converge_max_ms`: with 20 edits a "p99" would be the maximum anyway), and the
    control plane's peak RSS (VmHWM) over the run. Baseline in the same run: one client.
    Each simulated Envoy has its own TCP connection, as real ones do (--shared-connection
    multiplexes them all on one, as this bench did before: cheaper for both sides, unrealistic).
(c) The same with 10,000 Delta streams (--large-clients, --large-protocol): `converge_max_ms@N`
    (the maximum over the 20 edits: too few for a p99), `cp_peak_rss_mb@N` (the control plane's
    peak RSS, VmHWM, initial sync included), and the CPU of the control plane and of the
    simulated fleet while the edits are pushed (`cp_cpu_pct@N`, `clients_cpu_pct@N`, % of one
    core): the fleet shares this machine.

Prints one line:
  xds_push: visible_p50_ms=… visible_p99_ms=… clients=… converge_max_ms=… cp_peak_rss_mb=… …
    converge_max_ms@10000=… cp_peak_rss_mb@10000=… clients_cpu_pct@10000=… cp_cpu_pct@10000=…
and writes the details as JSON (--json, default bench/results/xds_push.json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from meshfn.common.processes import raise_open_files_limit
from meshfn.control_plane.identity.bootstrap_token import BootstrapTokens
from meshfn.testing import policies as p
from meshfn.testing.policies import Policies
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import (
    MESHFN,
    Processes,
    http_ok,
    pin,
    wait_for,
)

HERE = Path(__file__).resolve().parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set size of `pid` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time `pid` (all its threads) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- (a) visible through Envoy


def bench_visible(work: Path, changes: int) -> dict[str, Any]:
    policies = Policies(work / "visible")
    policies.route("/", "alpha")
    procs = Processes(work)
    try:
        up = procs.start(
            "visible-up",
            [
                MESHFN,
                "up",
                "--policies",
                str(policies.root),
                "--state-dir",
                str(work / "state"),
                "--envoy-concurrency",
                "1",
                "--log-level",
                "warning",
            ],
        )
        conn = http.client.HTTPConnection("127.0.0.1", policies.ports["listener"], timeout=5)

        def served() -> str:
            conn.request("GET", "/bench")
            response = conn.getresponse()
            body = response.read()
            return json.loads(body)["service"] if response.status == 200 else ""

        def first_answer() -> bool:
            try:
                return served() == "default/alpha"
            except (OSError, http.client.HTTPException, ValueError):
                conn.close()
                raise

        wait_for("meshfn up", first_answer, 60, every=0.05, proc=up)
        time.sleep(0.5)  # let the watcher's catch-up reload pass
        rtts = []
        for _ in range(200):
            t = time.perf_counter()
            served()
            rtts.append((time.perf_counter() - t) * 1000)
        visible = []
        current = "alpha"
        for _ in range(changes):
            current = "beta" if current == "alpha" else "alpha"
            wanted = f"default/{current}"
            policies.route("/", current)
            started = time.perf_counter()  # the new policy is in place from here on
            while served() != wanted:
                if time.perf_counter() - started > 10:
                    raise RuntimeError("a route change did not become visible within 10 s")
            visible.append((time.perf_counter() - started) * 1000)
            time.sleep(0.03)
        conn.close()
    finally:
        procs.stop_all()
    return {
        "changes": changes,
        "visible_ms": visible,
        "visible_p50_ms": statistics.median(visible),
        "visible_p99_ms": percentile(visible, 99),
        "request_rtt_p50_ms": statistics.median(rtts),
        "visible_over_rtt": statistics.median(visible) / statistics.median(rtts),
    }


# ---------------------------------------------------------------- (b) fan-out to N streams


def service_doc(index: int, port: int) -> str:
    name = f"svc-{index:05d}"
    net = f"10.{index // 250}.{index % 250}"
    endpoints = [{"address": f"{net}.1"}, {"address": f"{net}.2"}]
    return p.documents(
        p.service(name, port, endpoints, namespace="bench"),
        p.route(name, name, f"/{name}/", namespace="bench"),
    )


def bench_fanout(
    work: Path,
    clients: int,
    services: int,
    changes: int,
    protocol: str,
    shared_connection: bool = False,
) -> dict[str, Any]:
    xds, admin, envoy_admin, listener = free_ports(4)
    policies = work / f"fanout-{clients}-{protocol}"
    policies.mkdir()
    (policies / "mesh.yaml").write_text(
        p.documents(
            p.mesh("fanout", "bench.local", xds, admin),
            p.gateway(envoy_admin, listener, namespace="bench", xdsProtocol=protocol),
        )
    )
    (policies / "services").mkdir()
    for i in range(services):
        (policies / "services" / f"svc-{i:05d}.yaml").write_text(service_doc(i, 8000))
    procs = Processes(work)
    try:
        state = work / f"state-{clients}-{protocol}"
        # Simulated proxies authenticate like real ones: with their workload's bootstrap token.
        authorization = BootstrapTokens(state / "xds-token.key").header("edge.bench")
        cp = procs.start(
            f"cp-{clients}-{protocol}",
            [
                MESHFN,
                "serve",
                "--policies",
                str(policies),
                "--state-dir",
                str(state),
                "--log-level",
                "warning",
            ],
        )
        pin(cp.pid, 0)
        wait_for(
            "the control plane", lambda: http_ok(f"http://127.0.0.1:{admin}/healthz"), 120, proc=cp
        )
        fleet = procs.start(
            f"clients-{clients}-{protocol}",
            [
                sys.executable,
                "-P",
                str(HERE / "xds_clients.py"),
                "--target",
                f"127.0.0.1:{xds}",
                "--clients",
                str(clients),
                "--services",
                str(services),
                "--group",
                "edge.bench",
                "--protocol",
                protocol,
                "--authorization",
                authorization,
                *(["--shared-connection"] if shared_connection else []),
            ],
            pipe=True,
        )
        pin(fleet.pid, 1)
        assert fleet.popen is not None
        stdin, stdout = fleet.popen.stdin, fleet.popen.stdout
        assert stdin is not None and stdout is not None

        def ask(command: str) -> list[str]:
            stdin.write(command + "\n")
            stdin.flush()
            line: str = stdout.readline()
            return line.split()

        ready = stdout.readline().split()
        if not ready or ready[0] != "READY":
            raise RuntimeError(f"clients failed to sync: {ready}")
        sync_s = float(ready[1])
        time.sleep(1.0)  # let the watcher's catch-up reload pass
        cpu_from = (time.monotonic(), cpu_seconds(cp.pid), cpu_seconds(fleet.pid))
        converge = []
        other_updates = 0
        port = 8000
        for change in range(changes):
            index = (change * 7919) % services
            port += 1
            path = policies / "services" / f"svc-{index:05d}.yaml"
            p.write(path, service_doc(index, port))
            started = time.monotonic()
            reply = ask(f"WAIT svc-{index:05d}.bench {port}")
            if reply[0] != "DONE":
                raise RuntimeError(f"not every stream saw change {change}: {reply}")
            converge.append((float(reply[1]) - started) * 1000)
            other_updates = int(reply[3])
            time.sleep(0.1)
        rss, peak = rss_mb(cp.pid)
        wall = time.monotonic() - cpu_from[0]
        cp_cpu_s = cpu_seconds(cp.pid) - cpu_from[1]
        clients_cpu_s = cpu_seconds(fleet.pid) - cpu_from[2]
        ask("QUIT")
    finally:
        procs.stop_all()
    return {
        "clients": clients,
        "services": services,
        "protocol": protocol,
        "initial_sync_s": sync_s,
        "converge_ms": converge,
        "converge_p50_ms": statistics.median(converge),
        "converge_max_ms": max(converge),  # ~20 edits: too few for a p99
        "connections": "shared" if shared_connection else "one per client",
        "eds_updates_without_the_change": other_updates,
        "cp_rss_mb_at_end": rss,
        "cp_peak_rss_mb": peak,
        # While the edits were pushed (from sync + 1 s to the last ACK), % of one core, and
        # CPU time per edit (reload included): steadier than wall time on a shared machine.
        "cp_cpu_pct": 100 * cp_cpu_s / wall,
        "clients_cpu_pct": 100 * clients_cpu_s / wall,
        "cp_cpu_ms_per_change": 1000 * cp_cpu_s / changes,
        "clients_cpu_ms_per_change": 1000 * clients_cpu_s / changes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--changes", type=int, default=300, help="edits for (a) (>= 300: a p99)")
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument("--fanout-changes", type=int, default=20)
    parser.add_argument("--protocol", choices=["sotw", "delta"], default="sotw")
    parser.add_argument(
        "--large-clients", type=int, default=10000, help="streams for (c); 0 skips it"
    )
    parser.add_argument("--large-protocol", choices=["sotw", "delta"], default="delta")
    parser.add_argument("--large-changes", type=int, default=20)
    parser.add_argument(
        "--shared-connection",
        action="store_true",
        help="all simulated Envoys on one connection (this bench's old, unrealistic set-up)",
    )
    parser.add_argument("--json", type=Path, default=HERE / "results" / "xds_push.json")
    args = parser.parse_args()

    raise_open_files_limit()
    shared = args.shared_connection
    with tempfile.TemporaryDirectory(prefix="meshfn-bench-") as tmp:
        work = Path(tmp)
        visible = bench_visible(work, args.changes)
        baseline = bench_fanout(
            work, 1, args.services, max(5, args.fanout_changes // 2), args.protocol, shared
        )
        runs = [
            bench_fanout(work, n, args.services, args.fanout_changes, args.protocol, shared)
            for n in args.clients
        ]
        large = (
            bench_fanout(
                work,
                args.large_clients,
                args.services,
                args.large_changes,
                args.large_protocol,
                shared,
            )
            if args.large_clients
            else None
        )
    main_run = runs[0]
    result = {
        "visible": visible,
        "fanout_baseline_one_client": baseline,
        "fanout": runs,
        "large": large,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    parts = [
        f"visible_p50_ms={visible['visible_p50_ms']:.1f}",
        f"visible_p99_ms={visible['visible_p99_ms']:.1f}",
        f"clients={main_run['clients']}",
        f"converge_max_ms={main_run['converge_max_ms']:.0f}",
        f"cp_peak_rss_mb={main_run['cp_peak_rss_mb']:.0f}",
        f"converge_p50_ms={main_run['converge_p50_ms']:.0f}",
        f"one_client_converge_p50_ms={baseline['converge_p50_ms']:.0f}",
        f"request_rtt_p50_ms={visible['request_rtt_p50_ms']:.2f}",
    ]
    for run in runs[1:]:
        n = run["clients"]
        parts += [
            f"converge_max_ms@{n}={run['converge_max_ms']:.0f}",
            f"cp_peak_rss_mb@{n}={run['cp_peak_rss_mb']:.0f}",
        ]
    if large is not None:
        n = large["clients"]
        parts += [
            f"converge_max_ms@{n}={large['converge_max_ms']:.0f}",
            f"cp_peak_rss_mb@{n}={large['cp_peak_rss_mb']:.0f}",
            f"clients_cpu_pct@{n}={large['clients_cpu_pct']:.0f}",
            f"cp_cpu_pct@{n}={large['cp_cpu_pct']:.0f}",
            f"converge_p50_ms@{n}={large['converge_p50_ms']:.0f}",
        ]
    print("xds_push: " + " ".join(parts), flush=True)


if __name__ == "__main__":
    with closing(sys.stdout):
        main()
