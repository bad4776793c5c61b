"""Recurrent layers: RNN, GRU and LSTM, as PyTorch and Keras export them.

One batch row at a time, one direction at a time: the state of a row never meets another
row's, so the state and the gates live in a scratch of a few hidden-sized vectors whatever the
batch (in the element type, as onnxruntime keeps them; a gate's own arithmetic in double), and
`sequence_lens` (each row's own length, checked at run time) only changes how far a row's loop
goes. The weights are held transposed (baked in when constant), so the products vectorise. Steps past a row's length are
zeros in Y, and Y_h/Y_c hold the state after its last step (onnxruntime's meaning). Either
layout (time-major 0, batch-major 1), any direction; the activations ONNX names with their
default parameters."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .. import dtypes as D
from ..dims import Batch, Dim, Shape, cdim, static
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
        """The state and gates (in the element type), then room for W and R transposed when
        they are not constants."""
        rows = self.GATES * self.hidden
        item = self.x(0).dtype.np.itemsize
        weights = sum(
            self.dirs * rows * cols * self.x(0).dtype.np.itemsize
            for i, cols in ((1, self.size), (2, self.hidden))
            if self.x(i).value is None
        )
        return item * (self.GATES + 4) * self.hidden + weights

    # ---- C ----------------------------------------------------------------------------------
    def act(self, d: int, k: int, v: str, then: str = "", clip: bool = True) -> str:
        """Direction d's k-th activation of v + `then` (LSTM's peepholes), clipped first when
        the node says so: a gate's input, never LSTM's cell state (onnxruntime's meaning)."""
        v += then
        if clip and self.clip is not None:
            c = float(self.clip)
            v = f"mf_max({-c!r}, mf_min({c!r}, {v}))"
        name = self.funcs[d][k]
        if self.x(0).dtype == D.FLOAT and name in _FLOAT32:  # the float32 units' own kernels
            return f"((double){_FLOAT32[name]}((float)({v})))"
        return "(" + _ACTIVATIONS[name].format(v=f"({v})") + ")"

    def cell(self, e: Emitter, d: int) -> str:
        """One step of direction d: reads x (the step's input), h (and c); leaves the new state
        in hn (and c), with g (GATES*hidden) and rh (hidden) to work in."""
        raise NotImplementedError

    def dot(
        self, into: str, mat: str, first: int, count: int, vec: str, bias: str,
        add: bool = False,
    ) -> str:  # fmt: skip
        """into[q] (`add`: +)= bias + mat[first + q, :] . vec for q < count. `mat` ("Wt" or
        "Rt") is held transposed, one row per element of vec: the inner loop runs along the
        gates, so it vectorises without reordering any sum (in the element type, as
        onnxruntime's GEMM sums)."""
        width = self.size if mat == "Wt" else self.hidden
        stride = self.GATES * self.hidden
        t = self.x(0).dtype.c
        return (
            f"for (u32 q = 0; q < {count}; q++) {into}[q] {'+=' if add else '='} {bias};\n"
            f"for (u32 k = 0; k < {width}; k++) {{\n"
            f"  const {t} v = {vec}[k], *col = {mat} + (u64)k * {stride} + {first};\n"
            f"  for (u32 q = 0; q < {count}; q++) {into}[q] += v * col[q];\n}}"
        )

    def transposed(self, e: Emitter, i: int, cols: int, at: str) -> tuple[str, str]:
        """Input i ([dirs, GATES*hidden, cols]) as [dirs, cols, GATES*hidden]: baked in when it
        is a constant (the weights of every exported model), else written into scratch at `at`
        (C statements, pointer)."""
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

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        g, h, size, dirs = self.GATES, self.hidden, self.size, self.dirs
        seq, batch = cdim(self.seq), cdim(self.batch)
        if self.layout == 0:
            xi = f"((u64)tt * {batch} + b) * {size}"
            yi = f"(((u64)tt * {dirs} + d) * {batch} + b) * {h}"
            si = f"((u64)d * {batch} + b) * {h}"
        else:
            xi = f"((u64)b * {seq} + tt) * {size}"
            yi = f"(((u64)b * {seq} + tt) * {dirs} + d) * {h}"
            si = f"((u64)b * {dirs} + d) * {h}"
        length = f"{seq}"
        if self.has(4):
            bad = e.error("sequence_lens must be between 1 and the sequence length")
            length = f"(i64){e.inp(4)}[b]"
        state = self.x(0).dtype.np.itemsize * (g + 4) * h
        w_copy, w_t = self.transposed(e, 1, size, f"{e.scratch} + {state}")
        w_bytes = (
            0 if self.x(1).value is not None else dirs * g * h * size * self.x(0).dtype.np.itemsize
        )
        r_copy, r_t = self.transposed(e, 2, h, f"{e.scratch} + {state + w_bytes}")
        parts = [
            f"{t} *h = ({t} *){e.scratch}, *c = h + {h}, *hn = c + {h}, *rh = hn + {h}, "
            f"*g = rh + {h};",
            "(void)c; (void)rh;",
            w_copy,
            r_copy,
            f"for (u32 b = 0; b < {batch}; b++) {{",
            f"  const i64 len = {length};",
        ]
        if self.has(4):
            parts.append(f"  if (len < 1 || len > (i64){seq}) {{ {bad} }}")
        for d in range(dirs):
            backward = self.reverse or d == 1
            init = [f"  h[j] = {e.inp(5)}[{si} + j];" if self.has(5) else "  h[j] = 0;"]
            if self.STATES > 1:
                init.append(f"  c[j] = {e.inp(6)}[{si} + j];" if self.has(6) else "  c[j] = 0;")
            parts += [
                f"{{ const u32 d = {d};",
                f"for (u32 j = 0; j < {h}; j++) {{ " + " ".join(init) + " }",
                f"const {t} *Wt = {w_t} + (u64)d * {g * h * size};",
                f"const {t} *Rt = {r_t} + (u64)d * {g * h * h};",
                f"const {t} *Bw = {e.inp(3) + f' + (u64)d * {2 * g * h}' if self.has(3) else '0'};",
                "(void)Bw;",
                "for (i64 s = 0; s < len; s++) {",
                f"  const u32 tt = (u32)({'len - 1 - s' if backward else 's'});",
                f"  const {t} *x = {e.inp(0)} + {xi};",
                self.cell(e, d),
                f"  for (u32 j = 0; j < {h}; j++) h[j] = hn[j];",
            ]
            if self.has_out(0):
                parts.append(f"  for (u32 j = 0; j < {h}; j++) {e.out(0)}[{yi} + j] = ({t})h[j];")
            parts.append("}")
            if self.has_out(0):
                parts.append(
                    f"for (u32 tt = (u32)len; tt < {seq}; tt++) "
                    f"for (u32 j = 0; j < {h}; j++) {e.out(0)}[{yi} + j] = 0;"
                )
            if self.has_out(1):
                parts.append(f"for (u32 j = 0; j < {h}; j++) {e.out(1)}[{si} + j] = ({t})h[j];")
            if self.STATES > 1 and self.has_out(2):
                parts.append(f"for (u32 j = 0; j < {h}; j++) {e.out(2)}[{si} + j] = ({t})c[j];")
            parts.append("}")
        parts.append("}")
        return "{\n" + "\n".join(parts) + "\n}"

    def bias(self, offset: int) -> str:
        """The q-th bias of a block at row `offset` (W's bias and R's), or 0 without B."""
        if not self.has(3):
            return "0"
        second = self.GATES * self.hidden
        return f"(double)Bw[{offset} + q] + (double)Bw[{second + offset} + q]"


@register
class RNN(_Recurrent):
    OP = "RNN"
    GATES = 1
    DEFAULT = ("Tanh",)

    def cell(self, e: Emitter, d: int) -> str:
        h = self.hidden
        return "\n".join(
            [
                self.dot("g", "Wt", 0, h, "x", self.bias(0)),
                self.dot("g", "Rt", 0, h, "h", "0", add=True),
                f"  for (u32 j = 0; j < {h}; j++) hn[j] = {self.act(d, 0, 'g[j]')};",
            ]
        )


@register
class GRU(_Recurrent):
    OP = "GRU"
    GATES = 3
    DEFAULT = ("Sigmoid", "Tanh")

    def check(self) -> None:
        self.before = int(self.attr("linear_before_reset", 0))

    def cell(self, e: Emitter, d: int) -> str:
        h = self.hidden
        lines = [
            # g[0:3h): x.W + Wb (z, r, h); g[0:2h) += h.R + Rb (z, r)
            self.dot("g", "Wt", 0, 3 * h, "x", "(double)Bw[q]" if self.has(3) else "0"),
            self.dot(
                "g", "Rt", 0, 2 * h, "h", f"(double)Bw[{3 * h} + q]" if self.has(3) else "0", True
            ),
            f"  for (u32 j = 0; j < {2 * h}; j++) g[j] = {self.act(d, 0, 'g[j]')};",
        ]
        rb = f"(double)Bw[{5 * h} + q]" if self.has(3) else "0"
        if self.before:
            # (h.Rh + Rbh) scaled by r
            lines.append(self.dot("rh", "Rt", 2 * h, h, "h", rb))
            lines.append(
                f"  for (u32 j = 0; j < {h}; j++) rh[j] = g[{2 * h} + j] + g[{h} + j] * rh[j];"
            )
        else:
            lines.append(f"  for (u32 j = 0; j < {h}; j++) hn[j] = g[{h} + j] * h[j];")
            lines.append(self.dot("rh", "Rt", 2 * h, h, "hn", rb))
            lines.append(f"  for (u32 j = 0; j < {h}; j++) rh[j] += g[{2 * h} + j];")
        lines.append(
            f"  for (u32 j = 0; j < {h}; j++) {{ const double n = {self.act(d, 1, 'rh[j]')}; "
            "hn[j] = (1 - g[j]) * n + g[j] * h[j]; }"
        )
        return "\n".join(lines)


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

    def cell(self, e: Emitter, d: int) -> str:
        h = self.hidden

        def peep(k: int, state: str) -> str:  # P's blocks: i, o, f
            if not self.has(7):
                return ""
            return f" + (double){e.inp(7)}[{d * 3 * h + k * h} + j] * {state}"

        gate_i = self.act(d, 0, "g[j]", peep(0, "c[j]"))
        gate_f = "1 - i" if self.coupled else self.act(d, 0, f"g[{2 * h} + j]", peep(2, "c[j]"))
        gate_o = self.act(d, 0, f"g[{h} + j]", peep(1, "cn"))
        return "\n".join(
            [
                # g: x.W + h.R + biases, blocks i, o, f, c
                self.dot("g", "Wt", 0, 4 * h, "x", self.bias(0)),
                self.dot("g", "Rt", 0, 4 * h, "h", "0", add=True),
                f"  for (u32 j = 0; j < {h}; j++) {{",
                f"    const double i = {gate_i};",
                f"    const double f = {gate_f};",
                f"    const double cc = {self.act(d, 1, f'g[{3 * h} + j]')};",
                "    const double cn = f * c[j] + i * cc;",
                f"    const double o = {gate_o};",
                f"    c[j] = cn; hn[j] = o * {self.act(d, 2, 'cn', clip=False)};",
                "  }",
            ]
        )
