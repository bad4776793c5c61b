"""Shapes with one symbolic size: the batch.

A dimension is an `int` or a `Batch(k)` (k times the batch size N). Only one dimension of a
shape may depend on N, so every element count is `c` or `c*N` and buffer sizes stay linear in
N: the planner can then lay out memory once for every batch (two arenas, see plan.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import UnsupportedError


@dataclass(frozen=True, slots=True)
class Batch:
    """k * N, with N the run-time batch size (N >= 1)."""

    k: int

    def __mul__(self, other: object) -> Batch:
        if isinstance(other, bool) or not isinstance(other, int):
            raise UnsupportedError("a size would be quadratic in the batch (N*N)")
        return Batch(self.k * other)

    __rmul__ = __mul__

    def __floordiv__(self, other: object) -> Batch:
        if isinstance(other, bool) or not isinstance(other, int) or other == 0:
            raise UnsupportedError("a size would divide the batch by a non-constant")
        if self.k % other:
            raise UnsupportedError(f"a size would be a fraction of the batch ({self.k}*N/{other})")
        return Batch(self.k // other)

    def __add__(self, other: object) -> Batch:
        if other == 0:
            return self
        if isinstance(other, Batch):
            return Batch(self.k + other.k)
        raise UnsupportedError("a size would be the batch plus a constant")

    __radd__ = __add__

    def __sub__(self, other: object) -> Batch:
        if other == 0:
            return self
        raise UnsupportedError("a size would be the batch minus a constant")

    def __neg__(self) -> Batch:
        raise UnsupportedError("a size would be negative in the batch")

    def __repr__(self) -> str:
        return "N" if self.k == 1 else f"{self.k}*N"

    def c(self) -> str:
        return "N" if self.k == 1 else f"({self.k}*N)"


Dim = int | Batch
Shape = tuple[Dim, ...]


def numel(shape: Iterable[Dim]) -> Dim:
    total: Dim = 1
    for d in shape:
        total = d * total if isinstance(d, Batch) else total * d
    return total


def static(d: Dim) -> int:
    """A size that must not depend on the batch (callers have checked it does not)."""
    if isinstance(d, Batch):
        raise UnsupportedError(f"a size that depends on the batch ({d}) is not supported here")
    return d


def add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, Batch):
        return a + b
    if isinstance(b, Batch):
        return b + a
    return a + b


def cdim(d: Dim) -> str:
    """A C expression (of the run function's `N`) for a dimension or element count."""
    return d.c() if isinstance(d, Batch) else str(d)


def mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, Batch):
        return a * b
    if isinstance(b, Batch):
        return b * a
    return a * b


def is_static(shape: Sequence[Dim]) -> bool:
    return all(isinstance(d, int) for d in shape)


def split(size: Dim) -> tuple[int, int]:
    """(constant part, per-batch part) of a size: exactly one of them is zero."""
    return (0, size.k) if isinstance(size, Batch) else (size, 0)


def show(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(repr(d) for d in shape) + "]"
