"""Shape operators: views (Reshape, Flatten, Squeeze, Unsqueeze, Identity: no code), shape
arithmetic folded at build time (Shape, Size, Constant, Range), and data movement (Transpose,
Concat, Split, Gather, Slice, Expand, Tile, Pad, ConstantOfShape, Cast, Dropout).

Units fold over object arrays holding Batch sizes, so PyTorch's Shape -> Gather -> Concat ->
Reshape chains resolve at build time with the batch kept symbolic."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .. import dtypes as D
from ..clit import lit
from ..dims import Batch, Dim, Shape, add, cdim, mul, numel, static
from ..dtypes import DType
from ..errors import UnsupportedError
from . import loops
from .base import Emitter, Op, register

INT_MAX = (1 << 63) - 1


def _obj(v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.asarray(v, dtype=object) if v.dtype == object else v


def div(a: Dim, b: Dim, what: str) -> Dim:
    """a / b for sizes, exact."""
    if isinstance(b, Batch):
        if not isinstance(a, Batch) or a.k % b.k:
            raise UnsupportedError(f"{what}: {a} is not a multiple of {b}")
        return a.k // b.k
    if b == 0:
        raise UnsupportedError(f"{what}: division of a size by zero")
    if isinstance(a, Batch):
        return a // b
    if a % b:
        raise UnsupportedError(f"{what}: {a} is not a multiple of {b}")
    return a // b


class View(Op):
    VIEW = True

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        v = self.x(0).value
        if v is None:
            return None
        return [np.asarray(v).reshape([static(d) for d in self.oshape()])]

    def emit(self, e: Emitter) -> str:  # pragma: no cover - views emit nothing
        return ""


@register
class Identity(View):
    OP = "Identity"

    def infer(self) -> list[tuple[DType, Shape]]:
        return [(self.x(0).dtype, self.shape(0))]


@register
class Reshape(View):
    OP = "Reshape"
    SINCE = 5
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        src = self.shape(0)
        want = self.ints(1)
        allowzero = int(self.attr("allowzero", 0))
        out: list[Dim | None] = []
        for k, d in enumerate(want):
            if d == 0 and not allowzero:
                if k >= len(src):
                    self.fail(f"shape entry {k} is 0 but the input has rank {len(src)}")
                out.append(src[k])
            elif d == -1:
                out.append(None)
            elif isinstance(d, Batch) or d >= 0:
                out.append(d)
            else:
                self.fail(f"shape entry {d} is invalid")
        if out.count(None) > 1:
            self.fail("more than one -1 in the shape")
        if None in out:
            rest = numel([d for d in out if d is not None])
            out[out.index(None)] = div(numel(src), rest, f"{self.where}: {self.node.label}")
        shape = tuple(d for d in out if d is not None)
        if numel(shape) != numel(src):
            self.fail(f"cannot reshape {self.show(src)} to {self.show(shape)}")
        return [(self.x(0).dtype, shape)]


@register
class Flatten(View):
    OP = "Flatten"
    SINCE = 1

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        axis = int(self.attr("axis", 1))
        axis = axis + len(s) if axis < 0 else axis
        if not 0 <= axis <= len(s):
            self.fail(f"axis {axis} is out of range")
        return [(self.x(0).dtype, (numel(s[:axis]), numel(s[axis:])))]


@register
class Squeeze(View):
    OP = "Squeeze"
    SINCE = 1
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        axes = self.ints(1) if self.has(1) else self.attr("axes", None)
        if axes is None:
            axes = [k for k, d in enumerate(s) if d == 1]
        axes = {self.axis(int(a), len(s)) for a in axes}
        for a in axes:
            if s[a] != 1:
                self.fail(f"cannot squeeze axis {a} of size {s[a]}")
        return [(self.x(0).dtype, tuple(d for k, d in enumerate(s) if k not in axes))]


@register
class Unsqueeze(View):
    OP = "Unsqueeze"
    SINCE = 1
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        s = list(self.shape(0))
        axes = self.ints(1) if self.has(1) else self.attr("axes")
        rank = len(s) + len(axes)
        norm = sorted(self.axis(int(a), rank) for a in axes)
        if len(set(norm)) != len(norm):
            self.fail("repeated axes")
        for a in norm:
            s.insert(a, 1)
        return [(self.x(0).dtype, tuple(s))]


@register
class Shape_(Op):
    OP = "Shape"
    FROM_SHAPES = True

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        start, end = int(self.attr("start", 0)), self.attr("end", None)
        r = len(s)
        start = max(0, min(r, start + r if start < 0 else start))
        stop = r if end is None else int(end)
        stop = max(0, min(r, stop + r if stop < 0 else stop))
        self.dims = list(s[start:stop])
        return [(D.INT64, (len(self.dims),))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        if all(isinstance(d, int) for d in self.dims):
            return [np.array(self.dims, dtype=np.int64)]
        return [np.array(self.dims, dtype=object)]


@register
class Size(Op):
    OP = "Size"
    FROM_SHAPES = True

    def infer(self) -> list[tuple[DType, Shape]]:
        return [(D.INT64, ())]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        n = numel(self.shape(0))
        return [np.array(n, dtype=object if isinstance(n, Batch) else np.int64)]


@register
class Constant(Op):
    OP = "Constant"

    def infer(self) -> list[tuple[DType, Shape]]:
        attrs = self.node.attrs
        if "value" in attrs:
            v = np.asarray(attrs["value"])
        elif "value_float" in attrs:
            v = np.array(attrs["value_float"], dtype=np.float32)
        elif "value_floats" in attrs:
            v = np.array(attrs["value_floats"], dtype=np.float32)
        elif "value_int" in attrs:
            v = np.array(attrs["value_int"], dtype=np.int64)
        elif "value_ints" in attrs:
            v = np.array(attrs["value_ints"], dtype=np.int64)
        else:
            self.fail(f"only numeric values are supported (has {sorted(attrs)})")
        self.v = v
        dtype = D.from_numpy(v.dtype, f"{self.where}: {self.node.label}")
        return [(dtype, tuple(int(d) for d in v.shape))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        return [self.v]


@register
class ConstantOfShape(Op):
    OP = "ConstantOfShape"
    SINCE = 9
    STATIC_INPUTS = (0,)

    def infer(self) -> list[tuple[DType, Shape]]:
        shape = tuple(self.ints(0))
        value = self.attr("value", None)
        v = np.zeros(1, dtype=np.float32) if value is None else np.asarray(value).reshape(-1)
        self.v = v
        return [(D.from_numpy(v.dtype, f"{self.where}: {self.node.label}"), shape)]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        shape = self.oshape()
        if all(isinstance(d, int) for d in shape):
            return [np.full([static(d) for d in shape], self.v[0], dtype=self.v.dtype)]
        return None

    def emit(self, e: Emitter) -> str:
        dtype = self.out_dtype(0)
        n = self.numel_c(self.oshape())
        return f"for (u32 k = 0; k < {n}; k++) {e.out(0)}[k] = {lit(self.v[0], dtype)};"


@register
class Range(Op):
    OP = "Range"
    SINCE = 11
    STATIC_INPUTS = (0, 1, 2)

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.same_dtype(0, 1, 2)
        start, limit, delta = (np.asarray(self.value(i)).reshape(-1)[0] for i in (0, 1, 2))
        if isinstance(limit, Batch) and start == 0 and delta == 1:
            return [(dtype, (limit,))]
        if any(isinstance(v, Batch) for v in (start, limit, delta)):
            self.fail("a range over the batch must start at 0 with step 1")
        n = max(int(np.ceil((float(limit) - float(start)) / float(delta))), 0)
        return [(dtype, (n,))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        if isinstance(self.oshape()[0], Batch):
            return None
        start, _limit, delta = (np.asarray(self.value(i)).reshape(-1)[0] for i in (0, 1, 2))
        dtype = self.x(0).dtype.np
        n = static(self.oshape()[0])
        return [(start + np.arange(n) * delta).astype(dtype)]

    def emit(self, e: Emitter) -> str:
        return f"for (u32 k = 0; k < N; k++) {e.out(0)}[k] = k;"


# ----------------------------------------------------------------------------------- casting
def _cast_expr(src: DType, dst: DType, x: str) -> str:
    if dst.is_bool:
        return f"({x} != 0)"
    if src.is_bool:
        return f"({dst.c})({x} != 0)"
    if src.is_float and dst.is_int:
        # saturating (-mnontrapping-fptoint); NaN becomes 0
        return f"({dst.c})({x})"
    return f"({dst.c})({x})"


class _CastBase(Op):
    def target(self) -> DType:
        raise NotImplementedError

    def infer(self) -> list[tuple[DType, Shape]]:
        src = self.x(0).dtype
        dst = self.target()
        del src
        return [(dst, self.shape(0))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        t = self.x(0)
        if t.value is None:
            return None
        if t.symbolic:
            return [np.asarray(t.value, dtype=object)] if self.target().is_int else None
        with np.errstate(all="ignore"):
            return [np.asarray(t.value).astype(self.target().np)]

    def emit(self, e: Emitter) -> str:
        src, dst = self.x(0).dtype, self.target()
        n = self.numel_c(self.shape(0))
        return f"for (u32 k = 0; k < {n}; k++) {e.out(0)}[k] = {_cast_expr(src, dst, f'{e.inp(0)}[k]')};"


@register
class Cast(_CastBase):
    OP = "Cast"
    SINCE = 6

    def target(self) -> DType:
        return D.from_onnx(int(self.attr("to")), f"{self.where}: {self.node.label}: to")


@register
class CastLike(_CastBase):
    OP = "CastLike"
    SINCE = 15
    FROM_SHAPES = True  # only input 1's dtype is read

    def target(self) -> DType:
        return self.x(1).dtype


@register
class Dropout(Op):
    """Inference: the input unchanged, the mask all true. Training mode is refused."""

    OP = "Dropout"
    SINCE = 1
    STATIC_INPUTS = (2,)

    def infer(self) -> list[tuple[DType, Shape]]:
        if self.has(2) and bool(np.asarray(self.value(2)).reshape(-1)[0]):
            self.fail("training_mode=true is not supported (inference only)")
        s = self.shape(0)
        return [(self.x(0).dtype, s), (D.BOOL, s)]

    def emit(self, e: Emitter) -> str:
        n = self.numel_c(self.shape(0))
        mask = f" {e.out(1)}[k] = 1;" if self.has_out(1) else ""
        return f"for (u32 k = 0; k < {n}; k++) {{ {e.out(0)}[k] = {e.inp(0)}[k];{mask} }}"


# -------------------------------------------------------------------------------- movement
@register
class Transpose(Op):
    OP = "Transpose"

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        perm = self.attr("perm", None)
        perm = (
            list(range(len(s)))[::-1] if perm is None else [self.axis(int(p), len(s)) for p in perm]
        )
        if sorted(perm) != list(range(len(s))):
            self.fail(f"perm {perm} is not a permutation of {len(s)} axes")
        self.perm = perm
        return [(self.x(0).dtype, tuple(s[p] for p in perm))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        v = self.x(0).value
        return None if v is None else [np.transpose(v, self.perm)]

    def emit(self, e: Emitter) -> str:
        st = loops.strides(self.shape(0))
        in_st = [st[p] for p in self.perm]
        return loops.nest(
            self.oshape(), [in_st], lambda o, i: f"{e.out(0)}[{o}] = {e.inp(0)}[{i[0]}];", "j"
        )


@register
class Concat(Op):
    OP = "Concat"
    SINCE = 4

    def infer(self) -> list[tuple[DType, Shape]]:
        idx = [i for i in range(len(self.inputs)) if self.has(i)]
        dtype = self.same_dtype(*idx)
        shapes = [self.shape(i) for i in idx]
        rank = len(shapes[0])
        if any(len(s) != rank for s in shapes):
            self.fail("inputs differ in rank")
        self.ax = self.axis(int(self.attr("axis")), rank)
        out = list(shapes[0])
        total: Dim = 0
        for s in shapes:
            for k in range(rank):
                if k != self.ax and s[k] != out[k]:
                    self.fail(f"shapes {', '.join(map(self.show, shapes))} differ off the axis")
            total = add(total, s[self.ax])
        out[self.ax] = total
        return [(dtype, tuple(out))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        vals = [self.x(i).value for i in range(len(self.inputs)) if self.has(i)]
        if any(v is None for v in vals):
            return None
        arrays = [v for v in vals if v is not None]
        if any(v.dtype == object for v in arrays):
            arrays = [np.asarray(v, dtype=object) for v in arrays]
        return [np.concatenate(arrays, axis=self.ax)]

    def emit(self, e: Emitter) -> str:
        out = self.oshape()
        outer = numel(out[: self.ax])
        row = numel(out[self.ax :])
        parts = [i for i in range(len(self.inputs)) if self.has(i) and numel(self.shape(i)) != 0]
        t = self.out_dtype(0).c
        if len(parts) > 8:  # many inputs (an unrolled Scan's outputs): one loop over a table
            srcs = ", ".join(e.inp(i) for i in parts)
            lens = ", ".join(cdim(numel(self.shape(i)[self.ax :])) for i in parts)
            return (
                f"const {t} *const src[{len(parts)}] = {{{srcs}}};\n"
                f"const u32 len[{len(parts)}] = {{{lens}}};\n"
                "u32 off = 0;\n"
                f"for (u32 j = 0; j < {len(parts)}; j++) {{\n"
                f"  for (u32 a = 0; a < {cdim(outer)}; a++) for (u32 b = 0; b < len[j]; b++)\n"
                f"    {e.out(0)}[a * {cdim(row)} + off + b] = src[j][a * len[j] + b];\n"
                "  off += len[j];\n}"
            )
        lines = []
        offset: Dim = 0
        for i in parts:
            inner = numel(self.shape(i)[self.ax :])
            lines.append(
                f"for (u32 a = 0; a < {cdim(outer)}; a++) for (u32 b = 0; b < {cdim(inner)}; b++) "
                f"{e.out(0)}[a * {cdim(row)} + {cdim(offset)} + b] = {e.inp(i)}[a * {cdim(inner)} + b];"
            )
            offset = add(offset, inner)
        return "\n".join(lines)


@register
class Split(Op):
    OP = "Split"
    SINCE = 2
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        self.ax = self.axis(int(self.attr("axis", 0)), len(s))
        n_out = len(self.node.outputs)
        if self.has(1):
            sizes = self.ints(1)
        elif "split" in self.node.attrs:
            sizes = [int(v) for v in self.attr("split")]
        else:
            dim = s[self.ax]
            if isinstance(dim, Batch):
                self.fail("cannot split the batch")
            parts = int(self.attr("num_outputs", n_out))
            chunk = -(-dim // parts)
            sizes = [min(chunk, dim - k * chunk) for k in range(parts)]
        if sum(sizes) != s[self.ax] or len(sizes) != n_out:
            self.fail(f"split sizes {sizes} do not fit axis {self.ax} of {self.show(s)}")
        self.sizes = sizes
        return [
            (self.x(0).dtype, (*tuple(s[: self.ax]), z, *tuple(s[self.ax + 1 :]))) for z in sizes
        ]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        outer = numel(s[: self.ax])
        inner = numel(s[self.ax + 1 :])
        row = mul(s[self.ax], inner)
        lines = []
        offset = 0
        for j, z in enumerate(self.sizes):
            width = mul(z, inner)
            if self.has_out(j):
                lines.append(
                    f"for (u32 a = 0; a < {cdim(outer)}; a++) for (u32 b = 0; b < {cdim(width)}; b++) "
                    f"{e.out(j)}[a * {cdim(width)} + b] = {e.inp(0)}[a * {cdim(row)} + {cdim(mul(offset, inner))} + b];"
                )
            offset += z
        return "\n".join(lines)


@register
class Gather(Op):
    """Indices are checked at run time: out of range ends the run with an error."""

    OP = "Gather"
    SINCE = 1

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        self.need(1, (D.INT32, D.INT64))
        self.ax = self.axis(int(self.attr("axis", 0)), len(s))
        if isinstance(s[self.ax], Batch):
            self.fail("gathering along the batch axis is not supported")
        return [(self.x(0).dtype, tuple(s[: self.ax]) + self.shape(1) + tuple(s[self.ax + 1 :]))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        data, idx = self.x(0).value, self.x(1).value
        if data is None or idx is None or idx.dtype == object:
            return None
        if data.dtype != object:
            return None  # the reference implementation
        return [np.take(data, idx.astype(np.int64), axis=self.ax)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        outer = numel(s[: self.ax])
        dim = s[self.ax]
        inner = numel(s[self.ax + 1 :])
        count = numel(self.shape(1))
        bad = e.error("index out of range")
        return (
            f"for (u32 q = 0; q < {cdim(count)}; q++) {{ i64 ix = (i64){e.inp(1)}[q]; "
            f"if (ix < -(i64){cdim(dim)} || ix >= (i64){cdim(dim)}) {bad} }}\n"
            f"for (u32 a = 0; a < {cdim(outer)}; a++)\n"
            f"  for (u32 q = 0; q < {cdim(count)}; q++) {{\n"
            f"    i64 ix = (i64){e.inp(1)}[q]; if (ix < 0) ix += {cdim(dim)};\n"
            f"    for (u32 b = 0; b < {cdim(inner)}; b++)\n"
            f"      {e.out(0)}[(a * {cdim(count)} + q) * {cdim(inner)} + b] = "
            f"{e.inp(0)}[(a * {cdim(dim)} + (u32)ix) * {cdim(inner)} + b];\n  }}"
        )


@register
class Slice(Op):
    OP = "Slice"
    SINCE = 10
    STATIC_INPUTS = (1, 2, 3, 4)

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        starts, ends = self.ints(1), self.ints(2)
        axes = self.ints(3) if self.has(3) else list(range(len(starts)))
        steps = self.ints(4) if self.has(4) else [1] * len(starts)
        self.start = [0] * len(s)
        self.step = [1] * len(s)
        out = list(s)
        for a, b, axis, st in zip(starts, ends, axes, steps, strict=True):
            ax = self.axis(int(axis), len(s))
            dim = s[ax]
            if st == 0:
                self.fail("a step of 0")
            if isinstance(dim, Batch):
                if (
                    a == 0
                    and st == 1
                    and (
                        (isinstance(b, Batch) and b == dim)
                        or (isinstance(b, int) and b >= INT_MAX // 2)
                    )
                ):
                    continue
                self.fail("slicing the batch axis is not supported")
            if isinstance(a, Batch) or isinstance(b, Batch):
                self.fail(
                    "slice bounds computed from the batch are only supported on the batch axis"
                )
            lo, hi, step = slice(int(a), int(b), int(st)).indices(int(dim))
            n = len(range(lo, hi, step))
            self.start[ax], self.step[ax], out[ax] = lo, step, n
        return [(self.x(0).dtype, tuple(out))]

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        v = self.x(0).value
        if v is None:
            return None
        idx = tuple(
            slice(st, st + step * static(n), step)
            if step > 0
            else slice(st, (st + step * static(n)) if st + step * static(n) >= 0 else None, step)
            for st, step, n in zip(self.start, self.step, self.oshape(), strict=True)
        )
        return [np.asarray(v)[idx]]

    def emit(self, e: Emitter) -> str:
        st = loops.strides(self.shape(0))
        base = sum(self.start[k] * static(st[k]) for k in range(len(st)) if self.start[k])
        in_st = [mul(st[k], self.step[k]) for k in range(len(st))]
        return loops.nest(
            self.oshape(),
            [in_st],
            lambda o, i: f"{e.out(0)}[{o}] = {e.inp(0)}[{base} + {i[0]}];",
            "j",
            collapse=False,
        )


@register
class Expand(Op):
    OP = "Expand"
    SINCE = 8
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        want = tuple(self.ints(1))
        out = loops.broadcast([self.shape(0), want], f"{self.where}: {self.node.label}")
        return [(self.x(0).dtype, out)]

    def emit(self, e: Emitter) -> str:
        out = self.oshape()
        return loops.nest(
            out,
            [loops.bstrides(self.shape(0), out)],
            lambda o, i: f"{e.out(0)}[{o}] = {e.inp(0)}[{i[0]}];",
            "j",
        )


@register
class Tile(Op):
    OP = "Tile"
    SINCE = 6
    STATIC_INPUTS = (1,)

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        reps = self.ints(1)
        if len(reps) != len(s) or any(isinstance(r, Batch) or r < 0 for r in reps):
            self.fail(f"repeats {reps} do not fit rank {len(s)}")
        return [(self.x(0).dtype, tuple(mul(d, int(r)) for d, r in zip(s, reps, strict=True)))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        out = self.oshape()
        st = loops.strides(s)
        idx = [f"t{k}" for k in range(len(s))]
        loops_c = "".join(
            f"for (u32 {i} = 0; {i} < {cdim(d)}; {i}++) " for i, d in zip(idx, out, strict=True)
        )
        src = (
            " + ".join(
                f"({i} % {cdim(d)}) * {cdim(stv)}" for i, d, stv in zip(idx, s, st, strict=True)
            )
            or "0"
        )
        if any(d == 0 for d in out):
            return "/* empty */"
        return f"{{ u32 o = 0; {loops_c}{e.out(0)}[o++] = {e.inp(0)}[{src}]; }}"


@register
class Pad(Op):
    OP = "Pad"
    SINCE = 11
    STATIC_INPUTS = (1, 3)  # the constant value (2) may be computed at run time

    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        pads = self.ints(1)
        axes = self.ints(3) if self.has(3) else list(range(len(s)))
        axes = [self.axis(int(a), len(s)) for a in axes]
        if len(pads) != 2 * len(axes):
            self.fail("pads do not fit the axes")
        self.mode = self.attr("mode", "constant")
        if self.mode not in ("constant", "edge", "reflect", "wrap"):
            self.fail(f"mode {self.mode!r} is not supported")
        self.before = [0] * len(s)
        self.after = [0] * len(s)
        for j, a in enumerate(axes):
            self.before[a], self.after[a] = int(pads[j]), int(pads[j + len(axes)])
        out: list[Dim] = []
        for k, d in enumerate(s):
            if isinstance(d, Batch):
                if self.before[k] or self.after[k]:
                    self.fail("padding the batch axis is not supported")
                out.append(d)
            else:
                n = d + self.before[k] + self.after[k]
                if n < 0 or (self.mode != "constant" and d == 0 and n > 0):
                    self.fail("invalid pads")
                out.append(n)
        known = self.has(2) and self.x(2).value is not None
        self.fill = (
            lit(np.asarray(self.x(2).value).reshape(-1)[0], self.x(0).dtype)
            if known and numel(self.shape(2)) != 0
            else ("pad_value" if self.has(2) and numel(self.shape(2)) != 0 else "0")
        )
        return [(self.x(0).dtype, tuple(out))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        out = self.oshape()
        st = loops.strides(s)
        dtype = self.x(0).dtype
        lines = ["u32 o = 0;"]
        idx = [f"p{k}" for k in range(len(s))]
        open_ = "".join(
            f"for (i64 {i} = 0; {i} < {cdim(d)}; {i}++) " for i, d in zip(idx, out, strict=True)
        )
        conds = []
        terms = []
        for k, d in enumerate(s):
            dc = cdim(d)
            src = f"({idx[k]} - {self.before[k]})"
            if self.mode == "constant":
                conds.append(f"{src} < 0 || {src} >= {dc}")
                terms.append(f"{src} * {cdim(st[k])}")
            elif self.mode == "edge":
                terms.append(
                    f"({src} < 0 ? 0 : ({src} >= {dc} ? {dc} - 1 : {src})) * {cdim(st[k])}"
                )
            elif self.mode == "wrap":
                terms.append(f"((({src} % (i64){dc}) + {dc}) % (i64){dc}) * {cdim(st[k])}")
            else:  # reflect: period 2*(d-1)
                per = f"(2 * ((i64){dc} - 1))"
                m = f"((({src} % {per}) + {per}) % {per})"
                terms.append(f"({dc} == 1 ? 0 : ({m} < {dc} ? {m} : {per} - {m})) * {cdim(st[k])}")
        src_ix = " + ".join(terms) or "0"
        if any(d == 0 for d in out):
            return "/* empty */"
        if self.fill == "pad_value":
            lines.append(f"const {dtype.c} pad_value = {e.inp(2)}[0];")
        if conds:
            body = f"{e.out(0)}[o++] = ({' || '.join(conds)}) ? {self.fill} : {e.inp(0)}[{src_ix}];"
        else:
            body = f"{e.out(0)}[o++] = {e.inp(0)}[{src_ix}];"
        lines.append(open_ + "{ " + body + " }")
        return "{ " + "\n".join(lines) + " }"


_ = (ClassVar, INT_MAX)


class _DepthSpace(Op):
    def infer(self) -> list[tuple[DType, Shape]]:
        s = self.shape(0)
        if len(s) != 4 or any(isinstance(d, Batch) for d in s[1:]):
            self.fail("expects [N, C, H, W] with the batch first")
        self.bs = int(self.attr("blocksize"))
        n, c, h, w = s[0], static(s[1]), static(s[2]), static(s[3])
        b = self.bs
        if self.OP == "DepthToSpace":
            if c % (b * b):
                self.fail(f"channels {c} are not a multiple of blocksize^2")
            self.mode = self.attr("mode", "DCR")
            if self.mode not in ("DCR", "CRD"):
                self.fail(f"mode={self.mode!r} is not DCR or CRD")
            return [(self.x(0).dtype, (n, c // (b * b), h * b, w * b))]
        if h % b or w % b:
            self.fail("height and width must be multiples of blocksize")
        self.mode = self.attr("mode", "DCR")
        if self.mode not in ("DCR", "CRD"):
            self.fail(f"mode={self.mode!r} is not DCR or CRD")
        return [(self.x(0).dtype, (n, c * b * b, h // b, w // b))]

    def emit(self, e: Emitter) -> str:
        # expressed as a 6-D transpose of a reshaped view (as the spec defines both)
        s = self.shape(0)
        n, c, h, w = s[0], static(s[1]), static(s[2]), static(s[3])
        b = self.bs
        if self.OP == "DepthToSpace":
            if self.mode == "DCR":
                shape6, perm = (n, b, b, c // (b * b), h, w), [0, 3, 4, 1, 5, 2]
            else:
                shape6, perm = (n, c // (b * b), b, b, h, w), [0, 1, 4, 2, 5, 3]
        elif self.mode == "DCR":
            shape6, perm = (n, c, h // b, b, w // b, b), [0, 3, 5, 1, 2, 4]
        else:
            shape6, perm = (n, c, h // b, b, w // b, b), [0, 1, 3, 5, 2, 4]
        st = loops.strides(shape6)
        out6 = tuple(shape6[p] for p in perm)
        return loops.nest(
            out6,
            [[st[p] for p in perm]],
            lambda o, i: f"{e.out(0)}[{o}] = {e.inp(0)}[{i[0]}];",
            "j",
        )


@register
class DepthToSpace(_DepthSpace):
    OP = "DepthToSpace"
    SINCE = 11


@register
class SpaceToDepth(_DepthSpace):
    OP = "SpaceToDepth"
