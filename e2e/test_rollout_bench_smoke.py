"""bench/rollout.py runs end to end (one rollback, short steps) and prints its one summary line;
what it measures holds even at this size: the promotion fails no request, and the rollback
comes within two evaluation intervals of the first failure."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_rollout_bench_smoke(tmp_path: Path) -> None:
    tiny = ["--repeats", "1", "--rate", "30", "--step-seconds", "1"]
    line, data = run_bench("rollout.py", tiny, tmp_path, timeout=600)
    assert re.match(
        r"^rollout: rollback_s=[\d.]+ failed_ratio_vs_min=[\d.]+ promote_failed=0 interval_s=1 "
        r"weight_pct=10 rate=30 repeats=1$",
        line,
    ), line
    (rollback,) = data["rollbacks"]
    assert rollback["failed"] > 0 and rollback["rollback_s"] <= 2 * data["interval_s"]
    assert data["promotion"]["sent"] > 0 and data["promotion"]["statuses"] == [200]
