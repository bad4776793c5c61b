"""QuantizeLinear and DequantizeLinear (per tensor or per axis; int8/uint8/int16/uint16/int32
zero points): what QDQ-quantised models put around their float operators. Constant weights
with a DequantizeLinear in front fold at build time."""

from __future__ import annotations

import numpy as np

from .. import dtypes as D
from ..dims import Batch, Dim, Shape, cdim, numel, static
from ..dtypes import DType
from .base import Emitter, Op, register

QTYPES = (D.INT8, D.UINT8, D.INT16, D.UINT16, D.INT32)


class _Linear(Op):
    SINCE = 10

    def params(self) -> None:
        s = self.shape(0)
        scale = self.shape(1)
        if self.has(2) and self.shape(2) != scale:
            self.fail("the zero point must have the scale's shape")
        if int(self.attr("block_size", 0)):
            self.fail("blocked quantisation (block_size) is not supported")
        if not scale or static(numel(scale)) == 1:
            self.per_axis = False
            self.outer, self.count = numel(s), 1
            self.inner: Dim = 1
            return
        if len(scale) != 1:
            self.fail("the scale must be a scalar or 1-D (per axis)")
        ax = self.axis(int(self.attr("axis", 1)), len(s))
        if isinstance(s[ax], Batch) or s[ax] != scale[0]:
            self.fail(
                f"a per-axis scale of {scale[0]} values does not fit axis {ax} of {self.show(s)}"
            )
        self.per_axis = True
        self.outer, self.count = numel(s[:ax]), static(s[ax])
        self.inner = numel(s[ax + 1 :])

    def loop(self, body: str) -> str:
        if not self.per_axis:
            return f"for (u32 q = 0; q < {cdim(self.outer)}; q++) {{ const u32 c = 0; {body} }}"
        return (
            f"for (u32 a = 0; a < {cdim(self.outer)}; a++) for (u32 c = 0; c < {self.count}; c++) "
            f"for (u32 b = 0; b < {cdim(self.inner)}; b++) {{ const u32 q = (a * {self.count} + c) * {cdim(self.inner)} + b; {body} }}"
        )


@register
class DequantizeLinear(_Linear):
    OP = "DequantizeLinear"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, QTYPES)
        out = self.need(1, D.FLOATS)
        self.params()
        return [(out, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        t = self.x(1).dtype.c
        zp = f"({t}){e.inp(2)}[c]" if self.has(2) else "0"
        return self.loop(f"{e.out(0)}[q] = (({t}){e.inp(0)}[q] - {zp}) * {e.inp(1)}[c];")


@register
class QuantizeLinear(_Linear):
    OP = "QuantizeLinear"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, (*D.FLOATS, D.INT32))
        self.need(1, D.FLOATS)
        out = (
            self.need(2, QTYPES)
            if self.has(2)
            else D.from_onnx(int(self.attr("output_dtype", 2) or 2), self.where)
        )
        if out not in QTYPES:
            self.fail(f"output type {out.name} is not supported")
        self.params()
        return [(out, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        out = self.out_dtype(0)
        info = np.iinfo(out.np)  # type: ignore[type-var]
        zp = f"(double){e.inp(2)}[c]" if self.has(2) else "0"
        t = self.x(1).dtype.c  # x / scale in the scale's precision, as the spec's reference
        return self.loop(
            f"double v = mf_rint((double)(({t}){e.inp(0)}[q] / {e.inp(1)}[c])) + {zp}; "
            f"v = v < {int(info.min)}.0 ? {int(info.min)}.0 : (v > {int(info.max)}.0 ? {int(info.max)}.0 : v); "
            f"{e.out(0)}[q] = ({out.c})v;"
        )


@register
class DynamicQuantizeLinear(Op):
    """uint8 quantisation with the scale and zero point of the tensor's own range (widened to
    hold 0): what onnxruntime's dynamic quantisation puts in front of MatMulInteger and
    ConvInteger. In float32 as onnxruntime computes it (a range of one value has scale 1)."""

    OP = "DynamicQuantizeLinear"
    SINCE = 11

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, (D.FLOAT,))
        return [(D.UINT8, self.shape(0)), (D.FLOAT, ()), (D.UINT8, ())]

    def emit(self, e: Emitter) -> str:
        count = cdim(numel(self.shape(0)))
        x = e.inp(0)
        scale = f"{e.out(1)}[0] = s;" if self.has_out(1) else ""
        zero = f"{e.out(2)}[0] = (u8)zp;" if self.has_out(2) else ""
        return (
            "{\n"
            "  float lo = 0.0f, hi = 0.0f;\n"
            f"  for (u32 q = 0; q < {count}; q++) {{ const float v = {x}[q]; "
            "if (v < lo) lo = v; if (v > hi) hi = v; }\n"
            "  const float s = hi == lo ? 1.0f : (hi - lo) / 255.0f;\n"
            "  float z = 0.0f - lo / s;\n"
            "  z = z < 0.0f ? 0.0f : (z > 255.0f ? 255.0f : z);\n"
            "  const float zp = __builtin_rintf(z);\n"
            f"  {scale} {zero}\n"
            f"  for (u32 q = 0; q < {count}; q++) {{\n"
            f"    float v = __builtin_rintf({x}[q] / s) + zp;\n"
            "    v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);\n"
            f"    {e.out(0)}[q] = (u8)v;\n"
            "  }\n}"
        )
