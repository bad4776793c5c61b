"""`GET /meshfn/functions`: the backend's own view of the functions it serves, as JSON.

The control plane's console reads it from each backend it started (on loopback, beside the
KServe routes) instead of reaching into the backend: the backend talks to the control plane only
through Envoy-facing protocols and this status endpoint (docs/concepts/architecture.md). Read-only; it names
no file paths, keys or request data.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from .generation import StepEngine

if TYPE_CHECKING:
    from .backend import Backend
    from .pool import FunctionRuntime
    from .warmup import Warmer


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _state(rt: FunctionRuntime) -> str:
    """refused | unloaded (scaled to zero, code dropped) | dormant (code kept) | loaded."""
    if rt.refusal is not None:
        return "refused"
    if not rt.loaded:
        return "unloaded"
    return "dormant" if rt.dormant else "loaded"


def function_status(rt: FunctionRuntime, warmer: Warmer | None = None) -> dict[str, Any]:
    recent = sorted(rt.latencies)
    verified = rt.verified
    spec = rt.spec
    return {
        "name": rt.name,
        "version": rt.version,
        "kind": verified.kind if verified is not None else None,
        "state": _state(rt),
        "signature": {
            "verified": verified is not None,
            "key_id": verified.key_id if verified is not None else None,
            "error": str(rt.refusal) if rt.refusal is not None else None,
        },
        "isolation": spec.isolation,
        "pool": {
            "min_idle": spec.pool.minIdle,
            "max_idle": spec.pool.maxIdle,
            "idle": rt.idle_instances,
        },
        "inflight": rt.inflight,
        "max_concurrency": spec.limits.maxConcurrency,
        "cold_starts": rt.cold_starts,
        "code_cache_hits": rt.code_cache_hits,  # of cold_starts: no deserialize needed
        "recent_requests": len(recent),
        "p50_ms": _ms(_quantile(recent, 0.5)),
        "p99_ms": _ms(_quantile(recent, 0.99)),
        "memory_limit_bytes": rt.memory_bytes,
        # Instances alive now (warm pool + running), each capped at memory_limit_bytes.
        "instances": rt.idle_instances + rt.inflight,
        "cold_requests": rt.cold_requests,
        "warm_instance_seconds": round(rt.warm_instance_seconds(), 3),
        "warmup": warmer.status() if warmer is not None else {"mode": spec.warmup.mode},
    }


def _qos(backend: Backend, rt: FunctionRuntime) -> dict[str, Any] | None:
    """The QoSPolicy's view: per tenant seen so far, admitted/limited/shed and guest CPU."""
    lane = backend.dispatcher.lanes.get(rt.label)
    qos = rt.spec.qos
    if qos is None:
        return None
    tenants = lane.admission.snapshot() if lane is not None and lane.admission else []
    return {"policy": qos.policy, "tenants": tenants}


def _generation(backend: Backend, rt: FunctionRuntime) -> dict[str, Any] | None:
    """A generative function's recent generations: streams, tokens, time to first token and
    per output token (p50, p99), how they ended, and with continuous batching how many streams
    shared a decode step on average (batched_tokens_ratio)."""
    generative = backend.generative
    if not generative.generates(rt):
        return None
    stats = generative.recent.get(rt.label)
    engine = generative.engines.get(rt.label)
    ttft = sorted(stats.ttft) if stats else []
    tpot = sorted(stats.tpot) if stats else []
    step = engine if isinstance(engine, StepEngine) else None
    steps = step.steps if step is not None else 0
    batching = rt.spec.generation.batching if rt.spec.generation is not None else None
    return {
        "engine": "step" if step else ("generator" if engine else None),
        "active_streams": engine.streams if engine is not None else 0,
        "max_streams_per_step": batching.maxStreams if batching is not None else 1,
        "finished": dict(stats.finished) if stats else {},
        "prompt_tokens": stats.prompt_tokens if stats else 0,
        "completion_tokens": stats.completion_tokens if stats else 0,
        "ttft_p50_ms": _ms(_quantile(ttft, 0.5)),
        "ttft_p99_ms": _ms(_quantile(ttft, 0.99)),
        "tpot_p50_ms": _ms(_quantile(tpot, 0.5)),
        "tpot_p99_ms": _ms(_quantile(tpot, 0.99)),
        "decode_steps": steps,
        "batched_tokens_ratio": round(step.stepped_tokens / steps, 3) if step and steps else None,
    }


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def functions_document(backend: Backend) -> dict[str, Any]:
    return {
        "ready": backend.ready,
        "rss_bytes": _rss_bytes(),
        "processes": backend.config.processes,
        "pid": os.getpid(),
        "memory_pressure": backend.pressure,
        "sandbox": backend.sandbox,
        "code_cache": {
            "entries": len(backend.code),
            "held": backend.code.held,
            "ttl_s": backend.code.settings.ttl.total_seconds(),
            "max_entries": backend.code.settings.maxEntries,
        },
        "functions": [
            {
                **function_status(rt, _warmer(backend, rt)),
                "qos": _qos(backend, rt),
                "requests": _requests(backend, rt),
                "generation": _generation(backend, rt),
            }
            for name in sorted(backend.functions)
            for _, rt in sorted(backend.functions[name].items())
        ],
        # spans exported and dropped (a collector down or slow never delays a request)
        "tracing": backend.tracer.document(),
    }


def _requests(backend: Backend, rt: FunctionRuntime) -> dict[str, int]:
    """Requests that ran, answered or failed (the console's service graph takes rates)."""
    lane = backend.dispatcher.lanes.get(rt.label)
    if lane is None:
        return {"ok": 0, "failed": 0}
    return {"ok": lane.stats.success.count, "failed": lane.stats.fail.count}


def _warmer(backend: Backend, rt: FunctionRuntime) -> Warmer | None:
    lane = backend.dispatcher.lanes.get(rt.label)
    return lane.warmer if lane is not None else None
