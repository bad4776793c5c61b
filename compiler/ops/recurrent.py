"""Recurrent layers: RNN, GRU and LSTM, as PyTorch and Keras export them.

As onnxruntime computes them: per direction, every step's input projection at once (X.W over
all T*B rows, one product), then step by step one recurrent product over the batch (H.R) and
the gates row by row, each activation one tight loop over a gate's block (float32 sigmoid and
tanh vectorise), state in the element type. The weights are held transposed (baked in when
constant). `sequence_lens` (each row's own length, checked at run time) decides which rows a
step updates; steps past a row's length are zeros in Y, and Y_h/Y_c hold the state after its
last step (onnxruntime's meaning). Either layout (time-major 0, batch-major 1), any direction;
the activations ONNX names with their default parameters."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from .. import dtypes as D
from ..dims import Batch, Dim, Shape, cdim, mul, static
from ..dtypes import DType
from .base import Emitter, Op, register

# an activation's C expression of the double `v`, with ONNX's default parameters
_ACTIVATIONS = {
    "sigmoid": "mf_sigmoid({v})",
    "tanh": "mf_tanh({v})",
    "relu": "({v} < 0 ? 0.0 : {v})",
    "softsign": "({v} / (1 + mf_fabs({v})))",
    "softplus": "({v} > 0 ? {v} + mf_log1p(mf_exp(-{v})) : mf_log1p(mf_exp({v})))",
    "hardsigmoid": "mf_max(0.0, mf_min(1.0, 0.2 * {v} + 0.5))",
    "leakyrelu": "({v} < 0 ? 0.01 * {v} : {v})",
    "thresholdedrelu": "({v} > 1.0 ? {v} : 0.0)",
    "elu": "({v} < 0 ? mf_expm1({v}) : {v})",
}

# float32 models: sigmoid and tanh as the Sigmoid and Tanh units compute them in float32 (a few
# ulp), several times quicker than in double, and what onnxruntime computes too
_FLOAT32 = {"sigmoid": "mf_sigmoid_f", "tanh": "mf_tanh_f"}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Recurrent(Op):
    SINCE = 7
    GATES: ClassVar[int] = 1  # hidden-sized blocks of W's and R's rows
    DEFAULT: ClassVar[tuple[str, ...]] = ()  # the activations of one direction
    STATES: ClassVar[int] = 1  # outputs after Y: Y_h (and Y_c)
    NOTES = (
        "activation_alpha/activation_beta are refused (the activations run with ONNX's "
        "defaults; ScaledTanh and Affine have none)"
    )

    dirs: int
    hidden: int
    size: int
    seq: Dim
    batch: Dim
    funcs: list[list[str]]

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        for i in (1, 2, 3, 5, 6, 7):
            if self.has(i) and self.x(i).dtype != dtype:
                self.fail(f"input {i} must be {dtype.name} like X")
        self._geometry()
        h = self.hidden
        state = (self.dirs, self.batch, h) if self.layout == 0 else (self.batch, self.dirs, h)
        for i in range(5, 5 + self.STATES):
            if self.has(i) and self.shape(i) != state:
                self.fail(f"input {i} (an initial state) must have shape {self.show(state)}")
        self.clip = self.attr("clip", None)
        if self.clip is not None and not float(self.clip) > 0:
            self.fail("clip must be positive")
        self._activations()
        self.check()
        y = (
            (self.seq, self.dirs, self.batch, h)
            if self.layout == 0
            else (self.batch, self.seq, self.dirs, h)
        )
        return [(dtype, y)] + [(dtype, state)] * self.STATES

    def _geometry(self) -> None:
        """Layout, direction, sizes; W, R, B and sequence_lens checked against them."""
        self.layout = int(self.attr("layout", 0))
        if self.layout not in (0, 1):
            self.fail(f"layout={self.layout} is not 0 or 1")
        direction = _text(self.attr("direction", "forward"))
        if direction not in ("forward", "reverse", "bidirectional"):
            self.fail(f"direction={direction!r} is not forward, reverse or bidirectional")
        self.reverse = direction == "reverse"
        self.dirs = 2 if direction == "bidirectional" else 1
        x = self.shape(0)
        if len(x) != 3:
            self.fail(f"X must have rank 3, not {len(x)}")
        self.seq, self.batch = (x[0], x[1]) if self.layout == 0 else (x[1], x[0])
        if isinstance(x[2], Batch):
            self.fail("the input size cannot be the batch")
        self.size = static(x[2])
        w, r = self.shape(1), self.shape(2)
        g, d = self.GATES, self.dirs
        if len(w) != 3 or any(isinstance(k, Batch) for k in w) or static(w[1]) % g:
            self.fail(f"W must have shape [{d}, {g}*hidden_size, {self.size}]")
        self.hidden = h = int(self.attr("hidden_size", static(w[1]) // g))
        if w != (d, g * h, self.size):
            self.fail(f"W must have shape [{d}, {g * h}, {self.size}], not {self.show(w)}")
        if r != (d, g * h, h):
            self.fail(f"R must have shape [{d}, {g * h}, {h}], not {self.show(r)}")
        if self.has(3) and self.shape(3) != (d, 2 * g * h):
            self.fail(f"B must have shape [{d}, {2 * g * h}]")
        if self.has(4):
            self.need(4, (D.INT32,))
            if self.shape(4) != (self.batch,):
                self.fail(f"sequence_lens must have shape [{self.batch}]")

    def _activations(self) -> None:
        if self.attr("activation_alpha", None) or self.attr("activation_beta", None):
            self.fail(self.NOTES)
        names = [_text(n) for n in self.attr("activations", [])]
        per = len(self.DEFAULT)
        if not names:
            names = list(self.DEFAULT) * self.dirs
        elif len(names) == per:
            names = names * self.dirs
        if len(names) != per * self.dirs:
            self.fail(f"activations must name {per} functions per direction")
        for n in names:
            if n.lower() not in _ACTIVATIONS:
                self.fail(
                    f"activation {n!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
                )
        self.funcs = [[n.lower() for n in names[k * per : (k + 1) * per]] for k in range(self.dirs)]

    def check(self) -> None:
        """The unit's own attributes."""

    def scratch_bytes(self) -> Dim:
        """In the element type: every step's input projection (X.W + biases, [T*B, G*H]), one
        step's recurrent projection ([B, G*H]), the state H and C, GRU's r*H and its product
        ([B, H] each); then W and R transposed when they are not constants."""
        gh, h = self.GATES * self.hidden, self.hidden
        item = self.x(0).dtype.np.itemsize
        parts: list[Dim] = [
            mul(mul(self.seq, self.batch), gh * item),
            mul(self.batch, (gh + 4 * h) * item),
            self.weights_bytes(),
        ]
        if any(isinstance(p, Batch) for p in parts):  # sizes linear in N: a constant c as c*N
            parts = [p if isinstance(p, Batch) else Batch(p) for p in parts if p]
        total: Dim = 0
        for p in parts:
            total = total + p
        return total

    def weights_bytes(self) -> int:
        """Scratch for W and R transposed at run time (0 when both are constants)."""
        gh, item = self.GATES * self.hidden, self.x(0).dtype.np.itemsize
        return sum(
            self.dirs * gh * cols * item
            for i, cols in ((1, self.size), (2, self.hidden))
            if self.x(i).value is None
        )

    # ---- C ----------------------------------------------------------------------------------
    def apply(self, d: int, k: int, arr: str, lo: int, hi: int, clip: bool = True) -> str:
        """arr[lo:hi] = direction d's k-th activation of itself, clipped first when the node
        says so (a gate's input, never LSTM's cell state: onnxruntime's meaning). One tight
        loop over contiguous elements: float32 sigmoid and tanh (the units' own branch-free
        kernels) vectorise."""
        t = self.x(0).dtype.c
        name = self.funcs[d][k]
        if t == "float" and name in _FLOAT32:
            f = f"{_FLOAT32[name]}(v)"
        else:
            f = f"({t})" + _ACTIVATIONS[name].format(v="((double)v)")
        cut = ""
        if clip and self.clip is not None:
            c = float(self.clip)
            cut = f"v = v < ({t}){-c!r} ? ({t}){-c!r} : (v > ({t}){c!r} ? ({t}){c!r} : v); "
        return f"for (u32 q = {lo}; q < {hi}; q++) {{ {t} v = {arr}[q]; {cut}{arr}[q] = {f}; }}"

    def product(self, m: str, k: int, n: int, a: str, b: str, y: str, stride: int = 0) -> str:
        """y[m, n] += a[m, k] . b[k, n], b's rows `stride` apart (default n): the SIMD kernel
        for float32 (mf_rt.h), loops along y's rows that vectorise otherwise."""
        t = self.x(0).dtype.c
        if t == "float" and stride in (0, n):
            return f"mf_gemm_f32((u32)({m}), {k}, {n}, {a}, {b}, {y}, 1.0f);"
        return (
            f"for (u64 r = 0; r < (u64)({m}); r++) for (u32 q = 0; q < {k}; q++) {{\n"
            f"  const {t} v = {a}[r * {k} + q], *col = {b} + (u64)q * {stride or n};\n"
            f"  {t} *yr = {y} + r * {n};\n"
            f"  for (u32 c = 0; c < {n}; c++) yr[c] += v * col[c];\n}}"
        )

    def transposed(self, e: Emitter, i: int, cols: int, at: str) -> tuple[str, str]:
        """Input i ([dirs, GATES*hidden, cols]) as [dirs, cols, GATES*hidden]: baked in when it
        is a constant (the weights of every exported model), else written at `at` (C
        statements, pointer)."""
        rows = self.GATES * self.hidden
        value = self.x(i).value
        if value is not None:
            return "", e.const(
                np.ascontiguousarray(np.transpose(value, (0, 2, 1))), self.x(0).dtype
            )
        t = self.x(0).dtype.c
        copy = (
            f"{{ {t} *to = ({t} *)({at}); const {t} *from = {e.inp(i)};\n"
            f"  for (u32 d = 0; d < {self.dirs}; d++) for (u32 r = 0; r < {rows}; r++) "
            f"for (u32 k = 0; k < {cols}; k++)\n"
            f"    to[((u64)d * {cols} + k) * {rows} + r] = from[((u64)d * {rows} + r) * {cols} + k]; }}"
        )
        return copy, f"(({t} *)({at}))"

    def input_bias(self) -> str:
        """What every step's input projection starts from, for column q: W's bias and R's (GRU
        keeps R's bias of the h gate for the cell: it goes inside the reset gate's product)."""
        if not self.has(3):
            return "0"
        gh = self.GATES * self.hidden
        return f"Bw[q] + Bw[{gh} + q]"

    def cell(self, e: Emitter, d: int, rows: Callable[[str], str]) -> str:
        """One step of direction d for every row still in its sequence: xg (the step's input
        projection row), gr (its recurrent one, to work in) and the row's state hr (and cr)
        in, the new state in hr (and cr); `rows(body)` loops over those rows (tt: the row's
        time index; tmp: hidden-sized room of the row's own)."""
        raise NotImplementedError

    def rows(self, body: str, backward: bool) -> str:
        """`body` for every row b whose sequence reaches step s, with tt its time index and xg,
        gr, hr, cr, tmp its pointers."""
        t, gh, h = self.x(0).dtype.c, self.GATES * self.hidden, self.hidden
        return (
            f"for (u32 b = 0; b < {cdim(self.batch)}; b++) {{\n"
            "  const i64 len = LEN(b); if (s >= len) continue;\n"
            f"  const u32 tt = (u32)({'len - 1 - s' if backward else 's'});\n"
            f"  const {t} *xg = XW + XROW(tt, b) * {gh}; {t} *gr = G + (u64)b * {gh};\n"
            f"  {t} *hr = H + (u64)b * {h}; {t} *cr = C + (u64)b * {h}; {t} *tmp = RH + (u64)b * {h};\n"
            "  (void)xg; (void)gr; (void)cr; (void)tmp;\n" + body + "\n}"
        )

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        g, h, size, dirs = self.GATES, self.hidden, self.size, self.dirs
        gh = g * h
        seq, batch = cdim(self.seq), cdim(self.batch)
        if self.layout == 0:
            xrow = f"((u64)(T_) * {batch} + (B_))"
            yi = f"(((u64)tt * {dirs} + d) * {batch} + b) * {h}"
            si = f"((u64)d * {batch} + b) * {h}"
        else:
            xrow = f"((u64)(B_) * {seq} + (T_))"
            yi = f"(((u64)b * {seq} + tt) * {dirs} + d) * {h}"
            si = f"((u64)b * {dirs} + d) * {h}"
        length = f"(i64){e.inp(4)}[B_]" if self.has(4) else f"(i64){seq}"
        at = f"(u8 *)(RP + (u64){batch} * {h})"
        w_copy, w_t = self.transposed(e, 1, size, at)
        item = self.x(0).dtype.np.itemsize
        w_bytes = 0 if self.x(1).value is not None else dirs * gh * size * item
        r_copy, r_t = self.transposed(e, 2, h, f"{at} + {w_bytes}")
        parts = [
            f"#define XROW(T_, B_) {xrow}",
            f"#define LEN(B_) ({length})",
            f"{t} *XW = ({t} *){e.scratch};",
            f"{t} *G = XW + (u64){seq} * {batch} * {gh}, *H = G + (u64){batch} * {gh};",
            f"{t} *C = H + (u64){batch} * {h}, *RH = C + (u64){batch} * {h}, *RP = RH + (u64){batch} * {h};",
            "(void)C; (void)RH; (void)RP;",
            w_copy,
            r_copy,
            "i64 longest = 0;",
            f"for (u32 b = 0; b < {batch}; b++) {{ const i64 len = LEN(b);",
        ]
        if self.has(4):
            bad = e.error("sequence_lens must be between 1 and the sequence length")
            parts.append(f"  if (len < 1 || len > (i64){seq}) {{ {bad} }}")
        parts.append("  if (len > longest) longest = len; }")
        for d in range(dirs):
            backward = self.reverse or d == 1
            init = [f"H[(u64)b * {h} + j] = " + (f"{e.inp(5)}[{si} + j];" if self.has(5) else "0;")]
            if self.STATES > 1:
                init.append(
                    f"C[(u64)b * {h} + j] = " + (f"{e.inp(6)}[{si} + j];" if self.has(6) else "0;")
                )
            parts += [
                f"{{ const u32 d = {d};",
                f"const {t} *Wt = {w_t} + (u64)d * {gh * size};",
                f"const {t} *Rt = {r_t} + (u64)d * {gh * h};",
                f"const {t} *Bw = {e.inp(3) + f' + (u64)d * {2 * gh}' if self.has(3) else '0'};",
                "(void)Bw;",
                # every step's input projection at once: one product over all T*B rows
                f"for (u64 r = 0; r < (u64){seq} * {batch}; r++) for (u32 q = 0; q < {gh}; q++) "
                f"XW[r * {gh} + q] = {self.input_bias()};",
                self.product(f"(u64){seq} * {batch}", size, gh, e.inp(0), "Wt", "XW"),
                f"for (u32 b = 0; b < {batch}; b++) for (u32 j = 0; j < {h}; j++) {{ "
                + " ".join(init)
                + " }",
                "for (i64 s = 0; s < longest; s++) {",
                f"  for (u64 q = 0; q < (u64){batch} * {gh}; q++) G[q] = 0;",
                "  " + self.product(batch, h, gh, "H", "Rt", "G"),
                self.cell(e, d, functools.partial(self.rows, backward=backward)),
            ]
            if self.has_out(0):
                parts.append(
                    self.rows(
                        f"  for (u32 j = 0; j < {h}; j++) {e.out(0)}[{yi} + j] = hr[j];", backward
                    )
                )
            parts.append("}")
            if self.has_out(0):
                parts.append(
                    f"for (u32 b = 0; b < {batch}; b++) for (u32 tt = (u32)LEN(b); tt < {seq}; tt++) "
                    f"for (u32 j = 0; j < {h}; j++) {e.out(0)}[{yi} + j] = 0;"
                )
            if self.has_out(1):
                parts.append(
                    f"for (u32 b = 0; b < {batch}; b++) for (u32 j = 0; j < {h}; j++) "
                    f"{e.out(1)}[{si} + j] = H[(u64)b * {h} + j];"
                )
            if self.STATES > 1 and self.has_out(2):
                parts.append(
                    f"for (u32 b = 0; b < {batch}; b++) for (u32 j = 0; j < {h}; j++) "
                    f"{e.out(2)}[{si} + j] = C[(u64)b * {h} + j];"
                )
            parts.append("}")
        parts += ["#undef XROW", "#undef LEN"]
        return "{\n" + "\n".join(parts) + "\n}"


@register
class RNN(_Recurrent):
    OP = "RNN"
    GATES = 1
    DEFAULT = ("Tanh",)

    def cell(self, e: Emitter, d: int, rows: Callable[[str], str]) -> str:
        h = self.hidden
        return rows(
            f"for (u32 q = 0; q < {h}; q++) gr[q] += xg[q];\n"
            f"{self.apply(d, 0, 'gr', 0, h)}\n"
            f"for (u32 j = 0; j < {h}; j++) hr[j] = gr[j];"
        )


@register
class GRU(_Recurrent):
    OP = "GRU"
    GATES = 3
    DEFAULT = ("Sigmoid", "Tanh")

    def check(self) -> None:
        self.before = int(self.attr("linear_before_reset", 0))

    def input_bias(self) -> str:
        """W's biases and R's of the z and r gates (R's of the h gate goes in the cell)."""
        if not self.has(3):
            return "0"
        h = self.hidden
        return f"Bw[q] + (q < {2 * h} ? Bw[{3 * h} + q] : 0)"

    def cell(self, e: Emitter, d: int, rows: Callable[[str], str]) -> str:
        h = self.hidden
        rb = f" + Bw[{5 * h} + j]" if self.has(3) else ""
        zr = f"for (u32 q = 0; q < {2 * h}; q++) gr[q] += xg[q];\n" + self.apply(
            d, 0, "gr", 0, 2 * h
        )
        new = (
            f"{self.apply(d, 1, 'gr', 2 * h, 3 * h)}\n"
            f"for (u32 j = 0; j < {h}; j++) hr[j] = (1 - gr[j]) * gr[{2 * h} + j] + gr[j] * hr[j];"
        )
        if self.before:  # r scales h.Rh + Rbh
            return rows(
                f"{zr}\n"
                f"for (u32 j = 0; j < {h}; j++) "
                f"gr[{2 * h} + j] = xg[{2 * h} + j] + gr[{h} + j] * (gr[{2 * h} + j]{rb});\n"
                f"{new}"
            )
        # (r * h).Rh: r of every row first, one product over the rows, then the new state
        return "\n".join(
            [
                f"for (u64 q = 0; q < (u64){cdim(self.batch)} * {h}; q++) {{ RH[q] = 0; RP[q] = 0; }}",
                rows(f"{zr}\nfor (u32 j = 0; j < {h}; j++) tmp[j] = gr[{h} + j] * hr[j];"),
                self.product(cdim(self.batch), h, h, "RH", f"Rt + {2 * h}", "RP", 3 * h),
                rows(
                    f"for (u32 j = 0; j < {h}; j++) "
                    f"gr[{2 * h} + j] = xg[{2 * h} + j] + RP[(u64)b * {h} + j]{rb};\n{new}"
                ),
            ]
        )


@register
class LSTM(_Recurrent):
    OP = "LSTM"
    GATES = 4
    DEFAULT = ("Sigmoid", "Tanh", "Tanh")
    STATES = 2

    def check(self) -> None:
        self.coupled = int(self.attr("input_forget", 0))
        if self.has(7) and self.shape(7) != (self.dirs, 3 * self.hidden):
            self.fail(f"P must have shape [{self.dirs}, {3 * self.hidden}]")

    def cell(self, e: Emitter, d: int, rows: Callable[[str], str]) -> str:
        h = self.hidden
        p = f"{e.inp(7)} + {d * 3 * h}" if self.has(7) else ""

        def peep(gate: int, block: int, state: str) -> str:  # P's blocks: i, o, f
            if not p:
                return ""
            return f"for (u32 j = 0; j < {h}; j++) gr[{gate * h} + j] += ({p})[{block * h} + j] * {state}[j];\n"

        forget = (
            f"for (u32 j = 0; j < {h}; j++) gr[{2 * h} + j] = 1 - gr[j];"
            if self.coupled
            else self.apply(d, 0, "gr", 2 * h, 3 * h)
        )
        # the projections' blocks: i, o, f, c
        return rows(
            f"for (u32 q = 0; q < {4 * h}; q++) gr[q] += xg[q];\n"
            + peep(0, 0, "cr")
            + (peep(2, 2, "cr") if not self.coupled else "")
            + f"{self.apply(d, 0, 'gr', 0, h)}\n{forget}\n"
            f"{self.apply(d, 1, 'gr', 3 * h, 4 * h)}\n"
            f"for (u32 j = 0; j < {h}; j++) cr[j] = gr[{2 * h} + j] * cr[j] + gr[j] * gr[{3 * h} + j];\n"
            + peep(1, 1, "cr")
            + f"{self.apply(d, 0, 'gr', h, 2 * h)}\n"
            f"for (u32 j = 0; j < {h}; j++) tmp[j] = cr[j];\n"
            f"{self.apply(d, 2, 'tmp', 0, h, clip=False)}\n"
            f"for (u32 j = 0; j < {h}; j++) hr[j] = gr[{h} + j] * tmp[j];"
        )
