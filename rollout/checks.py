"""A step's SLO checks: the candidate against the stable version over the same window.

Each check is `pass` (judged on at least min_samples candidate answers, and within its limit),
`breach`, or `pending` (not enough answers yet). A check breaches before it has min_samples
answers when the answers so far already break it whatever the missing ones would be: at
min_samples 20 and a 1% ceiling, one failure in the first ten answers is a breach (1/20 > 1%),
and a p95 with two answers over its limit is (two of twenty is more than 5%). That is what lets
a candidate that fails every request be rolled back at the first evaluation instead of after
min_samples failures. A step never passes on a pending check: no data is never good news.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from meshfn import ir

from .figures import Sample, Window, percentile

Verdict = Literal["pass", "breach", "pending"]


@dataclass(frozen=True)
class CheckResult:
    """One check at one evaluation: the candidate's figure, the limit it is held to (None
    while the stable version's figure it depends on is not known), the stable version's figure
    and the answers behind them."""

    name: str  # "error ratio", "p95", "p99 vs stable", "agreement"
    unit: Literal["ratio", "ms"]
    candidate: float | None
    limit: float | None
    stable: float | None
    samples: int  # the candidate's answers (or compared pairs) in the window
    verdict: Verdict

    def describe(self) -> str:
        def show(value: float | None) -> str:
            if value is None:
                return "-"
            return f"{value:.2f} ms" if self.unit == "ms" else f"{value:.2%}"

        return (
            f"{self.name} {show(self.candidate)} (limit {show(self.limit)}, stable "
            f"{show(self.stable)}, {self.samples} answers): {self.verdict}"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "unit": self.unit,
            "candidate": _round(self.candidate),
            "limit": _round(self.limit),
            "stable": _round(self.stable),
            "samples": self.samples,
            "verdict": self.verdict,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def judge(window: Window, slo: ir.RolloutSlo, shadow: bool) -> tuple[CheckResult, ...]:
    """Every check of a step over `window` (agreement on shadow steps only)."""
    out = [error_ratio(window, slo)]
    out += [latency(window, check, slo.min_samples) for check in slo.latency]
    if shadow and slo.min_agreement is not None:
        out.append(agreement(window, slo.min_agreement, slo.min_samples))
    return tuple(out)


def error_ratio(window: Window, slo: ir.RolloutSlo) -> CheckResult:
    need = slo.min_samples
    n = len(window.candidate)
    failed = sum(s.failed for s in window.candidate)
    stable_n = len(window.stable)
    stable = sum(s.failed for s in window.stable) / stable_n if stable_n else None
    limit: float | None = slo.max_error_ratio
    relative = slo.max_error_increase is not None
    if relative and stable_n >= need and stable is not None:
        assert slo.max_error_increase is not None
        limit = min(slo.max_error_ratio, stable + slo.max_error_increase)
    # failures over at least `need` answers: the ratio the step will show at best
    floor = failed / max(n, need)
    assert limit is not None
    if floor > limit:
        verdict: Verdict = "breach"
    elif n >= need and (not relative or stable_n >= need):
        verdict = "pass"
    else:
        verdict = "pending"
    return CheckResult("error ratio", "ratio", failed / n if n else None, limit, stable, n, verdict)


def _durations(samples: Sequence[Sample]) -> list[float]:
    """What latency is judged on: answers that did not fail (a failure counts against the
    error ratio; its duration is how fast it failed)."""
    return [s.seconds for s in samples if not s.failed]


def latency(window: Window, check: ir.LatencyCheck, need: int) -> CheckResult:
    q = check.percentile / 100
    mine = _durations(window.candidate)
    theirs = _durations(window.stable)
    stable = percentile(theirs, q) * 1000 if theirs else None
    name = f"p{check.percentile}"
    limit: float | None = None
    if check.max is not None:
        limit = check.max.total_seconds() * 1000
    else:
        name += " vs stable"
        assert check.max_ratio is not None
        if stable is not None and len(theirs) >= need:
            floor = check.min_increase.total_seconds() * 1000
            limit = max(stable * check.max_ratio, stable + floor)
    value = percentile(mine, q) * 1000 if mine else None
    if limit is None:
        return CheckResult(name, "ms", value, None, stable, len(mine), "pending")
    total = max(len(mine), need)
    over = sum(1 for v in mine if v * 1000 > limit)
    # The percentile over `total` answers exceeds the limit once more answers are over it
    # than the percentile leaves above itself.
    if over > total - math.ceil(q * total):
        verdict: Verdict = "breach"
    elif len(mine) >= need:
        verdict = "pass"
    else:
        verdict = "pending"
    return CheckResult(name, "ms", value, limit, stable, len(mine), verdict)


def agreement(window: Window, minimum: float, need: int) -> CheckResult:
    compared = window.agree + window.disagree
    total = max(compared, need)
    if window.disagree > (1 - minimum) * total + 1e-9:
        verdict: Verdict = "breach"
    elif compared >= need:
        verdict = "pass"
    else:
        verdict = "pending"
    ratio = window.agree / compared if compared else None
    return CheckResult("agreement", "ratio", ratio, minimum, None, compared, verdict)
