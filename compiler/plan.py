"""Buffer planning: intermediate tensors share linear memory when their lifetimes do not
overlap.

Every size is `c` or `c*N` (dims.py), so there are two arenas: one for constant-size buffers
(offsets in bytes) and one for batch-size buffers (offsets in bytes per batch row, so the
address is `R + off*N`). A layout that is valid per row is valid for every N, so one plan
serves every batch and the module only grows memory, never replans."""

from __future__ import annotations

from dataclasses import dataclass

from .dims import Dim, split

ALIGN = 16
FOREVER = 1 << 30


@dataclass
class Buffer:
    key: int
    size: Dim  # bytes
    first: int  # step that writes it (-1: written by the host before the run)
    last: int  # last step that reads it (FOREVER: read by the host after the run)
    offset: int = 0
    batch: bool = False  # in the batch arena (offset and size are per row)


@dataclass
class Plan:
    buffers: dict[int, Buffer]
    const_bytes: int
    row_bytes: int

    def bytes_at(self, batch: int) -> int:
        return self.const_bytes + self.row_bytes * batch


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _place(items: list[Buffer], sizes: dict[int, int]) -> int:
    """Greedy by size (largest first), lowest offset that overlaps no live buffer; returns the
    arena's size. The classic heuristic: near-optimal for the chains of layers models are."""
    placed: list[Buffer] = []
    total = 0
    for b in sorted(items, key=lambda b: (-sizes[b.key], b.first, b.key)):
        size = sizes[b.key]
        live = sorted(
            (p.offset, p.offset + sizes[p.key])
            for p in placed
            if not (p.last < b.first or b.last < p.first)
        )
        offset = 0
        for start, end in live:
            if offset + size <= start:
                break
            offset = max(offset, _align(end))
        b.offset = offset
        placed.append(b)
        total = max(total, offset + size)
    return _align(total)


def plan(buffers: list[Buffer]) -> Plan:
    const_items: list[Buffer] = []
    row_items: list[Buffer] = []
    sizes: dict[int, int] = {}
    for b in buffers:
        c, per_row = split(b.size)
        if per_row:
            b.batch = True
            sizes[b.key] = _align(per_row)
            row_items.append(b)
        else:
            sizes[b.key] = _align(max(c, 1))
            const_items.append(b)
    const_bytes = _place(const_items, sizes)
    row_bytes = _place(row_items, sizes)
    return Plan({b.key: b for b in buffers}, const_bytes, row_bytes)
