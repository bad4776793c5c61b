"""The drift breaker: per-route latency against the route's own baseline.

Envoy streams every request's duration (gRPC access-log service); for each route with a
`driftBreaker` we keep recent samples. The route trips when the p95 of the last `window` exceeds
the baseline p95 (the `baselineWindow` before it, or `coldStartBaseline` until there are enough
samples) by more than `threshold` percent and by at least `minIncrease`. While tripped, the baseline is frozen and only the
probe share of traffic still reaches the primary; the route recovers when the probe's p95 over the
last `recoverAfter` is within half the trip margin (half the threshold, or half `minIncrease` where
that is larger): hysteresis, so a route does not flap.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from meshfn import ir
from meshfn.common import peerjson
from meshfn.contracts.genai import GENERATION_HEADER
from meshfn.contracts.tracing import (
    SPLIT_TRACE_METADATA,
    TRACEPARENT,
    parse_traceparent,
    split_unanswered,
    split_upstream_cluster,
    split_value,
)
from meshfn.xds.names import function_cluster_name, primary_clusters, version_cluster_name

if TYPE_CHECKING:
    from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

_SAMPLED_LAST_DIGITS = frozenset("13579bdf")  # W3C trace flags with the sampled bit

log = logging.getLogger("meshfn.drift")

MAX_SAMPLES = 200_000
HISTORY_POINTS = 600  # one per evaluation (every 0.2 s in the control plane): two minutes
HISTORY_EVENTS = 50
MAX_EXEMPLARS = 256  # recent traced samples per route, the slowest of which a trip names
EXEMPLARS_PER_TRIP = 3


def p95(values: Iterable[float] | np.ndarray) -> float:
    """The nearest-rank 95th percentile: a partial sort (numpy's, in C), not a full one."""
    found = values if isinstance(values, np.ndarray) else np.fromiter(values, float)
    rank = min(len(found) - 1, math.ceil(0.95 * len(found)) - 1)
    return float(np.partition(found, rank)[rank])


class Samples:
    """A route's samples, oldest first: two growable numpy arrays of (time, seconds) between
    `_lo` and `_hi`. The times only grow, so a window's bounds are a binary search and its
    values a slice. The breaker used to rebuild and sort Python lists of every sample at each
    evaluation (five a second): at 360 requests a second and the examples' 60 s baseline that
    was ~8 ms each, and it grew with traffic times `baselineWindow` (MAX_SAMPLES caps it)."""

    def __init__(self) -> None:
        self._t = np.empty(1024)
        self._v = np.empty(1024)
        self._lo = self._hi = 0

    def __len__(self) -> int:
        return self._hi - self._lo

    def __iter__(self) -> Iterator[tuple[float, float]]:
        times, values = self._t[self._lo : self._hi], self._v[self._lo : self._hi]
        return zip(times.tolist(), values.tolist(), strict=True)

    def append(self, at: float, seconds: float) -> None:
        """A sample at `at` (a time before the last one counts as the last one's)."""
        if self._hi == len(self._t):
            self._make_room()
        if self._hi > self._lo:
            at = max(at, float(self._t[self._hi - 1]))
        self._t[self._hi], self._v[self._hi] = at, seconds
        self._hi += 1
        if len(self) > MAX_SAMPLES:
            self._lo += 1

    def _make_room(self) -> None:
        count = len(self)
        size = len(self._t) * 2 if count * 2 > len(self._t) else len(self._t)  # else compact
        times, values = np.empty(size), np.empty(size)  # new arrays: a view handed out stays valid
        times[:count], values[:count] = self._t[self._lo : self._hi], self._v[self._lo : self._hi]
        self._t, self._v, self._lo, self._hi = times, values, 0, count

    def since(self, at: float) -> int:
        """The index (from the oldest kept) of the first sample at or after `at`."""
        return int(np.searchsorted(self._t[self._lo : self._hi], at, "left"))

    def drop_before(self, at: float) -> None:
        self._lo += self.since(at)

    def values(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """The seconds of samples [start, end) counted from the oldest kept (a view)."""
        return self._v[self._lo : self._hi][start:end]

    def clear(self) -> None:
        self._lo = self._hi = 0


def _traced(entry: HTTPAccessLogEntry) -> str:
    """The trace a gateway's access-log entry was sampled in, else "". A split gateway (no
    tracer on its own listener) has the id in metadata, only for the requests it sampled;
    otherwise the traceparent its tracer sent upstream (listeners._latency_log), most of them
    version 00 and not sampled (the flags' last digit even): read no further."""
    value = split_value(entry.common_properties.metadata.filter_metadata, SPLIT_TRACE_METADATA)
    if value:
        return value if len(value) == 32 else ""
    header = entry.request.request_headers.get(TRACEPARENT, "")
    if len(header) == 55 and header[-1] not in _SAMPLED_LAST_DIGITS:
        return ""
    parent = parse_traceparent(header)
    return parent.trace_id if parent is not None and parent.sampled else ""


def sample(entry: HTTPAccessLogEntry, metric: str) -> float | None:
    """The seconds an access-log entry contributes to a breaker reading `metric` (ir.Drift):
    the time to the last byte sent downstream (duration, where Envoy recorded it), to the first
    upstream byte (ttft: a stream's response starts with its first token), or a stream's time
    per token after the first (itl: from the backend's usage record, which the entry's trailers
    or headers carry; None without one, or with fewer than two tokens)."""
    common = entry.common_properties
    if metric == "ttft":
        if not common.HasField("time_to_first_upstream_rx_byte"):
            return None
        return float(common.time_to_first_upstream_rx_byte.ToNanoseconds()) / 1e9
    if metric == "itl":
        tokens = _completion_tokens(entry)
        first, last = common.time_to_first_upstream_rx_byte, common.time_to_last_upstream_rx_byte
        if tokens is None or tokens < 2 or not common.HasField("time_to_last_upstream_rx_byte"):
            return None
        return float(last.ToNanoseconds() - first.ToNanoseconds()) / 1e9 / (tokens - 1)
    timing = common.time_to_last_downstream_tx_byte
    if not common.HasField("time_to_last_downstream_tx_byte"):
        timing = common.duration
    return float(timing.ToNanoseconds()) / 1e9


def _completion_tokens(entry: HTTPAccessLogEntry) -> int | None:
    response = entry.response
    raw = response.response_trailers.get(GENERATION_HEADER) or response.response_headers.get(
        GENERATION_HEADER
    )
    if not raw:
        return None
    try:
        tokens = peerjson.loads(raw).get("completion_tokens")
    except (ValueError, AttributeError):
        return None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


@dataclass(frozen=True)
class WatchedRoute:
    """A route whose destination has a drift breaker: which clusters carry its primary, and
    what drifts (`sample`): its duration, or on a generative route (a stream) its time to first
    token or inter-token latency (ir.Drift.streams)."""

    route: str  # Route.key
    primary_clusters: frozenset[str]  # the primary, and the aggregate that starts with it
    settings: ir.Drift
    metric: str = "duration"


@dataclass(frozen=True)
class Transition:
    route: str
    to: str  # "degraded" | "healthy"
    p95_ms: float
    baseline_ms: float
    at: float
    # a trip names the slowest sampled traces of its window (trace ids): exemplars to open
    exemplars: tuple[str, ...] = ()


@dataclass(frozen=True)
class DriftPoint:
    """One evaluation of a route: what the console charts (times are time.monotonic())."""

    at: float
    p95_ms: float
    baseline_ms: float
    degraded: bool


@dataclass(frozen=True)
class RouteDrift:
    """A guarded route as the breaker sees it now, with its recent history."""

    route: str
    degraded: bool
    since_s: float | None
    p95_ms: float
    baseline_ms: float
    trip_at_ms: float  # the p95 that trips the route (or, while tripped, blocks recovery)
    samples: int
    transitions: int
    history: tuple[DriftPoint, ...]
    events: tuple[Transition, ...]


@dataclass
class _State:
    watched: WatchedRoute
    samples: Samples = field(default_factory=Samples)
    # (time, seconds, trace id) of recent samples whose trace was sampled
    traced: deque[tuple[float, float, str]] = field(
        default_factory=lambda: deque(maxlen=MAX_EXEMPLARS)
    )
    degraded: bool = False
    since: float = 0.0
    frozen_baseline: float = 0.0
    warm_baseline: float | None = None  # after a recovery, until the baseline refills
    last_p95: float = 0.0
    last_baseline: float = 0.0
    transitions: int = 0
    history: deque[DriftPoint] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    events: deque[Transition] = field(default_factory=lambda: deque(maxlen=HISTORY_EVENTS))

    def baseline(self) -> float:
        return self.frozen_baseline if self.degraded else self.last_baseline


class DriftBreaker:
    def __init__(self) -> None:
        self._routes: dict[str, _State] = {}

    def configure(self, routes: Iterable[WatchedRoute]) -> None:
        """Follow the routes of a new MeshModel; keep the history of routes that stay."""
        wanted = {r.route: r for r in routes}
        for key in list(self._routes):
            if key not in wanted:
                del self._routes[key]
        for key, watched in wanted.items():
            state = self._routes.get(key)
            if state is None:
                self._routes[key] = _State(watched)
            else:
                state.watched = watched

    def observe(
        self, route_name: str, cluster: str, seconds: float, now: float, trace_id: str = ""
    ) -> None:
        """`route_name` is Envoy's route name ("namespace/name/match-index", with "/degraded"
        for the twin the degrade filter reroutes to: its probe share measures recovery);
        `trace_id`: the request's trace, when it was sampled (a trip's exemplars)."""
        state = self._routes.get("/".join(route_name.split("/", 2)[:2]))
        if state is None or cluster not in state.watched.primary_clusters:
            return
        state.samples.append(now, seconds)
        if trace_id:
            state.traced.append((now, seconds, trace_id))

    def observe_access_log(self, entry: HTTPAccessLogEntry, now: float) -> None:
        """One Envoy access-log entry (ALS): its route, upstream cluster and the sample its
        route's breaker reads (`sample`). A request never sent upstream (shed by a circuit
        breaker, rate limited, denied) is answered at once, yet names its route's cluster:
        counted, it would hide a slow backend. Envoy's filter (names.LATENCY_LOG_FILTER) does
        not send those; this holds for any sender."""
        common = entry.common_properties
        if not common.HasField("upstream_local_address") or split_unanswered(
            common.metadata.filter_metadata
        ):
            return
        state = self._routes.get("/".join(common.route_name.split("/", 2)[:2]))
        metric = state.watched.metric if state is not None else "duration"
        seconds = sample(entry, metric)
        if seconds is None:
            return
        cluster = split_upstream_cluster(common.metadata.filter_metadata, common.upstream_cluster)
        self.observe(common.route_name, cluster, seconds, now, _traced(entry))

    def degraded(self) -> frozenset[str]:
        return frozenset(k for k, s in self._routes.items() if s.degraded)

    def evaluate(self, now: float) -> list[Transition]:
        transitions = []
        for key, state in self._routes.items():
            settings = state.watched.settings
            window = settings.window.total_seconds()
            span = settings.recover_after.total_seconds()
            horizon = now - max(settings.baseline_window.total_seconds() + window, span)
            state.samples.drop_before(horizon)
            if not state.degraded:
                split = state.samples.since(now - window)
                recent, older = state.samples.values(split), state.samples.values(0, split)
                baseline = self._baseline(state, older)
                state.last_baseline = baseline or 0.0
                if baseline is None or len(recent) < settings.min_samples:
                    continue
                state.last_p95 = p95(recent)
                if state.last_p95 > self._limit(settings, baseline, 1.0):
                    state.degraded, state.since = True, now
                    state.frozen_baseline = baseline
                    transitions.append(self._transition(state, key, "degraded", now))
            else:
                # One p95 over the whole recoverAfter span, not one per `window` that must all
                # pass: the probe share gives a window a dozen samples, whose p95 is their
                # maximum, so a single slow request anywhere in the span held the trip.
                probes = state.samples.values(state.samples.since(now - max(span, window)))
                if len(probes) < max(3, settings.min_samples // 4):  # the probe share is small
                    continue
                state.last_p95 = p95(probes)
                if now - state.since < span:
                    continue
                if state.last_p95 <= self._limit(settings, state.frozen_baseline, 0.5):
                    state.degraded, state.since = False, now
                    state.warm_baseline = state.frozen_baseline
                    state.samples.clear()  # the slow period must not become the new normal
                    transitions.append(self._transition(state, key, "healthy", now))
        for state in self._routes.values():
            state.history.append(
                DriftPoint(now, state.last_p95 * 1000, state.baseline() * 1000, state.degraded)
            )
        return transitions

    @staticmethod
    def _limit(settings: ir.Drift, baseline: float, share: float) -> float:
        """The p95 that trips (share 1) or still blocks recovery (share 0.5, the hysteresis
        midpoint). The minIncrease floor applies to both: without it in the recovery limit, a
        2 ms baseline would need every probe under 2.4 ms, and the few probe samples' p95 (their
        maximum) rarely is, so a healed route stayed on its fallback."""
        rise = max(
            baseline * settings.threshold_percent / 100, settings.min_increase.total_seconds()
        )
        return baseline + share * rise

    def _baseline(self, state: _State, older: np.ndarray) -> float | None:
        settings = state.watched.settings
        if len(older) >= settings.min_samples:
            state.warm_baseline = None
            return p95(older)
        if state.warm_baseline is not None:
            return state.warm_baseline
        if settings.cold_start_baseline is not None:
            return settings.cold_start_baseline.total_seconds()
        return None

    @staticmethod
    def _exemplars(state: _State, now: float) -> tuple[str, ...]:
        """The slowest sampled traces of the trip's window (its recent samples)."""
        since = now - state.watched.settings.window.total_seconds()
        recent = [(seconds, trace) for at, seconds, trace in state.traced if at >= since]
        slowest = sorted(recent, reverse=True)
        return tuple(dict.fromkeys(trace for _, trace in slowest))[:EXEMPLARS_PER_TRIP]

    def _transition(self, state: _State, key: str, to: str, now: float) -> Transition:
        state.transitions += 1
        baseline = state.frozen_baseline or state.last_baseline
        exemplars = self._exemplars(state, now) if to == "degraded" else ()
        transition = Transition(key, to, state.last_p95 * 1000, baseline * 1000, now, exemplars)
        state.events.append(transition)
        if to == "degraded":
            log.warning(
                "route %s degraded: p95 %.1f ms is more than %.0f%% above its baseline %.1f ms; "
                "sending it down its fallback chain%s",
                key,
                transition.p95_ms,
                state.watched.settings.threshold_percent,
                transition.baseline_ms,
                "; slow traces: " + ", ".join(exemplars) if exemplars else "",
                extra={"exemplars": list(exemplars)},
            )
        else:
            log.info(
                "route %s recovered: p95 %.1f ms near its baseline %.1f ms; traffic returns",
                key,
                transition.p95_ms,
                transition.baseline_ms,
            )
        return transition

    def views(self, now: float) -> list[RouteDrift]:
        """Every guarded route, by name, with its bounded history (for the console)."""
        out = []
        for key, s in sorted(self._routes.items()):
            baseline = s.baseline()
            limit = self._limit(s.watched.settings, baseline, 0.5 if s.degraded else 1.0)
            out.append(
                RouteDrift(
                    route=key,
                    degraded=s.degraded,
                    since_s=round(now - s.since, 3) if s.since else None,
                    p95_ms=round(s.last_p95 * 1000, 3),
                    baseline_ms=round(baseline * 1000, 3),
                    trip_at_ms=round(limit * 1000, 3) if baseline else 0.0,
                    samples=len(s.samples),
                    transitions=s.transitions,
                    history=tuple(s.history),
                    events=tuple(s.events),
                )
            )
        return out

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        return {
            v.route: {
                "state": "degraded" if v.degraded else "healthy",
                "since_s": v.since_s,
                "p95_ms": v.p95_ms,
                "baseline_ms": v.baseline_ms,
                "samples": v.samples,
                "transitions": v.transitions,
                # the last trip's slowest sampled traces
                "exemplars": list(
                    next((e.exemplars for e in reversed(v.events) if e.to == "degraded"), ())
                ),
            }
            for v in self.views(now)
        }


def carrying_clusters(
    model: ir.MeshModel, service: ir.Service, routes: Iterable[ir.Route]
) -> frozenset[str]:
    """The clusters a gateway sends `service`'s requests to, for `routes`: the service's own
    cluster, its per-locality tiers inside the fallback chain (Envoy's access log names the
    member cluster that served a request), their twins at a shedding gateway (one per Function)
    and, for a rolled-out Function's route, one twin per version."""
    own = primary_clusters(service.key)
    twins = {function_cluster_name(c, f) for c in own for f, _ in service.function_shed}
    for route in routes:
        rollout = model.rollout_of(f"{route.namespace}/{route.function}")
        if route.function and rollout is not None:
            twins |= {
                version_cluster_name(c, route.function, v)
                for c in own
                for v in (rollout.stable, rollout.candidate)
            }
    return own | twins


def watched_routes(model: ir.MeshModel) -> list[WatchedRoute]:
    """Gateway routes whose destination has a drift breaker, and the clusters that carry its
    primary (carrying_clusters)."""
    out = {}
    for workload in model.workloads:
        for listener in workload.listeners:
            for route in listener.routes:
                service = model.service(route.service)
                if service.drift is None:
                    continue
                out[route.key] = WatchedRoute(
                    route=route.key,
                    primary_clusters=carrying_clusters(model, service, (route,)),
                    settings=service.drift,
                    # a generative function's routes (streams: their idle timeout is set)
                    metric=service.drift.streams if route.idle_timeout else "duration",
                )
    return list(out.values())
