"""Resize (nearest, linear and cubic, any coordinate transformation mode but
tf_crop_and_resize): the per-axis source indices and weights are computed at build time and
baked in, so the run-time loop only gathers and blends."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from .. import dtypes as D
from ..dims import Batch, Dim, Shape, cdim, static
from ..dtypes import DType
from . import loops
from .base import Emitter, Op, register

TRANSFORMS = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
)


@register
class Resize(Op):
    OP = "Resize"
    SINCE = 11
    NOTES = (
        "nearest, linear, cubic (float images); every coordinate transformation but "
        "tf_crop_and_resize; antialias and keep_aspect_ratio_policy other than stretch refused"
    )
    STATIC_INPUTS: ClassVar[tuple[int, ...]] = (1, 2, 3)

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, (*D.FLOATS, D.INT8, D.UINT8))
        s = self.shape(0)
        self._attributes(dtype)
        axes = [self.axis(int(a), len(s)) for a in self.attr("axes", list(range(len(s))))]
        scales = [1.0] * len(s)
        sizes: list[Dim] = list(s)
        if self.has(3) and np.asarray(self.value(3)).size:
            want = [int(v) for v in np.asarray(self.value(3)).reshape(-1)]
            for a, n in zip(axes, want, strict=True):
                sizes[a] = n
                scales[a] = n / static(s[a]) if not isinstance(s[a], Batch) else 1.0
        elif (given := self.given_scales()) is not None:
            for a, sc in zip(axes, given, strict=True):
                scales[a] = sc
                if not isinstance(s[a], Batch):
                    sizes[a] = math.floor(static(s[a]) * sc)
        else:
            self.fail("needs scales or sizes")
        for k, d in enumerate(s):
            if isinstance(d, Batch) and (sizes[k] != d or scales[k] != 1.0):
                self.fail("resizing the batch axis is not supported")
        self.scales, self.sizes = scales, sizes
        return [(dtype, tuple(sizes))]

    def given_scales(self) -> list[float] | None:
        """The `scales` input, if the node has one that is not empty."""
        if self.has(2) and np.asarray(self.value(2)).size:
            return [float(v) for v in np.asarray(self.value(2)).reshape(-1)]
        return None

    def _attributes(self, dtype: DType) -> None:
        self.mode = self.attr("mode", "nearest")
        self.ct = self.attr("coordinate_transformation_mode", "half_pixel")
        self.nearest = self.attr("nearest_mode", "round_prefer_floor")
        if self.mode not in ("nearest", "linear", "cubic"):
            self.fail(f"mode={self.mode!r} is not supported (nearest, linear, cubic)")
        if self.mode == "cubic" and not dtype.is_float:
            self.fail("cubic resizing of integer images is not supported (float images only)")
        self.cubic_a = float(self.attr("cubic_coeff_a", -0.75))
        self.exclude_outside = int(self.attr("exclude_outside", 0))
        if self.ct not in TRANSFORMS:
            self.fail(f"coordinate_transformation_mode={self.ct!r} is not supported")
        if int(self.attr("antialias", 0)):
            self.fail("antialias is not supported")
        if self.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
            self.fail("keep_aspect_ratio_policy other than stretch is not supported")

    def _source(
        self, o: np.ndarray[Any, Any], n_in: int, n_int: int, n_out: float, scale: float
    ) -> np.ndarray[Any, Any]:
        if self.ct == "half_pixel":
            return (o + 0.5) / scale - 0.5
        if self.ct == "half_pixel_symmetric":
            adjustment = n_int / n_out
            offset = n_in / 2 * (1 - adjustment)
            return offset + (o + 0.5) / scale - 0.5
        if self.ct == "pytorch_half_pixel":
            return (o + 0.5) / scale - 0.5 if n_out > 1 else np.zeros_like(o)
        if self.ct == "align_corners":
            return o * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros_like(o)
        return o / scale

    def _nearest(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        half = x - np.floor(x) == 0.5
        if self.nearest == "round_prefer_floor":
            out = np.where(half, np.floor(x), np.round(x))
        elif self.nearest == "round_prefer_ceil":
            out = np.where(half, np.ceil(x), np.round(x))
        else:
            out = np.floor(x) if self.nearest == "floor" else np.ceil(x)
        return np.asarray(out)

    def table(self, e: Emitter, n_in: int, n_out: int, scale: float) -> tuple[str, str, str]:
        """One axis's source indices (nearest) or the two neighbours and the weight of the
        upper one (linear), as baked constants."""
        # the transform uses the unrounded resized length (input * scale), as the spec's reference
        x = self._source(np.arange(n_out, dtype=np.float64), n_in, n_out, n_in * scale, scale)
        if self.mode == "nearest":
            j = np.clip(self._nearest(x), 0, n_in - 1).astype(np.int32)
            return e.const(j, D.INT32), "", ""
        dtype = self.x(0).dtype
        wtype = dtype if dtype.is_float else D.FLOAT
        xc = np.clip(x, 0, n_in - 1)
        lo = np.floor(xc).astype(np.int32)
        hi = np.minimum(lo + 1, n_in - 1).astype(np.int32)
        return (
            e.const(lo, D.INT32),
            e.const(hi, D.INT32),
            e.const((xc - lo).astype(wtype.np), wtype),
        )

    def cubic_taps(self, e: Emitter, n_in: int, n_out: int, scale: float) -> list[tuple[str, str]]:
        """One axis's four neighbours (edge-clamped) and their weights (Keys' cubic kernel with
        `cubic_coeff_a`; with `exclude_outside`, neighbours outside the input weigh 0 and the
        others are renormalised), as baked constants (weights in double)."""
        x = self._source(np.arange(n_out, dtype=np.float64), n_in, n_out, n_in * scale, scale)
        base = np.floor(x)
        r = x - base
        a = self.cubic_a
        taps = []
        weights = []
        for offset, d in ((-1, 1 + r), (0, r), (1, 1 - r), (2, 2 - r)):
            near = ((a + 2) * d - (a + 3)) * d * d + 1  # |d| <= 1
            far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a  # 1 < |d| < 2
            w = np.where(np.abs(d) <= 1, near, far)
            j = base + offset
            if self.exclude_outside:
                w = np.where((j < 0) | (j > n_in - 1), 0.0, w)
            weights.append(w)
            taps.append(np.clip(j, 0, n_in - 1).astype(np.int32))
        total = np.sum(weights, axis=0) if self.exclude_outside else 1.0
        return [
            (e.const(j, D.INT32), e.const(np.asarray(w / total, np.float64), D.DOUBLE))
            for j, w in zip(taps, weights, strict=True)
        ]

    def emit(self, e: Emitter) -> str:
        s, out = self.shape(0), self.oshape()
        st = loops.strides(s)
        resized = [
            k
            for k in range(len(s))
            if not isinstance(s[k], Batch) and (out[k] != s[k] or self.scales[k] != 1.0)
        ]
        idx = [f"rz{k}" for k in range(len(s))]
        dtype = self.x(0).dtype
        lines = []
        args = {k: (static(s[k]), static(out[k]), self.scales[k]) for k in resized}
        if self.mode == "cubic":
            return self.emit_cubic(e, resized, {k: self.cubic_taps(e, *args[k]) for k in resized})
        tables = {k: self.table(e, *args[k]) for k in resized}
        for k, d in enumerate(out):
            lines.append(f"for (u32 {idx[k]} = 0; {idx[k]} < {cdim(d)}; {idx[k]}++)")
        fixed = (
            " + ".join(f"{idx[k]} * {cdim(st[k])}" for k in range(len(s)) if k not in resized)
            or "0"
        )
        if self.mode == "nearest":
            src = " + ".join(
                [fixed] + [f"(u32){tables[k][0]}[{idx[k]}] * {cdim(st[k])}" for k in resized]
            )
            body = f"{e.out(0)}[o++] = {e.inp(0)}[{src}];"
        else:
            terms = []
            for corner in range(1 << len(resized)):
                parts, weights = [fixed], []
                for bit, k in enumerate(resized):
                    lo, hi, w = tables[k]
                    if corner >> bit & 1:
                        parts.append(f"(u32){hi}[{idx[k]}] * {cdim(st[k])}")
                        weights.append(f"(double){w}[{idx[k]}]")
                    else:
                        parts.append(f"(u32){lo}[{idx[k]}] * {cdim(st[k])}")
                        weights.append(f"(1.0 - (double){w}[{idx[k]}])")
                terms.append(
                    f"{' * '.join(weights) or '1.0'} * (double){e.inp(0)}[{' + '.join(parts)}]"
                )
            cast = dtype.c
            rnd = "" if dtype.is_float else "mf_rint"
            body = f"{e.out(0)}[o++] = ({cast}){rnd}({' + '.join(terms)});"
        return "{ u32 o = 0;\n" + "\n".join(lines) + " {\n  " + body + "\n} }"

    def emit_cubic(
        self, e: Emitter, resized: list[int], taps: dict[int, list[tuple[str, str]]]
    ) -> str:
        """Every combination of the resized axes' four neighbours, weighted (in double)."""
        s, out = self.shape(0), self.oshape()
        st = loops.strides(s)
        idx = [f"rz{k}" for k in range(len(s))]
        lines = [
            f"for (u32 {idx[k]} = 0; {idx[k]} < {cdim(d)}; {idx[k]}++)" for k, d in enumerate(out)
        ]
        fixed = [f"{idx[k]} * {cdim(st[k])}" for k in range(len(s)) if k not in resized] or ["0"]
        terms = []
        for combo in range(4 ** len(resized)):
            parts, weights = list(fixed), []
            for n, k in enumerate(resized):
                j, w = taps[k][combo // 4**n % 4]
                parts.append(f"(u32){j}[{idx[k]}] * {cdim(st[k])}")
                weights.append(f"{w}[{idx[k]}]")
            terms.append(
                f"{' * '.join(weights) or '1.0'} * (double){e.inp(0)}[{' + '.join(parts)}]"
            )
        body = f"{e.out(0)}[o++] = ({self.x(0).dtype.c})({' + '.join(terms)});"
        return "{ u32 o = 0;\n" + "\n".join(lines) + " {\n  " + body + "\n} }"


@register
class Upsample(Resize):
    """Resize's predecessor (opsets 7-9, deprecated at 10, still in older exports): scales
    per axis (an attribute, then an input), nearest or linear, which onnxruntime computes as
    Resize's asymmetric transform with nearest rounding down."""

    OP = "Upsample"
    SINCE = 7
    NOTES = "nearest or linear, as onnxruntime computes them (Resize's asymmetric transform)"
    STATIC_INPUTS = (1,)

    def given_scales(self) -> list[float] | None:
        if self.has(1):
            return [float(v) for v in np.asarray(self.value(1)).reshape(-1)]
        scales = self.attr("scales", None)
        return [float(v) for v in scales] if scales is not None else None

    def _attributes(self, dtype: DType) -> None:
        self.mode = self.attr("mode", "nearest")
        if isinstance(self.mode, bytes):
            self.mode = self.mode.decode()
        if self.mode == "bilinear":
            self.mode = "linear"
        if self.mode not in ("nearest", "linear"):
            self.fail(f"mode={self.mode!r} is not supported (nearest, linear)")
        self.ct, self.nearest = "asymmetric", "floor"
