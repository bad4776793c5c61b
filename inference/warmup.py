"""Predictive warm-up: learn each function's arrival pattern online and have an instance ready
shortly before the predicted next request, within a memory budget, and gone again when the
prediction fails.

The idea is the "hybrid histogram" keep-alive of Shahrad et al. (Serverless in the Wild, ATC'20):
what matters for a cold start is the idle gap, from the moment a function has nothing in flight
to its next arrival. Gaps no longer than the idle TTL are served warm by the reactive policy
anyway; the others are cold unless something is warm when they end. So per function:

- `Predictor` keeps the recent idle gaps (and the recent rate and concurrency peak) and, when
  a function goes idle, predicts a window [start, end] in which the next request will arrive:
  from the spread of the recent long gaps (those over the TTL). A concentrated spread is a
  period (a timer, a cron-like client): the window is its 5th..95th percentile, widened by a
  lead for the warm-up itself. A wide spread (random arrivals) gets a keep-alive extension to
  the median long gap instead. Either is cut to `maxWarmIdle`.
- When the recent gaps are all long (a periodic client), the reactive TTL only costs memory:
  the instances are released as soon as the function is idle, and the warm-up brings one back.
- `Warmer` (event loop) arms a timer for the window's start, has the runtime instantiate the
  instances (a prewarm thread), holds them against the reaper until the window's end, and
  releases them if no request came (a miss). A request in the window is a hit; one before the
  instance was ready is an early miss (it pays the cold path as without prediction).

Budgets: each predicted instance counts as `limits.memoryMiB` (its cap, not its current size: a
budget that holds under the worst case) against the function's `warmup.memoryBudget` and the
process's `warmupMemoryBudget`; a warm-up that does not fit is skipped. Under memory pressure
(`lowMemory`), the reaper releases idle and predicted instances before anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshfn.contracts.function import FunctionWarmup

if TYPE_CHECKING:
    from .metrics import Metrics
    from .pool import FunctionRuntime

log = logging.getLogger("meshfn.inference.warmup")

MIN_GAPS = 3  # idle gaps seen before predicting anything
LONG_GAPS = 3  # gaps over the TTL seen before predicting one
HISTORY = 32  # recent gaps kept (an arrival pattern may change: old gaps age out)
LEAD_S = 0.025  # warm this much before the window (plus twice the warm-up's own duration)
CONCENTRATED = 0.5  # (p95 - p5) / median of long gaps at most this: a period
EARLY_RELEASE_SHORT = 0.1  # release at idle when under this fraction of gaps is short


def quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between order statistics (ordered ascending, non-empty)."""
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, slots=True)
class Window:
    """Seconds after the function went idle: warm at `start`, release at `end`."""

    start: float
    end: float
    instances: int
    periodic: bool


class Predictor:
    """Online statistics of one function's arrivals (event loop only; times in seconds)."""

    def __init__(self, ttl: float, max_warm_idle: float) -> None:
        self.ttl = ttl
        self.max_warm_idle = max_warm_idle
        self.gaps: deque[float] = deque(maxlen=HISTORY)
        self.arrivals: deque[float] = deque(maxlen=HISTORY)
        self.idle_since: float | None = None
        self.peak = 1  # most requests in flight at once since the last idle gap
        self.last_peak = 1
        self.warmup_s = 0.0  # how long a warm-up took (EWMA)

    def arrived(self, now: float, inflight: int) -> None:
        """A request arrives with `inflight` others already running."""
        self.arrivals.append(now)
        if inflight == 0 and self.idle_since is not None:
            self.gaps.append(max(0.0, now - self.idle_since))
            self.idle_since = None
            self.last_peak, self.peak = self.peak, 1
        self.peak = max(self.peak, inflight + 1)

    def idle(self, now: float) -> None:
        """Nothing is in flight any more."""
        self.idle_since = now

    def warmed(self, seconds: float) -> None:
        self.warmup_s = seconds if not self.warmup_s else 0.8 * self.warmup_s + 0.2 * seconds

    def rate(self, now: float) -> float:
        """Recent arrivals per second (over the kept arrivals)."""
        if len(self.arrivals) < 2:
            return 0.0
        return (len(self.arrivals) - 1) / max(1e-6, now - self.arrivals[0])

    @property
    def short_fraction(self) -> float:
        if not self.gaps:
            return 1.0
        return sum(1 for g in self.gaps if g <= self.ttl) / len(self.gaps)

    @property
    def release_at_idle(self) -> bool:
        """The recent gaps are (nearly) all longer than the TTL: keeping instances for the TTL
        after each request would only cost memory."""
        return len(self.gaps) >= MIN_GAPS and self.short_fraction < EARLY_RELEASE_SHORT

    def predict(self) -> Window | None:
        """Where the next request should arrive, relative to the moment of going idle."""
        if len(self.gaps) < MIN_GAPS:
            return None
        long = sorted(g for g in self.gaps if g > self.ttl)
        if len(long) < LONG_GAPS:
            return None  # the reactive TTL serves this function's gaps
        lo, mid, hi = quantile(long, 0.05), quantile(long, 0.5), quantile(long, 0.95)
        lead = LEAD_S + 2 * self.warmup_s
        periodic = hi - lo <= CONCENTRATED * mid
        if periodic:  # a few samples rarely span the jitter: widen by a quarter each side
            margin = max(0.01, 0.25 * (hi - lo))
            start, end = lo - margin - lead, hi + margin
        else:  # random arrivals: extend the keep-alive to cover half the long gaps
            start, end = self.ttl - lead, mid
        start = max(0.0, start)
        end = min(end, start + self.max_warm_idle)
        if end <= start:
            return None
        return Window(start, end, max(1, self.last_peak), periodic)


class WarmBudget:
    """MiB of predicted warm instances one process holds (event loop only)."""

    def __init__(self, mib: int) -> None:
        self.total = mib
        self.used = 0

    def reserve(self, mib: int) -> bool:
        if self.used + mib > self.total:
            return False
        self.used += mib
        return True

    def release(self, mib: int) -> None:
        self.used = max(0, self.used - mib)


class Warmer:
    """One function's predictive warm-up on the event loop (see the module doc)."""

    def __init__(
        self,
        rt: FunctionRuntime,
        settings: FunctionWarmup,
        budget: WarmBudget,
        executor: Executor,
        metrics: Metrics,
        under_pressure: Callable[[], bool],
    ) -> None:
        self.rt = rt
        self.settings = settings
        self.budget = budget
        self.executor = executor
        self.under_pressure = under_pressure
        self.predictor = Predictor(
            rt.spec.idleTtl.total_seconds(), settings.maxWarmIdle.total_seconds()
        )
        self.per_instance = rt.spec.limits.memoryMiB
        label = rt.label
        self._predictions = metrics.warmup_predictions.labels(label)
        self._hits = metrics.warmup_hits.labels(label)
        self._misses = {r: metrics.warmup_misses.labels(label, r) for r in ("early", "expired")}
        self._skipped = {r: metrics.warmup_skipped.labels(label, r) for r in ("budget", "pressure")}
        self.predictions = self.hits = 0
        self.misses: dict[str, int] = {"early": 0, "expired": 0}
        self.skipped: dict[str, int] = {"budget": 0, "pressure": 0}
        self.window: Window | None = None
        self.last_window: Window | None = None
        self.state = "idle"  # idle | armed | warming | warm
        self.reserved = 0
        self._timers: list[asyncio.TimerHandle] = []
        self._idle_at = 0.0  # when the armed window's idle gap began
        self._generation = 0

    # ------------------------------------------------------------------ requests

    def arrived(self, inflight: int) -> None:
        now = time.monotonic()
        self.predictor.arrived(now, inflight)
        if self.state == "idle":
            return
        if self.state == "warm":
            self.hits += 1
            self._hits.inc()
        elif self.state == "warming":
            self._miss("early")
        elif now - self._idle_at > self.predictor.ttl:  # armed: a long gap, shorter than foreseen
            self._count_prediction()
            self._miss("early")
        # else a short gap before the window: the reactive TTL serves it, nothing was predicted
        self._close(release_instances=False)

    def finished(self, inflight: int) -> None:
        """A request finished; with nothing else in flight the function goes idle."""
        if inflight:
            return
        now = time.monotonic()
        self.predictor.idle(now)
        window = self.predictor.predict()
        if self.predictor.release_at_idle:
            self._submit(self.rt.drop_instances)
        if window is None:
            return
        if self.under_pressure():
            self._skip("pressure")
            return
        self._idle_at = now
        self.window = self.last_window = window
        self.state = "armed"
        self._generation += 1
        generation = self._generation
        loop = asyncio.get_running_loop()
        at = loop.time() + window.start
        self.rt.hold_until = now + window.end  # the reaper keeps what the warm-up brings
        self._timers = [
            loop.call_at(at, self._warm, generation),
            loop.call_at(loop.time() + window.end, self._expire, generation),
        ]

    # ------------------------------------------------------------------ timers

    def _warm(self, generation: int) -> None:
        if generation != self._generation or self.state != "armed" or self.window is None:
            return
        if self.under_pressure():
            self._skip("pressure")
            self._close(release_instances=False)
            return
        wanted = min(
            self.window.instances,
            self.settings.memoryBudget // self.per_instance,
            max(1, self.rt.spec.pool.maxIdle),
        )
        mib = wanted * self.per_instance
        if wanted < 1 or not self.budget.reserve(mib):
            self._skip("budget")
            self._close(release_instances=False)
            return
        self.reserved = mib
        self._count_prediction()
        self.state = "warming"
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, self.rt.warm, wanted)
        future.add_done_callback(lambda f: self._warmed(f, generation))

    def _warmed(self, future: asyncio.Future[float], generation: int) -> None:
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():
                log.warning(
                    "warm-up failed",
                    extra={"function": self.rt.label, "error": str(future.exception())},
                )
            if generation == self._generation:
                self._close(release_instances=False)
            return
        self.predictor.warmed(future.result())
        if generation == self._generation and self.state == "warming":
            self.state = "warm"

    def _expire(self, generation: int) -> None:
        if generation != self._generation or self.state == "idle":
            return
        self._miss("expired")
        self._close(release_instances=True)

    # ------------------------------------------------------------------ helpers

    def _count_prediction(self) -> None:
        self.predictions += 1
        self._predictions.inc()

    def _skip(self, reason: str) -> None:
        self.skipped[reason] += 1
        self._skipped[reason].inc()

    def _miss(self, reason: str) -> None:
        self.misses[reason] += 1
        self._misses[reason].inc()

    def _close(self, release_instances: bool) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        self._generation += 1
        self.state = "idle"
        self.window = None
        self.rt.hold_until = 0.0
        if self.reserved:
            self.budget.release(self.reserved)
            self.reserved = 0
        if release_instances and not self.rt.inflight:
            self._submit(self.rt.drop_instances)

    def _submit(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # shutting down
            self.executor.submit(fn)

    def release(self) -> None:
        """Memory pressure or shutdown: give back what a prediction holds, now."""
        if self.state != "idle":
            self._close(release_instances=True)

    def status(self) -> dict[str, object]:
        now = time.monotonic()
        p = self.predictor
        long = sorted(g for g in p.gaps if g > p.ttl)
        return {
            "mode": self.settings.mode,
            "state": self.state,
            "predictions": self.predictions,
            "hits": self.hits,
            "misses": sum(self.misses.values()),
            "misses_by_reason": dict(self.misses),
            "skipped": dict(self.skipped),
            "recent_rate_per_s": round(p.rate(now), 3),
            "idle_gaps": len(p.gaps),
            "long_gap_p50_ms": round(quantile(long, 0.5) * 1000, 1) if long else None,
            "periodic": self.last_window.periodic if self.last_window else None,
            "reserved_mib": self.reserved,
        }
