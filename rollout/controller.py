"""The rollout controller: per Rollout, a state machine driven by its SLO checks and by people.

    Progressing (step i) --checks pass, minTime and minRequests met--> step i+1 ... --> Promoted
    Progressing --breach, onBreach rollback--> RolledBack       (every request to stable)
    Progressing --breach, onBreach pause-----> Paused           (the split held as it is)
    Progressing --no data for noDataTimeout after minTime--> as a breach
    Paused --resume--> Progressing (the step starts over); any --promote--> Promoted;
    Progressing/Paused/Promoted --abort--> Aborted (every request to stable)

Every transition is an Event (the compositions turn them into audit records, Kubernetes Events
and status conditions), is logged in the rollout's history and is saved (state.py) before the
composition pushes the new split. The controller itself does no IO but through its Store: the
compositions feed it the gateways' access-log entries and the backends' shadow comparisons,
call `evaluate` on a timer, and push `splits()` when it changed.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from meshfn import ir
from meshfn.contracts.tracing import split_unanswered, split_upstream_cluster
from meshfn.xds.names import cluster_name, version_cluster_name

from .checks import CheckResult, judge
from .figures import Figures, Pair, Sample, Window, count_since
from .state import HistoryEntry, Phase, RolloutState, Store, identity

if TYPE_CHECKING:
    from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

log = logging.getLogger("meshfn.rollout")

Role = Literal["stable", "candidate"]
Action = Literal["promote", "abort", "pause", "resume"]
ACTIONS: tuple[Action, ...] = ("promote", "abort", "pause", "resume")
KEEP_STABLE = 2000  # the stable version's last answers kept past the window (see _window)


class ActionError(Exception):
    """A manual action that cannot be taken: `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Event:
    """One transition of a rollout (or a manual action), for audit records and Events."""

    rollout: str
    function: str
    stable: str
    candidate: str
    event: str
    phase: Phase
    step: int  # index into the rollout's steps
    steps: int
    weight: int
    mirror: int
    reason: str
    by: str
    at: float  # wall clock

    @property
    def warning(self) -> bool:
        return self.event in ("rolled-back", "paused", "aborted", "breach")

    def describe(self) -> str:
        where = f"step {self.step + 1}/{self.steps}, candidate {self.weight}%"
        if self.mirror:
            where += f", mirror {self.mirror}%"
        return f"{self.event}: {where}: {self.reason}" if self.reason else f"{self.event}: {where}"

    def audit_record(self) -> dict[str, Any]:
        """The audit trail's record of it (the control chain: meshfn.audit.store)."""
        return {
            "v": 2,
            "event": "rollout",
            "time": dt.datetime.fromtimestamp(self.at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "rollout": self.rollout,
            "function": self.function,
            "stable": self.stable,
            "candidate": self.candidate,
            "action": self.event,
            "phase": self.phase,
            "step": self.step + 1,
            "steps": self.steps,
            "weight": self.weight,
            "mirror": self.mirror,
            "reason": self.reason,
            "by": self.by,
        }


def xds_clusters(model: ir.MeshModel, rollout: ir.Rollout) -> tuple[str, str]:
    """The clusters meshfn's gateways send each version's requests through (stable, candidate)."""
    function = model.function(rollout.function)
    assert function is not None
    base = cluster_name(function.backend)
    return (
        version_cluster_name(base, function.name, rollout.stable),
        version_cluster_name(base, function.name, rollout.candidate),
    )


Clusters = Callable[[ir.MeshModel, ir.Rollout], tuple[str, str]]


@dataclass
class _Tracked:
    rollout: ir.Rollout
    state: RolloutState
    clusters: tuple[str, str]
    figures: Figures = field(default_factory=Figures)
    next_at: float = 0.0  # monotonic: the next evaluation
    counted_until: float = 0.0  # monotonic: answers up to here are in state.requests


class RolloutController:
    def __init__(
        self,
        store: Store,
        clusters: Clusters = xds_clusters,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.clusters_of = clusters
        self.clock = clock
        self.monotonic = monotonic
        self._tracked: dict[str, _Tracked] = {}
        self._by_cluster: dict[str, tuple[_Tracked, Role]] = {}

    # ------------------------------------------------------------ configuration

    def positions(self, model: ir.MeshModel) -> tuple[ir.Split, ...]:
        """The split of every rollout of `model` as it would be after `configure(model)`:
        where a known rollout is (saved or tracked), the first step for a new one. Reads only,
        so a reload can translate with it before it commits to the model."""
        out = []
        for rollout in model.rollouts:
            tracked = self._tracked.get(rollout.key)
            state = tracked.state if tracked is not None else self.store.load(rollout.key)
            if state is None or state.identity != identity(rollout):
                out.append(rollout.initial())
            else:
                out.append(state.split())
        return tuple(sorted(out, key=lambda s: s.rollout))

    def configure(self, model: ir.MeshModel) -> list[Event]:
        """Follow the rollouts of a new MeshModel: resume each where its saved state says
        (a changed Function, version or steps starts it over), start new ones at their first
        step, forget removed ones (and their saved state)."""
        events: list[Event] = []
        wanted = {r.key: r for r in model.rollouts}
        for key in list(self._tracked):
            if key not in wanted:
                del self._tracked[key]
                self.store.remove(key)
                log.info("rollout %s removed from the policies", key)
        for key, rollout in wanted.items():
            tracked = self._tracked.get(key)
            clusters = self.clusters_of(model, rollout)
            if tracked is not None and tracked.state.identity == identity(rollout):
                tracked.rollout, tracked.clusters = rollout, clusters
                continue
            state = self.store.load(key)
            now = self.monotonic()
            if state is None or state.identity != identity(rollout):
                state = self._start(rollout)
                events.append(self._event(rollout, state, "started", state.reason, "controller"))
                self.store.save(state)
            else:
                log.info("rollout %s resumes: %s at step %d", key, state.phase, state.step + 1)
            self._tracked[key] = _Tracked(rollout, state, clusters, counted_until=now)
        roles: tuple[Role, Role] = ("stable", "candidate")
        self._by_cluster = {
            name: (t, role)
            for t in self._tracked.values()
            for name, role in zip(t.clusters, roles, strict=True)
        }
        return events

    def _start(self, rollout: ir.Rollout) -> RolloutState:
        now = self.clock()
        split = rollout.initial()
        state = RolloutState(
            rollout=rollout.key,
            identity=identity(rollout),
            phase="Progressing",
            step=0,
            weight=split.weight,
            mirror=split.mirror,
            pinned=True,
            step_started=now,
            started=now,
            reason=f"{rollout.candidate} takes over from {rollout.stable}",
        )
        state.log(HistoryEntry(now, "started", 0, split.weight, split.mirror, state.reason))
        return state

    def restart_step(self, key: str) -> None:
        """The rollout's current step starts over now with a fresh window: what came before
        (a backend restarting to serve the candidate) is not the candidate's doing."""
        tracked = self._tracked.get(key)
        if tracked is None or tracked.state.ended:
            return
        tracked.state.step_started, tracked.state.requests = self.clock(), 0
        tracked.counted_until = self.monotonic()
        tracked.figures.clear()
        self.store.save(tracked.state)

    def splits(self) -> tuple[ir.Split, ...]:
        return tuple(
            sorted((t.state.split() for t in self._tracked.values()), key=lambda s: s.rollout)
        )

    def shadowing(self) -> list[tuple[str, str]]:
        """(Function key, candidate) of every rollout on a shadow step now."""
        return [
            (t.rollout.function, t.rollout.candidate)
            for t in self._tracked.values()
            if t.state.mirror and not t.state.ended
        ]

    # ------------------------------------------------------------ figures

    def observe(self, cluster: str, seconds: float, failed: bool, now: float) -> None:
        found = self._by_cluster.get(cluster)
        if found is not None:
            tracked, role = found
            tracked.figures.add(role, Sample(now, seconds, failed))

    def observe_access_log(self, entry: HTTPAccessLogEntry, now: float) -> None:
        """One gateway access-log entry (the drift breaker's stream): its upstream cluster names
        the version; a 5xx (Envoy's own for a reset or timeout too) is a failure. Only
        inferences count: a metadata or readiness call is no answer of the model's."""
        common = entry.common_properties
        if split_unanswered(common.metadata.filter_metadata):  # no answer of any version's
            return
        cluster = split_upstream_cluster(common.metadata.filter_metadata, common.upstream_cluster)
        if cluster not in self._by_cluster:
            return
        if not entry.request.path.split("?", 1)[0].endswith("/infer"):
            return
        timing = common.time_to_last_downstream_tx_byte
        if not common.HasField("time_to_last_downstream_tx_byte"):
            timing = common.duration
        status = entry.response.response_code.value
        failed = status >= 500 or status == 0
        self.observe(cluster, timing.ToNanoseconds() / 1e9, failed, now)

    def observe_shadow(self, function: str, candidate: str, pairs: Iterable[Pair]) -> None:
        """Shadow comparisons a backend made for `function`'s `candidate` (times: monotonic)."""
        for tracked in self._tracked.values():
            if tracked.rollout.function == function and tracked.rollout.candidate == candidate:
                tracked.figures.add_pairs(pairs)

    # ------------------------------------------------------------ evaluation

    def next_due(self) -> float | None:
        """When the next evaluation is due (monotonic), None when no rollout runs."""
        due = [t.next_at for t in self._tracked.values() if not t.state.ended]
        return min(due) if due else None

    def evaluate(self, now: float | None = None) -> list[Event]:
        """Judge every rollout whose interval has come: advance, promote, roll back or pause.
        Saved before the caller pushes the new splits."""
        now = self.monotonic() if now is None else now
        events = []
        for tracked in self._tracked.values():
            if tracked.state.ended or now < tracked.next_at:
                continue
            tracked.next_at = now + tracked.rollout.interval.total_seconds()
            event = self._evaluate(tracked, now)
            self._prune(tracked, now)
            self.store.save(tracked.state)
            if event is not None:
                events.append(event)
        return events

    def _window(self, tracked: _Tracked, now: float, shadow: bool) -> Window:
        """The step's samples over its most recent `window`; where the stable version took
        too few answers there (the candidate takes every request), its most recent ones."""
        state, rollout = tracked.state, tracked.rollout
        step_start = now - max(0.0, self.clock() - state.step_started)
        since = max(step_start, now - rollout.window.total_seconds())
        if shadow:
            return Window.of_pairs(tracked.figures, since)
        window = Window.of_answers(tracked.figures, since)
        need = rollout.slo.min_samples
        if len(window.stable) < need and len(tracked.figures.stable) > len(window.stable):
            recent = tuple(tracked.figures.stable)[-need:]
            window = Window(recent, window.candidate)
        return window

    def _evaluate(self, tracked: _Tracked, now: float) -> Event | None:
        state, rollout = tracked.state, tracked.rollout
        step = rollout.steps[state.step]
        shadow = step.kind == "shadow"
        state.requests += count_since(tracked.figures, shadow, tracked.counted_until)
        tracked.counted_until = now
        checks = judge(self._window(tracked, now, shadow), rollout.slo, shadow)
        state.checks = [c.as_json() for c in checks]
        if state.phase != "Progressing":
            return None  # paused: the checks are shown, a person decides
        breached = [c for c in checks if c.verdict == "breach"]
        if breached:
            return self._breach(tracked, "; ".join(c.describe() for c in breached), now)
        elapsed = self.clock() - state.step_started
        ready = state.requests >= step.min_requests and all(c.verdict == "pass" for c in checks)
        if ready and elapsed >= step.min_time.total_seconds():
            return self._advance(tracked, checks, now)
        timeout = (step.min_time + rollout.no_data_timeout).total_seconds()
        if not ready and elapsed >= timeout:
            return self._breach(tracked, self._no_data(step, state, checks, elapsed), now)
        return None

    @staticmethod
    def _no_data(
        step: ir.RolloutStep, state: RolloutState, checks: tuple[CheckResult, ...], elapsed: float
    ) -> str:
        pending = [c.name for c in checks if c.verdict == "pending"]
        what = "comparisons" if step.kind == "shadow" else "candidate answers"
        text = f"no data: {state.requests} {what} in {elapsed:.0f} s (needs {step.min_requests})"
        return text + (f"; not judged yet: {', '.join(pending)}" if pending else "")

    def _breach(self, tracked: _Tracked, reason: str, now: float) -> Event:
        rollout, state = tracked.rollout, tracked.state
        if rollout.on_breach == "pause":
            self._move(tracked, "Paused", state.step, state.split(), now)
            return self._transition(tracked, "paused", f"breach: {reason}", "controller")
        self._move(tracked, "RolledBack", state.step, ir.Split(rollout.key, 0, 0, False), now)
        return self._transition(tracked, "rolled-back", f"breach: {reason}", "controller")

    def _advance(self, tracked: _Tracked, checks: tuple[CheckResult, ...], now: float) -> Event:
        rollout, state = tracked.rollout, tracked.state
        passed = f"step {state.step + 1} passed ({state.requests} answers)"
        if state.step + 1 >= len(rollout.steps):
            self._move(tracked, "Promoted", state.step, ir.Split(rollout.key, 100, 0, False), now)
            return self._transition(tracked, "promoted", passed, "controller")
        nxt = state.step + 1
        self._move(tracked, "Progressing", nxt, ir.Split.at_step(rollout, nxt), now)
        return self._transition(tracked, "step", passed, "controller")

    def _move(
        self, tracked: _Tracked, phase: Phase, step: int, split: ir.Split, now: float
    ) -> None:
        state = tracked.state
        if step != state.step or phase != state.phase:
            state.step_started = self.clock()
            state.requests = 0
            tracked.counted_until = now
        state.phase, state.step = phase, step
        state.weight, state.mirror, state.pinned = split.weight, split.mirror, split.pinned

    def _transition(self, tracked: _Tracked, event: str, reason: str, by: str) -> Event:
        state = tracked.state
        state.reason = reason
        state.log(
            HistoryEntry(self.clock(), event, state.step, state.weight, state.mirror, reason, by)
        )
        out = self._event(tracked.rollout, state, event, reason, by)
        logger = log.warning if out.warning else log.info
        logger("rollout %s %s", tracked.rollout.key, out.describe())
        return out

    def _event(
        self, rollout: ir.Rollout, state: RolloutState, event: str, reason: str, by: str
    ) -> Event:
        return Event(
            rollout.key,
            rollout.function,
            rollout.stable,
            rollout.candidate,
            event,
            state.phase,
            state.step,
            len(rollout.steps),
            state.weight,
            state.mirror,
            reason,
            by,
            self.clock(),
        )

    def _prune(self, tracked: _Tracked, now: float) -> None:
        rollout = tracked.rollout
        longest = max(s.min_time for s in rollout.steps) + rollout.no_data_timeout
        horizon = now - max(rollout.window, longest).total_seconds()
        keep = list(tracked.figures.stable)[-KEEP_STABLE:]
        tracked.figures.prune(horizon)
        if len(tracked.figures.stable) < len(keep):
            tracked.figures.stable.clear()
            tracked.figures.stable.extend(keep)

    # ------------------------------------------------------------ people

    def find(self, name: str) -> str:
        """The key of the rollout `name` ("namespace/name", or a name unique across
        namespaces); ActionError 404 naming the known ones otherwise."""
        if name in self._tracked:
            return name
        matches = [k for k in self._tracked if k.split("/", 1)[1] == name]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(sorted(self._tracked)) or "none"
        if matches:
            raise ActionError(404, f"rollout {name!r} is ambiguous: give namespace/name ({known})")
        raise ActionError(404, f"no rollout {name!r} (rollouts: {known})")

    def act(self, name: str, action: str, by: str) -> Event:
        """A person's promote, abort, pause or resume; saved at once (the caller pushes)."""
        tracked = self._tracked[self.find(name)]
        state, rollout = tracked.state, tracked.rollout
        now = self.monotonic()
        allowed: dict[str, tuple[Phase, ...]] = {
            "pause": ("Progressing",),
            "resume": ("Paused",),
            "promote": ("Progressing", "Paused", "RolledBack", "Aborted"),
            "abort": ("Progressing", "Paused", "Promoted"),
        }
        if action not in allowed:
            raise ActionError(400, f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
        if state.phase not in allowed[action]:
            raise ActionError(
                409, f"rollout {rollout.key} is {state.phase}: it cannot be {action}d now"
            )
        if action == "pause":
            self._move(tracked, "Paused", state.step, state.split(), now)
        elif action == "resume":
            state.phase = "Progressing"  # the step starts over: a fresh window and count
            state.step_started, state.requests, tracked.counted_until = self.clock(), 0, now
            tracked.figures.clear()
        elif action == "promote":
            self._move(tracked, "Promoted", state.step, ir.Split(rollout.key, 100, 0, False), now)
        else:
            self._move(tracked, "Aborted", state.step, ir.Split(rollout.key, 0, 0, False), now)
        tracked.next_at = now + rollout.interval.total_seconds()
        past = {"pause": "paused", "resume": "resumed", "promote": "promoted", "abort": "aborted"}
        event = self._transition(tracked, past[action], f"{action} by {by}", by)
        self.store.save(state)
        return event

    # ------------------------------------------------------------ reading

    def document(self, now: float | None = None) -> list[dict[str, Any]]:
        """Every rollout as plain data: the CLI, the console and /debug/status read this."""
        now = self.monotonic() if now is None else now
        return [self._document(t, now) for _, t in sorted(self._tracked.items())]

    def _document(self, tracked: _Tracked, now: float) -> dict[str, Any]:
        rollout, state = tracked.rollout, tracked.state
        step = rollout.steps[state.step]
        return {
            "rollout": rollout.key,
            "function": rollout.function,
            "stable": rollout.stable,
            "candidate": rollout.candidate,
            "phase": state.phase,
            "step": state.step + 1,
            "steps": [
                {
                    "kind": s.kind,
                    "percent": s.percent,
                    "min_requests": s.min_requests,
                    "min_time_s": s.min_time.total_seconds(),
                }
                for s in rollout.steps
            ],
            "step_kind": step.kind,
            "weight": state.weight,
            "mirror": state.mirror,
            "pinned": state.pinned,
            "pinning": _pinning(rollout.pinning),
            "requests": state.requests,
            "min_requests": step.min_requests,
            "step_elapsed_s": round(max(0.0, self.clock() - state.step_started), 1),
            "min_time_s": step.min_time.total_seconds(),
            "interval_s": rollout.interval.total_seconds(),
            "next_evaluation_s": None if state.ended else round(max(0.0, tracked.next_at - now), 1),
            "on_breach": rollout.on_breach,
            "reason": state.reason,
            "checks": state.checks,
            "history": [vars(h) for h in state.history],
            "started": state.started,
        }


def _pinning(pinning: ir.Pinning | None) -> dict[str, Any] | None:
    if pinning is None:
        return None
    return {
        "claim": pinning.claim,
        "stable": list(pinning.stable),
        "candidate": list(pinning.candidate),
    }
