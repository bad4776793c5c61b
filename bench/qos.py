"""Multi-tenant QoS under a noisy neighbour, at backend saturation, and with one slow endpoint.

Mesh 1: `meshfn up` on policies/examples plus policies/qos/tenants.yaml (tenant initech let past
the examples' tenant rule): the edge gateway Envoy limits each verified tenant's rate, the
inference backend (iris, behind mTLS sidecars) sheds by priority. Every request carries a
token; the tenant is its verified claim. Phases, each `--seconds` long, all in one run:
  quiet      acme (premium) alone, open loop at `--quiet-rate` requests/s: the baseline
  noisy      the same, beside globex (standard, 20/s with a burst of 20) sending 10x its limit
  saturated  the same quiet acme beside initech (batch, the lowest priority) in a closed loop
             on `--low-connections` connections: the backend saturates and initech is shed,
             by the gateway itself (the policy's gatewayShedding; `--no-gateway-shedding`: by
             the backend alone, the baseline)
Mesh 2: a gateway in front of two placeholder endpoints of one Service in one locality, one
  delayed by `--slow-ms` (meshfn up's delay file); closed-loop load (wrk, `--lb-seconds`) with
  the Service's loadBalancer weighted-round-robin (ORCA reports from the endpoints), then
  least-request (hot reload), `--rounds` times alternating; medians, and the share of
  requests each balancer sent to the slow endpoint (the gateway's per-host counters).

Each load generator is its own process (its event loop is not the measured one's).

  .venv/bin/python bench/qos.py                    # 10 s phases
  .venv/bin/python bench/qos.py --seconds 3        # the e2e smoke's short run
Prints one line:
  qos: quiet_p99_ratio=… noisy_admitted_ratio=… high_p99_ratio=… low_shed_pct=…
       low_shed_at_gateway_pct=… wrr_p99_ratio=…
       acme_not_200=… unexpected_statuses=…
  (quiet tenant's p99 with the noisy neighbour / alone; globex's admitted requests / what its
  bucket allows in the phase; acme's p99 at saturation / alone; % of initech's requests shed
  (at the gateway or by the backend), % shed at the gateway; p99 with weighted round robin /
  least-request. The p99s are of 200 answers: acme's requests answered otherwise, or not at
  all, over the three phases, and any answer a tenant should never get (anything but 200 for
  acme; anything but 200 or 429 for globex and initech) are counted, and either fails the run
  after the line is printed)
and writes bench/results/qos.json (or --json) with every phase's figures, and where the CPU went
during the saturated phase (`cpu_at_saturation`: each process of the mesh, the load generators,
the machine's busy share).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from meshfn.testing import load
from meshfn.testing import policies as p
from meshfn.testing.envoy import active_cluster, admin_json
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import (
    MESHFN,
    CpuSplit,
    Processes,
    issue_token,
    up_with_functions,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "policies" / "examples"
TENANTS = ROOT / "policies" / "qos" / "tenants.yaml"
IRIS = "/v2/models/iris/infer"
GLOBEX_RATE, GLOBEX_BURST = 20, 20  # policies/qos/tenants.yaml
EVERY_ANSWER_200 = {200}
SERVED_OR_LIMITED = {200, 429}  # a refusal by the tenant's limit or by priority shedding


def p99(values: list[float]) -> float:
    if not values:
        raise SystemExit("no successful request to measure")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


# ---------------------------------------------------------------- mesh 1: tenants


def tenants_mesh(
    tmp: Path, procs: Processes, gateway_shedding: bool = True
) -> tuple[str, dict[str, dict[str, str]]]:
    """The example mesh with the tenant policy: (gateway URL, tenant -> request headers)."""
    policies = tmp / "examples"
    mapping = p.qos_examples(EXAMPLES, TENANTS, policies, gateway_shedding=gateway_shedding)
    state = tmp / "state"
    up = procs.start("up", up_with_functions(policies, state, tmp / "functions"))
    wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=300)
    headers = {
        tenant: {
            "authorization": f"Bearer {issue_token(state, f'bench-{tenant}', tenant, '2h')}",
            "content-type": "application/json",
        }
        for tenant in ("acme", "globex", "initech")
    }
    url = f"http://127.0.0.1:{mapping[10000]}{IRIS}"
    wait_for("iris through the mesh", lambda: _status(url, headers["acme"]) == 200, timeout=60)
    return url, headers


def _status(url: str, headers: dict[str, str]) -> int:
    async def once() -> int:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=load.IRIS, headers=headers) as r,
        ):
            await r.read()
            return r.status

    try:
        return asyncio.run(once())
    except aiohttp.ClientError:
        return 0


def tenant_phases(
    url: str, headers: dict[str, dict[str, str]], args: argparse.Namespace, up: int
) -> dict[str, Any]:
    seconds, rate = args.seconds, args.quiet_rate
    quiet = ("open", (url, headers["acme"], rate, seconds))
    # Warm-up: instances, connections, the drift breaker's baseline.
    load.run_loads(("open", (url, headers["acme"], rate, min(seconds, 3))))
    alone = load.run_loads(quiet)[0]
    time.sleep(1.5)  # globex's bucket full again
    noisy_rate = 10 * GLOBEX_RATE
    with_noisy, noisy = load.run_loads(
        quiet, ("open", (url, headers["globex"], noisy_rate, seconds))
    )
    allowed = GLOBEX_BURST + GLOBEX_RATE * seconds
    split = CpuSplit(up)  # where the CPU goes at saturation (docs/benchmarks.md's analysis)
    saturated, low = load.run_loads(
        ("open", (url, headers["acme"], rate, seconds)),
        ("closed", (url, headers["initech"], args.low_connections, seconds + 0.5)),
    )
    low_total = sum(low["statuses"].values())
    # Who must be served: acme (premium) in every phase; globex only up to its bucket (429
    # beyond); initech only what is not shed (429). Anything else (a 503, no answer) is a
    # failure the ratios above would not show: they are of 200s only.
    answered_as = {
        "acme": (EVERY_ANSWER_200, [alone, with_noisy, saturated]),
        "globex": (SERVED_OR_LIMITED, [noisy]),
        "initech": (SERVED_OR_LIMITED, [low]),
    }
    unexpected = {
        tenant: sum(n for r in runs for s, n in r["statuses"].items() if s not in allowed_statuses)
        for tenant, (allowed_statuses, runs) in answered_as.items()
    }
    return {
        "acme_not_200": {
            phase: r["not_200"]
            for phase, r in (("alone", alone), ("with_noisy", with_noisy), ("saturated", saturated))
        },
        "unexpected_statuses": unexpected,
        "quiet_alone": _summary(alone),
        "quiet_with_noisy": _summary(with_noisy),
        "noisy": {"offered_rps": noisy_rate, "allowed": allowed, "statuses": noisy["statuses"]},
        "high_at_saturation": _summary(saturated),
        "low_at_saturation": {**low, "total": low_total},
        "cpu_at_saturation": split.result(),
        "quiet_p99_ratio": p99(with_noisy["latencies_ms"]) / p99(alone["latencies_ms"]),
        "noisy_admitted_ratio": noisy["statuses"].get(200, 0) / allowed,
        "high_p99_ratio": p99(saturated["latencies_ms"]) / p99(alone["latencies_ms"]),
        "low_shed_pct": 100 * low["limits"].get("shed", 0) / max(low_total, 1),
        "low_shed_at_gateway_pct": 100 * low["scopes"].get("gateway", 0) / max(low_total, 1),
    }


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    latencies = result["latencies_ms"]
    return {
        "sent": result["sent"],
        "statuses": result["statuses"],
        "not_200": result["not_200"],
        "p50_ms": statistics.median(latencies) if latencies else None,
        "p99_ms": p99(latencies),
    }


# ---------------------------------------------------------------- mesh 2: one slow endpoint


def balancer_policies(ports: dict[str, int], balancer: str) -> str:
    where = "eu/eu-1a/n1"
    return p.documents(
        p.mesh("lb", "lb.local", ports["xds"], ports["admin"]),
        p.gateway(ports["envoy_admin"], ports["listener"], locality=p.locality(where)),
        p.service(
            "pool", ports["fast"],
            [p.endpoint(where=where), p.endpoint(ports["slow"], where=where)],
            loadBalancer=balancer,
        ),
        p.route("pool", "pool"),
    )  # fmt: skip


def balancer_phases(tmp: Path, procs: Processes, args: argparse.Namespace) -> dict[str, Any]:
    ports = named_ports("xds", "admin", "envoy_admin", "listener", "fast", "slow")
    policies = tmp / "lb"
    policies.mkdir()
    policy = policies / "mesh.yaml"
    policy.write_text(balancer_policies(ports, "least-request"))
    state = tmp / "lb-state"
    up = procs.start(
        "up-lb",
        [
            MESHFN,
            "up",
            "--policies",
            str(policies),
            "--state-dir",
            str(state),
            "--envoy-concurrency",
            "1",
        ],
    )
    wait_for("the balancer mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=120)
    delay = state / "delay" / f"127.0.0.1-{ports['slow']}"
    delay.parent.mkdir(parents=True, exist_ok=True)
    delay.write_text(str(args.slow_ms))
    url = f"http://127.0.0.1:{ports['listener']}/"
    results: dict[str, list[float]] = {"weighted-round-robin": [], "least-request": []}
    slow_share: dict[str, list[float]] = {"weighted-round-robin": [], "least-request": []}
    current = "least-request"
    for _ in range(args.rounds):
        for balancer in ("weighted-round-robin", "least-request"):
            if balancer != current:
                policy.write_text(balancer_policies(ports, balancer))
                current = balancer
                wait_for(
                    f"the gateway on {balancer}",
                    functools.partial(_runs, ports["envoy_admin"], "pool.default", balancer),
                    timeout=30,
                )
            # The balancer settles first: weighted round robin weighs from reports once its
            # blackout (1 s from the first report) is over, and its weights take ~2.5 s more
            # (five updates) to shrink the slow endpoint's share to its floor (measured).
            load.wrk(url, b"{}", 4, args.lb_connections, tmp)
            before = _requests_by_port(ports["envoy_admin"])
            result = load.wrk(url, b"{}", args.lb_seconds, args.lb_connections, tmp)
            after = _requests_by_port(ports["envoy_admin"])
            sent = {port: after.get(port, 0) - before.get(port, 0) for port in after}
            results[balancer].append(result.p99_ms)
            slow_share[balancer].append(sent.get(ports["slow"], 0) / max(sum(sent.values()), 1))
    wrr = statistics.median(results["weighted-round-robin"])
    lr = statistics.median(results["least-request"])
    return {
        "slow_ms": args.slow_ms,
        "p99_ms": results,
        # the share of requests the gateway sent to the slow endpoint (its /clusters counters)
        "slow_endpoint_share": slow_share,
        "wrr_p99_ratio": wrr / lr,
    }


def _runs(admin: int, cluster: str, balancer: str) -> bool:
    """Whether the gateway's active `cluster` runs `balancer` (its config dump)."""
    found = active_cluster(admin, cluster)
    if balancer == "weighted-round-robin":
        return "client_side_weighted_round_robin" in json.dumps(found)
    return bool(found.get("lb_policy") == "LEAST_REQUEST")


def _requests_by_port(admin: int) -> dict[int, int]:
    """Requests the gateway has sent to each endpoint port (Envoy's per-host rq_total)."""
    clusters = admin_json(admin, "/clusters?format=json")["cluster_statuses"]
    totals: dict[int, int] = {}
    for cluster in clusters:
        for host in cluster.get("host_statuses", []):
            if "socket_address" not in host["address"]:
                continue  # the adminPort forwarder's cluster: the admin socket (a pipe)
            port = host["address"]["socket_address"]["port_value"]
            stats = {s["name"]: int(s.get("value", 0)) for s in host.get("stats", [])}
            totals[port] = totals.get(port, 0) + stats.get("rq_total", 0)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--quiet-rate", type=float, default=50)
    parser.add_argument("--low-connections", type=int, default=32)
    parser.add_argument("--slow-ms", type=float, default=20)
    parser.add_argument("--lb-connections", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="balancer rounds (medians)")
    parser.add_argument("--lb-seconds", type=float, default=5, help="each balancer run")
    parser.add_argument(
        "--no-gateway-shedding",
        action="store_true",
        help="the policy without gatewayShedding: the backend alone sheds (the baseline)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "qos.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshfn-qos-") as raw:
        tmp = Path(raw)
        procs = Processes(tmp)
        try:
            url, headers = tenants_mesh(tmp, procs, not args.no_gateway_shedding)
            tenants = tenant_phases(url, headers, args, procs.started[0].pid)
            procs.stop_all()
            balancers = balancer_phases(tmp, procs, args)
        finally:
            procs.stop_all()
    result = {
        "tenants": tenants,
        "balancers": balancers,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    acme_not_200 = sum(tenants["acme_not_200"].values())
    unexpected = sum(tenants["unexpected_statuses"].values())
    print(
        f"qos: quiet_p99_ratio={tenants['quiet_p99_ratio']:.2f} "
        f"noisy_admitted_ratio={tenants['noisy_admitted_ratio']:.3f} "
        f"high_p99_ratio={tenants['high_p99_ratio']:.2f} "
        f"low_shed_pct={tenants['low_shed_pct']:.1f} "
        f"low_shed_at_gateway_pct={tenants['low_shed_at_gateway_pct']:.1f} "
        f"wrr_p99_ratio={balancers['wrr_p99_ratio']:.2f} "
        f"acme_not_200={acme_not_200} unexpected_statuses={unexpected}"
    )
    sys.stdout.flush()
    if acme_not_200 or unexpected:  # the ratios are of 200s only: they would hide this
        sys.exit(
            f"qos: the premium tenant was not served ({tenants['acme_not_200']}), or a tenant "
            f"got an answer it should not ({tenants['unexpected_statuses']}); see {args.json}"
        )


if __name__ == "__main__":
    main()
