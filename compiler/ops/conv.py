"""Conv and pooling over 1-D and 2-D images (NCW, NCHW). Direct loops whose innermost runs
along an output row with the padding bounds hoisted out, so stride-1 rows vectorise."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from .. import dtypes as D
from ..dims import Batch, Dim, Shape, cdim, numel, static
from ..dtypes import DType
from .base import Emitter, Op, register


class _Window(Op):
    """Shared geometry: kernel, strides, dilations, pads (auto_pad), ceil_mode."""

    CEIL = False

    def geometry(self, spatial: list[int], kernel: list[int]) -> list[int]:
        r = len(spatial)
        self.kernel = kernel
        self.strides = [int(v) for v in self.attr("strides", [1] * r)]
        self.dil = [int(v) for v in self.attr("dilations", [1] * r)]
        pads = [int(v) for v in self.attr("pads", [0] * (2 * r))]
        auto = self.attr("auto_pad", "NOTSET")
        ceil = int(self.attr("ceil_mode", 0)) if self.CEIL else 0
        if len(self.strides) != r or len(self.dil) != r or len(pads) != 2 * r:
            self.fail("strides, dilations and pads must match the spatial rank")
        out = []
        self.pad_lo, self.pad_hi = [0] * r, [0] * r
        for i in range(r):
            eff = self.dil[i] * (kernel[i] - 1) + 1
            if auto in ("SAME_UPPER", "SAME_LOWER"):
                o = -(-spatial[i] // self.strides[i])
                total = max(0, (o - 1) * self.strides[i] + eff - spatial[i])
                small, big = total // 2, total - total // 2
                self.pad_lo[i], self.pad_hi[i] = (
                    (small, big) if auto == "SAME_UPPER" else (big, small)
                )
            elif auto == "VALID":
                o = (spatial[i] - eff) // self.strides[i] + 1
            elif auto == "NOTSET":
                self.pad_lo[i], self.pad_hi[i] = pads[i], pads[i + r]
                span = spatial[i] + pads[i] + pads[i + r] - eff
                if ceil:
                    o = math.ceil(span / self.strides[i]) + 1
                    if (o - 1) * self.strides[i] >= spatial[i] + pads[i]:
                        o -= 1  # the last window must start inside the input or left pad
                else:
                    o = span // self.strides[i] + 1
            else:
                self.fail(f"auto_pad={auto!r} is not supported")
            if o <= 0:
                self.fail("the window does not fit the input")
            out.append(o)
        return out

    def image(self, i: int) -> tuple[Dim, int, list[int]]:
        s = self.shape(i)
        if len(s) not in (3, 4):
            self.fail(f"only 1-D and 2-D images (rank 3 or 4) are supported, got rank {len(s)}")
        if any(isinstance(d, Batch) for d in s[1:]):
            self.fail("only the first dimension may be the batch")
        return s[0], static(s[1]), [static(d) for d in s[2:]]

    def weighted(self) -> tuple[DType, Dim, int, list[int], Shape]:
        """A convolution's float image X (its batch, channels, spatial sizes), its weights W of
        the same type, and `group`."""
        dtype = self.need(0, D.FLOATS)
        self.same_dtype(0, 1)
        n, c, spatial = self.image(0)
        self.group = int(self.attr("group", 1))
        return dtype, n, c, spatial, self.shape(1)

    def hw(self, v: list[int], fill: int) -> tuple[int, int]:
        return (fill, v[0]) if len(v) == 1 else (v[0], v[1])

    def ranges(self) -> str:
        """C helpers: the output rows/cols whose input index stays inside the image."""
        return ""


def _bounds(pad: int, step: int, dil: int, size: int, out: int, kvar: str, lo: str, hi: str) -> str:
    # first o with o*step + k*dil - pad >= 0; last o with o*step + k*dil - pad <= size-1
    return (
        f"i32 {lo} = (i32){pad} - (i32){kvar} * {dil}; {lo} = {lo} <= 0 ? 0 : ({lo} + {step} - 1) / {step};\n"
        f"i32 {hi} = (i32)({size - 1 + pad}) - (i32){kvar} * {dil}; {hi} = {hi} < 0 ? 0 : {hi} / {step} + 1;\n"
        f"if ({hi} > {out}) {hi} = {out};\n"
    )


@register
class Conv(_Window):
    OP = "Conv"
    SINCE = 1
    W_INPUT: ClassVar[int] = 1  # which input holds the weights

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype, n, c, spatial, w = self.weighted()
        if len(w) != len(spatial) + 2:
            self.fail("weights rank does not match the input")
        m, cg = static(w[0]), static(w[1])
        if cg * self.group != c or m % self.group:
            self.fail(f"channels {c}, weights {self.show(w)} and group {self.group} do not fit")
        kernel = [int(d) for d in self.attr("kernel_shape", list(w[2:]))]
        if kernel != [static(d) for d in w[2:]]:
            self.fail("kernel_shape does not match the weights")
        out = self.geometry(spatial, kernel)
        self.c, self.m, self.cg, self.spatial, self.out = c, m, cg, spatial, out
        return [(dtype, (n, m, *out))]

    def scratch_bytes(self) -> int:
        if self.x(0).dtype.c != "float":
            return 0
        kh, kw = self.hw(self.kernel, 1)
        oh, ow = self.hw(self.out, 1)
        return self.cg * kh * kw * oh * ow * 4

    def emit(self, e: Emitter) -> str:
        if self.x(0).dtype.c == "float":
            return self.emit_gemm(e)
        return self.emit_direct(e)

    def emit_gemm(self, e: Emitter) -> str:
        """im2col into scratch, then the SIMD kernel per image and group: the same sums in the
        same order as the direct loops (bias, then channels, kernel rows, kernel columns)."""
        ih, iw = self.hw(self.spatial, 1)
        oh, ow = self.hw(self.out, 1)
        kh, kw = self.hw(self.kernel, 1)
        sh, sw = self.hw(self.strides, 1)
        dh, dw = self.hw(self.dil, 1)
        ph, pw = self.hw(self.pad_lo, 0)
        mg = self.m // self.group
        ckk = self.cg * kh * kw
        n = cdim(self.shape(0)[0])
        bias = f"{e.inp(2)}[g * {mg} + m]" if self.has(2) else "0"
        return (
            "float *cols = (float *)scratch;\n"
            f"for (u32 b = 0; b < {n}; b++)\n"
            f"for (u32 g = 0; g < {self.group}; g++) {{\n"
            f"  for (u32 c = 0; c < {self.cg}; c++) {{\n"
            f"    const float *x = {e.inp(0)} + (b * {self.c} + g * {self.cg} + c) * {ih * iw};\n"
            f"    for (u32 u = 0; u < {kh}; u++) for (u32 v = 0; v < {kw}; v++) {{\n"
            f"      float *col = cols + ((c * {kh} + u) * {kw} + v) * {oh * ow};\n"
            f"      for (i32 r = 0; r < {oh}; r++) {{\n"
            f"        const i32 yy = r * {sh} + (i32)u * {dh} - {ph};\n"
            f"        for (i32 q = 0; q < {ow}; q++) {{\n"
            f"          const i32 xx = q * {sw} + (i32)v * {dw} - {pw};\n"
            f"          col[r * {ow} + q] = (yy >= 0 && yy < {ih} && xx >= 0 && xx < {iw}) ? x[yy * {iw} + xx] : 0.0f;\n"
            "        }\n      }\n    }\n  }\n"
            f"  float *y = {e.out(0)} + (b * {self.m} + g * {mg}) * {oh * ow};\n"
            f"  for (u32 m = 0; m < {mg}; m++) for (u32 p = 0; p < {oh * ow}; p++) y[m * {oh * ow} + p] = {bias};\n"
            f"  mf_gemm_f32({mg}, {ckk}, {oh * ow}, {e.inp(1)} + g * {mg * ckk}, cols, y, 1.0f);\n"
            "}"
        )

    def emit_direct(
        self, e: Emitter, acc: str | None = None, x_zero: str = "", w_zero: str = "",
        bias: str | None = None, plane: str = "", finish: str = "",
    ) -> str:  # fmt: skip
        """Direct loops, accumulating in `acc` (the element type by default); `x_zero` and
        `w_zero` (C expressions, w_zero may use m) are subtracted from every pixel and weight;
        `bias`: what an output channel m starts from (default input 2's, if any). `plane`: a C
        pointer to accumulate each (image, channel) plane into instead of the output, which
        `finish` (statements; b, m, y the plane) then writes out."""
        t = self.x(0).dtype.c
        wi = self.W_INPUT
        wt = self.x(wi).dtype.c
        acc = acc or t
        ih, iw = self.hw(self.spatial, 1)
        oh, ow = self.hw(self.out, 1)
        kh, kw = self.hw(self.kernel, 1)
        sh, sw = self.hw(self.strides, 1)
        dh, dw = self.hw(self.dil, 1)
        ph, pw = self.hw(self.pad_lo, 0)
        mg = self.m // self.group
        n = cdim(self.shape(0)[0])
        start = bias if bias is not None else (f"{e.inp(2)}[m]" if self.has(2) else "0")
        pixel = f"(({acc})xr[q * {sw}] - {x_zero})" if x_zero else f"xr[q * {sw}]"
        weight = f"({acc})w[u * {kw} + v] - {w_zero}" if w_zero else f"w[u * {kw} + v]"
        return (
            f"for (u32 b = 0; b < {n}; b++)\n"
            f"for (u32 m = 0; m < {self.m}; m++) {{\n"
            + (
                f"  {acc} *y = {plane};\n"
                if plane
                else f"  {acc} *y = {e.out(0)} + (b * {self.m} + m) * {oh * ow};\n"
            )
            + f"  for (u32 p = 0; p < {oh * ow}; p++) y[p] = {start};\n"
            f"  const u32 g = m / {mg};\n"
            f"  for (u32 c = 0; c < {self.cg}; c++) {{\n"
            f"    const {t} *x = {e.inp(0)} + (b * {self.c} + g * {self.cg} + c) * {ih * iw};\n"
            f"    const {wt} *w = {e.inp(wi)} + (m * {self.cg} + c) * {kh * kw};\n"
            f"    for (u32 u = 0; u < {kh}; u++) {{\n"
            + _indent(_bounds(ph, sh, dh, ih, oh, "u", "y0", "y1"), 6)
            + f"      for (u32 v = 0; v < {kw}; v++) {{\n"
            + _indent(_bounds(pw, sw, dw, iw, ow, "v", "x0", "x1"), 8)
            + f"        const {acc} wv = {weight};\n"
            f"        for (i32 r = y0; r < y1; r++) {{\n"
            f"          const {t} *xr = x + (r * {sh} + (i32)u * {dh} - {ph}) * {iw} + ((i32)v * {dw} - {pw});\n"
            f"          {acc} *yr = y + r * {ow};\n"
            f"          for (i32 q = x0; q < x1; q++) yr[q] += wv * {pixel};\n"
            "        }\n      }\n    }\n  }\n" + finish + "\n}"
        )


@register
class ConvInteger(Conv):
    """int32 convolution of 8-bit images and weights less their zero points (a padded pixel
    is the image's zero point, so it adds nothing): onnxruntime's dynamic quantisation of
    Conv. The weights' zero point per tensor or per output channel."""

    OP = "ConvInteger"
    SINCE = 10

    def weighted(self) -> tuple[DType, Dim, int, list[int], Shape]:
        for i in (0, 1):
            self.need(i, (D.INT8, D.UINT8))
        self.zero_points((2, 0), (3, 1))
        if self.has(2) and static(numel(self.shape(2))) != 1:
            self.fail("the image's zero point must be one value")
        n, c, spatial = self.image(0)
        self.group = int(self.attr("group", 1))
        return D.INT32, n, c, spatial, self.shape(1)

    def infer(self) -> list[tuple[DType, Shape]]:
        out = super().infer()
        if self.has(3) and static(numel(self.shape(3))) not in (1, self.m):
            self.fail(f"the weights' zero point must be one value or one per channel ({self.m})")
        return out

    def scratch_bytes(self) -> int:
        return 0

    def emit(self, e: Emitter) -> str:
        x_zero = f"(i32){e.inp(2)}[0]" if self.has(2) else "0"
        w_zero = "0"
        if self.has(3):
            per = static(numel(self.shape(3))) > 1
            w_zero = f"(i32){e.inp(3)}[{'m' if per else 0}]"
        return self.emit_direct(e, "i32", x_zero, w_zero, bias="0")


@register
class QLinearConv(ConvInteger):
    """The 8-bit convolution requantised: int32 sums of (x - x_zero) * (w - w_zero[m]) plus
    the int32 bias, times x_scale * w_scale[m] / y_scale in float32, rounded half to even,
    plus y_zero, saturated (TensorFlow Lite's converted models, onnxruntime's QOperator
    quantisation); the weights' scale and zero point per tensor or per output channel."""

    OP = "QLinearConv"
    SINCE = 10
    W_INPUT = 3

    def weighted(self) -> tuple[DType, Dim, int, list[int], Shape]:
        y_t = self.qlinear_types()
        if self.has(8):
            self.need(8, (D.INT32,))
        n, c, spatial = self.image(0)
        self.group = int(self.attr("group", 1))
        return y_t, n, c, spatial, self.shape(3)

    def infer(self) -> list[tuple[DType, Shape]]:
        out = Conv.infer(self)
        for i in (4, 5):
            if static(numel(self.shape(i))) not in (1, self.m):
                self.fail(f"input {i} must be one value or one per output channel ({self.m})")
        if self.has(8) and self.shape(8) != (self.m,):
            self.fail(f"the bias must have shape [{self.m}]")
        return out

    def scratch_bytes(self) -> int:
        oh, ow = self.hw(self.out, 1)
        return oh * ow * 4  # one int32 plane, requantised into the output

    def emit(self, e: Emitter) -> str:
        oh, ow = self.hw(self.out, 1)

        def per(i: int) -> str:
            return f"{e.inp(i)}[{'m' if static(numel(self.shape(i))) > 1 else 0}]"

        y_t = self.out_dtype()
        info = np.iinfo(y_t.np)  # type: ignore[type-var]
        lo, hi = float(info.min), float(info.max)
        finish = (
            f"  {{ const float scale = {e.inp(1)}[0] * {per(4)} / {e.inp(6)}[0];\n"
            f"    {y_t.c} *out = {e.out(0)} + (b * {self.m} + m) * {oh * ow};\n"
            f"    for (u32 p = 0; p < {oh * ow}; p++) {{\n"
            f"      float v = __builtin_rintf((float)y[p] * scale) + (float){e.inp(7)}[0];\n"
            f"      v = v < {lo!r}f ? {lo!r}f : (v > {hi!r}f ? {hi!r}f : v);\n"
            f"      out[p] = ({y_t.c})v;\n    }} }}"
        )
        return self.emit_direct(
            e, "i32", f"(i32){e.inp(2)}[0]", f"(i32){per(5)}",
            bias=f"{e.inp(8)}[m]" if self.has(8) else "0",
            plane=f"(i32 *){e.scratch}", finish=finish,
        )  # fmt: skip


def _indent(code: str, n: int) -> str:
    return "".join(" " * n + line + "\n" for line in code.splitlines())


class _Pool(_Window):
    CEIL = True

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS + ((D.INT8, D.UINT8) if self.OP == "MaxPool" else ()))
        n, c, spatial = self.image(0)
        kernel = [int(v) for v in self.attr("kernel_shape")]
        if len(kernel) != len(spatial):
            self.fail("kernel_shape does not match the input")
        if self.has_output_indices():
            self.fail("the Indices output is not supported")
        out = self.geometry(spatial, kernel)
        self.c, self.spatial, self.out = c, spatial, out
        return [(dtype, (n, c, *out))]

    def has_output_indices(self) -> bool:
        return len(self.node.outputs) > 1 and bool(self.node.outputs[1])

    def window(self, e: Emitter, init: str, acc: str, final: str) -> str:
        t = self.x(0).dtype.c
        ih, iw = self.hw(self.spatial, 1)
        oh, ow = self.hw(self.out, 1)
        kh, kw = self.hw(self.kernel, 1)
        sh, sw = self.hw(self.strides, 1)
        dh, dw = self.hw(self.dil, 1)
        ph, pw = self.hw(self.pad_lo, 0)
        n = cdim(self.shape(0)[0])
        return (
            f"for (u32 p = 0; p < {n} * {self.c}; p++) {{\n"
            f"  const {t} *x = {e.inp(0)} + p * {ih * iw};\n"
            f"  {t} *y = {e.out(0)} + p * {oh * ow};\n"
            f"  for (i32 r = 0; r < {oh}; r++) for (i32 q = 0; q < {ow}; q++) {{\n"
            f"    {init}\n"
            f"    for (i32 u = 0; u < {kh}; u++) {{\n"
            f"      const i32 yy = r * {sh} + u * {dh} - {ph};\n"
            f"      const int rin = yy >= 0 && yy < {ih};\n"
            f"      const int rpad = yy < {ih + self.hw(self.pad_hi, 0)[0]};\n"
            f"      for (i32 v = 0; v < {kw}; v++) {{\n"
            f"        const i32 xx = q * {sw} + v * {dw} - {pw};\n"
            f"        const int in = rin && xx >= 0 && xx < {iw};\n"
            f"        const int inpad = rpad && xx < {iw + self.hw(self.pad_hi, 0)[1]};\n"
            f"        (void)inpad;\n"
            f"        {acc}\n"
            "      }\n    }\n"
            f"    {final}\n"
            "  }\n}"
        )


@register
class MaxPool(_Pool):
    OP = "MaxPool"
    SINCE = 8

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype
        lowest = "-MF_INF" if t.is_float else ("-128" if t.c == "i8" else "0")
        return self.window(
            e,
            f"{t.c} best = {lowest};",
            "if (in) { const "
            + t.c
            + " v = x[yy * "
            + str(self.hw(self.spatial, 1)[1])
            + " + xx]; if (v > best || v != v) best = v; }",
            "y[r * " + str(self.hw(self.out, 1)[1]) + " + q] = best;",
        )


@register
class AveragePool(_Pool):
    OP = "AveragePool"
    SINCE = 7

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        iw = self.hw(self.spatial, 1)[1]
        ow = self.hw(self.out, 1)[1]
        include = int(self.attr("count_include_pad", 0))
        count = "inpad" if include else "in"
        return self.window(
            e,
            "double acc = 0; u32 cnt = 0;",
            f"if (in) acc += x[yy * {iw} + xx]; if ({count} && yy >= -{self.hw(self.pad_lo, 0)[0]} && xx >= -{self.hw(self.pad_lo, 0)[1]}) cnt++;",
            f"y[r * {ow} + q] = ({t})(cnt ? acc / cnt : 0);",
        )


def _lp(p: int) -> tuple[str, str]:
    """The p-norm's term for an element v and its root of a sum acc (both in double)."""
    term = {1: "mf_fabs(v)", 2: "v * v"}.get(p, f"mf_pow(mf_fabs(v), {p}.0)")
    root = {1: "acc", 2: "mf_sqrt(acc)"}.get(p, f"mf_pow(acc, 1.0 / {p})")
    return term, root


def _norm_order(op: Op) -> int:
    p = int(op.attr("p", 2))
    if p < 1:
        op.fail(f"p={p} must be at least 1")
    return p


@register
class LpPool(_Pool):
    """The p-norm of each window (p an integer, 2 by default)."""

    OP = "LpPool"
    SINCE = 2

    def infer(self) -> list[tuple[DType, Shape]]:
        self.p = _norm_order(self)
        return super().infer()

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        iw = self.hw(self.spatial, 1)[1]
        ow = self.hw(self.out, 1)[1]
        term, root = _lp(self.p)
        return self.window(
            e,
            "double acc = 0;",
            f"if (in) {{ const double v = x[yy * {iw} + xx]; acc += {term}; }}",
            f"y[r * {ow} + q] = ({t}){root};",
        )


class _Global(Op):
    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        s = self.shape(0)
        if len(s) < 3 or any(isinstance(d, Batch) for d in s[1:]):
            self.fail("expects [N, C, spatial...] with the batch first")
        return [(dtype, (s[0], s[1], *([1] * (len(s) - 2))))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        area = 1
        for d in s[2:]:
            area *= static(d)
        rows = f"{cdim(s[0])} * {s[1]}"
        if self.OP == "GlobalLpPool":
            term, root = _lp(_norm_order(self))
            return (
                f"for (u32 p = 0; p < {rows}; p++) {{ double acc = 0; "
                f"for (u32 k = 0; k < {area}; k++) {{ const double v = {e.inp(0)}[p * {area} + k]; "
                f"acc += {term}; }} {e.out(0)}[p] = ({t}){root}; }}"
            )
        if self.OP == "GlobalAveragePool":
            return (
                f"for (u32 p = 0; p < {rows}; p++) {{ double acc = 0; "
                f"for (u32 k = 0; k < {area}; k++) acc += {e.inp(0)}[p * {area} + k]; "
                f"{e.out(0)}[p] = ({t})(acc / {area}); }}"
            )
        return (
            f"for (u32 p = 0; p < {rows}; p++) {{ {t} best = -MF_INF; "
            f"for (u32 k = 0; k < {area}; k++) {{ {t} v = {e.inp(0)}[p * {area} + k]; if (v > best || v != v) best = v; }} "
            f"{e.out(0)}[p] = best; }}"
        )


@register
class GlobalAveragePool(_Global):
    OP = "GlobalAveragePool"


@register
class GlobalMaxPool(_Global):
    OP = "GlobalMaxPool"


@register
class GlobalLpPool(_Global):
    """The p-norm over each channel's whole image (p an integer, 2 by default)."""

    OP = "GlobalLpPool"
    SINCE = 2


_ = Any


@register
class ConvTranspose(_Window):
    """Transposed convolution (1-D, 2-D) as a scatter: each input pixel adds its kernel-weighted
    contribution to the outputs it reaches (pads, output_padding, output_shape, auto_pad)."""

    OP = "ConvTranspose"
    SINCE = 1

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype, n, c, spatial, w = self.weighted()
        r = len(spatial)
        if len(w) != r + 2 or static(w[0]) != c or c % self.group:
            self.fail(f"weights {self.show(w)} do not fit {c} channels and group {self.group}")
        mg = static(w[1])
        self.kernel = [static(d) for d in w[2:]]
        self.strides = [int(v) for v in self.attr("strides", [1] * r)]
        self.dil = [int(v) for v in self.attr("dilations", [1] * r)]
        outpad = [int(v) for v in self.attr("output_padding", [0] * r)]
        pads = [int(v) for v in self.attr("pads", [0] * (2 * r))]
        auto = self.attr("auto_pad", "NOTSET")
        want = self.attr("output_shape", None)
        self.pad_lo, out = [0] * r, []
        for i in range(r):
            full = (
                self.strides[i] * (spatial[i] - 1)
                + outpad[i]
                + (self.kernel[i] - 1) * self.dil[i]
                + 1
            )
            if want is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
                o = int(want[-r + i]) if want is not None else spatial[i] * self.strides[i]
                total = full - o  # the spec: SAME_UPPER puts the odd pixel at the end
                self.pad_lo[i] = total // 2 if auto == "SAME_UPPER" else total - total // 2
            elif auto in ("NOTSET", "VALID"):
                if auto == "VALID":
                    pads = [0] * (2 * r)
                self.pad_lo[i] = pads[i]
                o = full - pads[i] - pads[i + r]
            else:
                self.fail(f"auto_pad={auto!r} is not supported")
            if o <= 0:
                self.fail("the output would be empty")
            out.append(o)
        self.c, self.m, self.cg, self.mg, self.spatial, self.out = (
            c,
            mg * self.group,
            c // self.group,
            mg,
            spatial,
            out,
        )
        return [(dtype, (n, self.m, *out))]

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        ih, iw = self.hw(self.spatial, 1)
        oh, ow = self.hw(self.out, 1)
        kh, kw = self.hw(self.kernel, 1)
        sh, sw = self.hw(self.strides, 1)
        dh, dw = self.hw(self.dil, 1)
        ph, pw = self.hw(self.pad_lo, 0)
        n = cdim(self.shape(0)[0])
        bias = f"{e.inp(2)}[m]" if self.has(2) else "0"
        return (
            f"for (u32 b = 0; b < {n}; b++) {{\n"
            f"  for (u32 m = 0; m < {self.m}; m++) for (u32 p = 0; p < {oh * ow}; p++) "
            f"{e.out(0)}[(b * {self.m} + m) * {oh * ow} + p] = {bias};\n"
            f"  for (u32 g = 0; g < {self.group}; g++) for (u32 c = 0; c < {self.cg}; c++)\n"
            f"  for (i32 y = 0; y < {ih}; y++) for (i32 x = 0; x < {iw}; x++) {{\n"
            f"    const {t} v = {e.inp(0)}[((b * {self.c} + g * {self.cg} + c) * {ih} + y) * {iw} + x];\n"
            f"    for (u32 m = 0; m < {self.mg}; m++) for (i32 u = 0; u < {kh}; u++) {{\n"
            f"      const i32 yy = y * {sh} + u * {dh} - {ph}; if (yy < 0 || yy >= {oh}) continue;\n"
            f"      for (i32 q = 0; q < {kw}; q++) {{\n"
            f"        const i32 xx = x * {sw} + q * {dw} - {pw}; if (xx < 0 || xx >= {ow}) continue;\n"
            f"        {e.out(0)}[((b * {self.m} + g * {self.mg} + m) * {oh} + yy) * {ow} + xx] += "
            f"v * {e.inp(1)}[(((g * {self.cg} + c) * {self.mg} + m) * {kh} + u) * {kw} + q];\n"
            "      }\n    }\n  }\n}"
        )
