"""Resize (nearest, linear and cubic, any coordinate transformation mode but
tf_crop_and_resize; Upsample, its predecessor): the per-axis source indices and weights are
computed at build time and baked in, so the run-time loop only gathers and blends. GridSample,
whose points come at run time, computes each point's taps once for all channels."""

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


def _reflect(v: str, lo: str, hi: str, t: str) -> str:
    """C statements reflecting the variable v by the borders lo and hi until it lies between
    them (ONNX's reference: by the near border, as often as it takes)."""
    return (
        f"{{ const {t} span = {hi} - {lo};\n"
        f"  if (span <= 0) {v} = {lo};\n"
        f"  else if ({v} < {lo}) {{ const {t} dx = {lo} - {v}; const i64 k = (i64)(dx / span); "
        f"const {t} rem = dx - ({t})k * span; {v} = k % 2 == 0 ? {lo} + rem : {hi} - rem; }}\n"
        f"  else if ({v} > {hi}) {{ const {t} dx = {v} - {hi}; const i64 k = (i64)(dx / span); "
        f"const {t} rem = dx - ({t})k * span; {v} = k % 2 == 0 ? {hi} - rem : {lo} + rem; }} }}"
    )


@register
class GridSample(Op):
    """Samples each image at the grid's normalised (x, y) points (spatial transformers, optical
    flow warps): nearest, bilinear or bicubic (Keys' kernel, a = -0.75), zeros, border or
    reflection padding, align_corners; coordinates and weights in the element type, as
    onnxruntime computes them. 2-D images ([N, C, H, W]) only."""

    OP = "GridSample"
    SINCE = 16
    MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest",
             "bicubic": "cubic", "cubic": "cubic"}  # fmt: skip
    TAPS = {"nearest": 1, "linear": 2, "cubic": 4}  # per axis, around a point

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        if self.x(1).dtype != dtype:
            self.fail("the grid must have the image's element type")
        s, g = self.shape(0), self.shape(1)
        if len(s) != 4 or len(g) != 4 or g[3] != 2:
            self.fail("only 2-D images are supported: X [N, C, H, W] and grid [N, H_out, W_out, 2]")
        if any(isinstance(d, Batch) for d in (*s[1:], *g[1:])) or g[0] != s[0]:
            self.fail("the image and the grid must share their first (batch) dimension only")
        mode = str(self.attr("mode", "linear" if self.version >= 20 else "bilinear"))
        if mode not in self.MODES:
            self.fail(f"mode={mode!r} is not supported ({', '.join(self.MODES)})")
        self.mode = self.MODES[mode]
        self.padding = str(self.attr("padding_mode", "zeros"))
        if self.padding not in ("zeros", "border", "reflection"):
            self.fail(f"padding_mode={self.padding!r} is not supported")
        self.corners = int(self.attr("align_corners", 0))
        return [(dtype, (s[0], s[1], g[1], g[2]))]

    def _borders(self, size: int, t: str) -> tuple[str, str]:
        """The coordinates a point or a tap is reflected between (pixel centres or edges)."""
        if self.corners:
            return f"({t})0", f"({t}){size - 1}"
        return f"({t})-0.5", f"({t}){size - 0.5}"

    def _coordinate(self, v: str, g: str, size: int, t: str) -> str:
        """v = grid value g denormalised over `size` pixels, rounded (nearest) and moved inside
        the borders by the padding mode."""
        one = f"({t})1"
        lo, hi = self._borders(size, t)
        if self.corners:
            expr = f"({g} + {one}) / ({t})2 * ({t}){size - 1}"
        else:
            expr = f"(({g} + {one}) * ({t}){size} - {one}) / ({t})2"
        rint = "__builtin_rintf" if t == "float" else "__builtin_rint"
        code = f"{t} {v} = {expr};\n"
        if self.mode == "nearest":
            code += f"{v} = {rint}({v});\n"
        # bicubic clamps its taps only, not the point (onnxruntime and PyTorch; ONNX's
        # reference clamps both, and no conformance case has bicubic with border padding)
        if self.padding == "border" and self.mode != "cubic":
            code += f"if ({v} < {lo} || {v} > {hi}) {v} = {v} < 0 ? 0 : ({v} > {size - 1} ? {size - 1} : {v});\n"
        elif self.padding == "reflection":
            code += _reflect(v, lo, hi, t) + "\n"
        return code

    def _taps(self, axis: str, v: str, size: int, t: str) -> str:
        """The axis's tap indices (i{axis}[k], fixed by the padding mode), validity (ok{axis}[k])
        and weights (w{axis}[k]) around the coordinate v."""
        n = self.TAPS[self.mode]
        floor = "__builtin_floorf" if t == "float" else "__builtin_floor"
        code = f"i32 i{axis}[{n}]; int ok{axis}[{n}]; {t} w{axis}[{n}];\n"
        if self.mode == "nearest":
            code += f"i{axis}[0] = (i32){v}; w{axis}[0] = 1;\n"
        else:
            code += f"const {t} f{axis} = {floor}({v}), d{axis} = {v} - f{axis};\n"
            if self.mode == "linear":
                code += (
                    f"i{axis}[0] = (i32)f{axis}; i{axis}[1] = (i32)f{axis} + 1; "
                    f"w{axis}[0] = 1 - d{axis}; w{axis}[1] = d{axis};\n"
                )
            else:
                a = f"({t})-0.75"
                near = f"((({a} + 2) * D - ({a} + 3)) * D * D + 1)"
                far = f"((({a} * D - 5 * {a}) * D + 8 * {a}) * D - 4 * {a})"
                for k, dist in enumerate(
                    (f"(d{axis} + 1)", f"d{axis}", f"(1 - d{axis})", f"(2 - d{axis})")
                ):
                    rule = far if k in (0, 3) else near
                    code += f"i{axis}[{k}] = (i32)f{axis} + {k - 1}; w{axis}[{k}] = {rule.replace('D', dist)};\n"
        lo, hi = self._borders(size, t)
        fix = {
            "zeros": f"ok{axis}[k] = i{axis}[k] >= 0 && i{axis}[k] < {size};",
            "border": f"ok{axis}[k] = 1; i{axis}[k] = i{axis}[k] < 0 ? 0 : (i{axis}[k] > {size - 1} ? {size - 1} : i{axis}[k]);",
            "reflection": f"ok{axis}[k] = 1; {{ {t} at = ({t})i{axis}[k]; "
            + _reflect("at", lo, hi, t)
            + f" i{axis}[k] = (i32)at; }}",
        }[self.padding]
        return code + f"for (u32 k = 0; k < {n}; k++) {{ {fix} }}\n"

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        s, g = self.shape(0), self.shape(1)
        c, h, w = static(s[1]), static(s[2]), static(s[3])
        points = static(g[1]) * static(g[2])
        n = self.TAPS[self.mode]
        return (
            f"for (u32 b = 0; b < {cdim(s[0])}; b++) for (u32 p = 0; p < {points}; p++) {{\n"
            f"const {t} gx = {e.inp(1)}[((u64)b * {points} + p) * 2];\n"
            f"const {t} gy = {e.inp(1)}[((u64)b * {points} + p) * 2 + 1];\n"
            + self._coordinate("x", "gx", w, t)
            + self._coordinate("y", "gy", h, t)
            + self._taps("x", "x", w, t)
            + self._taps("y", "y", h, t)
            + f"for (u32 ch = 0; ch < {c}; ch++) {{\n"
            f"  const {t} *img = {e.inp(0)} + ((u64)b * {c} + ch) * {h * w};\n"
            f"  {t} acc = 0;\n"
            f"  for (u32 r = 0; r < {n}; r++) for (u32 q = 0; q < {n}; q++)\n"
            f"    if (oky[r] && okx[q]) acc += wy[r] * wx[q] * img[iy[r] * {w} + ix[q]];\n"
            f"  {e.out(0)}[((u64)b * {c} + ch) * {points} + p] = acc;\n"
            "}\n}"
        )
