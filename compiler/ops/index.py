"""Index operators: GatherElements, GatherND, ScatterElements, ScatterND, OneHot, Trilu,
EyeLike, CumSum, CumProd, ReverseSequence, TopK. Indices read at run time are checked (out of range ends the run with an
error, never a stray read or write)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .. import dtypes as D
from ..clit import lit
from ..dims import Batch, Shape, cdim, numel, static
from ..dtypes import DType
from . import loops
from .base import Emitter, Op, register

INDEX = (D.INT32, D.INT64)


def along_axis(op: Op, e: Emitter, ax: int, use: Callable[[str, str], str]) -> str:
    """A walk over op's indices (input 1), each one checked and made non-negative, which
    `use(o, at)` turns into a statement: o the position in the indices, at the data's element
    (input 0's shape) that the index picks along `ax`."""
    s, i = op.shape(0), op.shape(1)
    dim = static(s[ax])
    st = loops.strides(s)
    other = [st[k] if k != ax else 0 for k in range(len(s))]
    bad = e.error("index out of range")

    def body(o: str, ins: list[str]) -> str:
        return (
            f"i64 ix = (i64){e.inp(1)}[{o}]; if (ix < -{dim} || ix >= {dim}) {bad} "
            f"if (ix < 0) ix += {dim}; " + use(o, f"{ins[0]} + (u32)ix * {cdim(st[ax])}")
        )

    return loops.nest(i, [other], body, "j", collapse=False)


def by_index_tuples(op: Op, e: Emitter, depth: int, use: Callable[[str], str]) -> str:
    """A walk over op's index tuples (input 1's last axis, `depth` long; the batch may be one
    of the axes they index), each index checked and made non-negative: `use(n)` is the
    statement for tuple q, whose slice of n elements starts at `base` in the data (input 0)."""
    s, i = op.shape(0), op.shape(1)
    st = loops.strides(s)
    bad = e.error("index out of range")
    lines = [f"for (u32 q = 0; q < {cdim(numel(i[:-1]))}; q++) {{", "  u32 base = 0;"]
    for k in range(depth):
        d = f"(i64){cdim(s[k])}"  # the batch's size is known at run time only
        lines.append(
            f"  {{ i64 ix = {e.inp(1)}[q * {depth} + {k}]; if (ix < -{d} || ix >= {d}) {bad} "
            f"if (ix < 0) ix += {d}; base += (u32)ix * {cdim(st[k])}; }}"
        )
    lines += [use(cdim(numel(s[depth:]))), "}"]
    return "\n".join(lines)


@register
class GatherElements(Op):
    OP = "GatherElements"
    SINCE = 11

    def infer(self) -> list[tuple[DType, Shape]]:
        s, i = self.shape(0), self.shape(1)
        self.need(1, INDEX)
        if len(s) != len(i):
            self.fail("data and indices differ in rank")
        self.ax = self.axis(int(self.attr("axis", 0)), len(s))
        if isinstance(s[self.ax], Batch):
            self.fail("gathering along the batch axis is not supported")
        return [(self.x(0).dtype, i)]

    def emit(self, e: Emitter) -> str:
        return along_axis(self, e, self.ax, lambda o, at: f"{e.out(0)}[{o}] = {e.inp(0)}[{at}];")


@register
class GatherND(Op):
    OP = "GatherND"
    SINCE = 11

    def infer(self) -> list[tuple[DType, Shape]]:
        s, i = self.shape(0), self.shape(1)
        self.need(1, (D.INT64,))
        self.b = int(self.attr("batch_dims", 0))
        if self.b:
            self.fail("batch_dims > 0 is not supported")
        if not i or isinstance(i[-1], Batch):
            self.fail("the last axis of the indices must be static")
        self.depth = static(i[-1])
        if self.depth > len(s):
            self.fail(f"indices of depth {self.depth} index more axes than the data has")
        return [(self.x(0).dtype, tuple(i[:-1]) + tuple(s[self.depth :]))]

    def emit(self, e: Emitter) -> str:
        return by_index_tuples(
            self, e, self.depth,
            lambda n: f"  for (u32 b = 0; b < {n}; b++) {e.out(0)}[q * {n} + b] = {e.inp(0)}[base + b];",
        )  # fmt: skip


@register
class OneHot(Op):
    OP = "OneHot"
    SINCE = 9
    STATIC_INPUTS = (1, 2)

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, D.NUMERIC)
        depth = np.asarray(self.value(1)).reshape(-1)[0]
        if isinstance(depth, Batch):
            self.fail("depth cannot depend on the batch")
        self.depth = int(depth)
        self.values = np.asarray(self.value(2)).reshape(-1)
        s = list(self.shape(0))
        self.ax = self.axis(int(self.attr("axis", -1)), len(s) + 1)
        s.insert(self.ax, self.depth)
        return [(self.x(2).dtype, tuple(s))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        outer, inner = numel(s[: self.ax]), numel(s[self.ax :])
        dtype = self.x(2).dtype
        off, on = lit(self.values[0], dtype), lit(self.values[1], dtype)
        d = self.depth
        return (
            f"for (u32 a = 0; a < {cdim(outer)}; a++) for (u32 c = 0; c < {d}; c++) "
            f"for (u32 b = 0; b < {cdim(inner)}; b++) {{\n"
            f"  i64 v = (i64){e.inp(0)}[a * {cdim(inner)} + b]; if (v < 0) v += {d};\n"
            f"  {e.out(0)}[(a * {d} + c) * {cdim(inner)} + b] = v == (i64)c ? {on} : {off}; }}"
        )


@register
class Trilu(Op):
    OP = "Trilu"
    SINCE = 14
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        if len(s) < 2 or any(isinstance(d, Batch) for d in s[-2:]):
            self.fail("expects [..., rows, cols] with static rows and cols")
        self.k = int(np.asarray(self.value(1)).reshape(-1)[0]) if self.has(1) else 0
        self.upper = int(self.attr("upper", 1))
        return [(self.x(0).dtype, s)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        rows, cols = static(s[-2]), static(s[-1])
        keep = f"(i64)c - (i64)r >= {self.k}" if self.upper else f"(i64)c - (i64)r <= {self.k}"
        return (
            f"for (u32 m = 0; m < {cdim(numel(s[:-2]))}; m++) for (u32 r = 0; r < {rows}; r++) "
            f"for (u32 c = 0; c < {cols}; c++) {{ const u32 i = (m * {rows} + r) * {cols} + c; "
            f"{e.out(0)}[i] = ({keep}) ? {e.inp(0)}[i] : 0; }}"
        )


@register
class EyeLike(Op):
    OP = "EyeLike"
    SINCE = 9
    FROM_SHAPES = True

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        if len(s) != 2 or any(isinstance(d, Batch) for d in s):
            self.fail("expects a static matrix")
        dt = self.attr("dtype", None)
        self.dt = (
            D.from_onnx(int(dt), f"{self.where}: {self.node.label}")
            if dt is not None
            else self.x(0).dtype
        )
        return [(self.dt, s)]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        r, c = (static(d) for d in self.shape(0))
        return [np.eye(r, c, k=int(self.attr("k", 0)), dtype=self.dt.np)]


@register
class CumSum(Op):
    OP = "CumSum"
    SINCE = 11
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.NUMERIC)
        s = self.shape(0)
        self.ax = self.axis(int(np.asarray(self.value(1)).reshape(-1)[0]), len(s))
        if isinstance(s[self.ax], Batch):
            self.fail("a cumulative sum along the batch is not supported")
        self.exclusive = int(self.attr("exclusive", 0))
        self.reverse = int(self.attr("reverse", 0))
        return [(dtype, s)]

    # the running total: its start and how an element joins it
    START: ClassVar[str] = "0"
    JOIN: ClassVar[str] = "+="

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        outer, length, inner = numel(s[: self.ax]), static(s[self.ax]), numel(s[self.ax + 1 :])
        order = f"(u32)({length - 1} - j)" if self.reverse else "j"
        join = f"acc {self.JOIN} x[p];"
        step = f"y[p] = acc; {join}" if self.exclusive else f"{join} y[p] = acc;"
        return (
            f"for (u32 a = 0; a < {cdim(outer)}; a++) for (u32 b = 0; b < {cdim(inner)}; b++) {{\n"
            f"  const {t} *x = {e.inp(0)} + a * {length} * {cdim(inner)} + b;\n"
            f"  {t} *y = {e.out(0)} + a * {length} * {cdim(inner)} + b;\n"
            f"  {t} acc = {self.START};\n"
            f"  for (u32 j = 0; j < {length}; j++) {{ const u32 p = {order} * {cdim(inner)}; {step} }}\n}}"
        )


@register
class CumProd(CumSum):
    """CumSum's walk with products (opset 26): exclusive starts from 1."""

    OP = "CumProd"
    SINCE = 26
    START = "1"
    JOIN = "*="


@register
class ReverseSequence(Op):
    """Each batch row's first `sequence_lens[b]` steps reversed along the time axis, the rest
    copied (how TensorFlow's converted bidirectional layers run backwards); the lengths are
    read at run time and checked."""

    OP = "ReverseSequence"
    SINCE = 10

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        if len(s) < 2:
            self.fail("expects at least [time, batch] (rank 2)")
        self.time_ax = self.axis(int(self.attr("time_axis", 0)), len(s))
        self.batch_ax = self.axis(int(self.attr("batch_axis", 1)), len(s))
        if {self.time_ax, self.batch_ax} != {0, 1}:
            self.fail("time_axis and batch_axis must be 0 and 1, one each")
        if isinstance(s[self.time_ax], Batch):
            self.fail("reversing along the batch is not supported")
        self.need(1, INDEX)
        if self.shape(1) != (s[self.batch_ax],):
            self.fail(f"sequence_lens must have shape [{s[self.batch_ax]}]")
        return [(self.x(0).dtype, s)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        steps, rows = static(s[self.time_ax]), cdim(s[self.batch_ax])
        inner = cdim(numel(s[2:]))
        at = "((u64)(T_) * {rows} + b)" if self.time_ax == 0 else "((u64)b * {steps} + (T_))"
        at = at.format(rows=rows, steps=steps)
        bad = e.error(f"sequence_lens must be between 0 and the sequence length ({steps})")
        src, dst = at.replace("T_", "len - 1 - j"), at.replace("T_", "j")
        return (
            f"for (u32 b = 0; b < {rows}; b++) {{\n"
            f"  const i64 len = (i64){e.inp(1)}[b]; if (len < 0 || len > {steps}) {{ {bad} }}\n"
            f"  for (i64 j = 0; j < {steps}; j++) for (u32 k = 0; k < {inner}; k++)\n"
            f"    {e.out(0)}[{dst} * {inner} + k] = {e.inp(0)}[(j < len ? {src} : {dst}) * {inner} + k];\n}}"
        )


@register
class TopK(Op):
    """Selection by repeated scans (k is small in practice); ties keep the lower index first,
    as the spec asks; NaN counts as the largest value (numpy's order)."""

    OP = "TopK"
    SINCE = 10
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.NUMERIC)
        s = list(self.shape(0))
        self.ax = self.axis(int(self.attr("axis", -1)), len(s))
        if isinstance(s[self.ax], Batch):
            self.fail("TopK along the batch is not supported")
        k = np.asarray(self.value(1)).reshape(-1)[0]
        if isinstance(k, Batch) or not 0 <= int(k) <= static(s[self.ax]):
            self.fail(f"k={k} does not fit axis {self.ax} of size {s[self.ax]}")
        self.k = int(k)
        self.largest = int(self.attr("largest", 1))
        if not int(self.attr("sorted", 1)):
            pass  # sorted output is one valid order of an unsorted TopK
        s[self.ax] = self.k
        return [(dtype, tuple(s)), (D.INT64, tuple(s))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype
        outer, length, inner = numel(s[: self.ax]), static(s[self.ax]), numel(s[self.ax + 1 :])
        nan_big = " || (v != v && bv == bv)" if t.is_float else ""
        better = (
            f"(v > bv{nan_big})"
            if self.largest
            else "(v < bv || (bv != bv && v == v))"
            if t.is_float
            else "(v < bv)"
        )
        k = self.k
        vals = e.out(0)
        idx = e.out(1) if self.has_out(1) else None
        store_idx = f" {idx}[base_o + q * {cdim(inner)}] = best;" if idx else ""
        return (
            f"u8 *taken = scratch;\n"
            f"for (u32 a = 0; a < {cdim(outer)}; a++) for (u32 b = 0; b < {cdim(inner)}; b++) {{\n"
            f"  const {t.c} *x = {e.inp(0)} + a * {length} * {cdim(inner)} + b;\n"
            f"  const u32 base_o = a * {k} * {cdim(inner)} + b;\n"
            f"  for (u32 j = 0; j < {length}; j++) taken[j] = 0;\n"
            f"  for (u32 q = 0; q < {k}; q++) {{\n"
            f"    i32 best = -1; {t.c} bv = 0;\n"
            f"    for (u32 j = 0; j < {length}; j++) {{ if (taken[j]) continue; const {t.c} v = x[j * {cdim(inner)}];\n"
            f"      if (best < 0 || {better}) {{ best = (i32)j; bv = v; }} }}\n"
            f"    taken[best] = 1; {vals}[base_o + q * {cdim(inner)}] = bv;{store_idx}\n  }}\n}}"
        )

    def scratch_bytes(self) -> int:
        return max(1, static(self.shape(0)[self.ax]))


_REDUCE = {
    "none": "u",
    "add": "v + u",
    "mul": "v * u",
    "max": "(u > v ? u : v)",
    "min": "(u < v ? u : v)",
}


class _Scatter(Op):
    """The output is the data with updates written (or combined by `reduction`) at the
    indices, in the order the updates come, as onnxruntime writes them."""

    how: str  # the C expression of the reduction (v: the value there, u: the update)

    def reduction(self) -> str:
        how = str(self.attr("reduction", "none"))
        if how not in _REDUCE:
            self.fail(f"reduction={how!r} is not supported ({', '.join(_REDUCE)})")
        if how != "none" and self.x(0).dtype == D.BOOL:
            self.fail(f"reduction={how!r} of booleans is not supported")
        return _REDUCE[how]

    def copy(self, e: Emitter) -> str:
        n = cdim(numel(self.shape(0)))
        return f"for (u32 q = 0; q < {n}; q++) {e.out(0)}[q] = {e.inp(0)}[q];\n"

    def combine(self, target: str, update: str) -> str:
        t = self.x(0).dtype.c
        return f"{{ const {t} v = {target}, u = {update}; (void)v; {target} = ({t})({self.how}); }}"


@register
class ScatterElements(_Scatter):
    OP = "ScatterElements"
    SINCE = 11
    NOTES = (
        "reduction none, add, mul, max or min (updates applied in order); indices checked at "
        "run time; not along the batch axis"
    )

    def infer(self) -> list[tuple[DType, Shape]]:
        s, i = self.shape(0), self.shape(1)
        self.need(1, INDEX)
        if self.shape(2) != i:
            self.fail("updates must have the indices' shape")
        if self.x(2).dtype != self.x(0).dtype:
            self.fail("updates must have the data's element type")
        if len(s) != len(i):
            self.fail("data and indices differ in rank")
        self.ax = self.axis(int(self.attr("axis", 0)), len(s))
        if isinstance(s[self.ax], Batch):
            self.fail("scattering along the batch axis is not supported")
        for k, (ds, di) in enumerate(zip(s, i, strict=True)):
            if k != self.ax and isinstance(ds, int) and isinstance(di, int) and di > ds:
                self.fail(f"indices are larger than the data on axis {k}")
            if isinstance(ds, Batch) != isinstance(di, Batch):
                self.fail("the batch must be the same axis of data and indices")
        self.how = self.reduction()
        return [(self.x(0).dtype, s)]

    def emit(self, e: Emitter) -> str:
        return self.copy(e) + along_axis(
            self, e, self.ax,
            lambda o, at: self.combine(f"{e.out(0)}[{at}]", f"{e.inp(2)}[{o}]"),
        )  # fmt: skip


@register
class Scatter(ScatterElements):
    """ScatterElements under its name before opset 11 (deprecated there)."""

    OP = "Scatter"
    SINCE = 9


@register
class ScatterND(_Scatter):
    OP = "ScatterND"
    SINCE = 11
    NOTES = (
        "reduction none, add, mul, max or min (updates applied in order); indices checked at "
        "run time and may index the batch"
    )

    def infer(self) -> list[tuple[DType, Shape]]:
        s, i = self.shape(0), self.shape(1)
        self.need(1, (D.INT64,))
        if not i or isinstance(i[-1], Batch):
            self.fail("the last axis of the indices must be static")
        self.depth = static(i[-1])
        if self.depth > len(s):
            self.fail(f"indices of depth {self.depth} index more axes than the data has")
        want = tuple(i[:-1]) + tuple(s[self.depth :])
        if self.shape(2) != want:
            self.fail(f"updates must have shape {self.show(want)}, not {self.show(self.shape(2))}")
        if self.x(2).dtype != self.x(0).dtype:
            self.fail("updates must have the data's element type")
        self.how = self.reduction()
        return [(self.x(0).dtype, s)]

    def emit(self, e: Emitter) -> str:
        return self.copy(e) + by_index_tuples(
            self, e, self.depth,
            lambda n: f"  for (u32 b = 0; b < {n}; b++) "
            + self.combine(f"{e.out(0)}[base + b]", f"{e.inp(2)}[q * {n} + b]"),
        )  # fmt: skip
