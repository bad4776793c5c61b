"""Gemm and MatMul: row-major i-k-j kernels whose inner loop runs along the output row, so
clang vectorises it with SIMD128 without reassociating sums. Constant transposed weights
(PyTorch's Linear, skl2onnx's Gemm) are re-laid out at build time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .. import dtypes as D
from ..clit import lit
from ..dims import Batch, Dim, Shape, cdim, mul, numel, static
from ..dtypes import DType
from . import loops
from .base import Emitter, Op, register

TYPES = (*D.FLOATS, D.INT32, D.INT64, D.UINT32, D.UINT64)


def kernel(
    dtype: DType,
    m: Dim,
    k: int,
    n: int,
    a: str,
    b: str,
    y: str,
    a_rows: bool = True,
    alpha: float = 1.0,
    init: str | None = None,
    b_kn: bool = True,
) -> str:
    """y[m,n] (= init) + alpha * sum_k a[m,k] * b[k,n]; `a_rows`: a is [m,k] (else [k,m]);
    `b_kn`: b is [k,n] (else [n,k]); `init(row, col)` is a C expression or None for 0."""
    t = dtype.c
    if dtype.c == "float" and a_rows and b_kn:  # the SIMD kernel (mf_rt.h), same sums
        fill = (
            f"for (u32 r = 0; r < {cdim(m)}; r++) for (u32 c = 0; c < {n}; c++) {y}[r * {n} + c] = {init};\n"
            if init
            else f"for (u32 i = 0; i < {cdim(m)} * {n}; i++) {y}[i] = 0;\n"
        )
        return fill + f"mf_gemm_f32({cdim(m)}, {k}, {n}, {a}, {b}, {y}, {lit(alpha, dtype)});"
    a_ix = f"r * {k} + q" if a_rows else f"q * {cdim(m)} + r"
    b_ix = f"q * {n} + c" if b_kn else f"c * {k} + q"
    scale = "" if alpha == 1.0 else f"{lit(alpha, dtype)} * "
    init_c = init or "0"
    return (
        f"for (u32 r = 0; r < {cdim(m)}; r++) {{\n"
        f"  {t} *yr = {y} + r * {n};\n"
        f"  for (u32 c = 0; c < {n}; c++) yr[c] = {init_c};\n"
        f"  for (u32 q = 0; q < {k}; q++) {{\n"
        f"    const {t} av = {scale}{a}[{a_ix}];\n"
        f"    for (u32 c = 0; c < {n}; c++) yr[c] += av * {b}[{b_ix}];\n"
        "  }\n}"
    )


@register
class Gemm(Op):
    OP = "Gemm"
    SINCE = 7

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, TYPES)
        self.same_dtype(0, 1)
        a, b = self.shape(0), self.shape(1)
        if len(a) != 2 or len(b) != 2:
            self.fail("A and B must be matrices")
        self.ta, self.tb = int(self.attr("transA", 0)), int(self.attr("transB", 0))
        self.alpha, self.beta = float(self.attr("alpha", 1.0)), float(self.attr("beta", 1.0))
        m, k = (a[1], a[0]) if self.ta else (a[0], a[1])
        k2, n = (b[1], b[0]) if self.tb else (b[0], b[1])
        if k != k2 or isinstance(k, Batch) or isinstance(n, Batch):
            self.fail(
                f"cannot multiply {self.show(a)} by {self.show(b)} (transA={self.ta}, transB={self.tb})"
            )
        self.m, self.k, self.n = m, int(k), int(n)
        if self.has(2):
            try:
                loops.broadcast([self.shape(2), (m, n)], "")
            except Exception:
                self.fail(f"C {self.show(self.shape(2))} does not broadcast to {self.show((m, n))}")
            if loops.broadcast([self.shape(2), (m, n)], "") != (m, n):
                self.fail("C must broadcast to A x B's shape")
        return [(dtype, (m, n))]

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        b_ptr, b_kn = e.inp(1), not self.tb
        bv = self.x(1).value
        if self.tb and bv is not None:  # transpose constant weights once, at build time
            b_ptr, b_kn = e.const(np.ascontiguousarray(np.asarray(bv).T), dtype), True
        init = None
        if self.has(2) and self.beta != 0.0:
            cs = loops.bstrides(self.shape(2), (self.m, self.n))
            terms = [
                t
                for t in (
                    f"r * {cdim(cs[0])}" if cs[0] != 0 else "",
                    f"c * {cdim(cs[1])}" if cs[1] != 0 else "",
                )
                if t
            ]
            ix = " + ".join(terms) or "0"
            beta = "" if self.beta == 1.0 else f"{lit(self.beta, dtype)} * "
            init = f"{beta}{e.inp(2)}[{ix}]"
        return kernel(
            dtype,
            self.m,
            self.k,
            self.n,
            e.inp(0),
            b_ptr,
            e.out(0),
            not self.ta,
            self.alpha,
            init,
            b_kn,
        )


@register
class MatMul(Op):
    OP = "MatMul"
    SINCE = 1

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, TYPES)
        self.same_dtype(0, 1)
        return [(dtype, self.shapes())]

    B_INPUT: ClassVar[int] = 1  # which input is the right-hand matrix

    def shapes(self) -> Shape:
        """The product's shape (numpy's matmul: vectors promoted, leading axes broadcast)."""
        a, b = list(self.shape(0)), list(self.shape(self.B_INPUT))
        if not a or not b:
            self.fail("MatMul of a scalar")
        self.a1, self.b1 = len(a) == 1, len(b) == 1
        if self.a1:
            a = [1, *a]
        if self.b1:
            b = [*b, 1]
        if a[-1] != b[-2] or isinstance(a[-1], Batch) or isinstance(b[-1], Batch):
            self.fail(
                f"cannot multiply {self.show(self.shape(0))} by "
                f"{self.show(self.shape(self.B_INPUT))}"
            )
        batch = loops.broadcast([tuple(a[:-2]), tuple(b[:-2])], f"{self.where}: {self.node.label}")
        self.a, self.b, self.batch = tuple(a), tuple(b), batch
        out = [*list(batch), a[-2], b[-1]]
        if self.a1:
            del out[-2]
        if self.b1:
            del out[-1]
        return tuple(out)

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        a, b, batch = self.a, self.b, self.batch
        m, k, n = a[-2], static(a[-1]), static(b[-1])
        ma, mb = mul(m, k), k * n
        a_st = [mul(s, ma) for s in loops.bstrides(tuple(a[:-2]), batch)]
        b_st = [mul(s, mb) for s in loops.bstrides(tuple(b[:-2]), batch)]
        y_stride = mul(m, n)

        def body(o: str, ins: list[str]) -> str:
            return (
                "{\n"
                + kernel(
                    dtype,
                    m,
                    k,
                    n,
                    f"({e.inp(0)} + {ins[0]})",
                    f"({e.inp(1)} + {ins[1]})",
                    f"({e.out(0)} + ({o}) * {cdim(y_stride)})",
                )
                + "\n}"
            )

        # nest's output index counts batch entries; the kernel scales it by m*n
        return loops.nest(batch, [a_st, b_st], body, "bb", collapse=False)

    def products(self, e: Emitter, kernel: Callable[[Dim, int, int], str]) -> str:
        """One `kernel(m, k, n)` per matrix of the broadcast leading axes, over pointers A
        (input 0's matrix), B (the right-hand input's) and Y (the output's)."""
        a, b, batch = self.a, self.b, self.batch
        m, k, n = a[-2], static(a[-1]), static(b[-1])
        a_st = [mul(s, mul(m, k)) for s in loops.bstrides(tuple(a[:-2]), batch)]
        b_st = [mul(s, k * n) for s in loops.bstrides(tuple(b[:-2]), batch)]

        def body(o: str, ins: list[str]) -> str:
            return (
                f"{{ const {self.x(0).dtype.c} *A = {e.inp(0)} + {ins[0]};\n"
                f"  const {self.x(self.B_INPUT).dtype.c} *B = {e.inp(self.B_INPUT)} + {ins[1]};\n"
                f"  {self.out_dtype().c} *Y = {e.out(0)} + ({o}) * {cdim(mul(m, n))};\n"
                + kernel(m, k, n)
                + "\n}"
            )

        return loops.nest(batch, [a_st, b_st], body, "bb", collapse=False)


@register
class MatMulInteger(MatMul):
    """int32 products of 8-bit matrices less their zero points: what onnxruntime's dynamic
    quantisation (`quantize_dynamic`) puts in place of MatMul, between DynamicQuantizeLinear
    and the float rescale. A's zero point per tensor or per row, B's per tensor or per
    column."""

    OP = "MatMulInteger"
    SINCE = 10

    def infer(self) -> list[tuple[DType, Shape]]:
        for i in (0, 1):
            self.need(i, (D.INT8, D.UINT8))
        self.zero_points((2, 0), (3, 1))
        a, b = self.shape(0), self.shape(1)
        if len(a) < 2 or len(b) < 2:
            self.fail("MatMulInteger of a vector is not supported (rank 2 or more)")
        out = self.shapes()
        self.a_per_row = self._zero_point(2, a[-2], "rows of A")
        self.b_per_col = self._zero_point(3, b[-1], "columns of B")
        return [(D.INT32, out)]

    def _zero_point(self, i: int, size: Dim, what: str) -> bool:
        """True when input i is one zero point per `what` (else one for the whole tensor)."""
        if not self.has(i):
            return False
        s = self.shape(i)
        if not s or static(numel(s)) == 1:
            return False
        if len(s) != 1 or s[0] != size or isinstance(size, Batch):
            self.fail(f"input {i} must be a scalar or one zero point per {what} ({size})")
        return True

    def emit(self, e: Emitter) -> str:
        za = (f"{e.inp(2)}[r]" if self.a_per_row else f"{e.inp(2)}[0]") if self.has(2) else "0"
        zb = (f"{e.inp(3)}[c]" if self.b_per_col else f"{e.inp(3)}[0]") if self.has(3) else "0"

        def kernel(m: Dim, k: int, n: int) -> str:
            return (
                f"  for (u32 r = 0; r < {cdim(m)}; r++) {{\n"
                f"    i32 *yr = Y + r * {n};\n"
                f"    for (u32 c = 0; c < {n}; c++) yr[c] = 0;\n"
                f"    for (u32 q = 0; q < {k}; q++) {{\n"
                f"      const i32 av = (i32)A[r * {k} + q] - (i32){za};\n"
                f"      for (u32 c = 0; c < {n}; c++) yr[c] += av * ((i32)B[q * {n} + c] - (i32){zb});\n"
                "    }\n  }"
            )

        return self.products(e, kernel)


_ = (Any, numel)


@register
class Einsum(Op):
    """Any equation of letters (explicit `->` or numpy's implicit output), repeated letters
    (diagonals), `...` broadcast from the right: one loop per output letter around one per
    summed letter, the product of the operands' elements accumulated in double (in the
    element type for integers)."""

    OP = "Einsum"
    SINCE = 12

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, (*D.FLOATS, D.INT32, D.INT64, D.UINT32, D.UINT64))
        self.same_dtype(*range(len(self.inputs)))
        equation = "".join(str(self.attr("equation")).split())
        lhs, arrow, rhs = equation.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(self.inputs) or not all(self.has(i) for i in range(len(terms))):
            self.fail(f"equation {equation!r} names {len(terms)} operands, not {len(self.inputs)}")
        shapes = [self.shape(i) for i in range(len(terms))]
        ell = max(
            (
                len(s) - len(t.replace("...", ""))
                for t, s in zip(terms, shapes, strict=True)
                if "..." in t
            ),
            default=0,
        )
        wide = [chr(0x100 + k) for k in range(ell)]  # the ellipsis' axes, as labels of their own
        self.operands: list[list[str]] = []
        sizes: dict[str, Dim] = {}
        for t, s in zip(terms, shapes, strict=True):
            labels = self._labels(t, s, wide, equation)
            for label, d in zip(labels, s, strict=True):
                known = sizes.get(label)
                if known is None or known == 1:
                    sizes[label] = d
                elif d not in (1, known) or (d == 1 and label not in wide):
                    self.fail(f"{label!r} is {known} in one operand and {d} in another")
            self.operands.append(labels)
        if arrow:
            out = self._labels(rhs, None, wide, equation)
        else:
            counts = Counter(c for t in terms for c in t.replace("...", ""))
            out = wide + sorted(c for c, n in counts.items() if n == 1)
        if len(set(out)) != len(out) or any(c not in sizes for c in out):
            self.fail(f"the output of {equation!r} repeats a letter or names one no input has")
        self.out_labels = out
        self.summed = [c for c in sizes if c not in out]
        self.sizes = sizes
        if sum(isinstance(sizes[c], Batch) for c in self.summed) and any(
            isinstance(sizes[c], Batch) for c in out
        ):
            self.fail("the batch cannot be both summed and kept")
        return [(dtype, tuple(sizes[c] for c in out))]

    def _labels(self, term: str, shape: Shape | None, wide: list[str], equation: str) -> list[str]:
        head, dots, tail = term.partition("...")
        letters = head + tail
        if not all(c.isalpha() and c.isascii() for c in letters) or "..." in tail:
            self.fail(f"equation {equation!r}: {term!r} is not letters with at most one '...'")
        if shape is None:
            return [*head, *(wide if dots else []), *tail]
        extra = len(shape) - len(letters)
        if extra < 0 or (extra and not dots):
            self.fail(f"equation {equation!r}: {term!r} does not fit a tensor of rank {len(shape)}")
        return [*head, *wide[len(wide) - extra :], *tail]

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype
        acc = "double" if t.is_float else t.c
        var = {c: f"ein{k}" for k, c in enumerate([*self.out_labels, *self.summed])}

        def index(labels: list[str], shape: Shape) -> str:
            st = loops.strides(shape)
            terms = [
                f"{var[c]} * {cdim(st[k])}" if shape[k] != 1 else "" for k, c in enumerate(labels)
            ]
            return " + ".join(x for x in terms if x) or "0"

        product = " * ".join(
            f"({acc}){e.inp(i)}[{index(labels, self.shape(i))}]"
            for i, labels in enumerate(self.operands)
        )
        head = "".join(
            f"for (u32 {var[c]} = 0; {var[c]} < {cdim(self.sizes[c])}; {var[c]}++)\n"
            for c in self.out_labels
        )
        inner = "".join(
            f"  for (u32 {var[c]} = 0; {var[c]} < {cdim(self.sizes[c])}; {var[c]}++)\n"
            for c in self.summed
        )
        out = index(self.out_labels, self.oshape(0))
        return (
            head + "{\n"
            f"  {acc} sum = 0;\n" + inner + f"  sum += {product};\n"
            f"  {e.out(0)}[{out}] = ({t.c})sum;\n}}"
        )


@register
class QLinearMatMul(MatMul):
    """The 8-bit product requantised: (A - a_zero) . (B - b_zero) in int32, times
    a_scale * b_scale / y_scale in float32, rounded half to even, plus y_zero, saturated; B's
    scale and zero point per tensor or per column. What TensorFlow Lite's converted models and
    onnxruntime's QOperator quantisation hold."""

    OP = "QLinearMatMul"
    SINCE = 10
    B_INPUT = 3

    def infer(self) -> list[tuple[DType, Shape]]:
        y_t = self.qlinear_types()
        a, b = self.shape(0), self.shape(3)
        if len(a) < 2 or len(b) < 2:
            self.fail("QLinearMatMul of a vector is not supported (rank 2 or more)")
        out = self.shapes()
        self.per_col = False
        for i in (4, 5):
            count = static(numel(self.shape(i)))
            if count not in (1, b[-1]) or (count > 1 and len(self.shape(i)) != 1):
                self.fail(f"input {i} must be one value or one per column of B ({b[-1]})")
            self.per_col = self.per_col or count > 1
        return [(y_t, out)]

    def emit(self, e: Emitter) -> str:
        col = "c" if self.per_col else "0"
        bs = f"{e.inp(4)}[{col if static(numel(self.shape(4))) > 1 else 0}]"
        bz = f"{e.inp(5)}[{col if static(numel(self.shape(5))) > 1 else 0}]"
        info = np.iinfo(self.out_dtype().np)  # type: ignore[type-var]
        lo, hi = float(info.min), float(info.max)

        def kernel(m: Dim, k: int, n: int) -> str:
            return (
                f"  const i32 za = (i32){e.inp(2)}[0];\n"
                f"  for (u32 r = 0; r < {cdim(m)}; r++) for (u32 c = 0; c < {n}; c++) {{\n"
                f"    const i32 zb = (i32){bz}; i32 acc = 0;\n"
                f"    for (u32 q = 0; q < {k}; q++) acc += ((i32)A[r * {k} + q] - za) * ((i32)B[q * {n} + c] - zb);\n"
                f"    const float scale = {e.inp(1)}[0] * {bs} / {e.inp(6)}[0];\n"
                f"    float v = __builtin_rintf((float)acc * scale) + (float){e.inp(7)}[0];\n"
                f"    v = v < {lo!r}f ? {lo!r}f : (v > {hi!r}f ? {hi!r}f : v);\n"
                f"    Y[r * {n} + c] = ({self.out_dtype().c})v;\n"
                "  }"
            )

        return self.products(e, kernel)
