"""Iris classifier guest: a 4-16-3 MLP forward pass in pure Python (no numpy in the guest)."""

from __future__ import annotations

import math
from typing import Any

import meshfn_sdk
from weights import B1, B2, MEAN, STD, W1, W2


def classify(row: list[float]) -> tuple[int, list[float]]:
    x = [(v - m) / s for v, m, s in zip(row, MEAN, STD, strict=True)]
    hidden = [
        max(0.0, b + sum(w * v for w, v in zip(ws, x, strict=True)))
        for ws, b in zip(W1, B1, strict=True)
    ]
    logits = [
        b + sum(w * h for w, h in zip(ws, hidden, strict=True))
        for ws, b in zip(W2, B2, strict=True)
    ]
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
