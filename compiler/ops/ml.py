"""ai.onnx.ml operators as scikit-learn exports use them (skl2onnx): linear models, trees,
SVMs, scalers, normalisers, imputers, label encoding. Numeric labels only (string labels are
refused). Where the ONNX-ML spec is vague (binary classifiers, base values), the behaviour is
onnxruntime's, which is what users compare against."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as D
from ..clit import lit
from ..dims import Batch, Shape, cdim, numel, static
from ..dtypes import DType
from .base import Emitter, Op, register

ML = "ai.onnx.ml"
IN_TYPES = (D.FLOAT, D.DOUBLE, D.INT64, D.INT32)
TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO")


def post_transform(scores: str, count: int | str, how: str) -> str:
    """C applying an ONNX-ML post_transform in place to `count` float scores (onnxruntime's
    formulas, computed in double)."""
    if how == "NONE":
        return ""
    if how == "LOGISTIC":
        return f"for (u32 k = 0; k < {count}; k++) {scores}[k] = (float)mf_sigmoid((double){scores}[k]);"
    top = f"double top = {scores}[0]; for (u32 k = 1; k < {count}; k++) if ({scores}[k] > top) top = {scores}[k];"
    if how == "SOFTMAX":
        return (
            f"{{ {top} double sum = 0; double ex[{count}];\n"
            f"  for (u32 k = 0; k < {count}; k++) {{ ex[k] = mf_exp((double){scores}[k] - top); sum += ex[k]; }}\n"
            f"  for (u32 k = 0; k < {count}; k++) {scores}[k] = (float)(ex[k] / sum); }}"
        )
    # SOFTMAX_ZERO: zeros stay (scaled) out of the sum
    return (
        f"{{ {top} double sum = 0; double ex[{count}]; const double z = mf_exp(-top);\n"
        f"  for (u32 k = 0; k < {count}; k++) {{ double v = {scores}[k];\n"
        f"    if (v > 1e-7 || v < -1e-7) {{ ex[k] = mf_exp(v - top); sum += ex[k]; }} else ex[k] = v * z; }}\n"
        f"  for (u32 k = 0; k < {count}; k++) {scores}[k] = (float)(ex[k] / sum); }}"
    )


class _ML(Op):
    DOMAIN = ML

    def rows(self, i: int = 0) -> tuple[Any, int]:
        """[N, F] (or [F]) input as (rows, features)."""
        s = self.shape(i)
        if len(s) == 1:
            if isinstance(s[0], Batch):
                self.fail("a 1-D input cannot be the batch")
            return 1, int(s[0])
        if len(s) != 2 or isinstance(s[1], Batch):
            self.fail(f"expects a [N, features] input, got {self.show(s)}")
        return s[0], int(s[1])

    def labels(self) -> list[int]:
        if self.attr("classlabels_strings", None):
            self.fail(
                "string class labels are not supported: train with integer labels (or encode "
                "them) so the model outputs int64 labels"
            )
        return [int(v) for v in self.attr("classlabels_ints", self.attr("classlabels_int64s", []))]

    def transform(self) -> str:
        how = self.attr("post_transform", "NONE")
        if how not in TRANSFORMS:
            self.fail(f"post_transform={how!r} is not supported ({', '.join(TRANSFORMS)})")
        return str(how)


@register
class LinearRegressor(_ML):
    OP = "LinearRegressor"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        n, f = self.rows()
        self.t = int(self.attr("targets", 1))
        coef = np.asarray(self.attr("coefficients"), dtype=np.float32)
        if coef.size != self.t * f:
            self.fail(f"{coef.size} coefficients for {self.t} targets and {f} features")
        self.coef = coef.reshape(self.t, f)
        icp = self.attr("intercepts", None)
        self.icp = np.zeros(self.t, np.float32) if icp is None else np.asarray(icp, np.float32)
        if self.attr("post_transform", "NONE") != "NONE":
            self.fail("post_transform must be NONE")
        self.n, self.f = n, f
        return [(D.FLOAT, (n, self.t))]

    def emit(self, e: Emitter) -> str:
        w = e.const(np.ascontiguousarray(self.coef.T), D.FLOAT)
        b = e.const(self.icp, D.FLOAT)
        return (
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) {{ float *y = {e.out(0)} + r * {self.t};\n"
            f"  for (u32 c = 0; c < {self.t}; c++) y[c] = {b}[c];\n"
            f"  for (u32 q = 0; q < {self.f}; q++) {{ const float xv = (float){e.inp(0)}[r * {self.f} + q];\n"
            f"    for (u32 c = 0; c < {self.t}; c++) y[c] += xv * {w}[q * {self.t} + c]; }} }}"
        )


@register
class LinearClassifier(_ML):
    OP = "LinearClassifier"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        n, f = self.rows()
        icp = np.asarray(self.attr("intercepts", []), dtype=np.float32)
        c = icp.size
        coef = np.asarray(self.attr("coefficients"), dtype=np.float32)
        if c == 0 or coef.size != c * f:
            self.fail(f"{coef.size} coefficients for {c} classes and {f} features")
        self.labels_ = self.labels()
        self.how = self.transform()
        self.binary = c == 1 and len(self.labels_) == 2
        if c > 1 and len(self.labels_) != c:
            self.fail(f"{len(self.labels_)} class labels for {c} classes")
        self.n, self.f, self.c, self.coef, self.icp = n, f, c, coef.reshape(c, f), icp
        width = 2 if self.binary else c
        return [(D.INT64, (n,)), (D.FLOAT, (n, width))]

    def emit(self, e: Emitter) -> str:
        c, f = self.c, self.f
        w = e.const(np.ascontiguousarray(self.coef.T), D.FLOAT)
        b = e.const(self.icp, D.FLOAT)
        width = 2 if self.binary else c
        lines = [
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) {{",
            f"  float s[{c}];",
            f"  for (u32 k = 0; k < {c}; k++) s[k] = {b}[k];",
            f"  for (u32 q = 0; q < {f}; q++) {{ const float xv = (float){e.inp(0)}[r * {f} + q];",
            f"    for (u32 k = 0; k < {c}; k++) s[k] += xv * {w}[q * {c} + k]; }}",
        ]
        if c == 1:
            pos = self.labels_[1] if self.binary else 1
            neg = self.labels_[0] if self.binary else 0
            lines.append(f"  {e.out(0)}[r] = s[0] > 0 ? {pos} : {neg};")
            if self.binary:  # onnxruntime writes [1 - s, s] whatever the transform
                lines.append(f"  {e.out(1)}[r * 2] = 1.0f - s[0]; {e.out(1)}[r * 2 + 1] = s[0];")
            else:
                lines.append(f"  {e.out(1)}[r] = s[0];")
        else:
            labels = e.const(np.asarray(self.labels_, np.int64), D.INT64)
            lines.append(
                f"  u32 best = 0; for (u32 k = 1; k < {c}; k++) if (s[k] > s[best]) best = k;"
            )
            lines.append(f"  {e.out(0)}[r] = {labels}[best];")
            lines.append("  " + post_transform("s", c, self.how))
            lines.append(f"  for (u32 k = 0; k < {width}; k++) {e.out(1)}[r * {width} + k] = s[k];")
        lines.append("}")
        return "\n".join(lines)


@register
class Normalizer(_ML):
    """Norms are summed in double: onnxruntime sums squares in float32, so a feature above
    ~1.8e19 overflows there (the row turns to NaN) and is normalised correctly here."""

    OP = "Normalizer"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        self.n, self.f = self.rows()
        self.norm = self.attr("norm", "MAX")
        if self.norm not in ("MAX", "L1", "L2"):
            self.fail(f"norm={self.norm!r} is not MAX, L1 or L2")
        return [(D.FLOAT, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        f = self.f
        acc = {
            "MAX": f"double a = x[0]; for (u32 k = 1; k < {f}; k++) if (x[k] > a) a = x[k];",
            "L1": f"double a = 0; for (u32 k = 0; k < {f}; k++) a += x[k] < 0 ? -(double)x[k] : (double)x[k];",
            "L2": f"double a = 0; for (u32 k = 0; k < {f}; k++) a += (double)x[k] * x[k]; a = mf_sqrt(a);",
        }[self.norm]
        t = self.x(0).dtype.c
        return (
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) {{ const {t} *x = {e.inp(0)} + r * {f};\n"
            f"  {acc}\n"
            f"  for (u32 k = 0; k < {f}; k++) {e.out(0)}[r * {f} + k] = (float)((double)x[k] / a); }}"
        )


@register
class Scaler(_ML):
    OP = "Scaler"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        self.n, self.f = self.rows()
        self.offset = np.asarray(self.attr("offset", [0.0]), np.float32)
        self.scale = np.asarray(self.attr("scale", [1.0]), np.float32)
        for name, v in (("offset", self.offset), ("scale", self.scale)):
            if v.size not in (1, self.f):
                self.fail(f"{name} has {v.size} values for {self.f} features")
        return [(D.FLOAT, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        off = np.broadcast_to(self.offset, (self.f,)).copy()
        sc = np.broadcast_to(self.scale, (self.f,)).copy()
        o, s = e.const(off, D.FLOAT), e.const(sc, D.FLOAT)
        return (
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) for (u32 k = 0; k < {self.f}; k++)\n"
            f"  {e.out(0)}[r * {self.f} + k] = ((float){e.inp(0)}[r * {self.f} + k] - {o}[k]) * {s}[k];"
        )


@register
class Imputer(_ML):
    OP = "Imputer"

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, (D.FLOAT, D.INT64))
        self.n, self.f = self.rows()
        if dtype == D.FLOAT:
            vals = np.asarray(self.attr("imputed_value_floats"), np.float32)
            self.replaced = float(self.attr("replaced_value_float", 0.0))
        else:
            vals = np.asarray(self.attr("imputed_value_int64s"), np.int64)
            self.replaced = int(self.attr("replaced_value_int64", 0))
        if vals.size not in (1, self.f):
            self.fail(f"{vals.size} imputed values for {self.f} features")
        self.vals = np.broadcast_to(vals, (self.f,)).copy()
        return [(dtype, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        v = e.const(self.vals, dtype)
        if dtype.is_float and np.isnan(self.replaced):
            cond = "x != x"
        else:
            cond = f"x == {lit(self.replaced, dtype)}"
        return (
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) for (u32 k = 0; k < {self.f}; k++) {{\n"
            f"  const {dtype.c} x = {e.inp(0)}[r * {self.f} + k];\n"
            f"  {e.out(0)}[r * {self.f} + k] = ({cond}) ? {v}[k] : x; }}"
        )


@register
class Binarizer(_ML):
    OP = "Binarizer"

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, IN_TYPES)
        self.th = float(self.attr("threshold", 0.0))
        return [(dtype, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        n = self.numel_c(self.shape(0))
        return f"for (u32 k = 0; k < {n}; k++) {e.out(0)}[k] = {e.inp(0)}[k] > {lit(self.th, dtype)} ? 1 : 0;"


@register
class ArrayFeatureExtractor(_ML):
    """Indices are checked at run time: out of range ends the run with an error."""

    OP = "ArrayFeatureExtractor"

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, (*IN_TYPES, D.BOOL))
        self.need(1, (D.INT64,))
        s = self.shape(0)
        if not s or isinstance(s[-1], Batch):
            self.fail("the last axis of X cannot be the batch")
        count = numel(self.shape(1))
        if len(s) == 1:
            return [(dtype, (1, count))]
        return [(dtype, (*s[:-1], count))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        last = static(s[-1])
        outer = numel(s[:-1]) if len(s) > 1 else 1
        count = numel(self.shape(1))
        bad = e.error("index out of range")
        return (
            f"for (u32 q = 0; q < {cdim(count)}; q++) if ({e.inp(1)}[q] < 0 || {e.inp(1)}[q] >= {last}) {bad}\n"
            f"for (u32 a = 0; a < {cdim(outer)}; a++) for (u32 q = 0; q < {cdim(count)}; q++)\n"
            f"  {e.out(0)}[a * {cdim(count)} + q] = {e.inp(0)}[a * {last} + (u32){e.inp(1)}[q]];"
        )


@register
class LabelEncoder(_ML):
    """Numeric keys and values (int64, float); string tables are refused."""

    OP = "LabelEncoder"
    SINCE = 2

    def infer(self) -> list[tuple[DType, Shape]]:
        a = self.node.attrs
        if "keys_tensor" in a:
            keys, vals = np.asarray(a["keys_tensor"]), np.asarray(a["values_tensor"])
        else:
            keys = np.asarray(a.get("keys_int64s", a.get("keys_floats", a.get("keys_strings", []))))
            vals = np.asarray(
                a.get("values_int64s", a.get("values_floats", a.get("values_strings", [])))
            )
        if keys.dtype.kind in "US" or vals.dtype.kind in "US" or keys.dtype == object:
            self.fail("string keys or values are not supported")
        if keys.size != vals.size:
            self.fail("keys and values differ in length")
        in_t = self.need(0, (D.INT64, D.FLOAT, D.INT32, D.DOUBLE))
        out_t = (
            D.from_numpy(vals.dtype, f"{self.where}: {self.node.label}") if vals.size else D.INT64
        )
        if "default_tensor" in a:
            default = np.asarray(a["default_tensor"]).reshape(-1)[0]
        elif out_t.is_float:
            default = float(a.get("default_float", -0.0))
        else:
            default = int(a.get("default_int64", -1))
        self.keys, self.vals, self.default = keys.astype(in_t.np), vals.astype(out_t.np), default
        return [(out_t, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        in_t, out_t = self.x(0).dtype, self.out_dtype(0)
        k = e.const(self.keys, in_t)
        v = e.const(self.vals, out_t)
        n = self.numel_c(self.shape(0))
        # NaN keys match NaN inputs (onnxruntime's behaviour for float keys)
        eq = "(x == kk || (x != x && kk != kk))" if in_t.is_float else "x == kk"
        return (
            f"for (u32 q = 0; q < {n}; q++) {{ const {in_t.c} x = {e.inp(0)}[q]; {out_t.c} y = {lit(self.default, out_t)};\n"
            f"  for (u32 j = 0; j < {len(self.keys)}; j++) {{ const {in_t.c} kk = {k}[j]; if ({eq}) {{ y = {v}[j]; break; }} }}\n"
            f"  {e.out(0)}[q] = y; }}"
        )
