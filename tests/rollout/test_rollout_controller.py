"""The rollout controller's state machine on samples fed by hand, with its clocks in the test's
hands: steps pass only with enough answers, time and passing checks; a breach rolls back or
pauses at the next evaluation; no data times out into onBreach; people act; a restart resumes
at the saved step; the SLO checks judge early only when the answers so far are decisive."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from meshfn import ir
from meshfn.contracts.tracing import SPLIT_CLUSTER_METADATA, SPLIT_TRACE_METADATA
from meshfn.policy.loader import load_policies
from meshfn.rollout.checks import agreement, error_ratio, latency
from meshfn.rollout.controller import ActionError, Event, RolloutController
from meshfn.rollout.figures import Pair, Sample, Window
from meshfn.rollout.state import FileStore, MemoryStore, RolloutState
from meshfn.testing.policies import doc, documents, gateway, mesh, service

STABLE = "version|digits@1|models.default"
CANDIDATE = "version|digits@2|models.default"


def _model(tmp_path: Path, **rollout: object) -> ir.MeshModel:
    spec = {
        "function": "digits",
        "stable": "1",
        "candidate": "2",
        "interval": "1s",
        "canary": {"minRequests": 10, "minTime": "10s", "steps": [{"weight": 10}, {"weight": 50}]},
        "slo": {"minSamples": 10, "latency": [{"percentile": 95, "max": "50ms"}]},
        **rollout,
    }
    (tmp_path / "p.yaml").write_text(
        documents(
            mesh("m", "m.local"),
            gateway(None, 10000),
            service("models", 9101),
            doc("Function", "digits", {"backend": "models"}),
            doc("Rollout", "digits-v2", spec),
        )
    )
    return load_policies(tmp_path / "p.yaml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def wall(self) -> float:
        return self.now + 1_700_000_000

    def mono(self) -> float:
        return self.now


def _controller(store: MemoryStore | FileStore, clock: Clock) -> RolloutController:
    return RolloutController(store, clock=clock.wall, monotonic=clock.mono)


def _feed(
    c: RolloutController, clock: Clock, cluster: str, n: int, ms: float, failed: bool = False
) -> None:
    """`n` answers of one version arriving now (a moment after the last evaluation)."""
    clock.now += 0.001
    for _ in range(n):
        c.observe(cluster, ms / 1000, failed, clock.now)


def _evaluate(c: RolloutController, clock: Clock) -> list[Event]:
    """One evaluation a second from now."""
    clock.now += 1
    return c.evaluate()


def _tick(c: RolloutController, clock: Clock, seconds: float) -> list[str]:
    """Advance time in 1 s evaluations; the events that happened."""
    events = []
    for _ in range(int(seconds)):
        clock.now += 1
        events += [e.event for e in c.evaluate()]
    return events


def test_a_good_candidate_walks_every_step_then_is_promoted(tmp_path: Path) -> None:
    clock = Clock()
    c = _controller(MemoryStore(), clock)
    model = _model(tmp_path)
    assert [e.event for e in c.configure(model)] == ["started"]
    assert c.splits() == (ir.Split("default/digits-v2", 10, 0, True),)
    _feed(c, clock, STABLE, 90, 5)
    _feed(c, clock, CANDIDATE, 10, 5)
    assert _tick(c, clock, 5) == []  # checks pass, but minTime (10 s) has not
    assert _tick(c, clock, 6) == ["step"]
    assert c.splits() == (ir.Split("default/digits-v2", 50, 0, True),)
    assert _tick(c, clock, 12) == []  # no answers in the new step: it waits (no timeout yet)
    _feed(c, clock, STABLE, 20, 5)
    _feed(c, clock, CANDIDATE, 20, 6)
    assert _tick(c, clock, 1) == ["promoted"]
    assert c.splits() == (ir.Split("default/digits-v2", 100, 0, False),)
    (doc_,) = c.document()
    assert doc_["phase"] == "Promoted"
    assert [h["event"] for h in doc_["history"]] == ["started", "step", "promoted"]
    assert _tick(c, clock, 3) == []  # ended: nothing more


def test_a_failing_candidate_is_rolled_back_at_the_next_evaluation(tmp_path: Path) -> None:
    clock = Clock()
    c = _controller(MemoryStore(), clock)
    c.configure(_model(tmp_path))
    _feed(c, clock, STABLE, 50, 5)
    _feed(c, clock, CANDIDATE, 1, 5, failed=True)  # 1 failure / at least 10 answers > 1%
    events = _evaluate(c, clock)
    assert [e.event for e in events] == ["rolled-back"]
    assert "error ratio" in events[0].reason
    assert c.splits() == (ir.Split("default/digits-v2", 0, 0, False),)
    assert events[0].audit_record()["action"] == "rolled-back"


def test_a_slow_candidate_breaches_once_enough_answers_are_slow(tmp_path: Path) -> None:
    clock = Clock()
    c = _controller(MemoryStore(), clock)
    c.configure(
        _model(tmp_path, onBreach="pause",
               slo={"minSamples": 20, "latency": [{"percentile": 95, "max": "50ms"}]})
    )  # fmt: skip
    _feed(c, clock, STABLE, 50, 5)
    _feed(c, clock, CANDIDATE, 1, 80)  # one slow answer: a p95 over 20 could still pass
    assert _tick(c, clock, 1) == []
    _feed(c, clock, CANDIDATE, 1, 80)  # two: the p95 over 20 (the 19th) is over the limit
    assert _tick(c, clock, 1) == ["paused"]
    assert c.splits() == (ir.Split("default/digits-v2", 10, 0, True),)  # held as it was
    with pytest.raises(ActionError) as info:
        c.act("digits-v2", "pause", "ops")
    assert info.value.status == 409
    assert c.act("digits-v2", "resume", "ops").event == "resumed"
    assert c.act("default/digits-v2", "abort", "ops").by == "ops"
    assert c.splits() == (ir.Split("default/digits-v2", 0, 0, False),)
    with pytest.raises(ActionError) as info:
        c.act("nope", "promote", "ops")
    assert info.value.status == 404 and "default/digits-v2" in str(info.value)


def test_no_data_never_promotes_and_times_out_into_on_breach(tmp_path: Path) -> None:
    clock = Clock()
    c = _controller(MemoryStore(), clock)
    c.configure(_model(tmp_path, noDataTimeout="20s"))
    _feed(c, clock, STABLE, 50, 5)
    assert _tick(c, clock, 29) == []  # minTime 10 s + noDataTimeout 20 s
    events = _evaluate(c, clock)
    assert [e.event for e in events] == ["rolled-back"]
    assert events[0].reason.startswith("breach: no data: 0 candidate answers")


def test_a_restart_resumes_at_the_saved_step(tmp_path: Path) -> None:
    clock = Clock()
    store = FileStore(tmp_path / "rollouts")
    model = _model(tmp_path)
    c = _controller(store, clock)
    c.configure(model)
    _feed(c, clock, STABLE, 90, 5)
    _feed(c, clock, CANDIDATE, 10, 5)
    assert _tick(c, clock, 11) == ["step"]
    clock.now += 4
    fresh = _controller(store, clock)  # a new process: nothing in memory
    assert fresh.positions(model) == (ir.Split("default/digits-v2", 50, 0, True),)
    assert fresh.configure(model) == []  # resumed, not started again
    (doc_,) = fresh.document()
    assert doc_["step"] == 2 and doc_["step_elapsed_s"] == pytest.approx(4, abs=1.1)
    # a changed candidate is another rollout: it starts over
    other = _model(tmp_path, candidate="3")
    assert fresh.positions(other) == (ir.Split("default/digits-v2", 10, 0, True),)
    assert [e.event for e in fresh.configure(other)] == ["started"]
    # removed from the policies: its state goes too
    fresh.configure(load_policies(_without_rollout(tmp_path)))
    assert not list((tmp_path / "rollouts").rglob("*.json"))


def _without_rollout(tmp_path: Path) -> Path:
    text = (tmp_path / "p.yaml").read_text()
    (tmp_path / "q.yaml").write_text(text.rsplit("---\n", 1)[0])
    return tmp_path / "q.yaml"


def test_a_shadow_step_judges_the_backends_comparisons(tmp_path: Path) -> None:
    clock = Clock()
    c = _controller(MemoryStore(), clock)
    c.configure(
        _model(tmp_path, shadow={"percent": 50, "minRequests": 10, "minTime": "1s"},
               slo={"minSamples": 10, "agreement": {"minRatio": 0.95}})
    )  # fmt: skip
    assert c.splits() == (ir.Split("default/digits-v2", 0, 50, True),)
    assert c.shadowing() == [("default/digits", "2")]
    clock.now += 0.001
    pairs = [Pair(clock.now, 0.002, 0.002, "agree") for _ in range(9)]
    c.observe_shadow("default/digits", "2", [*pairs, Pair(clock.now, 0.002, 0.002, "disagree")])
    events = _evaluate(c, clock)
    assert [e.event for e in events] == ["rolled-back"]  # 1 in 10 disagree: under 95%
    assert "agreement" in events[0].reason
    assert c.splits()[0].weight == 0  # it never took a real request


def test_stored_states_that_are_not_states_are_ignored(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "x.json").write_text('{"rollout": "default/x", "phase": "Exploded"}')
    assert store.load("default/x") is None
    (tmp_path / "default" / "x.json").write_text("not json")
    assert store.load("default/x") is None
    assert RolloutState.from_json([1, 2]) is None


# ------------------------------------------------------------------ the checks on their own

SLO = ir.RolloutSlo(0.01, 0.005, (), None, 0.0, 20)


def _samples(n: int, ms: float = 5, failed: int = 0) -> tuple[Sample, ...]:
    return tuple(Sample(0, ms / 1000, i < failed) for i in range(n))


def test_error_ratio_is_decisive_early_and_pending_without_data() -> None:
    assert error_ratio(Window(_samples(100), ()), SLO).verdict == "pending"
    assert error_ratio(Window(_samples(100), _samples(5)), SLO).verdict == "pending"
    assert error_ratio(Window(_samples(100), _samples(5, failed=1)), SLO).verdict == "breach"
    assert error_ratio(Window(_samples(100), _samples(200, failed=1)), SLO).verdict == "pass"
    # relative: stable fails 0.5%, so the candidate may fail 1% (min of 1% and 0.5% + 0.5%)
    stable = _samples(200, failed=1)
    result = error_ratio(Window(stable, _samples(200, failed=3)), SLO)
    assert result.verdict == "breach" and result.limit == pytest.approx(0.01)


def test_latency_absolute_and_relative() -> None:
    absolute = ir.LatencyCheck(95, max=timedelta(milliseconds=10))
    slow = Window(_samples(50), (*_samples(19), *_samples(1, ms=30)))
    assert latency(slow, absolute, 20).verdict == "pass"  # 1 of 20 over: p95 is the 19th
    slower = Window(_samples(50), (*_samples(8), *_samples(2, ms=30)))
    assert latency(slower, absolute, 20).verdict == "breach"  # 2 over: the 19th of 20 is
    relative = ir.LatencyCheck(99, max_ratio=1.5, min_increase=timedelta(milliseconds=5))
    result = latency(Window(_samples(50, ms=4), _samples(20, ms=8)), relative, 20)
    assert result.limit == pytest.approx(9) and result.verdict == "pass"  # 4 ms + 5 ms floor
    assert latency(Window((), _samples(20, ms=8)), relative, 20).verdict == "pending"


def test_agreement() -> None:
    assert agreement(Window((), (), agree=19, disagree=1), 0.95, 20).verdict == "pass"
    assert agreement(Window((), (), agree=5, disagree=2), 0.95, 20).verdict == "breach"
    assert agreement(Window((), (), agree=5), 0.95, 20).verdict == "pending"


def test_the_gateways_access_log_counts_inferences_by_version(tmp_path: Path) -> None:
    from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

    clock = Clock()
    c = _controller(MemoryStore(), clock)
    c.configure(_model(tmp_path))

    def entry(cluster: str, path: str, status: int) -> HTTPAccessLogEntry:
        out = HTTPAccessLogEntry()
        out.common_properties.upstream_cluster = cluster
        out.common_properties.duration.FromMilliseconds(3)
        out.request.path = path
        out.response.response_code.value = status
        return out

    clock.now += 0.5
    c.observe_access_log(entry(CANDIDATE, "/v2/models/digits/infer", 503), clock.now)
    c.observe_access_log(entry(CANDIDATE, "/v2/models/digits/ready", 503), clock.now)  # no answer
    c.observe_access_log(entry("other.default", "/v2/models/x/infer", 500), clock.now)
    c.observe_access_log(entry(STABLE, "/v2/models/digits/infer?x=1", 200), clock.now)
    # a split gateway's sampled request that its internal listener shed: no version answered
    shed = entry("meshfn-traced-http", "/v2/models/digits/infer", 503)
    for (namespace, key), value in (
        (SPLIT_TRACE_METADATA, "ab" * 16),
        (SPLIT_CLUSTER_METADATA, STABLE),
    ):
        shed.common_properties.metadata.filter_metadata[namespace].update({key: value})
    c.observe_access_log(shed, clock.now)
    (event,) = _evaluate(c, clock)
    assert event.event == "rolled-back"
    assert "1 answers" in event.reason and "stable 0.00%" in event.reason


def test_the_drift_breaker_watches_the_versions_twins_too() -> None:
    """A rolled-out Function's requests go through its versions' twins of the primary's
    clusters: the drift breaker counts them as the primary's."""
    from meshfn.health.drift import watched_routes

    golden = Path(__file__).resolve().parents[1] / "golden" / "rollout-chain" / "in.yaml"
    model = load_policies(golden)
    watched = {w.route: w.primary_clusters for w in watched_routes(model)}
    clusters = watched["default/function-iris"]
    assert {
        "models.default",
        "version|iris@2|models.default",
        "version|iris@3|models.default|p0",
    } <= clusters
    assert not any("models-lite" in c for c in clusters)  # the chain's tail is no primary
