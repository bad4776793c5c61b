"""The drift breaker on streams: a generative route's whole duration measures how long its
answer was, not how its backend does, so its breaker can read the time to first token or the
inter-token latency instead (FallbackPolicy driftBreaker.metric)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry

from meshfn.health.drift import DriftBreaker, WatchedRoute, sample, watched_routes
from meshfn.policy import PolicyErrors, load_policies

from .test_fallback import DRIFT

ROOT = Path(__file__).resolve().parents[2]


def entry(
    first_ms: int, last_ms: int, tokens: int | None, trailer: bool = True
) -> HTTPAccessLogEntry:
    out = HTTPAccessLogEntry()
    common = out.common_properties
    common.route_name, common.upstream_cluster = "default/r/0", "a.default"
    common.upstream_local_address.socket_address.address = "127.0.0.1"
    common.time_to_first_upstream_rx_byte.FromMilliseconds(first_ms)
    common.time_to_last_upstream_rx_byte.FromMilliseconds(last_ms)
    common.time_to_last_downstream_tx_byte.FromMilliseconds(last_ms + 1)
    if tokens is not None:
        record = json.dumps({"model": "m", "completion_tokens": tokens})
        target = out.response.response_trailers if trailer else out.response.response_headers
        target["x-meshfn-generation"] = record
    return out


def test_each_metric_reads_its_own_sample() -> None:
    stream = entry(20, 2020, 101)  # 20 ms to the first token, 100 more in 2 s
    assert sample(stream, "duration") == pytest.approx(2.021)
    assert sample(stream, "ttft") == pytest.approx(0.020)
    assert sample(stream, "itl") == pytest.approx(0.020)
    assert sample(entry(20, 2020, 101, trailer=False), "itl") == pytest.approx(0.020)
    assert sample(entry(20, 25, 1), "itl") is None  # one token: no inter-token latency
    assert sample(entry(20, 25, None), "itl") is None  # no usage record: not counted


@pytest.mark.parametrize("metric", ["ttft", "itl"])
def test_a_stream_that_slows_down_per_token_trips_what_duration_cannot(metric: str) -> None:
    """Long answers get longer by their length: duration would trip on a model asked for more
    tokens. The backend slowing down per token (or before the first) is what trips itl (or
    ttft), and only that."""
    b = DriftBreaker()
    b.configure([WatchedRoute("default/r", frozenset({"a.default"}), DRIFT, metric)])
    t = 0.0
    for i in range(1000):  # 10 s of healthy streams of every length
        tokens = 10 + (i % 7) * 100
        b.observe_access_log(entry(20, 20 + 10 * (tokens - 1), tokens), t)
        t += 0.01
    assert b.evaluate(t) == []
    for _ in range(100):  # one second of streams 3x slower per token, and to their first
        b.observe_access_log(entry(60, 60 + 30 * 99, 100), t)
        t += 0.01
    (trip,) = b.evaluate(t)
    assert trip.to == "degraded"


def test_generative_routes_read_the_stream_metric_the_others_their_duration(
    tmp_path: Path,
) -> None:
    text = (ROOT / "policies" / "examples" / "fallback.yaml").read_text()
    for path in (ROOT / "policies" / "examples").glob("*.yaml"):
        (tmp_path / path.name).write_text(path.read_text())
    itl = text.replace("recoverAfter: 10s}", "recoverAfter: 10s, streams: itl}")
    (tmp_path / "fallback.yaml").write_text(itl)
    watched = {w.route: w.metric for w in watched_routes(load_policies(tmp_path))}
    assert watched["default/function-tiny-lm"] == watched["default/openai-tiny-lm"] == "itl"
    assert watched["default/function-iris"] == "duration"
    (tmp_path / "fallback.yaml").write_text(text)
    defaults = {w.route: w.metric for w in watched_routes(load_policies(tmp_path))}
    assert defaults["default/openai-tiny-lm"] == "ttft"
    bad = text.replace("recoverAfter: 10s}", "recoverAfter: 10s, streams: p99}")
    (tmp_path / "fallback.yaml").write_text(bad)
    with pytest.raises(PolicyErrors) as caught:
        load_policies(tmp_path)
    assert "driftBreaker.streams" in str(caught.value)
