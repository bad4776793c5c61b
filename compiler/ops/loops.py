"""Loop nests over shapes with the batch symbolic: contiguous strides, numpy broadcasting, and
one emitter for every 'walk the output, index each input' kernel (elementwise, Where, Expand,
reductions, Transpose)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..dims import Batch, Dim, Shape, cdim, mul
from ..errors import UnsupportedError


def strides(shape: Sequence[Dim]) -> list[Dim]:
    out: list[Dim] = [1] * len(shape)
    acc: Dim = 1
    for k in range(len(shape) - 1, -1, -1):
        out[k] = acc
        acc = mul(acc, shape[k])
    return out


def broadcast(shapes: Sequence[Shape], what: str) -> Shape:
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        big = [d for d in dims if d != 1]
        if not big:
            out.append(1)
            continue
        first = big[0]
        if any(d != first for d in big):
            raise UnsupportedError(f"{what}: shapes {', '.join(map(str, shapes))} do not broadcast")
        out.append(first)
    return tuple(out)


def bstrides(in_shape: Shape, out_shape: Shape) -> list[Dim]:
    """Strides of an input walked in the output's index space (0 where it is broadcast)."""
    pad = len(out_shape) - len(in_shape)
    shape = (1,) * pad + tuple(in_shape)
    st = strides(shape)
    return [0 if shape[k] == 1 and out_shape[k] != 1 else st[k] for k in range(len(out_shape))]


def _collapse(
    dims: list[Dim], operand_strides: list[list[Dim]]
) -> tuple[list[Dim], list[list[Dim]]]:
    """Drop size-1 axes and merge adjacent axes that every operand walks contiguously."""
    keep = [k for k, d in enumerate(dims) if d != 1]
    dims = [dims[k] for k in keep]
    operand_strides = [[s[k] for k in keep] for s in operand_strides]
    k = len(dims) - 2
    while k >= 0:
        ok = all(
            s[k] == mul(s[k + 1], dims[k + 1]) or (s[k] == 0 and s[k + 1] == 0)
            for s in operand_strides
        )
        if ok:
            dims[k] = mul(dims[k], dims[k + 1])
            del dims[k + 1]
            for s in operand_strides:
                del s[k]
        k -= 1
    return dims, operand_strides


def _term(i: str, s: Dim) -> str | None:
    if s == 0:
        return None
    if s == 1:
        return i
    return f"{i}*{cdim(s)}"


def nest(
    out_shape: Shape,
    in_strides: Sequence[Sequence[Dim]],
    body: Callable[[str, list[str]], str],
    tag: str,
    collapse: bool = True,
) -> str:
    """Loops over `out_shape` in row-major order; `body(out_index, [in_index...])` is the inner
    statement. Input index expressions come from `in_strides` (one list per input)."""
    dims = list(out_shape)
    ops = [list(strides(out_shape))] + [list(s) for s in in_strides]
    if collapse:
        dims, ops = _collapse(dims, ops)
    if any(d == 0 for d in dims):
        return "/* empty tensor */"
    if not dims:
        return "{ " + body("0", ["0"] * len(in_strides)) + " }"
    idx = [f"{tag}{k}" for k in range(len(dims))]
    exprs: list[str] = []
    for s in ops:
        terms = [t for t in (_term(idx[k], s[k]) for k in range(len(dims))) if t]
        exprs.append(" + ".join(terms) if terms else "0")
    lines = []
    for k, d in enumerate(dims):
        lines.append(f"for (u32 {idx[k]} = 0; {idx[k]} < {cdim(d)}; {idx[k]}++)")
    return "\n".join(lines) + " {\n  " + body(exprs[0], exprs[1:]) + "\n}"


def is_batch(d: Dim) -> bool:
    return isinstance(d, Batch)
