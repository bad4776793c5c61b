"""Cost of tracing through the mesh, in one run: `meshfn up` on policies/examples (its gateway,
the models' sidecars, their inference backends), iris infer requests sent one at a time over a
keep-alive connection, with tracing off, at 1% sampling and at 100% sampling.

Two meshes run side by side, and the client alternates between them in blocks of `--block`
requests: what a phase adds is what one mesh took more than the other over the same seconds.
The machine's drift over a run (a round's p50 moves by 100-150 µs on this shared VM) is larger
than the effect at 1% (tens of µs); phases measured one after the other on one mesh could not
resolve it even over 16 rounds, while interleaved the rounds agree within ~25 µs. Each round
compares `off` with 1%, then with 100% (or the other way round), the mesh that runs `off`
changing from round to round so that neither mesh's own difference counts. 1% is the Mesh's
sampling, 100% the edge gateway's own (its sidecars and backends follow the gateway's
decision); off removes tracing. No phase restarts anything: the Envoys take their new
configuration over xDS and the backends reload their tracing in place (SIGHUP), so the phases
differ in tracing alone, not in how warm a freshly started backend is; `backends_restarted` in
the JSON says whether any process changed during the run (it must not). Per mesh and
comparison: the client's p50 and the CPU of every process `meshfn up` started (Envoys,
backends, upstreams) per request, schedstat run time, the Envoys' part of it and the edge
gateway's part of theirs; the control plane's own CPU (the embedded collector receiving the
spans) separately. The added p50 and CPU are medians over the rounds of the traced mesh minus
the `off` one.

The floor, after the meshes' rounds: two bare proxies in a row (the router alone, the second
one answering itself), three such pairs, the first proxy of two of them with the edge
gateway's own tracer (its tracing block, collector cluster and export batches as Envoy runs
them) at 1% and at 100%, compared with the untraced pair as the meshes are: what Envoy's
tracer costs a proxy that does nothing else, on this machine (`floor_p1_added_us`,
`floor_p100_added_us` and their `_cpu_us` in the JSON's summary; the mesh has two proxies on
the path). At 1% the mesh's gateway is split (docs/concepts/tracing.md#a-gateway-at-a-low-rate):
its own listener has no tracer, so the floor is what that saves, not what it pays.

`backend_span_us`: what one traced request costs the backend (bench/tracing_spans.py, in
process): its spans on the request's path plus its share of the exporter's OTLP encoding.
`--sdk PYTHON`: the same spans with the OpenTelemetry SDK, run by PYTHON (a virtual environment
with opentelemetry-sdk and opentelemetry-exporter-otlp-proto-common; never meshfn's own: see
tracing_spans.py) for the comparison in the JSON.

Prints one line:
  tracing: off_p50_us=… p1_added_us=… p100_added_us=… backend_span_us=…
Goals: p1_added_us at most 20 (within the noise), p100_added_us at most 150 (`--check` exits 1
when one is missed); details in --json (default bench/results/tracing.json).
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
from pathlib import Path
from typing import Any, Protocol

import yaml

from meshfn.inference.devtools import RawHttp
from meshfn.testing import load
from meshfn.testing.envoy import active_cluster, admin_json, admin_socket, start_bare_chain
from meshfn.testing.policies import remap
from meshfn.testing.processes import MESHFN, Processes, cpu_ns, meshfn, wait_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
EXAMPLES = ROOT / "policies" / "examples"
PHASES = ("off", "p1", "p100")
GOALS = {"p1_added_us": 20.0, "p100_added_us": 150.0}
EXAMPLES_TRACING = "  tracing:\n    sampling: 10\n"  # policies/examples/mesh.yaml as shipped


def mesh_text(original: str, phase: str) -> str:
    """policies/examples' mesh.yaml for a phase: no tracing, 1%, or 1% with the edge gateway
    at 100%."""
    assert EXAMPLES_TRACING in original, "policies/examples/mesh.yaml traces 10%: update this bench"
    if phase == "off":
        return original.replace(EXAMPLES_TRACING, "")
    text = original.replace(EXAMPLES_TRACING, "  tracing:\n    sampling: 1\n")
    if phase == "p100":
        gateway = "kind: Gateway\nmetadata:\n  name: edge\n  namespace: ingress\nspec:\n"
        assert gateway in text
        text = text.replace(gateway, gateway + "  tracing: {sampling: 100}\n")
    return text


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (what meshfn up started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _cpu(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += cpu_ns(pid)
        except OSError:
            continue
    return total


class Bench:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mapping = remap(EXAMPLES, tmp / "examples")
        self.mesh = tmp / "examples" / "mesh.yaml"
        self.original = self.mesh.read_text()
        self.admin = f"http://127.0.0.1:{self.mapping[18001]}"
        self.port = self.mapping[10000]
        self.procs = Processes(tmp)
        self.up_pid = 0
        self.token = ""
        self.seen: list[list[int]] = []  # meshfn up's children at each measurement

    def start(self) -> None:
        self.mesh.write_text(mesh_text(self.original, "off"))
        up = self.procs.start(
            "up",
            [MESHFN, "up", "--policies", str(self.tmp / "examples"), "--state-dir",
             str(self.tmp / "state"), "--functions-registry", str(self.tmp / "functions"),
             "--publish-examples", "--envoy-concurrency", "1"],
            env={**os.environ, "MESHFN_CALLER_DIR": str(self.tmp)},
        )  # fmt: skip
        wait_for("meshfn up", lambda: "Ctrl-C stops everything" in up.output(), timeout=300)
        assert up.pid is not None
        self.up_pid = up.pid
        self.token = meshfn(
            "token", "issue", "--state-dir", str(self.tmp / "state"), "--sub", "bench",
            "--aud", "meshfn", "--claim", "tenant=acme",
        ).stdout.strip()  # fmt: skip

    def switch(self, phase: str) -> None:
        """Write the phase's policy and wait until the gateway has it and iris answers."""
        self.mesh.write_text(mesh_text(self.original, phase))
        want = {"off": None, "p1": 100, "p100": 10_000}[phase]  # per ten thousand

        def applied() -> bool:
            out = meshfn(
                "config-dump", "edge.ingress", "--admin", self.admin, "--type", "routes",
                "--state-dir", str(self.tmp / "state"),
            )  # fmt: skip
            tables = yaml.safe_load(out.stdout or "{}").get("routes") or {}
            hosts = [
                host
                for table in (tables.values() if isinstance(tables, dict) else tables)
                for host in table.get("virtualHosts", [])
            ]
            found = [_sampling(route) for host in hosts for route in _host_routes(host)]
            if want == 100:  # split: one draw sends a request to the twins, no route traces
                draws = {_draw(host) for host in hosts} - {None}
                return draws == {want} and not any(found)
            return bool(found) and all(n == want for n in found)

        wait_for(f"the {phase} configuration at the gateway", applied, timeout=60, every=0.5)
        wait_for(f"iris answering ({phase})", self._answers, timeout=120, every=0.5)

    def _answers(self) -> bool:
        client = RawHttp("127.0.0.1", self.port)
        try:
            status, _ = client.send(self.raw(client))
        except OSError:
            return False
        finally:
            client.close()
        return status == 200

    def raw(self, client: RawHttp) -> bytes:
        raw = client.encode("POST", "/v2/models/iris/infer", load.IRIS)
        return raw.replace(
            b"\r\n\r\n", f"\r\nauthorization: Bearer {self.token}\r\n\r\n".encode(), 1
        )

    def processes(self) -> dict[str, list[int]]:
        """meshfn up's children (all, the Envoys among them, the edge gateway's) and meshfn up
        itself."""
        pids = children(self.up_pid)
        self.seen.append(sorted(pids))
        envoys = [pid for pid in pids if _comm(pid) == "envoy"]
        gateway = [pid for pid in envoys if "edge.ingress" in _cmdline(pid)]
        return {"mesh": pids, "envoy": envoys, "gateway": gateway, "control_plane": [self.up_pid]}


class Target(Protocol):
    """What `measure_pair` sends to: a port, the request, the processes behind it."""

    port: int

    def raw(self, client: RawHttp) -> bytes: ...

    def processes(self) -> dict[str, list[int]]: ...


class BareChain:
    """Two bare proxies in a row (testing.envoy's bare_proxy), the second one answering 200
    itself; the first one traces with `tracing` (or not at all): the floor, what Envoy's own
    tracer costs a proxy that does nothing else, measured beside the meshes."""

    def __init__(
        self, procs: Processes, work: Path, name: str, tracing: dict[str, Any] | None,
        clusters: list[dict[str, Any]],
    ) -> None:  # fmt: skip
        self.port, started = start_bare_chain(procs, work, name, None, tracing, clusters)
        self.pids = [proc.pid for proc in started if proc.pid is not None]

    def raw(self, client: RawHttp) -> bytes:
        return client.encode("POST", "/v2/models/iris/infer", load.IRIS)

    def processes(self) -> dict[str, list[int]]:
        """The first proxy's pid (the one that traces) as `envoy`, both as `mesh`."""
        return {
            "mesh": self.pids,
            "envoy": self.pids[:1],
            "gateway": self.pids[:1],
            "control_plane": [],
        }


def _host_routes(host: dict[str, Any]) -> list[dict[str, Any]]:
    """A virtual host's routes in order; at a split gateway those a request walks when the
    draw does not sample it (the routes of the twins' keys and the twins apart)."""
    if "matcher" in host:
        rest = host["matcher"]["onNoMatch"]
        if "matcher" in rest:
            rest = rest["matcher"]["onNoMatch"]
        found: list[dict[str, Any]] = rest["action"]["typedConfig"]["routes"]
        return found
    routes: list[dict[str, Any]] = host.get("routes", [])
    return routes


def _sampling(route: dict[str, Any]) -> int | None:
    """A gateway route's sampling per ten thousand (None: it traces nothing)."""
    if "tracing" in route:
        return int(route["tracing"].get("randomSampling", {}).get("numerator", 0))
    return None


def _draw(host: dict[str, Any]) -> int | None:
    """A split gateway's draw per ten thousand in a virtual host (None: it has none)."""
    rest = host.get("matcher", {}).get("onNoMatch", {})
    for field in rest.get("matcher", {}).get("matcherList", {}).get("matchers", []):
        share = field["predicate"]["singlePredicate"]["customMatch"]["typedConfig"]
        return int(share["runtimeFraction"]["defaultValue"].get("numerator", 0))
    return None


def gateway_tracing(bench: Bench) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The edge gateway's tracing block as Envoy runs it, made 1% (at 1% the gateway is split:
    its internal listener's, which traces what reaches it; the floor's 100% sets its own rate)
    and the collector cluster it names."""
    admin = admin_socket(bench.tmp / "state", "edge.ingress")
    dump = admin_json(admin, "/config_dump?resource=dynamic_listeners")
    found = [
        f["typed_config"]["tracing"]
        for entry in dump["configs"]
        if "active_state" in entry
        for chain in entry["active_state"]["listener"].get("filter_chains", [])
        for f in chain["filters"]
        if "tracing" in f.get("typed_config", {})
    ]
    if not found:
        raise SystemExit("the edge gateway has no tracer at 1%")
    tracing = {**found[0], "random_sampling": {"value": 1.0}}
    provider = tracing["provider"]["typed_config"]
    cluster = provider["grpc_service"]["envoy_grpc"]["cluster_name"]
    found_cluster = active_cluster(admin, cluster)
    return tracing, [{k: v for k, v in found_cluster.items() if k != "@type"}]


def measure_pair(
    benches: tuple[Target, Target], requests: int, block: int, warmup: int = 200
) -> list[dict[str, float]]:
    """Each mesh's p50 over `requests` sequential requests, sent in alternating blocks of
    `block` (the two meshes share the machine's drift), and the CPU per request of each mesh's
    processes over the same seconds."""
    clients = [RawHttp("127.0.0.1", bench.port) for bench in benches]
    try:
        raws = [bench.raw(client) for bench, client in zip(benches, clients, strict=True)]
        for client, raw in zip(clients, raws, strict=True):
            for _ in range(warmup):
                assert client.send(raw)[0] == 200
        groups = [bench.processes() for bench in benches]
        before = [{k: _cpu(pids) for k, pids in g.items()} for g in groups]
        times: list[list[float]] = [[], []]
        for n in range(-(-requests // block)):
            for i in (0, 1) if n % 2 == 0 else (1, 0):
                client, raw, took = clients[i], raws[i], times[i]
                for _ in range(min(block, requests - n * block)):
                    started = time.perf_counter()
                    status, body = client.send(raw)
                    took.append((time.perf_counter() - started) * 1e6)
                    assert status == 200, body
        after = [{k: _cpu(pids) for k, pids in g.items()} for g in groups]
    finally:
        for client in clients:
            client.close()
    return [
        {
            "p50_us": statistics.median(took),
            "p99_us": load.pct(took, 0.99),
            **{
                f"{kind}_cpu_us": (end[kind] - begin[kind]) / len(took) / 1000
                for kind in ("mesh", "envoy", "gateway", "control_plane")
            },
        }
        for took, begin, end in zip(times, before, after, strict=True)
    ]


def spans(python: str, count: int, side: str) -> dict[str, float]:
    done = subprocess.run(
        [python, "-P", str(HERE / "tracing_spans.py"), side, str(count)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshfn-bench-tracing-") as tmp:
        benches: list[Bench] = []
        rounds: list[dict[str, dict[str, Any]]] = []
        floor: list[dict[str, Any]] = []
        try:
            for name in ("a", "b"):  # the second takes its ports once the first holds its own
                (Path(tmp) / name).mkdir()
                benches.append(Bench(Path(tmp) / name))
                benches[-1].start()
            pair = (benches[0], benches[1])
            for n in range(args.rounds):
                measured: dict[str, dict[str, Any]] = {}
                off = n % 2  # the mesh that runs `off` in this round
                for traced in ("p1", "p100") if n % 4 < 2 else ("p100", "p1"):
                    phases = [traced, traced]
                    phases[off] = "off"
                    for bench, phase in zip(pair, phases, strict=True):
                        bench.switch(phase)
                    figures = measure_pair(pair, args.requests, args.block)
                    measured[traced] = {
                        "off": figures[off],
                        traced: figures[1 - off],
                        "off_mesh": "ab"[off],
                    }
                rounds.append(measured)
            benches[0].switch("p1")
            tracing, clusters = gateway_tracing(benches[0])
            work = Path(tmp) / "floor"
            work.mkdir()
            every = {**tracing, "random_sampling": {"value": 100.0}}
            chains = {
                phase: BareChain(benches[0].procs, work, phase, block, clusters)
                for phase, block in (("off", None), ("p1", tracing), ("p100", every))
            }
            for n in range(args.floor_rounds):  # as the meshes' rounds, on the bare proxies
                bare: dict[str, dict[str, Any]] = {}
                for traced in ("p1", "p100") if n % 4 < 2 else ("p100", "p1"):
                    order = ("off", traced) if n % 2 == 0 else (traced, "off")
                    figures = measure_pair(
                        (chains[order[0]], chains[order[1]]), args.requests, args.block
                    )
                    bare[traced] = {phase: figures[order.index(phase)] for phase in order}
                floor.append(bare)
        finally:
            for bench in benches:
                bench.procs.stop_all()
    ours = spans(sys.executable, args.span_requests, "ours")
    data: dict[str, Any] = {
        "rounds": rounds,
        "floor": floor,
        "backends_restarted": any(seen != b.seen[0] for b in benches for seen in b.seen),
        "spans": {"ours": ours},
        "goals": GOALS,
    }
    if args.sdk:
        data["spans"]["sdk"] = spans(args.sdk, args.span_requests, "sdk")
    return data


def _differences(rounds: list[dict[str, dict[str, Any]]], phase: str, key: str) -> list[float]:
    return [r[phase][phase][key] - r[phase]["off"][key] for r in rounds]


def _added(rounds: list[dict[str, dict[str, Any]]], phase: str, key: str) -> float:
    return float(statistics.median(_differences(rounds, phase, key)))


def _spread(rounds: list[dict[str, dict[str, Any]]], phase: str) -> float:
    """The rounds' standard deviation of the added p50: what one round can resolve."""
    found = _differences(rounds, phase, "p50_us")
    return statistics.stdev(found) if len(found) > 1 else 0.0


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    rounds = data["rounds"]
    ours = data["spans"]["ours"]
    summary: dict[str, Any] = {
        "off_p50_us": statistics.median(r[t]["off"]["p50_us"] for r in rounds for t in r),
        "p1_added_us": _added(rounds, "p1", "p50_us"),
        "p100_added_us": _added(rounds, "p100", "p50_us"),
        "p1_added_sd_us": _spread(rounds, "p1"),
        "p100_added_sd_us": _spread(rounds, "p100"),
        "backend_span_us": ours["hot"] + ours["encode"],
        "off_cpu_us": statistics.median(r[t]["off"]["mesh_cpu_us"] for r in rounds for t in r),
        "p1_added_cpu_us": _added(rounds, "p1", "mesh_cpu_us"),
        "p100_added_cpu_us": _added(rounds, "p100", "mesh_cpu_us"),
        "p1_added_envoy_cpu_us": _added(rounds, "p1", "envoy_cpu_us"),
        "p1_added_gateway_cpu_us": _added(rounds, "p1", "gateway_cpu_us"),
        "p100_added_envoy_cpu_us": _added(rounds, "p100", "envoy_cpu_us"),
        "p100_collector_cpu_us": _added(rounds, "p100", "control_plane_cpu_us"),
    }
    floor = data["floor"]
    if floor:  # Envoy's own tracer in a bare proxy: p50 and that proxy's CPU added
        for phase in ("p1", "p100"):
            summary[f"floor_{phase}_added_us"] = _added(floor, phase, "p50_us")
            summary[f"floor_{phase}_added_cpu_us"] = _added(floor, phase, "envoy_cpu_us")
    summary["goals_met"] = {k: summary[k] <= limit for k, limit in GOALS.items()}
    if "sdk" in data["spans"]:
        sdk = data["spans"]["sdk"]
        summary["sdk_span_us"] = sdk["hot"] + sdk["encode"]
        summary["sdk_hot_us"] = sdk["hot"]
        summary["ours_hot_us"] = ours["hot"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--rounds", type=int, default=10, help="each compares off with 1%% and 100%%"
    )
    parser.add_argument("--requests", type=int, default=1000, help="per mesh and comparison")
    parser.add_argument(
        "--floor-rounds", type=int, default=8, help="bare proxies with and without a tracer"
    )
    parser.add_argument("--block", type=int, default=25, help="requests to one mesh in a row")
    parser.add_argument("--span-requests", type=int, default=20000)
    parser.add_argument("--sdk", help="a Python with opentelemetry-sdk, for the comparison")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--json", type=Path, default=RESULTS / "tracing.json")
    args = parser.parse_args()
    data = run(args)
    summary = summarise(data)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"summary": summary, **data}, indent=2) + "\n")
    print(
        f"tracing: off_p50_us={summary['off_p50_us']:.0f} p1_added_us={summary['p1_added_us']:.1f}"
        f" p100_added_us={summary['p100_added_us']:.1f}"
        f" backend_span_us={summary['backend_span_us']:.1f}"
    )
    if args.check and not all(summary["goals_met"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
