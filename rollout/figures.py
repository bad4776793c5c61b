"""What the controller knows of one rollout's two versions, as samples in time.

- Real requests (canary steps): one sample per answer a gateway forwarded to a version's
  cluster, from Envoy's access-log stream: when it arrived here, its duration, and whether it
  failed (a 5xx, including Envoy's own for a reset or a timeout).
- Shadow comparisons (shadow steps): one pair per mirrored request, from the backend, which
  answered it with both versions on the same input (contracts.rollout.ShadowPair).

Times are time.monotonic() of the control plane; samples older than the longest window any
rollout looks at are dropped.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from meshfn.contracts.rollout import ShadowOutcome

MAX_SAMPLES = 200_000  # per version: a bound, not a window


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    seconds: float
    failed: bool


@dataclass(frozen=True, slots=True)
class Pair:
    at: float
    candidate_s: float
    stable_s: float
    outcome: ShadowOutcome


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in (0, 1]) of `values` (sorted or not; not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Figures:
    """One rollout's samples: answers per version (real traffic) and shadow pairs."""

    stable: deque[Sample] = field(default_factory=deque)
    candidate: deque[Sample] = field(default_factory=deque)
    pairs: deque[Pair] = field(default_factory=deque)

    def add(self, role: str, sample: Sample) -> None:
        samples = self.candidate if role == "candidate" else self.stable
        samples.append(sample)
        if len(samples) > MAX_SAMPLES:
            samples.popleft()

    def add_pairs(self, pairs: Iterable[Pair]) -> None:
        for pair in pairs:
            self.pairs.append(pair)
        while len(self.pairs) > MAX_SAMPLES:
            self.pairs.popleft()

    def prune(self, horizon: float) -> None:
        for samples in (self.stable, self.candidate, self.pairs):
            while samples and samples[0].at < horizon:
                samples.popleft()

    def clear(self) -> None:
        for samples in (self.stable, self.candidate, self.pairs):
            samples.clear()


@dataclass(frozen=True)
class Window:
    """The samples of both versions over one span: what every check of a step compares.
    Shadow steps fill it from the pairs (both versions answered the same inputs), canary steps
    from the gateways' answers."""

    stable: tuple[Sample, ...]
    candidate: tuple[Sample, ...]
    agree: int = 0
    disagree: int = 0

    @classmethod
    def of_answers(cls, figures: Figures, since: float) -> Window:
        return cls(
            tuple(s for s in figures.stable if s.at >= since),
            tuple(s for s in figures.candidate if s.at >= since),
        )

    @classmethod
    def of_pairs(cls, figures: Figures, since: float) -> Window:
        pairs = [p for p in figures.pairs if p.at >= since]
        return cls(
            tuple(Sample(p.at, p.stable_s, p.outcome == "stable_error") for p in pairs),
            tuple(Sample(p.at, p.candidate_s, p.outcome == "candidate_error") for p in pairs),
            agree=sum(p.outcome == "agree" for p in pairs),
            disagree=sum(p.outcome == "disagree" for p in pairs),
        )


def count_since(figures: Figures, shadow: bool, since: float) -> int:
    """Candidate answers (or shadow comparisons) after `since`: a step's progress."""
    samples: Iterable[Sample | Pair] = figures.pairs if shadow else figures.candidate
    return sum(1 for s in samples if s.at > since)
