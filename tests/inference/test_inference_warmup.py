"""Predictive warm-up: the predictor on synthetic arrival patterns, the schema's rules, and the
real backend (wasmtime, the example functions) warming ahead of a periodic client, releasing
on a failed prediction, respecting budgets and memory pressure; and guest calls on the event loop (core, and short
Python calls)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from meshfn.contracts.function import FunctionSettings
from meshfn.inference.backend import Backend
from meshfn.inference.dispatch import INLINE_PYTHON_MAX_S, INLINE_SLICE_TICKS, SLICE_SECONDS
from meshfn.inference.engine import EPOCH_TICK_S
from meshfn.inference.warmup import Predictor, WarmBudget, quantile

from .test_inference_runtime import Published, X, backend_for, chaos, published, until

SPIN_TIMEOUT_S = 0.3  # the chaos functions' limits.timeout below ("300ms")
# A lower bound only: the spin's own deadline, not the inline slice (SLICE_SECONDS, 10 ms),
# interrupted it (less a few epoch ticks: deadlines are counted in ticks). A slow machine only
# makes it later, so no margin for load is needed.
INTERRUPTED_AFTER_S = SPIN_TIMEOUT_S - 4 * EPOCH_TICK_S
assert INTERRUPTED_AFTER_S > 10 * SLICE_SECONDS

__all__ = ["published"]  # the module-scoped registry fixture


def feed(p: Predictor, gaps: list[float], service: float = 0.001) -> None:
    now = 100.0
    p.arrived(now, 0)
    for gap in gaps:
        now += service
        p.idle(now)
        now += gap
        p.arrived(now, 0)
    p.idle(now + service)


def test_quantile_interpolates() -> None:
    assert quantile([1.0], 0.5) == 1.0
    assert quantile([0.0, 10.0], 0.25) == 2.5
    assert quantile([1.0, 2.0, 3.0], 0.95) == pytest.approx(2.9)


def test_periodic_arrivals_predict_a_tight_window_and_release_at_idle() -> None:
    rng = random.Random(1)
    p = Predictor(ttl=0.2, max_warm_idle=5.0)
    feed(p, [0.5 + rng.uniform(-0.05, 0.05) for _ in range(20)])
    w = p.predict()
    assert w is not None and w.periodic
    assert 0.35 < w.start < 0.45 and 0.54 < w.end < 0.6  # brackets 0.45..0.55 with a lead
    assert p.release_at_idle  # every gap is over the TTL: keeping instances only costs memory


def test_too_few_or_short_gaps_predict_nothing() -> None:
    p = Predictor(ttl=0.2, max_warm_idle=5.0)
    feed(p, [0.5, 0.5])
    assert p.predict() is None  # not enough history
    q = Predictor(ttl=0.2, max_warm_idle=5.0)
    feed(q, [0.01] * 30 + [0.5, 0.5])
    assert q.predict() is None and not q.release_at_idle  # the reactive TTL covers a burst


def test_random_arrivals_extend_the_keep_alive_within_max_warm_idle() -> None:
    rng = random.Random(2)
    p = Predictor(ttl=0.2, max_warm_idle=0.3)
    feed(p, [rng.expovariate(1 / 0.6) for _ in range(32)])
    w = p.predict()
    assert w is not None and not w.periodic
    assert w.start <= 0.2 and w.end - w.start <= 0.3 + 1e-9
    assert not p.release_at_idle


def test_bursts_remember_their_concurrency() -> None:
    p = Predictor(ttl=0.1, max_warm_idle=5.0)
    now = 0.0
    for _ in range(6):  # bursts of 3 concurrent requests, 1 s apart
        for k in range(3):
            p.arrived(now, k)
        p.idle(now + 0.01)
        now += 1.0
    w = p.predict()
    assert w is not None and w.instances == 3


def test_budget_reserves_and_releases() -> None:
    b = WarmBudget(100)
    assert b.reserve(64) and not b.reserve(64)
    b.release(64)
    assert b.reserve(100) and b.used == 100


def test_schema_rules() -> None:
    assert FunctionSettings().warmup.mode == "reactive"
    for bad, message in [
        ({"warmup": {"mode": "predictive", "memoryBudget": 8}}, "fits no instance"),
        (
            {"warmup": {"mode": "predictive"}, "isolation": "fresh-instance-per-request"},
            "needs isolation: reuse",
        ),
        ({"warmup": {"maxWarmIdle": "0s"}}, "maxWarmIdle must be"),
        ({"warmup": {"mode": "eager"}}, "mode"),
        ({"warmup": {"budget": 1}}, "Extra inputs"),
    ]:
        with pytest.raises(ValidationError, match=message):
            FunctionSettings.model_validate(bad)


# ---------------------------------------------------------------------- the real backend

PREDICTIVE = {
    "name": "chaos-core",
    "idleTtl": "100ms",
    "pool": {"minIdle": 0, "maxIdle": 2},
    "warmup": {"mode": "predictive", "maxWarmIdle": "1s", "memoryBudget": 64},
}


async def periodic(b: Backend, n: int, period: float) -> list[int]:
    """`n` requests `period` apart; the cold-request count after each."""
    rt = b.lookup("chaos-core", None)
    out = []
    for _ in range(n):
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        out.append(rt.cold_requests)
        await asyncio.sleep(period)
    return out


async def test_periodic_client_is_served_warm_and_a_failed_prediction_is_released(
    published: Published,
) -> None:
    b = backend_for(published, [PREDICTIVE])
    await b.start()
    try:
        rt = b.lookup("chaos-core", None)
        colds = await periodic(b, 12, 0.3)
        warmer = b.dispatcher.lanes[rt.label].warmer
        assert warmer is not None
        # learning takes MIN_GAPS + a few; afterwards every request found a warm instance
        assert colds[-1] - colds[6] == 0, colds
        assert warmer.hits >= 4 and b.metrics.warmup_hits.labels(rt.label)._value.get() >= 4
        # the client stops: the window expires (a miss), the instance goes, nothing stays warm
        await until(lambda: warmer.misses["expired"] == 1, seconds=3)
        await until(lambda: rt.idle_instances == 0 and warmer.state == "idle", seconds=3)
        await asyncio.sleep(0.3)
        assert rt.idle_instances == 0
        assert b.metrics.warmup_misses.labels(rt.label, "expired")._value.get() == 1
        doc = json.loads(await b_status(b))
        entry = doc["functions"][0]["warmup"]
        assert entry["mode"] == "predictive" and entry["hits"] == warmer.hits
        assert entry["predictions"] >= entry["hits"] + entry["misses"] - 1
    finally:
        await b.drain(1)


async def b_status(b: Backend) -> str:
    from meshfn.inference.status import functions_document

    return json.dumps(functions_document(b))


async def test_a_full_budget_skips_the_warm_up(published: Published) -> None:
    b = Backend(backend_for(published, [PREDICTIVE]).config.with_overrides(warmupMemoryBudget=32))
    await b.start()
    try:
        colds = await periodic(b, 9, 0.3)
        warmer = b.dispatcher.lanes["chaos-core@1"].warmer
        assert warmer is not None and warmer.skipped["budget"] >= 3 and warmer.hits == 0
        assert colds[-1] - colds[4] == 4  # still cold every time: the prediction cost nothing
    finally:
        await b.drain(1)


async def test_under_memory_pressure_warm_instances_go_first(published: Published) -> None:
    reactive = {"name": "digits", "idleTtl": "1h", "pool": {"minIdle": 2, "maxIdle": 4}}
    b = backend_for(published, [PREDICTIVE, reactive])
    await b.start()
    try:
        digits = b.lookup("digits", None)
        body = json.dumps(
            {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [0] * 64}]}
        )
        assert (await b.infer("digits", None, body.encode())).status == 200
        await until(lambda: digits.idle_instances == 2)
        await periodic(b, 8, 0.3)
        # available memory is now "low" (more than this machine has): everything idle goes
        b.config = b.config.with_overrides(lowMemory=1 << 20)
        await until(lambda: b.pressure and digits.idle_instances == 0, seconds=3)
        assert digits.loaded  # the code stays; only warm instances go
        warmer = b.dispatcher.lanes["chaos-core@1"].warmer
        assert warmer is not None
        await periodic(b, 4, 0.3)
        assert warmer.skipped["pressure"] >= 1 and warmer.state in ("idle", "armed")
        assert (await b.infer("digits", None, body.encode())).status == 200  # still serves
    finally:
        await b.drain(1)


async def test_mode_off_creates_instances_only_on_demand(published: Published) -> None:
    b = backend_for(
        published,
        [{"name": "chaos-core", "pool": {"minIdle": 2}, "warmup": {"mode": "off"}}],
    )
    await b.start()
    try:
        rt = b.lookup("chaos-core", None)
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        await asyncio.sleep(0.2)
        assert rt.idle_instances == 1  # the used one is kept; minIdle is not refilled
    finally:
        await b.drain(1)


def calls_of(rt: Any) -> list[tuple[int, int | None]]:
    """Each guest call of `rt` from now on: (the thread that ran it, its deadline in ticks)."""
    seen: list[tuple[int, int | None]] = []
    invoke = rt.invoke

    def spy(text: str, ticks: int | None = None, preemptible: bool = False) -> Any:
        seen.append((threading.get_ident(), ticks))
        return invoke(text, ticks, preemptible)

    rt.invoke = spy
    return seen


async def test_core_calls_run_inline_and_a_long_one_finishes_on_a_worker(
    published: Published,
) -> None:
    b = backend_for(published, [{"name": "chaos-core", "limits": {"timeout": "300ms"}}])
    await b.start()
    try:
        rt = b.lookup("chaos-core", None)
        seen = calls_of(rt)
        assert (await b.infer("chaos-core", None, X.encode())).status == 200  # loads (a thread)
        assert seen[-1][0] != threading.get_ident()
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        assert seen[-1] == (threading.get_ident(), INLINE_SLICE_TICKS)  # the loop's own thread
        # a spin outlives the slice: it runs again on a worker with the rest of its deadline,
        # and that deadline (300 ms), not the slice, interrupts it
        seen.clear()
        started = time.monotonic()
        spin = await b.infer("chaos-core", None, chaos("spin").encode())
        assert spin.status == 504 and time.monotonic() - started >= INTERRUPTED_AFTER_S
        assert "300 ms deadline" in json.loads(spin.body)["error"]
        assert len(seen) == 2 and seen[1][0] != threading.get_ident()
        discarded = b.metrics.traps.labels(rt.label, "timeout")._value.get()
        assert discarded == 1  # the slice's own interruption is not counted
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
    finally:
        await b.drain(1)


async def test_short_python_calls_run_inline_and_a_long_one_sends_the_next_to_a_worker(
    published: Published,
) -> None:
    b = backend_for(
        published, [{"name": "chaos", "pool": {"minIdle": 1}, "limits": {"timeout": "300ms"}}]
    )
    await b.start()
    try:
        rt = b.lookup("chaos", None)
        lane = b.dispatcher.lane(rt)
        seen = calls_of(rt)
        loop_thread = threading.get_ident()
        # Unmeasured, or cold: worker threads. Then, short calls with an instance ready: inline.
        # "Short" is the dispatcher's own threshold (INLINE_PYTHON_MAX_S, on its moving average
        # of the calls it timed), not one of this test. How many calls on workers bring that
        # average under it depends on how long the cold call took (one of 10 ms needs more
        # than ten calls of 1 ms after it), so the calls go on until it is under, and then the
        # next one must run inline.
        assert (await b.infer("chaos", None, X.encode())).status == 200
        assert seen[-1][0] != loop_thread
        for _ in range(100):
            await until(lambda: rt.idle_instances > 0)
            recent = lane.recent_call_s
            assert (await b.infer("chaos", None, X.encode())).status == 200
            if recent is not None and recent <= INLINE_PYTHON_MAX_S:
                break
            assert seen[-1][0] != loop_thread, (recent, seen)  # a long average: a worker
        assert seen[-1] == (loop_thread, INLINE_SLICE_TICKS), (lane.recent_call_s, seen)
        assert lane.recent_call_s is not None and lane.recent_call_s <= INLINE_PYTHON_MAX_S
        # A spin outlives the slice: run again on a worker, interrupted by its own deadline.
        seen.clear()
        started = time.monotonic()
        spin = await b.infer("chaos", None, chaos("spin").encode())
        assert spin.status == 504 and time.monotonic() - started >= INTERRUPTED_AFTER_S
        assert "300 ms deadline" in json.loads(spin.body)["error"]
        assert [t == loop_thread for t, _ in seen] == [True, False]
        # The slice counted as a long call: the next one goes to a worker, and it still works.
        assert lane.recent_call_s is not None and lane.recent_call_s > INLINE_PYTHON_MAX_S
        seen.clear()
        await until(lambda: rt.idle_instances > 0)
        assert (await b.infer("chaos", None, X.encode())).status == 200
        assert seen[-1][0] != loop_thread
    finally:
        await b.drain(1)


async def test_python_calls_stay_on_workers_when_turned_off(
    published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHFN_INLINE_PYTHON", "0")  # read when the backend starts
    b = backend_for(published, [{"name": "chaos", "pool": {"minIdle": 1}}])
    await b.start()
    try:
        rt = b.lookup("chaos", None)
        seen = calls_of(rt)
        for _ in range(5):
            assert (await b.infer("chaos", None, X.encode())).status == 200
            await until(lambda: rt.idle_instances > 0)
        assert len(seen) == 5 and threading.get_ident() not in {thread for thread, _ in seen}
    finally:
        await b.drain(1)
