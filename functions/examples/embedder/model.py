"""Text embedder guest: deterministic feature hashing (FNV-1a), no learned weights."""

from __future__ import annotations

import math
from typing import Any

import meshfn_sdk

DIM = 32
MAX_TEXT = 65536


def fnv1a(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def embed(text: str) -> tuple[list[float], int]:
    words = text.lower().split()
    vec = [0.0] * DIM
    features = [w.encode() for w in words]
    for w in words:
        padded = f"^{w}$".encode()
        features.extend(padded[i : i + 3] for i in range(len(padded) - 2))
    for f in features:
        h = fnv1a(f)
        vec[h % DIM] += 1.0 if (h >> 16) & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec], len(words)


class Embedder(meshfn_sdk.Model):
    def predict(
        self, inputs: dict[str, meshfn_sdk.Tensor], parameters: dict[str, Any]
    ) -> list[meshfn_sdk.Tensor]:
        texts = inputs["text"].data
        vectors: list[float] = []
        counts: list[int] = []
        for text in texts:
            if len(text) > MAX_TEXT:
                raise meshfn_sdk.BadRequest(f"text longer than {MAX_TEXT} characters")
            vec, n = embed(text)
            vectors.extend(vec)
            counts.append(n)
        return [
            meshfn_sdk.Tensor("embedding", "FP32", [len(texts), DIM], vectors),
            meshfn_sdk.Tensor("tokens", "INT32", [len(texts)], counts),
        ]


MODEL = Embedder()
