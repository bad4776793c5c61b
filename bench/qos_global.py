"""A global rate limit (QoSPolicy `global`: the control plane's rate-limit service, Envoy's RLS
protocol) measured through real gateways, all in one `meshfn up` run:

  shared     gateways a and b share one policy (`--rate` requests/s, burst the same, fail
             closed); each gets an open loop of `--offered` x the rate from tenant globex for
             `--seconds`: together they should admit what one bucket allows (burst + rate x
             time), where two local limits would admit twice that
  hop        gateway c (a global rate that never limits, fail open) against gateway l (the same
             rate as Envoy's local limit, no limit service): one connection each (wrk),
             alternating `--rounds` times; the p50 difference is what the RLS hop costs
  frozen     the control plane SIGSTOPped (the limit service cannot answer): `--fail-requests`
             sequential requests to a (deny: 503) and to c (allow: 200), each waiting for the
             policy's `--timeout-ms`

  .venv/bin/python bench/qos_global.py
  .venv/bin/python bench/qos_global.py --seconds 2 --rounds 1 --hop-seconds 1   # the smoke's
Prints one line:
  qos_global: global_admitted_ratio=… global_p50_over_local_us=… fail_closed_p50_ms=…
  fail_open_p50_ms=… timeout_ms=…
  (admitted across both gateways / what one bucket allows; the gateway p50 with the RLS hop
  minus without, in us; each frozen request's latency, median, beside the policy's timeout).
  The run fails when the shared phase answered anything but 200 or 429, the hop's wrk saw an
  answer outside 2xx or a socket error, or a frozen request was not answered as its policy
  says (503 on a, fail closed; 200 on c, fail open)
and writes bench/results/qos_global.json (or --json) with every phase's figures.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshfn.testing import load
from meshfn.testing import policies as p
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN, Proc, Processes, http_status, issue_token, wait_for

ROOT = Path(__file__).resolve().parents[1]
GATEWAYS = {"a": "edge-a", "b": "edge-b", "c": "edge-c", "l": "edge-l"}
UNLIMITED = {"requests": 100_000}  # c and l: the filters run, nobody is limited


def mesh(tmp: Path, procs: Processes, args: argparse.Namespace) -> tuple[Proc, dict[str, int]]:
    ports = named_ports("xds", "admin", "alpha", *GATEWAYS, *(f"{k}_admin" for k in GATEWAYS))
    root = tmp / "policies"
    root.mkdir()
    timeout = f"{args.timeout_ms}ms"
    rate = {"requests": args.rate, "per": "1s", "burst": args.rate}
    policies = p.gateways_mesh(
        "bench",
        ports,
        GATEWAYS,
        p.qos_policy("shared", ["edge-a", "edge-b"], rate, "deny", timeout),
        p.qos_policy("open", ["edge-c"], UNLIMITED, "allow", timeout),
        p.qos_policy("local", ["edge-l"], UNLIMITED),
    )
    p.write(root / "mesh.yaml", policies)
    state = tmp / "state"
    argv = [MESHFN, "up", "--policies", str(root), "--state-dir", str(state)]
    up = procs.start("up", [*argv, "--envoy-concurrency", "1"])
    wait_for("meshfn up", lambda: "Ctrl-C stops everything" in up.output(), 120, proc=up)
    headers = auth(state, "probe")
    for key in GATEWAYS:
        url = f"http://127.0.0.1:{ports[key]}/"
        wait_for(f"gateway {key}", lambda u=url: http_status(u, headers) == 200, 60, proc=up)
    return up, ports


def auth(state: Path, tenant: str) -> dict[str, str]:
    token = issue_token(state, f"bench-{tenant}", tenant, "2h")
    return {"authorization": f"Bearer {token}", "content-type": "application/json"}


def shared(state: Path, ports: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    headers = auth(state, "globex")  # its first requests: a full bucket
    offered = args.offered * args.rate
    runs = load.run_loads(
        *(("open", (f"http://127.0.0.1:{ports[k]}/", headers, offered, args.seconds)) for k in "ab")
    )
    admitted = {k: r["statuses"].get(200, 0) for k, r in zip("ab", runs, strict=True)}
    allowed = args.rate + args.rate * args.seconds
    other = {
        k: {s: n for s, n in r["statuses"].items() if s not in (200, 429)}
        for k, r in zip("ab", runs, strict=True)
    }
    if any(other.values()):  # admitted or limited, nothing else (no 503, no lost request)
        raise SystemExit(f"qos_global: shared phase answered other than 200 or 429: {other}")
    return {
        "offered_rps_per_gateway": offered,
        "allowed": allowed,
        "admitted": admitted,
        "statuses": {k: r["statuses"] for k, r in zip("ab", runs, strict=True)},
        "global_admitted_ratio": sum(admitted.values()) / allowed,
        "two_local_limits_would_admit": 2 * allowed,
    }


def hop(state: Path, ports: dict[str, int], tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    headers = auth(state, "acme")
    p50: dict[str, list[float]] = {"c": [], "l": []}
    p99: dict[str, list[float]] = {"c": [], "l": []}
    for _ in range(args.rounds):
        for key in ("c", "l"):
            url = f"http://127.0.0.1:{ports[key]}/"
            result = load.wrk(url, b"{}", args.hop_seconds, 1, tmp, headers=headers)
            p50[key].append(result.p50_ms)
            p99[key].append(result.p99_ms)
    global_p50, local_p50 = statistics.median(p50["c"]), statistics.median(p50["l"])
    return {
        "p50_ms": p50,
        "p99_ms": p99,
        "global_p50_ms": global_p50,
        "local_p50_ms": local_p50,
        "global_p50_over_local_us": (global_p50 - local_p50) * 1000,
    }


def frozen(
    up: Proc, state: Path, ports: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    headers = auth(state, "initech")
    times: dict[str, list[float]] = {"a": [], "c": []}
    statuses: dict[str, list[int]] = {"a": [], "c": []}
    up.send(signal.SIGSTOP)
    try:
        for _ in range(args.fail_requests):
            for key in ("a", "c"):
                started = time.perf_counter()
                status = http_status(f"http://127.0.0.1:{ports[key]}/", headers, timeout=10)
                times[key].append((time.perf_counter() - started) * 1000)
                statuses[key].append(status)
    finally:
        up.send(signal.SIGCONT)
    # The latencies say how long the policy's timeout held each request; they are only that
    # if each answer is what the policy says: deny (503) on a, allow (200) on c.
    expected = {"a": 503, "c": 200}
    wrong = {k: [s for s in statuses[k] if s != want] for k, want in expected.items()}
    if any(wrong.values()):
        raise SystemExit(
            f"qos_global: with the limit service frozen, answers other than {expected}: {wrong}"
        )
    return {
        "timeout_ms": args.timeout_ms,
        "latency_ms": times,
        "statuses": statuses,
        "fail_closed_p50_ms": statistics.median(times["a"]),
        "fail_open_p50_ms": statistics.median(times["c"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=int, default=50, help="the shared requests/s (= burst)")
    parser.add_argument("--offered", type=float, default=1.5, help="x the rate, per gateway")
    parser.add_argument("--seconds", type=float, default=10, help="the shared phase")
    parser.add_argument("--rounds", type=int, default=5, help="hop rounds (medians)")
    parser.add_argument("--hop-seconds", type=float, default=3, help="each hop run")
    parser.add_argument("--timeout-ms", type=int, default=100)
    parser.add_argument("--fail-requests", type=int, default=10)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "qos_global.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshfn-qos-global-") as raw:
        tmp = Path(raw)
        procs = Processes(tmp)
        try:
            up, ports = mesh(tmp, procs, args)
            state = tmp / "state"
            result = {
                "shared": shared(state, ports, args),
                "hop": hop(state, ports, tmp, args),
                "frozen": frozen(up, state, ports, args),
                "args": {k: str(v) for k, v in vars(args).items()},
            }
        finally:
            procs.stop_all()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"qos_global: global_admitted_ratio={result['shared']['global_admitted_ratio']:.3f} "
        f"global_p50_over_local_us={result['hop']['global_p50_over_local_us']:.0f} "
        f"fail_closed_p50_ms={result['frozen']['fail_closed_p50_ms']:.1f} "
        f"fail_open_p50_ms={result['frozen']['fail_open_p50_ms']:.1f} "
        f"timeout_ms={args.timeout_ms}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
