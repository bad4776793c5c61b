"""Benchmark of the backend's sandbox (bench/sandbox.py): what confining a backend costs in
requests per second, and whether wasmtime needs anonymous executable memory.

  throughput  two backends of the same config on loopback in one run (both pinned to --cpu, so
              the scheduler treats them alike), one with every layer
              the machine allows (Landlock, the seccomp allow-list, the eBPF egress cgroup:
              what `meshfn up` gives a backend by default) and one with none; wrk (closed loop,
              --connections) against each in turn, ABBA order, --rounds rounds of --seconds,
              for the Python guest (iris) and the core guest (digits). Per function: the
              median of the per-round ratios (confined / unconfined) of requests/s and of p99.
              The summary line takes the worse function for each.
  exec memory executable mappings of the unconfined backend (/proc/PID/maps) after its
              start-up and after every function was loaded from the code cache (.cwasm), cold
              starts forced by a short idle TTL: anonymous ones (what seccomp's mmap rule refuses)
              and file-backed ones. For contrast, in a child process: one module deserialized
              from its .cwasm, then compiled from its .wasm in the process.

Prints one line:
  sandbox: rps_ratio=… p99_ratio=… layers=…       (layers: those in force on the confined one)
and writes bench/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from meshfn.inference.examples import publish_examples
from meshfn.testing import load
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Proc, Processes, http_ok, wait_for

RESULTS = Path(__file__).resolve().parent / "results"
PY = sys.executable
BODIES = {"iris": load.IRIS, "digits": load.DIGITS}
Json = dict[str, Any]


def log(message: str) -> None:
    print(f"[sandbox bench] {message}", file=sys.stderr, flush=True)


def backend(
    procs: Processes,
    tmp: Path,
    name: str,
    registry: Path,
    key: Path,
    confined: bool,
    join: Any,
    cpu: int,
) -> tuple[Proc, int]:
    state = tmp / name
    state.mkdir()
    off = {"landlock": "off", "seccomp": "off"}
    config = {
        "registry": str(registry),
        "trustedKeys": [str(key)],
        "workers": 2,
        "functions": [
            # a short idle TTL: the exec-memory pass cold-starts them from the code cache
            {"name": f, "pool": {"minIdle": 1}, "idleTtl": "1s", "limits": {"maxConcurrency": 64}}
            for f in BODIES
        ],
        "codeCache": {"ttl": "0s"},
        "sandbox": {"stateDir": str(state), **({} if confined else off)},
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    (port,) = free_ports(1)
    argv = [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(path)]

    def preexec() -> None:  # in the child before exec: join the egress cgroup, pin
        if join is not None:
            join()
        if cpu >= 0:
            os.sched_setaffinity(0, {cpu})

    proc = procs.start(
        name, [*argv, "--port", str(port), "--log-level", "warning"], preexec=preexec
    )
    url = f"http://127.0.0.1:{port}/v2/health/ready"
    wait_for(url, lambda: http_ok(url), 60, every=0.05, proc=proc)
    return proc, port


def layers(tmp: Path, egress: bool) -> list[str]:
    """The layers in force on the confined backend, as it reported them (and the kernel shows
    for egress: the process is in the cgroup the programs are attached to)."""
    report = json.loads((tmp / "confined" / "sandbox.json").read_text())
    found = [layer for layer in ("landlock", "seccomp") if report[layer]["state"] == "on"]
    return found + (["egress"] if egress else [])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (clock ticks of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def throughput(args: argparse.Namespace, backends: dict[str, tuple[int, int]], tmp: Path) -> Json:
    """`backends`: name -> (pid, port). The machine is shared: short rounds, alternating in ABBA
    order, and ratios taken per round, so a change of load hits both sides of a ratio."""
    out: Json = {}
    for function, body in BODIES.items():
        rounds: dict[str, list[load.WrkResult]] = {"confined": [], "unconfined": []}
        cpu: dict[str, list[float]] = {"confined": [], "unconfined": []}
        for _, port in backends.values():  # warm both up
            load.wrk(f"http://127.0.0.1:{port}/v2/models/{function}/infer", body, 1, 4, tmp)
        for i in range(args.rounds):
            order = ["confined", "unconfined"] if i % 2 == 0 else ["unconfined", "confined"]
            for name in order:
                pid, port = backends[name]
                url = f"http://127.0.0.1:{port}/v2/models/{function}/infer"
                before = cpu_seconds(pid)
                result = load.wrk(url, body, args.seconds, args.connections, tmp)
                used = cpu_seconds(pid) - before
                rounds[name].append(result)
                cpu[name].append(used / max(1.0, result.rps * args.seconds) * 1e6)
        pairs = list(zip(rounds["confined"], rounds["unconfined"], strict=True))
        cpu_pairs = zip(cpu["confined"], cpu["unconfined"], strict=True)
        out[function] = {
            "rps_ratio": statistics.median(c.rps / u.rps for c, u in pairs),
            "p99_ratio": statistics.median(c.p99_ms / u.p99_ms for c, u in pairs),
            # the backend's own CPU per request: what the filters cost, least moved by the
            # other processes of a shared machine
            "cpu_per_request_ratio": statistics.median(c / u for c, u in cpu_pairs if u),
            "rounds_rps": {k: [r.rps for r in v] for k, v in rounds.items()},
            "rounds_p99_ms": {k: [r.p99_ms for r in v] for k, v in rounds.items()},
            "rounds_cpu_us_per_request": cpu,
        }
        log(
            f"{function}: rps ratio {out[function]['rps_ratio']:.3f}, p99 ratio "
            f"{out[function]['p99_ratio']:.3f}, CPU per request ratio "
            f"{out[function]['cpu_per_request_ratio']:.3f}"
        )
    return out


def exec_mappings(pid: int) -> Json:
    """Executable mappings of a process: anonymous, and per backing file kind."""
    anonymous, cwasm, other = 0, 0, 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if "x" not in fields[1]:
            continue
        path = fields[5] if len(fields) > 5 else ""
        if not path or path.startswith("[anon"):
            anonymous += 1
        elif path.endswith(".cwasm") or ".cwasm" in path:
            cwasm += 1
        elif not path.startswith("["):  # [vdso], [vsyscall] are the kernel's
            other += 1
    return {"anonymous": anonymous, "cwasm": cwasm, "files": other}


_CONTRAST = """
import json, sys, wasmtime
from pathlib import Path
sys.path.insert(0, {bench!r})
from sandbox import exec_mappings
from meshfn.inference.engine import new_engine
engine = new_engine()
before = exec_mappings(__import__("os").getpid())
module = wasmtime.Module.deserialize_file(engine, {cwasm!r})
loaded = exec_mappings(__import__("os").getpid())
compiled = wasmtime.Module(engine, Path({wasm!r}).read_bytes())
after = exec_mappings(__import__("os").getpid())
print(json.dumps({{"start": before, "from_cwasm": loaded, "compiled_in_process": after}}))
"""


def contrast(registry: Path) -> Json:
    """One core module (digits) deserialized from the code cache, then compiled in process."""
    entry = registry / "digits" / "1"
    cwasm = next((entry / "compiled").glob("*.cwasm"))
    code = _CONTRAST.format(
        bench=str(Path(__file__).resolve().parent),
        cwasm=str(cwasm),
        wasm=str(entry / "module.wasm"),
    )
    out = subprocess.run([PY, "-P", "-c", code], capture_output=True, text=True, check=True)
    result: Json = json.loads(out.stdout)
    return result


def exec_memory(pid: int, port: int, registry: Path) -> Json:
    """The unconfined backend's executable mappings after start-up, and while every function
    is loaded, three times, each after the idle TTL let the code go (a cold start from the
    .cwasm each time: the code cache keeps nothing, `codeCache.ttl: 0s`)."""
    started = exec_mappings(pid)
    loaded = []
    for _ in range(3):
        for function, body in BODIES.items():
            load.sequential(port, f"/v2/models/{function}/infer", body, 5, warmup=0)
        loaded.append(exec_mappings(pid))
        time.sleep(1.6)
    return {"after_start": started, "loaded": loaded, "contrast": contrast(registry)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="ABBA rounds per function")
    parser.add_argument("--seconds", type=float, default=1, help="wrk run per round")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument(
        "--cpu", type=int, default=1, help="pin both backends to this CPU (the same one); -1: no"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "sandbox.json")
    args = parser.parse_args()

    from meshfn.ebpf import EgressControl

    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshfn-bench-sbx-")))
        _, key = publish_examples(tmp / "registry")
        egress = EgressControl(tmp / "state")
        status = egress.setup("auto")
        log(status.line())
        stack.callback(egress.shutdown)  # after the backends have stopped
        procs = Processes(tmp)
        stack.callback(procs.stop_all)
        join = egress.add_backend("confined", []) if status.attached else None
        cpu = args.cpu if args.cpu < (os.cpu_count() or 1) else -1
        registry = tmp / "registry"
        confined, confined_port = backend(procs, tmp, "confined", registry, key, True, join, cpu)
        plain, plain_port = backend(procs, tmp, "unconfined", registry, key, False, None, cpu)
        active = layers(tmp, status.attached)
        log(f"confined backend: {', '.join(active) or 'no layer'} (pid {confined.pid})")
        backends = {
            "confined": (confined.pid, confined_port),
            "unconfined": (plain.pid, plain_port),
        }
        results: Json = {"config": {k: str(v) for k, v in vars(args).items()}, "layers": active}
        results["egress"] = {"attached": status.attached, "reason": status.reason}
        results["throughput"] = throughput(args, backends, tmp)
        results["exec_memory"] = exec_memory(plain.pid, plain_port, tmp / "registry")
        confined.check_running()  # seccomp kills on anonymous exec memory: it is still alive
        results["exec_memory"]["confined_survived"] = True

    per = results["throughput"].values()
    rps_ratio = min(part["rps_ratio"] for part in per)
    p99_ratio = max(part["p99_ratio"] for part in per)
    line = (
        f"sandbox: rps_ratio={rps_ratio:.2f} p99_ratio={p99_ratio:.2f} "
        f"layers={','.join(results['layers']) or 'none'}"
    )
    results["summary"] = line
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
