"""Benchmark of generative inference (bench/generative.py): tiny-lm's streams, all in one run.

Two ways to the same model (functions/examples/tiny-lm, its decode step compiled from ONNX):
  direct  one inference backend on loopback, with the model served four ways by one process:
          `tiny-lm` (continuous batching, generation.batching.maxStreams 16), `tiny-solo`
          (batching off: each stream's steps are calls of their own), `tiny-acct` (batching,
          plus a tenant token budget to reserve and settle in, and generation.auditText hmac:
          the accounting and audit a budgeted request costs the backend)
  mesh    `meshfn up` on policies/examples: the edge gateway (JWT, the model router, RBAC),
          the backend's mTLS sidecar with its audit filter, tiny-lm as the examples serve it
          (batching 16), the official `/v1/completions` path with a tenant's token
Each measure streams `--streams` concurrent `/v1/completions` (stream: true, a fixed seed and
`--tokens` max_tokens, temperature 0.8) `--rounds` times, the two ways alternating:
  ttft  the time from sending the request to its first text chunk
  itl   a stream's inter-token latency: the time from its first text chunk to its last over
        its completion tokens after the first (OpenTelemetry's time per output token, per
        request). Not the gaps between chunks as the client reads them: a client reading 16
        streams in one event loop, or a proxy's read, joins chunks that came apart, which
        would make gaps of ~0 out of real decode steps
  tokens_per_s  completion tokens (the usage the backend reports) over the wall time of a
        round, summed over its streams
Percentiles are over every stream of every round.

Prints one line:
  generative: ttft_p50_ms=… ttft_p99_ms=… itl_p50_ms=… itl_p99_ms=… mesh_ttft_added_ms=…
              tokens_per_s=… batched_tokens_ratio=…
  (ttft/itl: through the mesh at 16 streams; mesh_ttft_added_ms: TTFT p50 through the mesh
  minus straight to the backend, at 1 stream; tokens_per_s: through the mesh at 16 streams;
  batched_tokens_ratio: direct tokens/s at 16 streams with batching over without)
and writes bench/results/generative.json (or --json) with every figure: per concurrency, both
ways, ITL added by the mesh, the accounting/audit overhead, batching's ITL p99 both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from meshfn.contracts.qos import TENANT_HEADER
from meshfn.inference.examples import publish_examples
from meshfn.testing import policies as p
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import MESHFN, Processes, http_ok, issue_token, wait_for

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "policies" / "examples"
PY = sys.executable
PROMPT = "The with statement"
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


async def measure(
    url: str, model: str, headers: dict[str, str], streams: int, tokens: int, seed: int
) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(session, url, model, headers, tokens, seed + i) for i in range(streams))
        )
        wall = time.perf_counter() - started
    return {
        "ttft": [r[0] for r in results],
        "itl": [r[1] for r in results if r[1] is not None],
        "tokens": sum(r[2] for r in results),
        "wall": wall,
    }


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


def start_backend(procs: Processes, tmp: Path, registry: Path, key: Path) -> str:
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
    )  # fmt: skip
    ready = f"http://127.0.0.1:{port}/v2/health/ready"
    wait_for("backend ready", lambda: http_ok(ready), 120, proc=proc)
    return f"http://127.0.0.1:{port}"


def start_mesh(procs: Processes, tmp: Path, registry: Path, key: Path) -> tuple[str, str]:
    """The example mesh: (gateway URL, acme's token)."""
    mapping = p.remap(EXAMPLES, tmp / "policies")
    state = tmp / "state"
    up = procs.start(
        "up",
        [MESHFN, "up", "--policies", str(tmp / "policies"), "--state-dir", str(state),
         "--functions-registry", str(registry), "--trusted-key", str(key),
         "--envoy-concurrency", "1"],
    )  # fmt: skip
    wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=300)
    return f"http://127.0.0.1:{mapping[10000]}", issue_token(state, "bench-acme", "acme", "2h")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens per stream")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", default="1,4,16", help="streams at once, comma-separated")
    parser.add_argument("--json", type=Path, default=RESULTS / "generative.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    top = max(levels)
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-generative-"))
    procs = Processes(tmp)
    try:
        _, key = publish_examples(tmp / "functions")
        direct = start_backend(procs, tmp, tmp / "functions", key)
        gateway, token = start_mesh(procs, tmp, tmp / "functions", key)
        direct_url = f"{direct}/v2/models/tiny-lm/openai/v1/completions"
        mesh_url = f"{gateway}/v1/completions"
        plain = {"content-type": "application/json"}
        acme = {**plain, TENANT_HEADER: "acme"}  # what the sidecar writes from the claim
        mesh_headers = {**plain, "authorization": f"Bearer {token}"}
        wait_for(
            "tiny-lm through the mesh",
            lambda: asyncio.run(measure(mesh_url, "tiny-lm", mesh_headers, 1, 2, 0)),
            timeout=120,
        )
        ways = {
            "mesh": (mesh_url, "tiny-lm", mesh_headers),
            "direct": (direct_url, "tiny-lm", plain),
            "direct_unbatched": (
                f"{direct}/v2/models/tiny-solo/openai/v1/completions",
                "tiny-solo",
                plain,
            ),
            "direct_accounted": (
                f"{direct}/v2/models/tiny-acct/openai/v1/completions",
                "tiny-acct",
                acme,
            ),
        }
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {
            w: {n: [] for n in levels} for w in ways
        }
        for _ in range(args.rounds + 1):  # the first round warms every path
            for n in levels:
                for way, (url, model, headers) in ways.items():
                    if way not in {"mesh", "direct"} and n != top:
                        continue
                    runs[way][n].append(
                        asyncio.run(measure(url, model, headers, n, args.tokens, 1))
                    )
        figures = {
            way: {str(n): summary(r[1:]) for n, r in per.items() if r} for way, per in runs.items()
        }
    finally:
        procs.stop_all()
    mesh, direct_f = figures["mesh"], figures["direct"]
    low, high = str(min(levels)), str(top)
    result = {
        **{k: mesh[high][k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")},
        "mesh_ttft_added_ms": round(mesh[low]["ttft_p50_ms"] - direct_f[low]["ttft_p50_ms"], 3),
        "tokens_per_s": mesh[high]["tokens_per_s"],
        "batched_tokens_ratio": round(
            direct_f[high]["tokens_per_s"] / figures["direct_unbatched"][high]["tokens_per_s"], 2
        ),
    }
    detail = {
        "mesh_itl_added_ms": {
            n: round(mesh[n]["itl_p50_ms"] - direct_f[n]["itl_p50_ms"], 3) for n in mesh
        },
        "accounting_audit_ttft_added_ms": round(
            figures["direct_accounted"][high]["ttft_p50_ms"] - direct_f[high]["ttft_p50_ms"], 3
        ),
        "accounting_audit_tokens_ratio": round(
            figures["direct_accounted"][high]["tokens_per_s"] / direct_f[high]["tokens_per_s"], 3
        ),
        "batched_itl_p99_ms": direct_f[high]["itl_p99_ms"],
        "unbatched_itl_p99_ms": figures["direct_unbatched"][high]["itl_p99_ms"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"summary": result, **detail, "figures": figures, "tokens": args.tokens,
                    "rounds": args.rounds}, indent=1)
    )  # fmt: skip
    print("generative: " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
