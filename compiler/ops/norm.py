"""Normalisations and softmax: BatchNormalization (inference), LayerNormalization,
InstanceNormalization, Softmax/LogSoftmax/Hardmax over an axis. Statistics and sums are
accumulated in double and the result rounded once."""

from __future__ import annotations

from .. import dtypes as D
from ..clit import lit
from ..dims import Batch, Shape, cdim, numel, static
from ..dtypes import DType
from .base import Emitter, Op, register


class _OverTrailingAxes(Op):
    """Layer and RMS normalisation read the same attributes: the axes from `axis` on (none of
    them the batch) make rows of `inner` elements, `epsilon` guards the root."""

    ax: int
    inner: int
    eps: float

    def _rows(self) -> tuple[DType, Shape]:
        dtype = self.need(0, D.FLOATS)
        s = self.shape(0)
        self.ax = self.axis(int(self.attr("axis", -1)), len(s))
        if any(isinstance(d, Batch) for d in s[self.ax :]):
            self.fail("cannot normalise over the batch")
        self.inner = static(numel(s[self.ax :]))
        self.eps = float(self.attr("epsilon", 1e-5))
        return dtype, s


@register
class BatchNormalization(Op):
    OP = "BatchNormalization"
    SINCE = 9

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        if int(self.attr("training_mode", 0)):
            self.fail("training_mode=1 is not supported (inference only)")
        if len([o for o in self.node.outputs if o]) > 1:
            self.fail("only the Y output is supported (inference)")
        s = self.shape(0)
        if len(s) < 2 or isinstance(s[1], Batch):
            self.fail("expects [N, C, ...]")
        for i in (1, 2, 3, 4):
            if self.x(i).shape != (s[1],):
                self.fail(f"input {i} must have shape [C]")
        self.eps = float(self.attr("epsilon", 1e-5))
        return [(dtype, s)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        c = static(s[1])
        inner = numel(s[2:])
        return (
            f"for (u32 b = 0; b < {cdim(s[0])}; b++) for (u32 ch = 0; ch < {c}; ch++) {{\n"
            f"  const {t} a = ({t})({e.inp(1)}[ch] / mf_sqrt((double){e.inp(4)}[ch] + {self.eps!r}));\n"
            f"  const {t} m = {e.inp(3)}[ch], z = {e.inp(2)}[ch];\n"
            f"  const {t} *x = {e.inp(0)} + (b * {c} + ch) * {cdim(inner)};\n"
            f"  {t} *y = {e.out(0)} + (b * {c} + ch) * {cdim(inner)};\n"
            f"  for (u32 k = 0; k < {cdim(inner)}; k++) y[k] = (x[k] - m) * a + z;\n}}"
        )


@register
class LayerNormalization(_OverTrailingAxes):
    OP = "LayerNormalization"
    SINCE = 17

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype, s = self._rows()
        for i in (1, 2):
            if self.has(i) and static(numel(self.shape(i))) not in (1, self.inner):
                self.fail(f"input {i} must have the normalised shape (or one element)")
        stat = tuple(s[: self.ax]) + (1,) * (len(s) - self.ax)
        stash = D.from_onnx(int(self.attr("stash_type", 1)), f"{self.where}: {self.node.label}")
        return [(dtype, s), (stash, stat), (stash, stat)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        outer = numel(s[: self.ax])
        n = self.inner

        def pick(i: int) -> str:
            if not self.has(i):
                return "0"
            return f"{e.inp(i)}[k]" if static(numel(self.shape(i))) == n else f"{e.inp(i)}[0]"

        stats = ""
        if self.has_out(1):
            stats += f"  {e.out(1)}[r] = mean;\n"
        if self.has_out(2):
            stats += f"  {e.out(2)}[r] = inv;\n"
        scale = pick(1) if self.has(1) else "1"
        return (
            f"for (u32 r = 0; r < {cdim(outer)}; r++) {{\n"
            f"  const {t} *x = {e.inp(0)} + r * {n};\n"
            f"  {t} *y = {e.out(0)} + r * {n};\n"
            f"  double sum = 0, sq = 0;\n"
            f"  for (u32 k = 0; k < {n}; k++) sum += x[k];\n"
            f"  const double mean = sum / {n};\n"
            f"  for (u32 k = 0; k < {n}; k++) {{ double d = x[k] - mean; sq += d * d; }}\n"
            f"  const double inv = 1.0 / mf_sqrt(sq / {n} + {self.eps!r});\n"
            + stats
            + f"  for (u32 k = 0; k < {n}; k++) y[k] = ({t})(((double)x[k] - mean) * inv * {scale} + {pick(2)});\n}}"
        )


@register
class InstanceNormalization(Op):
    OP = "InstanceNormalization"
    SINCE = 6

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        s = self.shape(0)
        if len(s) < 3 or any(isinstance(d, Batch) for d in s[1:]):
            self.fail("expects [N, C, spatial...]")
        self.eps = float(self.attr("epsilon", 1e-5))
        return [(dtype, s)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        c = static(s[1])
        n = static(numel(s[2:]))
        return (
            f"for (u32 r = 0; r < {cdim(s[0])} * {c}; r++) {{\n"
            f"  const u32 ch = r % {c};\n"
            f"  const {t} *x = {e.inp(0)} + r * {n};\n  {t} *y = {e.out(0)} + r * {n};\n"
            f"  double sum = 0, sq = 0;\n"
            f"  for (u32 k = 0; k < {n}; k++) sum += x[k];\n"
            f"  const double mean = sum / {n};\n"
            f"  for (u32 k = 0; k < {n}; k++) {{ double d = x[k] - mean; sq += d * d; }}\n"
            f"  const double inv = 1.0 / mf_sqrt(sq / {n} + {self.eps!r});\n"
            f"  for (u32 k = 0; k < {n}; k++) y[k] = ({t})(((double)x[k] - mean) * inv * {e.inp(1)}[ch] + {e.inp(2)}[ch]);\n}}"
        )


class _Softmax(Op):
    """opset >= 13: along one axis; before 13: over the input flattened to 2-D at `axis`."""

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        s = self.shape(0)
        default = -1 if self.version >= 13 else 1
        ax = self.axis(int(self.attr("axis", default)), len(s))
        if self.version >= 13:
            outer, length, inner = numel(s[:ax]), s[ax], numel(s[ax + 1 :])
        else:
            outer, length, inner = numel(s[:ax]), numel(s[ax:]), 1
        if isinstance(length, Batch) or isinstance(inner, Batch):
            self.fail("cannot normalise over the batch")
        self.outer, self.length, self.inner = outer, int(length), int(inner)
        return [(dtype, s)]

    def loop(self, e: Emitter, body: str) -> str:
        t = self.x(0).dtype.c
        L, inner = self.length, self.inner
        return (
            f"for (u32 r = 0; r < {cdim(self.outer)}; r++) for (u32 c = 0; c < {inner}; c++) {{\n"
            f"  const {t} *x = {e.inp(0)} + r * {L * inner} + c;\n"
            f"  {t} *y = {e.out(0)} + r * {L * inner} + c;\n"
            f"  {t} top = x[0];\n"
            f"  for (u32 k = 1; k < {L}; k++) if (x[k * {inner}] > top) top = x[k * {inner}];\n"
            f"{body}\n}}"
        )


@register
class Softmax(_Softmax):
    OP = "Softmax"

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        L, inner = self.length, self.inner
        if t == "float":  # exps in one vectorisable loop, the sum in double, one reciprocal
            return self.loop(
                e,
                (
                    f"  for (u32 k = 0; k < {L}; k++) y[k * {inner}] = mf_expf(x[k * {inner}] - top);\n"
                    f"  double sum = 0;\n"
                    f"  for (u32 k = 0; k < {L}; k++) sum += y[k * {inner}];\n"
                    f"  const float inv = (float)(1.0 / sum);\n"
                    f"  for (u32 k = 0; k < {L}; k++) y[k * {inner}] *= inv;"
                ),
            )
        return self.loop(
            e,
            (
                f"  double sum = 0;\n"
                f"  for (u32 k = 0; k < {L}; k++) sum += mf_exp((double)x[k * {inner}] - top);\n"
                f"  for (u32 k = 0; k < {L}; k++) y[k * {inner}] = ({t})(mf_exp((double)x[k * {inner}] - top) / sum);"
            ),
        )


@register
class LogSoftmax(_Softmax):
    OP = "LogSoftmax"

    def emit(self, e: Emitter) -> str:
        t = self.x(0).dtype.c
        L, inner = self.length, self.inner
        return self.loop(
            e,
            (
                f"  double sum = 0;\n"
                f"  for (u32 k = 0; k < {L}; k++) sum += mf_exp((double)x[k * {inner}] - top);\n"
                f"  const double ls = mf_log(sum);\n"
                f"  for (u32 k = 0; k < {L}; k++) y[k * {inner}] = ({t})((double)x[k * {inner}] - top - ls);"
            ),
        )


@register
class Hardmax(_Softmax):
    OP = "Hardmax"

    def emit(self, e: Emitter) -> str:
        L, inner = self.length, self.inner
        return self.loop(
            e,
            (
                f"  u32 best = 0;\n"
                f"  for (u32 k = 1; k < {L}; k++) if (x[k * {inner}] > x[best * {inner}]) best = k;\n"
                f"  for (u32 k = 0; k < {L}; k++) y[k * {inner}] = k == best ? 1 : 0;"
            ),
        )


_ = lit


@register
class RMSNormalization(_OverTrailingAxes):
    """x / sqrt(mean(x^2) + epsilon) * scale over the trailing axes from `axis` (opset 23)."""

    OP = "RMSNormalization"
    SINCE = 23

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype, s = self._rows()
        scale = static(numel(self.shape(1)))
        if scale not in (1, self.inner) or len(self.shape(1)) > len(s) - self.ax:
            self.fail("scale must have the normalised shape (or one element)")
        return [(dtype, s)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        n = self.inner
        sc = f"{e.inp(1)}[k]" if static(numel(self.shape(1))) == n else f"{e.inp(1)}[0]"
        return (
            f"for (u32 r = 0; r < {cdim(numel(s[: self.ax]))}; r++) {{\n"
            f"  const {t} *x = {e.inp(0)} + r * {n};\n  {t} *y = {e.out(0)} + r * {n};\n"
            f"  double sq = 0; for (u32 k = 0; k < {n}; k++) sq += (double)x[k] * x[k];\n"
            f"  const double inv = 1.0 / mf_sqrt(sq / {n} + {self.eps!r});\n"
            f"  for (u32 k = 0; k < {n}; k++) y[k] = ({t})((double)x[k] * inv * {sc});\n}}"
        )


@register
class LRN(Op):
    """Local response normalisation across channels (AlexNet, GoogLeNet, the model zoo's
    classic CNNs): each element over the squares of its `size` neighbouring channels."""

    OP = "LRN"

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        s = self.shape(0)
        if len(s) < 2 or any(isinstance(d, Batch) for d in s[1:]):
            self.fail("expects [N, C, spatial...]")
        self.size = int(self.attr("size"))
        if self.size < 1:
            self.fail(f"size={self.size} must be at least 1")
        self.alpha = float(self.attr("alpha", 1e-4))
        self.beta = float(self.attr("beta", 0.75))
        self.bias = float(self.attr("bias", 1.0))
        return [(dtype, s)]

    def power(self, base: str) -> str:
        """base ** beta: the usual betas (AlexNet's and GoogLeNet's 0.75) by square roots,
        several times quicker than pow, and as exact for the non-negative bases of a
        non-negative bias."""
        roots = {
            0.5: f"mf_sqrt({base})",
            1.0: base,
            0.75: f"(mf_sqrt({base}) * mf_sqrt(mf_sqrt({base})))",
        }
        return roots.get(self.beta, f"mf_pow({base}, {self.beta!r})")

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        c = static(s[1])
        n = static(numel(s[2:]))
        below, above = (self.size - 1) // 2, self.size // 2  # floor and ceil of (size-1)/2
        return (
            f"for (u32 r = 0; r < {cdim(s[0])} * {c}; r++) {{\n"
            f"  const u32 ch = r % {c}, lo = ch >= {below} ? ch - {below} : 0;\n"
            f"  const u32 hi = ch + {above} < {c} ? ch + {above} : {c - 1};\n"
            f"  const {t} *x = {e.inp(0)} + (r - ch) * {n};\n"
            f"  {t} *y = {e.out(0)} + r * {n};\n"
            f"  for (u32 k = 0; k < {n}; k++) {{\n"
            f"    double sq = 0;\n"
            f"    for (u32 q = lo; q <= hi; q++) {{ const double v = x[q * {n} + k]; sq += v * v; }}\n"
            f"    const double base = {self.bias!r} + {self.alpha / self.size!r} * sq;\n"
            f"    y[k] = ({t})((double)x[ch * {n} + k] / {self.power('base')});\n"
            f"  }}\n}}"
        )


@register
class LpNormalization(Op):
    OP = "LpNormalization"

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        s = self.shape(0)
        self.ax = self.axis(int(self.attr("axis", -1)), len(s))
        if isinstance(s[self.ax], Batch):
            self.fail("cannot normalise over the batch")
        self.p = int(self.attr("p", 2))
        if self.p not in (1, 2):
            self.fail(f"p={self.p} is not 1 or 2")
        return [(dtype, s)]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        outer, length, inner = numel(s[: self.ax]), static(s[self.ax]), numel(s[self.ax + 1 :])
        acc = "a += v < 0 ? -v : v;" if self.p == 1 else "a += v * v;"
        fin = "" if self.p == 1 else "a = mf_sqrt(a);"
        return (
            f"for (u32 r = 0; r < {cdim(outer)}; r++) for (u32 c = 0; c < {cdim(inner)}; c++) {{\n"
            f"  const {t} *x = {e.inp(0)} + r * {length} * {cdim(inner)} + c;\n"
            f"  {t} *y = {e.out(0)} + r * {length} * {cdim(inner)} + c;\n"
            f"  double a = 0; for (u32 k = 0; k < {length}; k++) {{ const double v = x[k * {cdim(inner)}]; {acc} }} {fin}\n"
            f"  for (u32 k = 0; k < {length}; k++) y[k * {cdim(inner)}] = a == 0 ? 0 : ({t})(x[k * {cdim(inner)}] / a);\n}}"
        )
