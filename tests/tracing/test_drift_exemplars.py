"""A drift breaker's trip names the slowest sampled traces of its window (exemplars), read from
the traceparent the gateway's access-log stream carries (a split gateway's: the trace id in
its metadata)."""

from __future__ import annotations

import logging

import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

from meshfn.contracts.tracing import (
    SPLIT_CLUSTER_METADATA,
    SPLIT_TRACE_METADATA,
    SPLIT_UPSTREAM_METADATA,
    split_unanswered,
)
from meshfn.health.drift import DriftBreaker, WatchedRoute
from meshfn.testing.policies import DRIFT


def _entry(
    ms: float, trace: int | None, sampled: bool = True, split: bool = False, upstream: bool = True
) -> HTTPAccessLogEntry:
    """`split`: as a split gateway logs it, the trace id, the upstream cluster and connection of
    a sampled request in metadata (its internal listener's answer; `upstream` False: that
    listener answered itself), none for the others."""
    entry = HTTPAccessLogEntry()
    common = entry.common_properties
    common.route_name, common.upstream_cluster = "default/r/0", "a.default"
    common.upstream_local_address.socket_address.address = "127.0.0.1"
    common.time_to_last_downstream_tx_byte.FromNanoseconds(round(ms * 1e6))
    if trace is not None and split:
        if sampled:  # its own upstream was the internal listener, which named the real one
            common.upstream_cluster = "meshfn-traced-http"
            namespace, key = SPLIT_TRACE_METADATA
            common.metadata.filter_metadata[namespace].update({key: f"{trace:032x}"})
            namespace, key = SPLIT_CLUSTER_METADATA
            common.metadata.filter_metadata[namespace].update({key: "a.default"})
            if upstream:
                namespace, key = SPLIT_UPSTREAM_METADATA
                common.metadata.filter_metadata[namespace].update({key: "127.0.0.1:40000"})
    elif trace is not None:
        flags = "01" if sampled else "00"
        entry.request.request_headers["traceparent"] = f"00-{trace:032x}-{1:016x}-{flags}"
    return entry


@pytest.mark.parametrize("split", [False, True])
def test_a_trip_names_the_slowest_sampled_traces_of_its_window(
    caplog: pytest.LogCaptureFixture, split: bool
) -> None:
    breaker = DriftBreaker()
    breaker.configure([WatchedRoute("default/r", frozenset({"a.default"}), DRIFT)])
    for i in range(1000):  # ten seconds at 100 ms: the baseline
        breaker.observe_access_log(_entry(100, i + 1 if i % 10 == 0 else None), i / 100)
    assert breaker.evaluate(10) == []
    for i in range(100):  # then a slow second; some requests traced, some not sampled
        at = 10 + i / 100
        slow = 200 + i  # the later, the slower
        trace = 5000 + i if i % 7 == 0 else (9000 + i if i % 5 == 0 else None)
        breaker.observe_access_log(_entry(slow, trace, sampled=i % 7 == 0, split=split), at)
    caplog.set_level(logging.WARNING, "meshfn.drift")
    (trip,) = breaker.evaluate(11)
    assert trip.to == "degraded"
    # the sampled ones only (i % 7 == 0), slowest first: i = 98, 91, 84
    assert trip.exemplars == tuple(f"{5000 + i:032x}" for i in (98, 91, 84))
    assert breaker.snapshot(11)["default/r"]["exemplars"] == list(trip.exemplars)
    (line,) = [r for r in caplog.records if "degraded" in r.getMessage()]
    assert f"{5098:032x}" in line.getMessage() and line.exemplars == list(trip.exemplars)  # type: ignore[attr-defined]


def test_without_sampled_traces_a_trip_names_none() -> None:
    breaker = DriftBreaker()
    breaker.configure([WatchedRoute("default/r", frozenset({"a.default"}), DRIFT)])
    for i in range(1000):
        breaker.observe_access_log(_entry(100, None), i / 100)
    for i in range(100):
        breaker.observe_access_log(_entry(300, 7, sampled=False), 10 + i / 100)
    (trip,) = breaker.evaluate(11)
    assert trip.exemplars == ()


def test_a_split_gateways_request_its_internal_listener_answered_itself_is_no_sample() -> None:
    """Shed or without an upstream there, it reached no backend, as the gateway's own listener's
    refusals (which its access-log filter leaves out): a run of fast refusals must not pull the
    window's p95 down, nor name their traces."""
    breaker = DriftBreaker()
    breaker.configure([WatchedRoute("default/r", frozenset({"a.default"}), DRIFT)])
    for i in range(1000):
        breaker.observe_access_log(_entry(100, None), i / 100)
    for i in range(100):
        at = 10 + i / 100
        breaker.observe_access_log(_entry(300, None), at)
        breaker.observe_access_log(_entry(0.05, 4000 + i, split=True, upstream=False), at)
    (trip,) = breaker.evaluate(11)
    assert trip.to == "degraded" and trip.exemplars == ()


@pytest.mark.parametrize(
    ("trace", "upstream", "unanswered"),
    [("ab" * 16, None, True), ("ab" * 16, "-", True), ("ab" * 16, "127.0.0.1:1", False),
     (None, None, False)],
)  # fmt: skip
def test_split_unanswered_reads_the_internal_listeners_upstream(
    trace: str | None, upstream: str | None, unanswered: bool
) -> None:
    """Only a sampled request (a trace id) whose internal listener made no upstream request
    (no address, or Envoy's "-" for none) counts as answered there."""
    entry = HTTPAccessLogEntry()
    metadata = entry.common_properties.metadata.filter_metadata
    for (namespace, key), value in (
        (SPLIT_TRACE_METADATA, trace),
        (SPLIT_UPSTREAM_METADATA, upstream),
    ):
        if value is not None:
            metadata[namespace].update({key: value})
    assert split_unanswered(metadata) is unanswered
