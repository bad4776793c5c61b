"""The backend's side of a rollout without a guest: how two answers are compared (labels equal,
numbers within the tolerance, shapes and names alike, binary answers byte for byte), how a
shadow and the requested version are recognised, and the comparisons' report to the controller
(each after the reader's last, with what was dropped unread)."""

from __future__ import annotations

import json
from typing import Any

from meshfn.contracts.rollout import SHADOW_AUTHORITY, ShadowReport
from meshfn.inference.backend import Reply
from meshfn.inference.metrics import Metrics
from meshfn.inference.shadow import KEEP, Shadows, agree, is_shadow, requested_version


def _answer(label: list[int], probabilities: list[float], **extra: Any) -> Reply:
    outputs = [
        {"name": "label", "datatype": "INT64", "shape": [len(label)], "data": label},
        {"name": "probabilities", "datatype": "FP32", "shape": [len(label), 2],
         "data": probabilities},
    ]  # fmt: skip
    return Reply(200, json.dumps({"model_name": "m", "outputs": outputs, **extra}).encode())


def test_labels_must_be_equal_and_numbers_within_the_tolerance() -> None:
    stable = _answer([3], [0.25, 0.75])
    assert agree(_answer([3], [0.25, 0.75], model_version="2"), stable, 0.0)
    assert agree(_answer([3], [0.2501, 0.7499]), stable, 0.001)
    assert not agree(_answer([3], [0.26, 0.74]), stable, 0.001)
    assert not agree(_answer([8], [0.25, 0.75]), stable, 1.0)  # a label is never "close"
    assert not agree(_answer([3, 3], [0.25, 0.75, 0.25, 0.75]), stable, 0.0)  # shape
    nan = Reply(200, stable.body.replace(b"0.25", b"NaN"))
    assert agree(nan, nan, 0.0) and not agree(nan, stable, 1.0)
    binary = Reply(200, b"\x00\x01", content_type=b"application/octet-stream")
    assert agree(binary, binary, 0.0) and not agree(binary, stable, 0.0)


def test_a_shadow_is_known_by_its_authority_and_a_version_by_its_header() -> None:
    assert is_shadow({b"host": SHADOW_AUTHORITY.encode()})
    assert not is_shadow({b"host": b"meshfn-rollout.internal"})
    assert not is_shadow({b"host": b"evil-shadow"})  # only the authority meshfn sets
    assert requested_version({b"x-meshfn-version": b"2"}) == "2"
    assert requested_version({}) is None


class _Backend:
    """What Shadows reads of a backend: its functions (none here) and metrics."""

    def __init__(self) -> None:
        self.functions: dict[str, Any] = {}
        self.metrics = Metrics()


def test_the_report_gives_each_comparison_once_and_counts_what_was_dropped() -> None:
    shadows = Shadows(_Backend())  # type: ignore[arg-type]
    for i in range(KEEP + 3):
        shadows._keep("digits@2", 0.002, 0.001, "agree" if i % 2 else "disagree")
    first = ShadowReport.model_validate(shadows.report("after=0"))
    pairs = first.functions["digits@2"]
    assert len(pairs) == KEEP and pairs[0].seq == 4 and first.lost == 3
    later = ShadowReport.model_validate(shadows.report(f"after={pairs[-10].seq}"))
    assert [p.seq for p in later.functions["digits@2"]] == [p.seq for p in pairs[-9:]]
    assert later.lost == 0 and later.process == first.process
    assert ShadowReport.model_validate(shadows.report("after=x&y")).lost == 3  # after=0
