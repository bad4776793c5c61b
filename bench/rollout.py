"""Rollout benchmark: `meshfn up` (real Envoy, the real backend, real functions) under steady load.

(1) Promotion: a candidate identical to the stable version goes through three canary steps;
    promote_failed counts the requests that failed on the way (goal: 0).
(2) Rollback, repeated: a candidate that fails every request (a build that traps) takes its
    first step's weight. From the client's side: rollback_s is the time from the first failed
    request to the last one (after which the candidate gets nothing: the rollback is complete),
    and failed_ratio_vs_min is the requests it failed over the theoretical minimum, its weight x
    the request rate x the detection time (one evaluation interval: a breach can wait that long
    for its evaluation). Goals: rollback_s within 2 evaluation intervals; the ratio near 1.
Medians over the repeats are reported. Prints one line:
  rollout: rollback_s=… failed_ratio_vs_min=… promote_failed=… interval_s=… weight_pct=… rate=… repeats=…

The candidates are meshfn.testing.candidates' (the digits example, compiled from ONNX).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from meshfn.common.adminauth import admin_headers
from meshfn.testing import candidates
from meshfn.testing import policies as p
from meshfn.testing.load import DIGITS, SteadyLoad
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN, Proc, Processes, wait_for

HERE = Path(__file__).resolve().parent


def _function(name: str) -> str:
    spec = {"backend": "models", "limits": {"timeout": "2s", "maxConcurrency": 64}}
    return p.doc("Function", name, spec)


def _rollout(
    function: str, candidate: str, interval: float, steps: list[int], step_s: float
) -> str:
    doc = {
        "apiVersion": p.API_VERSION,
        "kind": "Rollout",
        "metadata": {"name": function},
        "spec": {
            "function": function,
            "stable": "1",
            "candidate": candidate,
            "interval": f"{interval}s",
            "canary": {
                "minRequests": 10,
                "minTime": f"{step_s}s",
                "steps": [{"weight": w} for w in steps],
            },
            "slo": {"minSamples": 10},
        },
    }
    return yaml.safe_dump(doc)


class Mesh:
    def __init__(self, work: Path, repeats: int) -> None:
        self.work = work
        self.ports = named_ports("xds", "admin", "edge", "models")
        self.gateway = f"http://127.0.0.1:{self.ports['edge']}"
        self.admin = f"http://127.0.0.1:{self.ports['admin']}"
        self.policies = work / "policies"
        self.policies.mkdir()
        published: list[tuple[str, str, candidates.Variant]] = [
            ("bench-good", "1", "same"),
            ("bench-good", "2", "same"),
            ("bench-bad", "1", "same"),
        ]
        published += [("bench-bad", str(k), "trap") for k in range(2, repeats + 2)]
        self.key = candidates.publish(work / "build", work / "functions", published)
        (self.policies / "mesh.yaml").write_text(
            p.documents(
                p.mesh("bench", "bench.local", self.ports["xds"], self.ports["admin"]),
                p.gateway(None, self.ports["edge"]),
                p.service("models", self.ports["models"]),
                _function("bench-good"),
                _function("bench-bad"),
            )
        )

    def start(self, procs: Processes) -> Proc:
        up = procs.start(
            "up",
            [
                MESHFN, "up", "--policies", str(self.policies), "--state-dir",
                str(self.work / "state"), "--functions-registry", str(self.work / "functions"),
                "--trusted-key", str(self.key), "--envoy-concurrency", "1", "--log-level",
                "warning",
            ],
        )  # fmt: skip
        wait_for("meshfn up", lambda: "Ctrl-C stops everything" in up.output(), 240, proc=up)
        return up

    def status(self, function: str) -> dict[str, Any] | None:
        request = urllib.request.Request(
            self.admin + "/rollouts", headers=admin_headers(self.work / "state")
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            docs = json.loads(response.read())["rollouts"]
        return next((d for d in docs if d["rollout"] == f"default/{function}"), None)

    def start_rollout(self, up: Proc, function: str, candidate: str, text: str) -> None:
        """Write the Rollout and wait until it runs and both versions answer (the backend
        restarts to serve the candidate)."""
        (self.policies / f"rollout-{function}.yaml").write_text(text)

        def running() -> bool:
            doc = self.status(function)
            return doc is not None and doc["candidate"] == candidate

        wait_for(f"{function} {candidate}", running, 60, proc=up)
        for version in ("1", candidate):
            url = f"{self.gateway}/v2/models/{function}/versions/{version}/ready"
            wait_for(f"{function}@{version}", lambda u=url: _ok(u), 60)

    def until(self, up: Proc, function: str, phase: str, timeout: float) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            doc = self.status(function)
            return doc if doc and doc["phase"] == phase else None

        return wait_for(f"{function} {phase}", reached, timeout, every=0.1, proc=up)


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)


def promotion(mesh: Mesh, up: Proc, args: argparse.Namespace) -> dict[str, Any]:
    text = _rollout("bench-good", "2", args.interval, [10, 50, 100], args.step_seconds)
    mesh.start_rollout(up, "bench-good", "2", text)
    load = SteadyLoad(f"{mesh.gateway}/v2/models/bench-good/infer", DIGITS, args.rate).start()
    try:
        doc = mesh.until(up, "bench-good", "Promoted", 60 + 6 * args.step_seconds)
        time.sleep(1)
    finally:
        answers = load.stop()
    failed = [a for a in answers if a.status != 200]
    return {
        "sent": len(answers),
        "failed": len(failed),
        "statuses": sorted({a.status for a in answers}),
        "history": doc["history"],
    }


def rollback(mesh: Mesh, up: Proc, args: argparse.Namespace, candidate: str) -> dict[str, Any]:
    text = _rollout("bench-bad", candidate, args.interval, [args.weight, 100], 30)
    mesh.start_rollout(up, "bench-bad", candidate, text)
    load = SteadyLoad(f"{mesh.gateway}/v2/models/bench-bad/infer", DIGITS, args.rate).start()
    try:
        doc = mesh.until(up, "bench-bad", "RolledBack", 60)
        time.sleep(2 * args.interval + 1)  # any failure still to come would come by now
    finally:
        answers = load.stop()
    failed = sorted(a.sent for a in answers if a.status != 200)
    if not failed:
        raise RuntimeError(f"the failing candidate failed no request: {doc['history']}")
    minimum = args.weight / 100 * args.rate * args.interval
    return {
        "rollback_s": failed[-1] - failed[0],
        "failed": len(failed),
        "minimum": minimum,
        "failed_ratio_vs_min": len(failed) / minimum,
        "sent": len(answers),
        "reason": doc["reason"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s of the steady load")
    parser.add_argument("--interval", type=float, default=1.0, help="evaluation interval (s)")
    parser.add_argument("--weight", type=int, default=10, help="the failing candidate's weight")
    parser.add_argument("--step-seconds", type=float, default=3.0, help="promotion: minTime")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "rollout.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshfn-rollout-") as tmp:
        mesh = Mesh(Path(tmp), args.repeats)
        procs = Processes(Path(tmp))
        try:
            up = mesh.start(procs)
            promoted = promotion(mesh, up, args)
            rollbacks = [rollback(mesh, up, args, str(k)) for k in range(2, args.repeats + 2)]
        finally:
            procs.stop_all()
    result = {
        "rollback_s": statistics.median(r["rollback_s"] for r in rollbacks),
        "failed_ratio_vs_min": statistics.median(r["failed_ratio_vs_min"] for r in rollbacks),
        "promote_failed": promoted["failed"],
        "interval_s": args.interval,
        "weight_pct": args.weight,
        "rate": args.rate,
        "repeats": args.repeats,
        "goals": {
            "rollback_s": f"<= {2 * args.interval} (2 evaluation intervals)",
            "promote_failed": "0",
        },
        "promotion": promoted,
        "rollbacks": rollbacks,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(
        f"rollout: rollback_s={result['rollback_s']:.2f} "
        f"failed_ratio_vs_min={result['failed_ratio_vs_min']:.2f} "
        f"promote_failed={result['promote_failed']} interval_s={args.interval:g} "
        f"weight_pct={args.weight} rate={args.rate:g} repeats={args.repeats}"
    )


if __name__ == "__main__":
    main()
