"""bench/qos.py runs end to end (short phases) and prints its one summary line; what it
measures holds even at this size: the noisy tenant gets about what its bucket allows, and only
the lowest-priority tenant is shed at saturation."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_qos_bench_smoke(tmp_path: Path) -> None:
    short = ["--seconds", "2", "--rounds", "1", "--lb-seconds", "1"]
    line, data = run_bench("qos.py", short, tmp_path, timeout=400)
    assert re.match(
        r"^qos: quiet_p99_ratio=[\d.]+ noisy_admitted_ratio=[\d.]+ high_p99_ratio=[\d.]+ "
        r"low_shed_pct=[\d.]+ low_shed_at_gateway_pct=[\d.]+ wrr_p99_ratio=[\d.]+ "
        r"acme_not_200=0 unexpected_statuses=0$",
        line,
    ), line
    tenants = data["tenants"]
    # the quiet and the high-priority tenant: every request answered 200
    for phase in ("quiet_alone", "quiet_with_noisy", "high_at_saturation"):
        assert set(tenants[phase]["statuses"]) == {"200"}, (phase, tenants[phase])
    # globex at 10x its limit: its burst at least, never much more than its bucket allows
    # (rate x time + burst; Envoy refills in whole seconds, and a loaded machine stretches the
    # phase a little)
    noisy = tenants["noisy"]
    assert 20 <= noisy["statuses"]["200"] <= 1.5 * noisy["allowed"], noisy
    assert noisy["statuses"]["429"] > noisy["statuses"]["200"], noisy
    # only what was shed by priority was refused, and some was: with the example's gateway
    # shedding, by the gateway itself
    low = tenants["low_at_saturation"]
    assert set(low["limits"]) <= {"shed"} and low["limits"].get("shed", 0) > 0, low
    assert low["scopes"].get("gateway", 0) > 0, low
    assert set(data["balancers"]["p99_ms"]) == {"weighted-round-robin", "least-request"}
