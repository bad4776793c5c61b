"""Every fuzz target for a bounded time (meshfn.testing.fuzz): the proxy-wasm filters' C code
under libFuzzer + ASan + UBSan, the Python parsers under atheris, each from its corpus in
tests/fuzz/corpus/. A finding (crash, sanitizer report, leak, hang, unbounded allocation)
fails the test with the input and the log. Longer runs: bench/fuzz.py.

MESHFN_FUZZ_SECONDS overrides every target's budget (0 runs only the corpus)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from meshfn.common import env
from meshfn.testing import fuzz

# Seconds per target in the test command: ~3.5 minutes of fuzzing in all, with the interpreter
# start-up of the Python targets. The policy target is the slowest per input (a whole load +
# translate).
BUDGET = {t: 15 for t in fuzz.TARGETS} | {"policy": 20, "filter-audit": 20}
TEST = "test_fuzz_target_finds_nothing"


def _seconds(target: str) -> float:
    return float(env.FUZZ_SECONDS.get() or BUDGET[target])


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[fuzz.FuzzResult]]]:
    """The selected targets' runs, started together, as many at once as there are CPUs: a
    fuzzer is one process on one core, so on the 2 vCPUs of the test machine two run side by
    side, each with its whole budget, in half the wall time of one after the other."""
    wanted = [
        item.callspec.params["target"]
        for item in request.session.items
        if getattr(item, "originalname", "") == TEST and hasattr(item, "callspec")
    ]
    if any(t in fuzz.C_TARGETS for t in wanted):
        fuzz.c_fuzzers()  # built once (cached), before the threads
    with ThreadPoolExecutor(max(1, min(len(wanted), os.cpu_count() or 1))) as pool:
        yield {
            t: pool.submit(fuzz.run, t, _seconds(t), tmp_path_factory.mktemp(f"fuzz-{t}"))
            for t in wanted
        }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_fuzz_target_finds_nothing(target: str, runs: dict[str, Future[fuzz.FuzzResult]]) -> None:
    result = runs[target].result()
    print(result.line())
    assert result.finding is None, (
        f"{target}: finding {result.finding}; reproduce with "
        f"{' '.join(fuzz.command(target))} {result.finding}\n{result.log_tail}"
    )
    seeds = sum(1 for _ in (fuzz.CORPORA / target).iterdir())
    assert result.execs >= seeds, f"{target} ran {result.execs} inputs of {seeds} seeds"
    assert result.coverage > 0, result.log_tail
