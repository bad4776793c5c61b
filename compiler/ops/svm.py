"""SVMRegressor and SVMClassifier (support-vector mode, one-vs-one votes) as onnxruntime
computes them. Probability outputs (SVC(probability=True): pairwise coupling) are refused
with advice; export with probability=False."""

from __future__ import annotations

import numpy as np

from .. import dtypes as D
from ..dims import Shape, cdim
from ..dtypes import DType
from .base import Emitter, register
from .ml import _ML, IN_TYPES, post_transform

KERNELS = ("LINEAR", "POLY", "RBF", "SIGMOID")


class _SVM(_ML):
    def kernel(self) -> None:
        self.kt = self.attr("kernel_type", "LINEAR")
        if self.kt not in KERNELS:
            self.fail(f"kernel_type={self.kt!r} is not supported ({', '.join(KERNELS)})")
        params = [float(v) for v in self.attr("kernel_params", [])] + [0.0, 0.0, 0.0]
        self.gamma, self.coef0, self.degree = params[0], params[1], params[2]

    def kernel_c(self, e: Emitter, sv: str, count: int, f: int, x: str, out: str) -> str:
        """C filling out[0..count) with K(x, sv_j) (float, as onnxruntime)."""
        g, c0, deg = (float(np.float32(v)) for v in (self.gamma, self.coef0, self.degree))
        if self.kt == "RBF":
            acc = f"double s = 0; for (u32 q = 0; q < {f}; q++) {{ double d = (double)(float){x}[q] - {sv}[j * {f} + q]; s += d * d; }}"
            val = f"(float)mf_exp(-{g!r} * s)"
        else:
            acc = f"double s = 0; for (u32 q = 0; q < {f}; q++) s += (double)(float){x}[q] * {sv}[j * {f} + q];"
            val = {
                "LINEAR": "(float)s",
                "POLY": f"(float)mf_pow({g!r} * s + {c0!r}, {deg!r})",
                "SIGMOID": f"(float)mf_tanh({g!r} * s + {c0!r})",
            }[self.kt]
        return f"for (u32 j = 0; j < {count}; j++) {{ {acc} {out}[j] = {val}; }}"


@register
class SVMRegressor(_SVM):
    OP = "SVMRegressor"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        self.n, self.f = self.rows()
        self.kernel()
        self.nsv = int(self.attr("n_supports", 0))
        self.coef = np.asarray(self.attr("coefficients"), np.float32)
        self.rho = float(np.asarray(self.attr("rho", [0.0]), np.float32)[0])
        self.one_class = int(self.attr("one_class", 0))
        if self.attr("post_transform", "NONE") != "NONE":
            self.fail("post_transform must be NONE")
        if self.nsv:
            self.sv = np.asarray(self.attr("support_vectors"), np.float32)
            if self.sv.size != self.nsv * self.f or self.coef.size < self.nsv:
                self.fail("support_vectors or coefficients do not fit n_supports and the features")
        elif self.coef.size != self.f:
            self.fail(f"{self.coef.size} coefficients for {self.f} features")
        return [(D.FLOAT, (self.n, 1))]

    def emit(self, e: Emitter) -> str:
        f = self.f
        t = self.x(0).dtype.c
        coef = e.const(self.coef, D.FLOAT)
        lines = [
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) {{",
            f"  const {t} *x = {e.inp(0)} + r * {f};",
        ]
        if self.nsv:
            sv = e.const(self.sv, D.FLOAT)
            lines.append(f"  float k[{self.nsv}];")
            lines.append("  " + self.kernel_c(e, sv, self.nsv, f, "x", "k"))
            lines.append(
                f"  double s = 0; for (u32 j = 0; j < {self.nsv}; j++) s += (double){coef}[j] * k[j];"
            )
        else:
            lines.append(
                f"  double s = 0; for (u32 q = 0; q < {f}; q++) s += (double)(float)x[q] * {coef}[q];"
            )
        lines.append(f"  float y = (float)(s + {self.rho!r});")
        if self.one_class:
            lines.append("  y = y > 0 ? 1.0f : -1.0f;")
        lines.append(f"  {e.out(0)}[r] = y;\n}}")
        return "\n".join(lines)


@register
class SVMClassifier(_SVM):
    OP = "SVMClassifier"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        self.n, self.f = self.rows()
        self.kernel()
        self.prob_a = np.asarray(self.attr("prob_a", []), np.float32)
        self.prob_b = np.asarray(self.attr("prob_b", []), np.float32)
        self.labels_ = self.labels()
        per = [int(v) for v in self.attr("vectors_per_class", [])]
        if not per:
            self.fail("linear-mode SVMClassifier (no support vectors) is not supported")
        self.c = len(per)
        if self.c != len(self.labels_) or self.c < 2:
            self.fail(f"{self.c} classes of support vectors for {len(self.labels_)} labels")
        self.nsv = sum(per)
        self.start = [sum(per[:i]) for i in range(self.c)]
        self.per = per
        self.sv = np.asarray(self.attr("support_vectors"), np.float32)
        self.coef = np.asarray(self.attr("coefficients"), np.float32)
        self.rho = np.asarray(self.attr("rho"), np.float32)
        pairs = self.c * (self.c - 1) // 2
        if (
            self.sv.size != self.nsv * self.f
            or self.coef.size < (self.c - 1) * self.nsv
            or self.rho.size < pairs
        ):
            self.fail("support_vectors, coefficients or rho do not fit the classes and features")
        self.how = self.transform()
        self.pairs = pairs
        self.proba = self.prob_a.size > 0
        if self.proba and (self.prob_a.size < pairs or self.prob_b.size < pairs):
            self.fail("prob_a/prob_b need one value per pair of classes")
        if self.proba and self.how != "NONE":
            self.fail("post_transform must be NONE with probability estimates")
        width = self.c if self.proba else (pairs if self.c > 2 else 2)
        return [(D.INT64, (self.n,)), (D.FLOAT, (self.n, width))]

    def emit(self, e: Emitter) -> str:
        f, c, nsv = self.f, self.c, self.nsv
        t = self.x(0).dtype.c
        sv, coef = e.const(self.sv, D.FLOAT), e.const(self.coef, D.FLOAT)
        labels = e.const(np.asarray(self.labels_, np.int64), D.INT64)
        lines = [
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) {{",
            f"  const {t} *x = {e.inp(0)} + r * {f};",
            f"  float k[{nsv}]; float s[{max(self.pairs, 2)}]; u32 votes[{c}];",
            f"  for (u32 q = 0; q < {c}; q++) votes[q] = 0;",
            "  " + self.kernel_c(e, sv, nsv, f, "x", "k"),
        ]
        idx = 0
        for i in range(c - 1):
            for j in range(i + 1, c):
                si, sj = self.start[i], self.start[j]
                lines.append(
                    f"  {{ double sum = 0;\n"
                    f"    for (u32 m = 0; m < {self.per[i]}; m++) sum += {coef}[{nsv * (j - 1) + si} + m] * k[{si} + m];\n"
                    f"    for (u32 m = 0; m < {self.per[j]}; m++) sum += {coef}[{nsv * i + sj} + m] * k[{sj} + m];\n"
                    f"    sum += {float(self.rho[idx])!r};\n"
                    f"    s[{idx}] = (float)sum; votes[sum > 0 ? {i} : {j}]++; }}"
                )
                idx += 1
        lines.append(
            f"  u32 best = 0; for (u32 q = 1; q < {c}; q++) if (votes[q] > votes[best]) best = q;"
        )
        lines.append(f"  {e.out(0)}[r] = {labels}[best];")
        z = e.out(1)
        if self.proba:
            lines.append("  " + self.coupling(e, z))
        elif c > 2:
            lines.append("  " + post_transform("s", self.pairs, self.how))
            lines.append(
                f"  for (u32 q = 0; q < {self.pairs}; q++) {z}[r * {self.pairs} + q] = s[q];"
            )
        elif self.how == "NONE":
            lines.append(f"  {z}[r * 2] = -s[0]; {z}[r * 2 + 1] = s[0];")
        else:  # onnxruntime writes [1 - s, s] without the transform here
            lines.append(f"  {z}[r * 2] = 1.0f - s[0]; {z}[r * 2 + 1] = s[0];")
        lines.append("}")
        return "\n".join(lines)

    def coupling(self, e: Emitter, z: str) -> str:
        """Platt-scaled pairwise probabilities coupled into class probabilities (Wu, Lin and
        Weng's second method, as libsvm and onnxruntime: float arithmetic, at most 100
        iterations, stopping at 0.005 / classes)."""
        c = self.c
        pa, pb = e.const(self.prob_a, D.FLOAT), e.const(self.prob_b, D.FLOAT)
        return (
            f"{{ float rr[{c * c}], Q[{c * c}], Qp[{c}], p[{c}];\n"
            f"  for (u32 q = 0; q < {c * c}; q++) {{ rr[q] = 0; Q[q] = 0; }}\n"
            f"  u32 idx = 0;\n"
            f"  for (u32 i = 0; i + 1 < {c}; i++) for (u32 j = i + 1; j < {c}; j++, idx++) {{\n"
            f"    const float v = s[idx] * {pa}[idx] + {pb}[idx];\n"
            f"    const float lg = 1.0f / (1.0f + mf_expf(-(v < 0 ? -v : v)));\n"
            f"    float p1 = 1.0f - (v < 0 ? 1.0f - lg : lg);\n"
            f"    p1 = p1 < 1.0e-7f ? 1.0e-7f : p1; p1 = p1 > 1.0f - 1.0e-7f ? 1.0f - 1.0e-7f : p1;\n"
            f"    rr[i * {c} + j] = p1; rr[j * {c} + i] = 1.0f - p1;\n  }}\n"
            f"  const float eps = 0.005f / (float){c};\n"
            f"  for (u32 i = 0; i < {c}; i++) {{\n"
            f"    p[i] = 1.0f / (float){c};\n"
            f"    for (u32 j = 0; j < i; j++) {{ Q[i * {c} + i] += rr[j * {c} + i] * rr[j * {c} + i]; Q[i * {c} + j] = Q[j * {c} + i]; }}\n"
            f"    for (u32 j = i + 1; j < {c}; j++) {{ Q[i * {c} + i] += rr[j * {c} + i] * rr[j * {c} + i]; Q[i * {c} + j] = -rr[j * {c} + i] * rr[i * {c} + j]; }}\n"
            f"  }}\n"
            f"  for (u32 loop = 0; loop < 100; loop++) {{\n"
            f"    float pQp = 0;\n"
            f"    for (u32 i = 0; i < {c}; i++) {{ Qp[i] = 0; for (u32 j = 0; j < {c}; j++) Qp[i] += Q[i * {c} + j] * p[j]; pQp += p[i] * Qp[i]; }}\n"
            f"    float max_error = 0;\n"
            f"    for (u32 i = 0; i < {c}; i++) {{ float er = Qp[i] - pQp; er = er < 0 ? -er : er; if (er > max_error) max_error = er; }}\n"
            f"    if (max_error < eps) break;\n"
            f"    for (u32 i = 0; i < {c}; i++) {{\n"
            f"      const float diff = (-Qp[i] + pQp) / Q[i * {c} + i];\n"
            f"      p[i] += diff;\n"
            f"      pQp = (pQp + diff * (diff * Q[i * {c} + i] + 2 * Qp[i])) / (1 + diff) / (1 + diff);\n"
            f"      for (u32 j = 0; j < {c}; j++) {{ Qp[j] = (Qp[j] + diff * Q[i * {c} + j]) / (1 + diff); p[j] /= (1 + diff); }}\n"
            f"    }}\n  }}\n"
            f"  for (u32 i = 0; i < {c}; i++) {z}[r * {c} + i] = p[i]; }}"
        )
