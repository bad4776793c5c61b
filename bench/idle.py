"""What meshfn costs while nothing happens (bench/idle.py): serverless means most functions are
idle most of the time, and an idle process that wakes hundreds of times a second costs CPU,
power and, on a small machine, the latency of the requests that do come.

  servers  the iris model served by meshfn's backend (compiled from its skl2onnx export) and by
           MLServer 1.7.1 (the same fitted estimator), started as bench/models.py starts them;
           each answers `--requests` requests, then both idle: `--settle` seconds, then
           `--seconds` measured. CPU (schedstat, every thread of the process and of its
           children) in ms per second and context switches (voluntary and not: the
           process's wake-ups) per second
  mesh     `meshfn up` on policies/examples as shipped (its gateways, sidecars, backends,
           control plane and upstreams), after the same settle: the same two figures for the
           whole of it and per kind of process (control plane, Envoys, backends, others)

Prints one line:
  idle: backend_cpu_ms_s=… mlserver_cpu_ms_s=… cpu_vs_mlserver=… backend_wakeups_s=… mlserver_wakeups_s=… mesh_cpu_ms_s=… mesh_wakeups_s=…
and writes bench/results/idle.json (or --json) with the per-process figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshfn.inference.devtools import RawHttp
from meshfn.testing import load
from meshfn.testing.policies import remap
from meshfn.testing.processes import MESHFN, Processes, cpu_ns, descendants, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SERVED, start_both

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
EXAMPLES = HERE.parent / "policies" / "examples"


def _switches(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that just exited
        total += sum(
            int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line
        )
    return total


def _sample(pids: list[int]) -> dict[int, tuple[int, int]]:
    out = {}
    for pid in pids:
        try:
            out[pid] = (cpu_ns(pid), _switches(pid))
        except OSError:
            continue  # gone
    return out


def idle(groups: dict[str, list[int]], settle: float, seconds: float) -> dict[str, Any]:
    """CPU ms/s and wake-ups/s of each group of processes, over `seconds` after `settle`."""
    time.sleep(settle)
    pids = [pid for group in groups.values() for pid in group]
    before = _sample(pids)
    time.sleep(seconds)
    after = _sample(pids)
    out: dict[str, Any] = {}
    for name, group in groups.items():
        kept = [p for p in group if p in before and p in after]
        out[name] = {
            "cpu_ms_s": sum(after[p][0] - before[p][0] for p in kept) / seconds / 1e6,
            "wakeups_s": sum(after[p][1] - before[p][1] for p in kept) / seconds,
            "processes": len(kept),
        }
    return out


def _answer(port: int, requests: int) -> None:
    client = RawHttp("127.0.0.1", port)
    raw = client.encode("POST", f"/v2/models/{SERVED}/infer", load.IRIS)
    try:
        for _ in range(requests):
            status, body = client.send(raw)
            assert status == 200, body
    finally:
        client.close()


def servers(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-idle-"))
    procs = Processes(tmp)
    try:
        backend, mlserver, _, _ = start_both(procs, tmp)
        ports = {"backend": backend, "mlserver": mlserver}
        for port in ports.values():
            _answer(port, args.requests)
        pids = {p.log.stem: p.pid for p in procs.started if p.pid is not None}
        groups = {name: [pids[name], *descendants(pids[name])] for name in ports}
        return idle(groups, args.settle, args.seconds)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def _kind(pid: int) -> str:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "others"
    if comm == "envoy":
        return "envoys"
    if b"meshfn.inference" in cmdline:
        return "backends"
    return "others"


def mesh(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-idle-mesh-"))
    procs = Processes(tmp)
    try:
        remap(EXAMPLES, tmp / "examples")
        up = procs.start(
            "up",
            [MESHFN, "up", "--policies", str(tmp / "examples"), "--state-dir",
             str(tmp / "state"), "--functions-registry", str(tmp / "functions"),
             "--publish-examples", "--envoy-concurrency", "1"],
            env={**os.environ, "MESHFN_CALLER_DIR": str(tmp)},
        )  # fmt: skip
        wait_for("meshfn up", lambda: "Ctrl-C stops everything" in up.output(), timeout=300)
        assert up.pid is not None
        below = list(descendants(up.pid))
        groups: dict[str, list[int]] = {"control_plane": [up.pid]}
        for pid in below:
            groups.setdefault(_kind(pid), []).append(pid)
        groups["all"] = [up.pid, *below]
        return idle(groups, args.settle, args.seconds)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def summarise(data: dict[str, Any]) -> dict[str, float]:
    s, m = data["servers"], data["mesh"]["all"]
    return {
        "backend_cpu_ms_s": round(s["backend"]["cpu_ms_s"], 2),
        "mlserver_cpu_ms_s": round(s["mlserver"]["cpu_ms_s"], 2),
        "cpu_vs_mlserver": round(s["backend"]["cpu_ms_s"] / s["mlserver"]["cpu_ms_s"], 3),
        "backend_wakeups_s": round(s["backend"]["wakeups_s"], 1),
        "mlserver_wakeups_s": round(s["mlserver"]["wakeups_s"], 1),
        "mesh_cpu_ms_s": round(m["cpu_ms_s"], 2),
        "mesh_wakeups_s": round(m["wakeups_s"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="answered before idling")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds measured")
    parser.add_argument("--json", type=Path, default=RESULTS / "idle.json")
    args = parser.parse_args()
    settings = {**vars(args), "json": str(args.json)}
    data = {"servers": servers(args), "mesh": mesh(args), "settings": settings}
    data["summary"] = summarise(data)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    print("idle: " + " ".join(f"{k}={v}" for k, v in data["summary"].items()))


if __name__ == "__main__":
    main()
