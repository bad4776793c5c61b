"""Iris classifier guest: a 4-16-3 MLP forward pass in pure Python (no numpy in the guest)."""

from __future__ import annotations

import math
from operator import mul
from typing import Any

import meshfn_sdk
from weights import B1, B2, MEAN, STD, W1, W2

# Weights as tuples, each row beside its bias: the dot products then run in C
# (sum(map(mul, ...))), about half the time per row of generator expressions in the guest.
LAYER1 = tuple(zip((tuple(w) for w in W1), B1, strict=True))
LAYER2 = tuple(zip((tuple(w) for w in W2), B2, strict=True))
SCALE = tuple(zip(MEAN, STD, strict=True))


def classify(row: list[float]) -> tuple[int, list[float]]:
    x = [(v - m) / s for v, (m, s) in zip(row, SCALE, strict=True)]
    hidden = [max(0.0, b + sum(map(mul, ws, x))) for ws, b in LAYER1]
    logits = [b + sum(map(mul, ws, hidden)) for ws, b in LAYER2]
    top = max(logits)
    exp = [math.exp(v - top) for v in logits]
    total = sum(exp)
    probs = [e / total for e in exp]
    return probs.index(max(probs)), probs


class Iris(meshfn_sdk.Model):
    def predict(
        self, inputs: dict[str, meshfn_sdk.Tensor], parameters: dict[str, Any]
    ) -> list[meshfn_sdk.Tensor]:
        rows = inputs["features"].rows()
        labels: list[int] = []
        probs: list[float] = []
        for row in rows:
            label, p = classify(row)
            labels.append(label)
            probs.extend(round(v, 6) for v in p)
        n = len(rows)
        return [
            meshfn_sdk.Tensor("label", "INT64", [n], labels),
            meshfn_sdk.Tensor("probabilities", "FP32", [n, 3], probs),
        ]


MODEL = Iris()
