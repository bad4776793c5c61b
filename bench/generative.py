"""Benchmark of generative inference (bench/generative.py): tiny-lm's streams, all in one run.

Two ways to the same backends, and a bench backend of its own:
  mesh    `meshfn up` on policies/examples: the edge gateway (JWT, the model router, RBAC),
          the backends' mTLS sidecars with their audit filter, tiny-lm as the examples serve it
          (batching 16), the official `/v1/completions` path with a tenant's token
  direct  the same backend processes (the examples' `models`, two of them) on the unix sockets
          their sidecars forward to, with the tenant header the sidecar writes from the token:
          what the mesh adds is then the two Envoys and nothing else (another process would
          differ in its pool, its batches and where the scheduler puts it). Which backends:
          those the gateway sent a warm-up's streams to (their generation counts in /metrics),
          since two processes of one backend differ by ~0.1 ms of TTFT and the gateway prefers
          its locality's
  floor   two bare Envoys in a row (the router alone, HTTP/1.1, no TLS: testing.envoy's
          bare_proxy) in front of the same backends' sockets, rotating with mesh and direct:
          what any two proxies add on this machine, the floor under the mesh's figures
  floor_mtls  the same two with mutual TLS between them, as the gateway reaches a sidecar
          (certificates of meshfn's CA, the peer's SPIFFE ID pinned, HTTP/1.1 inside): what
          any zero-trust pair of proxies adds, so `mesh_over_mtls_floor_ms` is what meshfn's
          policies cost (routing by the body's model, JWT, authorization, audit, tracing, the
          drift breaker's feed)
  joined  mesh and direct again (16 streams) with tiny-lm-joined: tiny-lm on the same backends
          with generation.streamInterval 4 (a Function the benchmark adds to its copy of the
          examples): an event per four tokens, so each proxy handles a quarter of the chunks
  bench   one inference backend of the benchmark's own on loopback, with the model served
          three ways by one process: `tiny-lm` (continuous batching, maxStreams 16),
          `tiny-solo` (batching off: each stream's steps are calls of their own), `tiny-acct`
          (batching, plus a tenant token budget to reserve and settle in, and
          generation.auditText hmac: the accounting and audit a budgeted request costs)
Each measure streams N concurrent `/v1/completions` (stream: true, a fixed seed and `--tokens`
max_tokens, temperature 0.8) over kept-alive connections (as the SDK's client pool does);
mesh, direct and the floors take turns, which goes first rotating too, `--pairs` rounds at one
stream (in blocks of `--block` rounds each way) and `--rounds` at more. Stream by stream, every stream
through the mesh would follow one straight to the backend, which leaves the Envoys idle (their
caches cold) and the backend warm: each mesh stream would pay for the proxies' wake-up and
cache misses and no direct stream for the backend's, a bias against the mesh that a client
sending one stream after another through it does not meet. In blocks only a block's first
stream does; the one-stream pairs are also run stream by stream (`one_stream_alternating` in
the JSON) to show the difference:
  ttft  the time from sending the request to its first text chunk
  itl   a stream's inter-token latency: the time from its first text chunk to its last over
        its completion tokens after the first (OpenTelemetry's time per output token, per
        request). Not the gaps between chunks as the client reads them: a client reading 16
        streams in one event loop, or a proxy's read, joins chunks that came apart, which
        would make gaps of ~0 out of real decode steps
  tokens_per_s  completion tokens (the usage the backend reports) over the wall time of a
        round, summed over its streams
`--placed PROXY_CPUS:BACKEND_CPUS` runs every Envoy (the mesh's, through `meshfn up
--proxy-cpus`, and the floors') on the first CPUs and every backend on the others
(docs/operations/placement.md); the JSON's `placed` says which.
Percentiles are over every stream of every round. What the mesh adds is the median over the
rounds of mesh minus direct in the same pair of rounds: a shared machine's load moves both.

Prints one line:
  generative: ttft_p50_ms=… ttft_p99_ms=… itl_p50_ms=… itl_p99_ms=… mesh_ttft_added_ms=…
              tokens_per_s=… batched_tokens_ratio=…
  (ttft/itl: through the mesh at 16 streams; mesh_ttft_added_ms: TTFT through the mesh minus
  straight to the backend at 1 stream, the median of the pairs; tokens_per_s: through the mesh
  at 16 streams; batched_tokens_ratio: the bench backend's tokens/s at 16 streams with batching
  over without)
and writes bench/results/generative.json (or --json) with every figure: per concurrency and
way, TTFT and ITL added by the mesh (paired medians), by the floors' two bare proxies
(`floor_added_ms`, `mtls_floor_added_ms`) and by the mesh over them (`mesh_over_floor_ms`,
`mesh_over_mtls_floor_ms`), the accounting/audit
overhead, batching's ITL p99 both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from meshfn.common.processes import cpu_list, cpu_list_text, pinned
from meshfn.contracts.qos import TENANT_HEADER
from meshfn.inference.examples import publish_examples
from meshfn.testing import policies as p
from meshfn.testing.envoy import start_bare_chain
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import (
    MESHFN,
    Processes,
    http_ok,
    issue_token,
    metric_sum,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "policies" / "examples"
PY = sys.executable
PROMPT = "The with statement"
BACKEND = "default/models"  # the examples' backend of tiny-lm
TEXT_KEY = "5e" * 32
BATCHED = {"maxTokens": 512, "batching": {"maxStreams": 16}}
FUNCTIONS: list[dict[str, Any]] = [
    {"name": "tiny-lm", "limits": {"maxConcurrency": 64}, "generation": BATCHED},
    {"name": "tiny-solo", "artifact": "tiny-lm@1", "limits": {"maxConcurrency": 64},
     "generation": {"maxTokens": 512, "batching": None}},
    {"name": "tiny-acct", "artifact": "tiny-lm@1", "limits": {"maxConcurrency": 64},
     "generation": {**BATCHED, "auditText": "hmac"},
     "qos": {"policy": "default/bench-tokens", "defaultClass": "std",
             "classes": [{"name": "std", "tokens": [{"tokens": 10**12, "per": "month"}]}]}},
]  # fmt: skip


@dataclass(frozen=True)
class Placement:
    """--placed: where the Envoys and the backends run."""

    proxies: frozenset[int]
    backends: frozenset[int]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        raise SystemExit("nothing measured")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_stream(
    session: aiohttp.ClientSession, url: str, model: str, headers: dict[str, str], tokens: int,
    seed: int,
) -> tuple[float, float | None, int]:  # fmt: skip
    """(TTFT s, inter-token latency s or None for a one-token text, completion tokens) of one
    streamed completion."""
    body = {
        "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0.8,
        "seed": seed, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    stamps: list[float] = []
    used = 0
    async with session.post(url, json=body, headers=headers) as reply:
        if reply.status != 200:
            raise SystemExit(f"{model}: {reply.status} {await reply.text()}")
        async for raw in reply.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                used = int(chunk["usage"]["completion_tokens"])
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    if not stamps:
        raise SystemExit(f"{model}: a stream without text")
    itl = (stamps[-1] - stamps[0]) / (used - 1) if used > 1 else None
    return stamps[0] - started, itl, used


@dataclass(frozen=True)
class Way:
    """Where a measure's streams go: one client session per backend (a stream's turn picks)."""

    sessions: list[aiohttp.ClientSession]
    url: str
    model: str
    headers: dict[str, str]


async def measure(way: Way, streams: int, tokens: int, seed: int, turn: int = 0) -> dict[str, Any]:
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            one_stream(way.sessions[(i + turn) % len(way.sessions)], way.url, way.model,
                       way.headers, tokens, seed + i)
            for i in range(streams)
        )
    )  # fmt: skip
    wall = time.perf_counter() - started
    return {
        "ttft": [r[0] for r in results],
        "itl": [r[1] for r in results if r[1] is not None],
        "tokens": sum(r[2] for r in results),
        "wall": wall,
    }


async def answers(url: str, model: str, headers: dict[str, str]) -> bool:
    async with aiohttp.ClientSession() as session:
        await measure(Way([session], url, model, headers), 1, 2, 0)
    return True


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    ttft = [t for r in runs for t in r["ttft"]]
    itl = [g for r in runs for g in r["itl"]]
    return {
        "ttft_p50_ms": round(pct(ttft, 0.5) * 1e3, 3),
        "ttft_p99_ms": round(pct(ttft, 0.99) * 1e3, 3),
        "itl_p50_ms": round(pct(itl, 0.5) * 1e3, 3),
        "itl_p99_ms": round(pct(itl, 0.99) * 1e3, 3),
        "tokens_per_s": round(statistics.median(r["tokens"] / r["wall"] for r in runs), 1),
    }


def start_backend(
    procs: Processes, tmp: Path, registry: Path, key: Path, cpus: frozenset[int] | None
) -> str:
    config = tmp / "backend.json"
    config.write_text(
        json.dumps(
            {"registry": str(registry), "trustedKeys": [str(key)], "functions": FUNCTIONS,
             "auditTextKey": TEXT_KEY}
        )
    )  # fmt: skip
    port, grpc_port = free_ports(2)
    proc = procs.start(
        "backend",
        [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(config),
         "--port", str(port), "--grpc-port", str(grpc_port), "--log-level", "warning"],
        preexec=pinned(cpus),
    )  # fmt: skip
    ready = f"http://127.0.0.1:{port}/v2/health/ready"
    wait_for("backend ready", lambda: http_ok(ready), 120, proc=proc)
    return f"http://127.0.0.1:{port}"


JOINED = "tiny-lm-joined"
JOINED_POLICY = f"""apiVersion: meshfn.io/v1alpha1
kind: Function
metadata: {{name: {JOINED}, namespace: default}}
spec:
  artifact: tiny-lm@1
  backend: models
  gateway: ingress/edge
  limits: {{memoryMiB: 64, maxConcurrency: 64}}
  generation: {{maxTokens: 512, streamInterval: 4, batching: {{maxStreams: 16}}}}
"""


def start_mesh(
    procs: Processes, tmp: Path, registry: Path, key: Path, placed: Placement | None
) -> tuple[str, str, list[Path]]:
    """The example mesh with tiny-lm-joined added: (gateway URL, acme's token, the HTTP sockets
    of the backends that serve tiny-lm, which their sidecars forward to)."""
    where = (
        ["--proxy-cpus", cpu_list_text(placed.proxies),
         "--backend-cpus", cpu_list_text(placed.backends)]
        if placed
        else []
    )  # fmt: skip
    joined = tmp / "joined.yaml"
    joined.write_text(JOINED_POLICY)
    mapping = p.remap(EXAMPLES, tmp / "policies", joined)
    state = tmp / "state"
    up = procs.start(
        "up",
        [MESHFN, "up", "--policies", str(tmp / "policies"), "--state-dir", str(state),
         "--functions-registry", str(registry), "--trusted-key", str(key),
         "--envoy-concurrency", "1", *where],
    )  # fmt: skip
    wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=300)
    children = json.loads((state / "state.json").read_text())["children"]
    # "inference default/models 127.0.0.1:PORT" serves on STATE/inference/127.0.0.1-PORT/
    sockets = sorted(
        state / "inference" / name.rsplit(" ", 1)[1].replace(":", "-") / "http.sock"
        for name in children
        if name.startswith(f"inference {BACKEND} ")
    )
    if not sockets or not all(s.is_socket() for s in sockets):
        raise SystemExit(f"no HTTP socket of the {BACKEND} backends in {state / 'inference'}")
    token = issue_token(state, "bench-acme", "acme", "2h")
    return f"http://127.0.0.1:{mapping[10000]}", token, sockets


async def run_ways(
    ways: dict[str, Way], pairs: list[tuple[str, ...]], levels: list[int], rounds: int,
    repeats: int, tokens: int, block: int = 1,
) -> dict[str, dict[int, list[dict[str, Any]]]]:  # fmt: skip
    """Every way's rounds (the first round of each warms it up): the first group at every
    level, the others at the top level, a group's ways taking turns, and which of them goes
    first rotating too (at one stream in blocks of `block` rounds); the ways in no group at the
    top level. With blocks, the first group's first two ways' one-stream rounds again stream
    by stream, as `{way}_alternating`."""
    top = max(levels)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {w: {n: [] for n in levels} for w in ways}

    async def alternate(
        group: tuple[str, ...], n: int, count: int, size: int,
        into: dict[str, dict[int, list[dict[str, Any]]]],
    ) -> None:  # fmt: skip
        turns = range(count + 1)
        for b, start in enumerate(range(0, len(turns), size)):
            first = b % len(group)
            for name in group[first:] + group[:first]:
                for turn in turns[start : start + size]:
                    into[name][n].append(await measure(ways[name], n, tokens, 1, turn))

    for i, pair in enumerate(pairs):
        for n in levels if i == 0 else [top]:
            count, size = (repeats, block) if n == 1 else (rounds, 1)
            await alternate(pair, n, count, size, runs)
    if block > 1:
        alternated: dict[str, dict[int, list[dict[str, Any]]]] = {w: {1: []} for w in pairs[0][:2]}
        await alternate(pairs[0][:2], 1, repeats, 1, alternated)
        runs.update({f"{name}_alternating": found for name, found in alternated.items()})
    paired = {name for pair in pairs for name in pair}
    for name in [w for w in ways if w not in paired]:
        for turn in range(rounds + 1):
            runs[name][top].append(await measure(ways[name], top, tokens, 1, turn))
    return runs


def added(mesh: list[dict[str, Any]], direct: list[dict[str, Any]], key: str) -> float:
    """The median over paired rounds of mesh minus direct (each round's own median), ms."""

    def mid(r: dict[str, Any]) -> float:
        return float(statistics.median(r[key]))

    return round(
        statistics.median(mid(m) - mid(d) for m, d in zip(mesh, direct, strict=True)) * 1e3, 3
    )


SERVED = "gen_ai_server_request_duration_seconds_count"


async def served(sessions: list[aiohttp.ClientSession], model: str) -> list[float]:
    """Each backend's generations of `model` so far (its /metrics)."""
    counts = []
    for session in sessions:
        async with session.get("http://backend/metrics") as reply:
            text = await reply.text()
        counts.append(metric_sum(text, SERVED, gen_ai_request_model=model))
    return counts


async def mesh_backends(
    mesh: Way, sessions: list[aiohttp.ClientSession], warmup: int = 12
) -> list[int]:
    """Which backends the gateway sends `mesh`'s streams to: each one that served at least a
    quarter of `warmup` streams through the mesh."""
    before = await served(sessions, mesh.model)
    for turn in range(warmup):
        await measure(mesh, 1, 2, 0, turn)
    after = await served(sessions, mesh.model)
    rose = [a - b for a, b in zip(after, before, strict=True)]
    chosen = [i for i, n in enumerate(rose) if n >= warmup / 4]
    if not chosen:
        raise SystemExit(f"no backend served {mesh.model} through the mesh: {rose}")
    return chosen


async def measure_all(
    args: argparse.Namespace, levels: list[int], gateway: str, token: str, sockets: list[Path],
    bench: str, backends: dict[str, list[str]], chain: Callable[[list[Path], bool], int],
) -> dict[str, dict[int, list[dict[str, Any]]]]:  # fmt: skip
    """Every way's rounds; `backends` gets the backends (their state folders) each model's
    direct way went to; `chain` starts two bare proxies to the given sockets, with mutual TLS
    between them or not (their port)."""
    timeout = aiohttp.ClientTimeout(total=300)
    plain = {"content-type": "application/json"}
    acme = {**plain, TENANT_HEADER: "acme"}  # what the sidecar writes from the token's claim
    through_mesh = {**plain, "authorization": f"Bearer {token}"}
    path = "/v2/models/{}/openai/v1/completions"  # the backend's own spelling
    async with contextlib.AsyncExitStack() as stack:

        async def session(connector: aiohttp.BaseConnector | None = None) -> aiohttp.ClientSession:
            return await stack.enter_async_context(
                aiohttp.ClientSession(timeout=timeout, connector=connector)
            )

        to_sockets = [await session(aiohttp.UnixConnector(path=str(s))) for s in sockets]
        tcp = await session()
        mesh = Way([tcp], f"{gateway}/v1/completions", "tiny-lm", through_mesh)
        mesh_joined = Way([tcp], f"{gateway}/v1/completions", JOINED, through_mesh)
        chosen = {way.model: await mesh_backends(way, to_sockets) for way in (mesh, mesh_joined)}
        backends.update({m: [sockets[i].parent.name for i in c] for m, c in chosen.items()})

        def direct(model: str) -> Way:
            return Way([to_sockets[i] for i in chosen[model]], "http://backend" +
                       path.format(model), model, acme)  # fmt: skip

        to = [sockets[i] for i in chosen["tiny-lm"]]
        floor = f"http://127.0.0.1:{chain(to, False)}"
        floor_mtls = f"http://127.0.0.1:{chain(to, True)}"
        ways = {
            "mesh": mesh,
            "direct": direct("tiny-lm"),
            "floor": Way([tcp], floor + path.format("tiny-lm"), "tiny-lm", acme),
            "floor_mtls": Way([tcp], floor_mtls + path.format("tiny-lm"), "tiny-lm", acme),
            "mesh_joined": mesh_joined,
            "direct_joined": direct(JOINED),
            "bench_batched": Way([tcp], bench + path.format("tiny-lm"), "tiny-lm", plain),
            "bench_unbatched": Way([tcp], bench + path.format("tiny-solo"), "tiny-solo", plain),
            "bench_accounted": Way([tcp], bench + path.format("tiny-acct"), "tiny-acct", acme),
        }
        pairs = [("mesh", "direct", "floor", "floor_mtls"), ("mesh_joined", "direct_joined")]
        return await run_ways(ways, pairs, levels, args.rounds, args.pairs, args.tokens, args.block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens per stream")
    parser.add_argument("--rounds", type=int, default=5, help="rounds at more than one stream")
    parser.add_argument("--pairs", type=int, default=200, help="rounds at one stream")
    parser.add_argument(
        "--block", type=int, default=10, help="rounds in a row each way at one stream"
    )
    parser.add_argument("--concurrency", default="1,4,16", help="streams at once, comma-separated")
    parser.add_argument("--json", type=Path, default=RESULTS / "generative.json")
    parser.add_argument(
        "--placed",
        metavar="PROXY_CPUS:BACKEND_CPUS",
        help="run every Envoy (the mesh's and the floors') on PROXY_CPUS and every backend on "
        "BACKEND_CPUS (Linux CPU lists; meshfn up --proxy-cpus/--backend-cpus), e.g. 0:1",
    )
    args = parser.parse_args()
    placed = None
    if args.placed is not None:
        proxies, colon, backends_at = args.placed.partition(":")
        if not colon:
            parser.error("--placed: PROXY_CPUS:BACKEND_CPUS, e.g. 0:1")
        try:
            placed = Placement(cpu_list(proxies), cpu_list(backends_at))
        except ValueError as exc:
            parser.error(f"--placed: {exc}")
    if args.block < 1:
        parser.error("--block must be at least 1")
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (an inter-token latency needs two)")
    if levels[0] != 1:
        parser.error("--concurrency must include 1 (what the mesh adds is measured there)")
    top = max(levels)
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-generative-"))
    procs = Processes(tmp)
    try:
        _, key = publish_examples(tmp / "functions")
        bench = start_backend(
            procs, tmp, tmp / "functions", key, placed.backends if placed else None
        )
        gateway, token, sockets = start_mesh(procs, tmp, tmp / "functions", key, placed)
        mesh_headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
        wait_for(
            "tiny-lm through the mesh",
            lambda: asyncio.run(answers(f"{gateway}/v1/completions", "tiny-lm", mesh_headers)),
            timeout=120,
        )
        backends: dict[str, list[str]] = {}

        def chain(to: list[Path], mtls: bool) -> int:
            upstreams = [{"pipe": {"path": str(socket)}} for socket in to]
            name = "floor-mtls" if mtls else "floor"
            cpus = placed.proxies if placed else None
            return start_bare_chain(procs, tmp, name, upstreams, mtls=mtls, cpus=cpus)[0]

        runs = asyncio.run(
            measure_all(args, levels, gateway, token, sockets, bench, backends, chain)
        )
    finally:
        procs.stop_all()
    figures = {
        way: {str(n): summary(r[1:]) for n, r in per.items() if r} for way, per in runs.items()
    }
    mesh = figures["mesh"]
    high = str(top)
    result = {
        **{k: mesh[high][k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")},
        "mesh_ttft_added_ms": added(runs["mesh"][1][1:], runs["direct"][1][1:], "ttft"),
        "tokens_per_s": mesh[high]["tokens_per_s"],
        "batched_tokens_ratio": round(
            figures["bench_batched"][high]["tokens_per_s"]
            / figures["bench_unbatched"][high]["tokens_per_s"],
            2,
        ),
    }
    bench_f = figures["bench_batched"][high]

    def per_level(way: str, under: str) -> dict[str, dict[str, float]]:
        """What `way` adds over `under` at every level, TTFT and ITL (paired medians)."""
        return {
            str(n): {
                key: added(runs[way][n][1:], runs[under][n][1:], key) for key in ("ttft", "itl")
            }
            for n in levels
        }

    detail = {
        "one_stream_alternating_added_ms": {
            key: added(runs["mesh_alternating"][1][1:], runs["direct_alternating"][1][1:], key)
            for key in ("ttft", "itl")
        }
        if "mesh_alternating" in runs
        else None,
        "mesh_added_ms": per_level("mesh", "direct"),
        "floor_added_ms": per_level("floor", "direct"),
        "mesh_over_floor_ms": per_level("mesh", "floor"),
        "mtls_floor_added_ms": per_level("floor_mtls", "direct"),
        "mesh_over_mtls_floor_ms": per_level("mesh", "floor_mtls"),
        "mesh_tokens_ratio": round(
            mesh[high]["tokens_per_s"] / figures["direct"][high]["tokens_per_s"], 3
        ),
        "joined": {
            "streams": top,
            "mesh_added_ms": {
                key: added(runs["mesh_joined"][top][1:], runs["direct_joined"][top][1:], key)
                for key in ("ttft", "itl")
            },
            "mesh_tokens_ratio": round(
                figures["mesh_joined"][high]["tokens_per_s"]
                / figures["direct_joined"][high]["tokens_per_s"],
                3,
            ),
        },
        "accounting_audit_ttft_added_ms": round(
            figures["bench_accounted"][high]["ttft_p50_ms"] - bench_f["ttft_p50_ms"], 3
        ),
        "accounting_audit_tokens_ratio": round(
            figures["bench_accounted"][high]["tokens_per_s"] / bench_f["tokens_per_s"], 3
        ),
        "batched_itl_p99_ms": bench_f["itl_p99_ms"],
        "unbatched_itl_p99_ms": figures["bench_unbatched"][high]["itl_p99_ms"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"summary": result, **detail, "figures": figures, "tokens": args.tokens,
                    "rounds": args.rounds, "pairs": args.pairs, "block": args.block,
                    "direct_backends": backends,
                    "placed": {"proxy_cpus": sorted(placed.proxies),
                               "backend_cpus": sorted(placed.backends)} if placed else None},
                   indent=1)
    )  # fmt: skip
    print("generative: " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
