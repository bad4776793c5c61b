"""Rollouts at the backend: which version answers, shadow comparisons, and their report.

- A request under `/v2/models/{name}` that names no version in its path is answered by the
  version the gateway named in `contracts.rollout.VERSION_HEADER` (else the default: in a
  rollout, the stable version).
- A mirrored copy (Host `SHADOW_AUTHORITY`: Envoy appends `-shadow` to the authority the
  gateway set) of an inference request of a Function in a rollout is answered by the candidate;
  the stable version runs on the same input beside it, and the two answers are compared: labels
  (integers, strings, booleans) must be equal, numbers may differ by the rollout's tolerance.
  Envoy discards the shadow's answer; the outcome and both times are kept for the rollout
  controller, which reads them at `SHADOW_PATH?after=SEQ` (the last few thousand per process).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from meshfn.contracts.rollout import (
    SHADOW_AUTHORITY,
    VERSION_HEADER,
    FunctionRollout,
    ShadowOutcome,
    ShadowPair,
    ShadowReport,
)

from .http import query_values

if TYPE_CHECKING:
    from .backend import Backend, Reply

KEEP = 5000  # comparisons kept per Function for the controller
_VERSION_KEY = VERSION_HEADER.encode()
_SHADOW_HOST = SHADOW_AUTHORITY.encode()
_FLOATS = {"FP16", "FP32", "FP64", "BF16"}


def requested_version(headers: dict[bytes, bytes]) -> str | None:
    """The version the gateway named for a request whose path names none."""
    value = headers.get(_VERSION_KEY)
    return value.decode("latin-1") if value else None


def is_shadow(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"host") == _SHADOW_HOST


def _outputs(reply: Reply) -> list[dict[str, Any]] | None:
    """A JSON answer's outputs (None: not JSON, e.g. the binary tensor extension)."""
    if not reply.content_type.startswith(b"application/json"):
        return None
    try:
        body = json.loads(reply.body)
    except ValueError:
        return None
    outputs = body.get("outputs") if isinstance(body, dict) else None
    return outputs if isinstance(outputs, list) else None


def _flat(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flat(item)]
    return [data]


def _same_numbers(a: list[Any], b: list[Any], tolerance: float) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if not isinstance(x, int | float) or not isinstance(y, int | float):
            return False
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return False
        elif abs(x - y) > tolerance:
            return False
    return True


def agree(candidate: Reply, stable: Reply, tolerance: float) -> bool:
    """Two successful answers to the same input: the same outputs (names, types, shapes),
    labels equal, numbers within `tolerance`; binary answers byte for byte."""
    mine, theirs = _outputs(candidate), _outputs(stable)
    if mine is None or theirs is None:
        return candidate.body == stable.body
    by_name = {o.get("name"): o for o in theirs if isinstance(o, dict)}
    if len(by_name) != len(mine):
        return False
    for out in mine:
        other = by_name.get(out.get("name")) if isinstance(out, dict) else None
        if other is None or (out.get("datatype"), out.get("shape")) != (
            other.get("datatype"),
            other.get("shape"),
        ):
            return False
        a, b = _flat(out.get("data")), _flat(other.get("data"))
        if out.get("datatype") in _FLOATS:
            if not _same_numbers(a, b, tolerance):
                return False
        elif a != b:
            return False
    return True


class Shadows:
    """The comparisons of one backend process."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.process = uuid.uuid4().hex[:12]
        self.seq = 0
        self.kept: dict[str, deque[ShadowPair]] = {}
        # per label: how many were pushed out of `kept`, and the newest of them
        self.dropped: dict[str, tuple[int, int]] = {}

    def rollout(self, name: str) -> FunctionRollout | None:
        versions = self.backend.functions.get(name) or {}
        return next((rt.spec.rollout for rt in versions.values() if rt.spec.rollout), None)

    async def infer(
        self, name: str, rollout: FunctionRollout, body: bytes, headers: dict[bytes, bytes]
    ) -> Reply:
        """Answer a shadow with the candidate; compare with the stable version's answer."""

        async def timed(version: str) -> tuple[Reply, float]:
            started = time.perf_counter()
            reply = await self.backend.infer(name, version, body, headers)
            return reply, time.perf_counter() - started

        (mine, mine_s), (theirs, theirs_s) = await asyncio.gather(
            timed(rollout.candidate), timed(rollout.stable)
        )
        outcome: ShadowOutcome
        if mine.status != 200:
            outcome = "candidate_error" if mine.status >= 500 or mine.status == 429 else "agree"
            if mine.status != theirs.status and outcome == "agree":
                outcome = "disagree"  # a 4xx the stable version did not give
        elif theirs.status != 200:
            outcome = "stable_error"
        else:
            outcome = "agree" if agree(mine, theirs, rollout.tolerance) else "disagree"
        self._keep(f"{name}@{rollout.candidate}", mine_s, theirs_s, outcome)
        return mine

    def _keep(
        self, label: str, candidate_s: float, stable_s: float, outcome: ShadowOutcome
    ) -> None:
        self.seq += 1
        kept = self.kept.setdefault(label, deque())
        kept.append(
            ShadowPair(
                seq=self.seq,
                at=time.time(),
                candidate_s=candidate_s,
                stable_s=stable_s,
                outcome=outcome,
            )
        )
        self.backend.metrics.shadow_comparisons.labels(label, outcome).inc()
        if len(kept) > KEEP:
            count, _ = self.dropped.get(label, (0, 0))
            self.dropped[label] = (count + 1, kept.popleft().seq)

    def report(self, query: str) -> dict[str, Any]:
        """What `SHADOW_PATH?after=SEQ` answers."""
        after = 0
        for value in query_values(query, "after"):
            if value.isdigit():
                after = int(value)
        # an upper bound: every drop of a label whose newest drop this reader had not seen
        lost = sum(count for count, newest in self.dropped.values() if newest > after)
        report = ShadowReport(
            process=self.process,
            functions={
                label: [p for p in pairs if p.seq > after] for label, pairs in self.kept.items()
            },
            lost=lost,
        )
        return report.model_dump(mode="json")
