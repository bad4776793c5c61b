"""What a rollout's stages agree on: how a gateway tells the inference backend which version of a
Function answers a request, how the backend tells a mirrored (shadow) copy from a real request,
and the shadow comparisons the backend reports to the rollout controller.

- The gateway (meshfn's Envoy and Istio's alike) splits a Function's REST requests between the
  versions by weight and sets `VERSION_HEADER` on each (Envoy's per-weighted-cluster headers,
  Istio's per-destination headers); the backend serves the version it names. An explicit
  `/versions/{v}` path still wins.
- Its requests carry Host `ROLLOUT_AUTHORITY` (route-level authority rewrite, so no client can
  choose it). Envoy's request mirroring sends the copy with `-shadow` appended to the Host
  (`request_mirror_policies` in Envoy, `mirror` in Istio: the same suffix), so the backend knows
  a shadow by `SHADOW_AUTHORITY` alone. It answers a shadow with the candidate, runs the stable
  version on the same input, compares the two answers and keeps the outcome (`ShadowPair`) for
  the controller, which reads them at `SHADOW_PATH`. Envoy discards the shadow's answer.
- Every inference answer names the version that computed it in `MODEL_VERSION_HEADER`; the
  audit records copy it.

A leaf: pydantic only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

VERSION_HEADER = "x-meshfn-version"
MODEL_VERSION_HEADER = "x-meshfn-model-version"
ROLLOUT_AUTHORITY = "meshfn-rollout.internal"
SHADOW_SUFFIX = "-shadow"  # what Envoy appends to a mirrored request's Host
SHADOW_AUTHORITY = ROLLOUT_AUTHORITY + SHADOW_SUFFIX
SHADOW_PATH = "/meshfn/shadow"

# How one shadow comparison ended: the answers agree or not, or a version failed (an error
# answer, a trap, a timeout): `candidate_error` counts against the candidate's error ratio.
ShadowOutcome = Literal["agree", "disagree", "candidate_error", "stable_error"]
SHADOW_OUTCOMES: tuple[ShadowOutcome, ...] = (
    "agree",
    "disagree",
    "candidate_error",
    "stable_error",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FunctionRollout(_Strict):
    """A Function in a rollout, as its backend sees it: both versions are served, unversioned
    requests without a version header go to `stable`, shadows to `candidate` (compared with
    `stable`)."""

    stable: str = Field(description="the version in service")
    candidate: str = Field(description="the version being rolled out")
    tolerance: Annotated[float, Field(ge=0, le=1e9)] = Field(
        0.0,
        description="shadow comparisons: numbers agree within this absolute difference; "
        "labels (integers, strings, booleans) must be equal",
    )


class ShadowPair(_Strict):
    """One shadow request, answered by both versions on the same input."""

    seq: int = Field(description="increasing per backend process")
    at: float = Field(description="when it finished (seconds since the epoch)")
    candidate_s: float = Field(description="the candidate's time to answer")
    stable_s: float = Field(description="the stable version's time to answer")
    outcome: ShadowOutcome


class ShadowReport(_Strict):
    """GET SHADOW_PATH?after=SEQ: one backend process's comparisons after `after`, oldest
    first (at most the last few thousand are kept: a reader that falls behind misses some and
    sees `lost`)."""

    process: str = Field(description="changes when the process restarts (seq starts again)")
    functions: dict[str, list[ShadowPair]] = Field(
        description='per "name@candidate" its comparisons after `after`'
    )
    lost: int = Field(
        0, description="comparisons dropped before this reader fetched them (at most this many)"
    )
