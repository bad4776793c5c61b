"""Every fuzz target for a bounded time (meshfn.testing.fuzz): the proxy-wasm filters' C code
under libFuzzer + ASan + UBSan, the Python parsers under atheris, each from its corpus in
tests/fuzz/corpus/. A finding (crash, sanitizer report, leak, hang, unbounded allocation)
fails the test with the input and the log. Longer runs: bench/fuzz.py.

MESHFN_FUZZ_SECONDS overrides every target's budget (0 runs only the corpus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshfn.common import env
from meshfn.testing import fuzz

# Seconds per target in the test command: ~3.5 minutes in all, with the interpreter start-up of
# the Python targets. The policy target is the slowest per input (a whole load + translate).
BUDGET = {t: 15 for t in fuzz.TARGETS} | {"policy": 20, "filter-audit": 20}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_fuzz_target_finds_nothing(target: str, tmp_path: Path) -> None:
    seconds = float(env.FUZZ_SECONDS.get() or BUDGET[target])
    result = fuzz.run(target, seconds, tmp_path)
    print(result.line())
    assert result.finding is None, (
        f"{target}: finding {result.finding}; reproduce with "
        f"{' '.join(fuzz.command(target))} {result.finding}\n{result.log_tail}"
    )
    seeds = sum(1 for _ in (fuzz.CORPORA / target).iterdir())
    assert result.execs >= seeds, f"{target} ran {result.execs} inputs of {seeds} seeds"
    assert result.coverage > 0, result.log_tail
