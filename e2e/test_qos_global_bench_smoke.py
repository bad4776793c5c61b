"""bench/qos_global.py runs end to end (short phases) and prints its one summary line; what it
measures holds even at this size: two gateways sharing a global rate admit about one bucket's
worth, and with the limit service frozen each request waits for the policy's timeout, no more,
and fails as the policy says."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_qos_global_bench_smoke(tmp_path: Path) -> None:
    short = ["--seconds", "2", "--rounds", "1", "--hop-seconds", "1", "--fail-requests", "3"]
    line, data = run_bench("qos_global.py", short, tmp_path, timeout=300)
    assert re.match(
        r"^qos_global: global_admitted_ratio=[\d.]+ global_p50_over_local_us=-?\d+ "
        r"fail_closed_p50_ms=[\d.]+ fail_open_p50_ms=[\d.]+ timeout_ms=100$",
        line,
    ), line
    shared = data["shared"]
    # One bucket for both (burst + rate x time), far below what two local limits would admit;
    # a loaded machine stretches the phase a little.
    total = sum(shared["admitted"].values())
    assert 0.9 * shared["allowed"] <= total <= 1.2 * shared["allowed"], shared
    assert all(n > 0 for n in shared["admitted"].values()), shared  # both gateways admitted
    assert {s for st in shared["statuses"].values() for s in st} == {"200", "429"}, shared
    frozen = data["frozen"]
    assert set(frozen["statuses"]["a"]) == {503} and set(frozen["statuses"]["c"]) == {200}
    assert all(90 <= t < 2000 for ts in frozen["latency_ms"].values() for t in ts), frozen
    assert set(data["hop"]["p50_ms"]) == {"c", "l"}
