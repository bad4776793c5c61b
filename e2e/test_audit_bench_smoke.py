"""bench/audit.py runs end to end (tiny sizes: real collectors, signer, SQLite and PostgreSQL)
and prints its one summary line."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn_e2e import run_bench


def test_audit_bench_smoke(tmp_path: Path) -> None:
    line, data = run_bench("audit.py", ["--records", "2000"], tmp_path)
    assert re.match(
        r"^audit: sqlite_rps=\d+ pg_rps=\d+ pg4_rps=\d+ verify_s_per_m=[\d.]+ ", line
    ), line
    assert data["pg4"]["records"] == 8000 and data["pg4"]["collectors"] == 4
    assert data["sqlite"]["unsigned_tail"] == 0 and data["pg4"]["checkpoints"] >= 1
    assert re.search(r" goals=pg4_rps>=20000:(NOT-)?met,verify_s_per_m<=10:(NOT-)?met$", line), line
    assert set(data["goals"]) == {"pg4_rps>=20000", "verify_s_per_m<=10"}
