"""Topology fallback: policy validation, chain flattening, EDS priorities, and the drift
breaker's state machine on a controlled clock."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from datetime import timedelta
from pathlib import Path

import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

from meshfn import ir
from meshfn.health import drift
from meshfn.health.drift import DriftBreaker, WatchedRoute
from meshfn.policy import PolicyErrors, load_policies
from meshfn.testing.policies import DRIFT, documents, gateway, mesh
from meshfn.xds.translate.endpoints import priority

BASE = documents(mesh("t", "t.local"), gateway(19000, 10000, locality={"region": "eu"}))


def service(name: str, port: int, region: str | None = "eu") -> str:
    locality = f", locality: {{region: {region}}}" if region else ""
    return (
        f"---\napiVersion: meshfn.io/v1alpha1\nkind: Service\nmetadata: {{name: {name}}}\n"
        f"spec: {{port: {port}, endpoints: [{{address: 10.0.0.{port % 250}{locality}}}]}}\n"
    )


def fallback(spec: str, name: str = "fb") -> str:
    return f"---\napiVersion: meshfn.io/v1alpha1\nkind: FallbackPolicy\nmetadata: {{name: {name}}}\nspec:\n{spec}"


SERVICES = service("a", 8001) + service("b", 8002) + service("c", 8003) + service("d", 8004, None)


def load(tmp_path: Path, extra: str) -> ir.MeshModel:
    (tmp_path / "p.yaml").write_text(BASE + SERVICES + extra)
    return load_policies(tmp_path)


CASES = [
    ("  service: a\n  chain: [a]\n", "spec", "contains the primary service 'a' itself"),
    ("  service: a\n  chain: [b, b]\n", "spec", "names a service twice"),
    ("  service: a\n  chain: [zz]\n", "spec.chain[0]", "unknown Service default/zz"),
    ("  service: zz\n", "spec.service", "unknown Service default/zz"),
    (
        "  service: a\n  maxFallbackDepth: 0\n  chain: [b]\n",
        "spec.maxFallbackDepth",
        "greater than or equal to 1",
    ),
    ("  service: a\n  locality: {}\n", "spec", "needs outlierDetection or healthCheck"),
    (
        "  service: d\n  locality: {}\n  outlierDetection: {}\n",
        "spec.locality",
        "no endpoint of Service default/d declares a locality",
    ),
    (
        "  service: a\n  locality: {failover: [{from: eu, to: mars}]}\n  outlierDetection: {}\n",
        "spec.locality.failover[0].to",
        "no endpoint of Service default/a is in region 'mars'",
    ),
    (
        "  service: a\n  outlierDetection: {consecutive5xxErrors: 0}\n",
        "spec.outlierDetection",
        "set consecutive5xxErrors or consecutiveGatewayErrors",
    ),
    (
        "  service: a\n  outlierDetection: {maxEjectionPercent: 101}\n",
        "spec.outlierDetection.maxEjectionPercent",
        "less than or equal to 100",
    ),
    ("  service: a\n  retryBudget: {percent: 0}\n", "spec.retryBudget.percent", "greater than 0"),
    ("  service: a\n  driftBreaker: {}\n", "spec", "driftBreaker needs a chain"),
    (
        "  service: a\n  chain: [b]\n  driftBreaker: {threshold: -5}\n",
        "spec.driftBreaker.threshold",
        "greater than 0",
    ),
    (
        "  service: a\n  chain: [b]\n  driftBreaker: {window: 10s, baselineWindow: 5s}\n",
        "spec.driftBreaker",
        "baselineWindow must not be shorter",
    ),
    (
        "  service: a\n  chain: [b]\n  driftBreaker: {minSamples: 1}\n",
        "spec.driftBreaker.minSamples",
        "greater than or equal to 5",
    ),
    ("  service: a\n  healthCheck: {interval: 0s}\n", "spec.healthCheck", "must be positive"),
]


@pytest.mark.parametrize(("spec", "path", "fragment"), CASES)
def test_fallback_policy_errors(tmp_path: Path, spec: str, path: str, fragment: str) -> None:
    with pytest.raises(PolicyErrors) as caught:
        load(tmp_path, fallback(spec))
    found = [e for e in caught.value.errors if e.path == path and fragment in e.message]
    assert found, f"no {path}: {fragment!r} in {[str(e) for e in caught.value.errors]}"
    assert found[0].line > 0


def test_cycles_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyErrors) as caught:
        load(
            tmp_path,
            fallback("  service: a\n  chain: [b]\n")
            + fallback("  service: b\n  chain: [a]\n", "fb2"),
        )
    (error,) = caught.value.errors
    assert error.path == "spec.chain"
    assert "fallback chains form a cycle: default/a -> default/b -> default/a" in error.message


def test_a_second_policy_for_one_service(tmp_path: Path) -> None:
    with pytest.raises(PolicyErrors, match="a second FallbackPolicy for Service default/a"):
        load(tmp_path, fallback("  service: a\n") + fallback("  service: a\n", "fb2"))


def test_chains_flatten_depth_first_within_the_depth(tmp_path: Path) -> None:
    model = load(
        tmp_path,
        fallback("  service: a\n  chain: [b, d]\n  maxFallbackDepth: 2\n")
        + fallback("  service: b\n  chain: [c]\n", "fb2"),
    )
    assert model.service("default/a").fallback == ("default/b", "default/c")
    assert model.service("default/b").fallback == ("default/c",)
    assert model.service("default/c").fallback == ()


def test_priorities_by_proximity() -> None:
    proxy = ir.Locality("eu", "eu-1", "n1")
    failover = (("eu", "us"),)
    assert priority(ir.Locality("eu", "eu-1", "n1"), proxy, failover) == 0
    assert priority(ir.Locality("eu", "eu-1", "n2"), proxy, failover) == 1
    assert priority(ir.Locality("eu", "eu-2"), proxy, failover) == 2
    assert priority(ir.Locality("us", "us-1"), proxy, failover) == 3
    assert priority(ir.Locality("ap", "ap-1"), proxy, failover) == 4
    assert priority(ir.Locality(), ir.Locality(), ()) == 4


def breaker(settings: ir.Drift = DRIFT) -> DriftBreaker:
    b = DriftBreaker()
    b.configure(
        [
            WatchedRoute(
                "default/r", frozenset({"a.default", "fallback|a.default>b.default"}), settings
            )
        ]
    )
    return b


def feed(
    b: DriftBreaker,
    start: float,
    end: float,
    latency: float,
    rate: int = 100,
    cluster: str = "a.default",
) -> None:
    steps = int((end - start) * rate)
    for i in range(steps):
        b.observe("default/r/0", cluster, latency, start + i / rate)


@pytest.mark.parametrize("refusal", ["upstream_overflow", "rate_limited", "unauthorized_details"])
def test_requests_that_reached_no_upstream_are_not_latency_samples(refusal: str) -> None:
    """A shedding gateway's refusal (Envoy's UO), a rate limit's (RL, which Envoy logs with its
    route's cluster: measured) or a denial is answered at once: counting those would pull the
    p95 down and hide a slow backend. Only requests sent on an upstream connection are samples
    (an overflow has an upstream host but no connection: measured)."""
    b = breaker()
    for i, refused in enumerate([False, True, True, False]):
        entry = HTTPAccessLogEntry()
        common = entry.common_properties
        common.route_name, common.upstream_cluster = "default/r/0", "a.default"
        common.time_to_last_downstream_tx_byte.FromMilliseconds(1 if refused else 100)
        if refused:
            flag = getattr(common.response_flags, refusal)
            if isinstance(flag, bool):
                setattr(common.response_flags, refusal, True)
            else:
                flag.reason = 1  # UAEX: ext_authz denied
            common.upstream_remote_address.socket_address.address = "127.0.0.1"
        else:
            common.upstream_local_address.socket_address.address = "127.0.0.1"
        b.observe_access_log(entry, 1.0 + i)
    assert [v for _, v in b._routes["default/r"].samples] == [0.1, 0.1]


def test_trips_on_drift_and_recovers_with_hysteresis() -> None:
    b = breaker()
    feed(b, 0, 10, 0.100)
    assert b.evaluate(10) == [] and b.degraded() == frozenset()
    feed(b, 10, 11, 0.130)  # +30%: within the 40% threshold
    assert b.evaluate(11) == []
    feed(b, 11, 12, 0.200)  # +100%
    (trip,) = b.evaluate(12)
    # The +30% second is part of the baseline now, and it is what its p95 sees.
    assert trip.to == "degraded" and round(trip.baseline_ms) == 130
    assert b.degraded() == {"default/r"}
    # The probe share of traffic still reaches the primary; while it is slow, no recovery.
    feed(b, 12, 14, 0.200, rate=5)
    assert b.evaluate(14) == []
    # Faster, but +27% is above half the threshold (20%): hysteresis holds the trip.
    feed(b, 14, 16, 0.165, rate=5)
    assert b.evaluate(16) == []
    feed(b, 16, 17, 0.105, rate=5)
    assert b.evaluate(17) == []  # healthy for 0 s so far
    feed(b, 17, 19.1, 0.105, rate=5)
    (recovery,) = b.evaluate(19.1)
    assert recovery.to == "healthy" and b.degraded() == frozenset()


def test_cold_start_baseline_and_minimum_samples() -> None:
    assert breaker().evaluate(0) == []
    quiet = breaker()
    feed(quiet, 0, 1, 5.0, rate=5)  # slow but too few samples to judge
    assert quiet.evaluate(1) == []
    cold = breaker(dataclasses.replace(DRIFT, cold_start_baseline=timedelta(milliseconds=50)))
    feed(cold, 0, 1, 0.100)
    (trip,) = cold.evaluate(1)  # no history yet: judged against the cold-start baseline
    assert round(trip.baseline_ms) == 50


def test_other_clusters_and_routes_are_ignored() -> None:
    b = breaker()
    feed(b, 0, 10, 0.100)
    feed(b, 10, 11, 0.900, cluster="b.default")  # the fallback being slow is not the primary
    b.observe("default/other/0", "a.default", 9.0, 10.5)
    assert b.evaluate(11) == []


def test_small_absolute_drift_is_noise() -> None:
    """At a 2 ms baseline a jump to 3 ms is +50% but below minIncrease: no trip."""
    b = breaker()
    feed(b, 0, 10, 0.002)
    feed(b, 10, 11, 0.003)
    assert b.evaluate(11) == []
    feed(b, 11, 12, 0.020)
    (trip,) = b.evaluate(12)
    assert trip.to == "degraded"


def test_a_fast_route_recovers_despite_probe_jitter() -> None:
    """minIncrease bounds recovery too: at a 2 ms baseline, probes back at 2-6 ms (+200% at
    worst, but within half of minIncrease) are healthy, and one slow probe in the recoverAfter
    span does not hold the trip; probes 8 ms above the baseline do."""
    b = breaker()
    feed(b, 0, 10, 0.002)
    feed(b, 10, 11, 0.150)
    (trip,) = b.evaluate(11)
    assert trip.to == "degraded"
    feed(b, 11, 14, 0.010, rate=10)  # +8 ms: above the recovery limit of 2 + 10 / 2 ms
    assert b.evaluate(12) == [] and b.evaluate(14) == [] and b.degraded() == {"default/r"}
    for i in range(40):  # near normal: every fourth probe at 6 ms, one at 50 ms
        slow = 0.050 if i == 7 else 0.006 if i % 4 == 0 else 0.002
        b.observe("default/r/0/degraded", "a.default", slow, 14 + i / 10)
    assert b.evaluate(15) == []  # the last 2 s still hold 8 ms probes
    (recovery,) = b.evaluate(16)
    assert recovery.to == "healthy" and b.degraded() == frozenset()


def test_recovery_needs_recover_after_and_enough_probes() -> None:
    b = breaker()
    feed(b, 0, 10, 0.002)
    feed(b, 10, 11, 0.150)
    assert b.evaluate(11)[0].to == "degraded"
    b.observe("default/r/0/degraded", "a.default", 0.002, 11.5)
    b.observe("default/r/0/degraded", "a.default", 0.002, 11.6)
    assert b.evaluate(12.5) == []  # 1.5 s after the trip, and two probes only
    feed(b, 11.7, 12.9, 0.002, rate=10)
    assert b.evaluate(12.9) == []  # 1.9 s after the trip
    assert b.evaluate(13.1)[0].to == "healthy"


def test_the_degraded_twin_feeds_the_breaker() -> None:
    """Once tripped, the probe share reaches the primary through the degraded twin route; its
    samples are what lets the breaker see the primary recover."""
    b = breaker()
    b.observe("default/r/0/degraded", "a.default", 0.1, 1.0)
    b.observe("default/r/0", "a.default", 0.1, 1.0)
    assert len(b._routes["default/r"].samples) == 2


def test_tripping_pushes_only_new_degrade_filter_config() -> None:
    """The drift breaker drives the degrade filter (ECDS): listeners, routes, clusters and
    endpoints stay byte-identical, so no listener drains and no route table is rebuilt."""
    from meshfn.xds.names import EXTENSION
    from meshfn.xds.translate import translate

    model = load_policies(Path(__file__).resolve().parents[1] / "golden" / "fallback" / "in.yaml")
    healthy = translate(model, "edge.default")
    tripped = translate(model, "edge.default", overlay=ir.Overlay(frozenset({"default/generate"})))
    assert healthy is not None and tripped is not None
    for type_url in healthy:
        same = {n: m.SerializeToString() for n, m in healthy[type_url].items()} == {
            n: m.SerializeToString() for n, m in tripped[type_url].items()
        }
        assert same == (type_url != EXTENSION), type_url

    def depth(resources: dict) -> int:  # type: ignore[type-arg]
        from envoy.extensions.filters.http.wasm.v3 import wasm_pb2
        from google.protobuf import wrappers_pb2

        (extension,) = resources[EXTENSION].values()
        plugin = wasm_pb2.Wasm()
        extension.typed_config.Unpack(plugin)
        value = wrappers_pb2.StringValue()
        plugin.config.configuration.Unpack(value)
        (rule,) = json.loads(value.value)["rules"]
        assert rule["routes"] == ["default/generate/0"] and rule["fallbacks"] == [
            "default/generate"
        ]
        return int(rule["depth"])

    assert (depth(healthy), depth(tripped)) == (0, 1)


def test_samples_keep_their_order_across_growth_compaction_and_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The breaker's sample store (numpy arrays, windows by binary search on time): what it
    holds and the p95 of any window are what a sorted list of every sample gives, through
    growth, compaction after old samples are dropped, MAX_SAMPLES, and a time that goes back
    (counted at the last one's)."""
    monkeypatch.setattr(drift, "MAX_SAMPLES", 3000)
    rng = random.Random(7)
    kept = drift.Samples()
    reference: list[tuple[float, float]] = []
    at = 0.0
    for step in range(9000):
        at += rng.random() / 100 if step % 500 else -1.0  # now and then a step back in time
        value = rng.lognormvariate(-5, 1)
        kept.append(at, value)
        reference.append((max(at, reference[-1][0]) if reference else at, value))
        reference = reference[-3000:]
        if step % 1700 == 0:  # the evaluation's horizon: drop what is older
            horizon = reference[len(reference) // 3][0]
            kept.drop_before(horizon)
            reference = [(t, v) for t, v in reference if t >= horizon]
        if step % 97 == 0:
            assert list(kept) == reference
            cut = reference[len(reference) // 2][0]
            split = kept.since(cut)
            newer = [v for t, v in reference if t >= cut]
            older = [v for t, v in reference if t < cut]
            assert kept.values(split).tolist() == newer and kept.values(0, split).tolist() == older
            ordered = sorted(newer)
            assert drift.p95(kept.values(split)) == ordered[math.ceil(0.95 * len(ordered)) - 1]
    kept.clear()
    assert len(kept) == 0 and list(kept) == []
