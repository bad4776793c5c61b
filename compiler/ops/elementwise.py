"""Elementwise operators: unary functions, binary arithmetic and comparisons with numpy
broadcasting, variadic Max/Min/Sum/Mean, Where, Clip, PRelu.

Float32 arithmetic is done in float32 (as onnxruntime); transcendental functions are computed
in double by mf_rt.h and rounded once."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .. import dtypes as D
from ..clit import lit
from ..dims import Batch, Shape, numel
from ..dtypes import DType
from ..errors import UnsupportedError
from . import loops
from .base import Emitter, Op, register

FLOATS = D.FLOATS
SIGNED = (D.INT8, D.INT16, D.INT32, D.INT64)
UNSIGNED = (D.UINT8, D.UINT16, D.UINT32, D.UINT64)
INTS = SIGNED + UNSIGNED
NUMERIC = FLOATS + INTS


def _pick(exprs: dict[str, str], dtype: DType) -> str:
    """The expression for a dtype: by C type, else by kind (f: float, i: signed, u: unsigned,
    b: bool, n: any numeric)."""
    kind = {"f": "f", "i": "i", "u": "u", "b": "b"}[dtype.np.kind]
    for key in (dtype.c, kind, "n"):
        if key in exprs:
            return exprs[key]
    raise KeyError(dtype.name)


def _fill(expr: str, dtype: DType, attrs: dict[str, Any]) -> str:
    expr = expr.replace("$T", dtype.c)
    for name, value in sorted(attrs.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${name}", lit(value, dtype))
    return expr


# ------------------------------------------------------------------------------------ unary
class Unary(Op):
    EXPR: ClassVar[dict[str, str]] = {}
    TYPES: ClassVar[tuple[DType, ...]] = FLOATS
    ATTRS: ClassVar[dict[str, float]] = {}
    OUT: ClassVar[DType | None] = None  # output dtype when not the input's

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, self.TYPES)
        self.attrs = {k: self.attr(k, v) for k, v in self.ATTRS.items()}
        return [(self.OUT or dtype, self.shape(0))]

    def exprs(self) -> dict[str, str]:
        return self.EXPR

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        expr = _fill(_pick(self.exprs(), dtype), dtype, self.attrs)
        n = self.numel_c(self.shape(0))
        return (
            f"for (u32 k = 0; k < {n}; k++) {{\n"
            f"  const {dtype.c} x = {e.inp(0)}[k];\n"
            f"  {e.out(0)}[k] = ({(self.OUT or dtype).c})({expr});\n}}"
        )


def unary(
    op: str,
    exprs: dict[str, str],
    types: tuple[DType, ...] = FLOATS,
    since: int = 1,
    attrs: dict[str, float] | None = None,
    out: DType | None = None,
) -> type[Op]:
    cls = type(
        op,
        (Unary,),
        {"OP": op, "EXPR": exprs, "TYPES": types, "SINCE": since, "ATTRS": attrs or {}, "OUT": out},
    )
    return register(cls)


def _f(fn: str) -> dict[str, str]:
    """A function of mf_rt.h computed in double."""
    return {"float": f"(float){fn}((double)x)", "double": f"{fn}(x)"}


unary(
    "Abs",
    {"float": "__builtin_fabsf(x)", "double": "__builtin_fabs(x)", "i": "x < 0 ? -x : x", "u": "x"},
    NUMERIC,
    6,
)
unary("Neg", {"n": "-x"}, FLOATS + SIGNED, 6)
unary("Sqrt", {"float": "__builtin_sqrtf(x)", "double": "__builtin_sqrt(x)"}, since=6)
unary("Exp", {"float": "mf_expf(x)", "double": "mf_exp(x)"}, since=6)
unary("Log", _f("mf_log"), since=6)
unary("Tanh", {"float": "mf_tanh_f(x)", "double": "mf_tanh(x)"}, since=6)
unary("Sigmoid", {"float": "mf_sigmoid_f(x)", "double": "mf_sigmoid(x)"}, since=6)
unary("Erf", {"float": "mf_erff(x)", "double": "mf_erf(x)"}, since=9)
unary("Sin", _f("mf_sin"), since=7)
unary("Cos", _f("mf_cos"), since=7)
unary("Atan", _f("mf_atan"), since=7)
unary("Tan", _f("mf_tan"), since=7)
unary("Asin", _f("mf_asin"), since=7)
unary("Acos", _f("mf_acos"), since=7)
unary("Sinh", _f("mf_sinh"), since=9)
unary("Cosh", _f("mf_cosh"), since=9)
unary("Asinh", _f("mf_asinh"), since=9)
unary("Acosh", _f("mf_acosh"), since=9)
unary("Atanh", _f("mf_atanh"), since=9)
unary("Reciprocal", {"float": "1.0f / x", "double": "1.0 / x"}, since=6)
unary("Floor", {"float": "__builtin_floorf(x)", "double": "__builtin_floor(x)"}, since=6)
unary("Ceil", {"float": "__builtin_ceilf(x)", "double": "__builtin_ceil(x)"}, since=6)
unary("Round", {"float": "__builtin_rintf(x)", "double": "__builtin_rint(x)"}, since=11)
unary("Relu", {"f": "x < 0 ? 0 : x", "i": "x < 0 ? 0 : x"}, FLOATS + SIGNED, 6)
unary(
    "Sign",
    {
        "f": "x > 0 ? 1 : (x < 0 ? -1 : x)",
        "i": "x > 0 ? 1 : (x < 0 ? -1 : 0)",
        "u": "x > 0 ? 1 : 0",
    },
    NUMERIC,
    9,
)
unary("Softsign", {"f": "x / (1 + (x < 0 ? -x : x))"}, since=1)
unary(
    "Softplus",
    {"f": "($T)(x > 0 ? (double)x + mf_log1p(mf_exp(-(double)x)) : mf_log1p(mf_exp((double)x)))"},
    since=1,
)
unary("Not", {"b": "!x"}, (D.BOOL,), 1)
unary("IsNaN", {"f": "x != x"}, FLOATS, 9, out=D.BOOL)
unary("BitwiseNot", {"n": "~x"}, INTS, 18)
unary("LeakyRelu", {"f": "x < 0 ? $alpha * x : x"}, FLOATS, 6, {"alpha": 0.01})
unary("Elu", {"f": "x < 0 ? ($T)($alpha * mf_expm1((double)x)) : x"}, FLOATS, 6, {"alpha": 1.0})
unary(
    "Celu",
    {"f": "x > 0 ? x : ($T)($alpha * mf_expm1((double)x / $alpha))"},
    FLOATS,
    12,
    {"alpha": 1.0},
)
unary(
    "Selu",
    {"f": "x <= 0 ? ($T)($gamma * ($alpha * mf_exp((double)x) - $alpha)) : $gamma * x"},
    FLOATS,
    6,
    {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
)
unary(
    "HardSigmoid",
    {"f": "mf_max(0, mf_min(1, $alpha * x + $beta))"},
    FLOATS,
    6,
    {"alpha": 0.2, "beta": 0.5},
)
unary("HardSwish", {"f": "x * mf_max(0, mf_min(1, ($T)(1.0 / 6) * x + ($T)0.5))"}, FLOATS, 14)
unary("ThresholdedRelu", {"f": "x > $alpha ? x : 0"}, FLOATS, 10, {"alpha": 1.0})
unary(
    "Shrink",
    {"f": "x < -$lambd ? x + $bias : (x > $lambd ? x - $bias : 0)"},
    FLOATS + SIGNED,
    9,
    {"bias": 0.0, "lambd": 0.5},
)
unary(
    "Mish",
    {
        "f": "($T)((double)x * mf_tanh(x > 0 ? (double)x + mf_log1p(mf_exp(-(double)x)) : mf_log1p(mf_exp((double)x))))"
    },
    FLOATS,
    18,
)
unary(
    "Swish", {"f": "($T)((double)x * mf_sigmoid($alpha * (double)x))"}, FLOATS, 24, {"alpha": 1.0}
)


@register
class IsInf(Unary):
    OP = "IsInf"
    SINCE = 10
    OUT = D.BOOL

    def exprs(self) -> dict[str, str]:
        pos, neg = int(self.attr("detect_positive", 1)), int(self.attr("detect_negative", 1))
        cond = [c for c, on in (("x == MF_INF", pos), ("x == -MF_INF", neg)) if on]
        return {"f": " || ".join(cond) or "0"}


@register
class Gelu(Unary):
    OP = "Gelu"
    SINCE = 20

    def exprs(self) -> dict[str, str]:
        approx = self.attr("approximate", "none")
        if approx == "tanh":
            return {
                "float": "0.5f * x * (1.0f + mf_tanh_f(0.797884561f * (x + 0.044715f * x * x * x)))",
                "double": "0.5 * x * (1 + mf_tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))",
            }
        if approx != "none":
            self.fail(f"approximate={approx!r} is not supported (none, tanh)")
        return {"float": "mf_gelu_f(x)", "double": "0.5 * x * (1 + mf_erf(x * 0.7071067811865476))"}

    def infer(self) -> list[tuple[DType, Shape]]:
        self.exprs()  # refuse a bad attribute at build
        return super().infer()


# ------------------------------------------------------------------------------- broadcasting
class Broadcast(Op):
    """Operators over inputs broadcast numpy-style to one output shape."""

    TYPES: ClassVar[tuple[DType, ...]] = NUMERIC
    OUT: ClassVar[DType | None] = None
    EXPR: ClassVar[dict[str, str]] = {}  # C with a, b (and c) for the inputs' elements

    def operands(self) -> list[int]:
        return [i for i in range(len(self.inputs)) if self.has(i)]

    def infer(self) -> list[tuple[DType, Shape]]:
        idx = self.operands()
        if not idx:
            self.fail("needs at least one input")
        dtype = self.same_dtype(*idx)
        self.need(idx[0], self.TYPES)
        self.attrs: dict[str, Any] = {}
        out = loops.broadcast([self.shape(i) for i in idx], f"{self.where}: {self.node.label}")
        return [(self.OUT or dtype, out)]

    def exprs(self) -> dict[str, str]:
        return self.EXPR

    def expr(self, dtype: DType) -> str:
        return _fill(_pick(self.exprs(), dtype), dtype, self.attrs)

    def emit(self, e: Emitter) -> str:
        idx = self.operands()
        out = self.oshape()
        dtype = self.x(idx[0]).dtype
        expr = self.expr(dtype)
        names = "abcdefgh"

        def body(o: str, ins: list[str]) -> str:
            decl = " ".join(
                f"const {self.x(i).dtype.c} {names[j]} = {e.inp(i)}[{ix}];"
                for j, (i, ix) in enumerate(zip(idx, ins, strict=True))
            )
            return f"{decl} {e.out(0)}[{o}] = ({(self.OUT or dtype).c})({expr});"

        return loops.nest(out, [loops.bstrides(self.shape(i), out) for i in idx], body, "j")


def _symbolic(values: list[np.ndarray[Any, Any]], fn: Any) -> list[np.ndarray[Any, Any]] | None:
    try:
        return [np.asarray(fn(*[np.asarray(v, dtype=object) for v in values]), dtype=object)]
    except (UnsupportedError, TypeError, ZeroDivisionError):
        return None


class Binary(Broadcast):
    SYMBOLIC: ClassVar[Any] = None  # numpy-style function over Batch sizes, for shape math

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        ins = [self.x(i) for i in self.operands()]
        if self.SYMBOLIC is None or not any(t.symbolic for t in ins):
            return None
        if not self.x(0).dtype.is_int:
            return None
        return _symbolic([t.value for t in ins if t.value is not None], type(self).SYMBOLIC)


def binary(
    op: str,
    exprs: dict[str, str],
    types: tuple[DType, ...] = NUMERIC,
    since: int = 7,
    out: DType | None = None,
    symbolic: Any = None,
) -> type[Op]:
    cls = type(
        op,
        (Binary,),
        {
            "OP": op,
            "EXPR": exprs,
            "TYPES": types,
            "SINCE": since,
            "OUT": out,
            "SYMBOLIC": staticmethod(symbolic) if symbolic else None,
        },
    )
    return register(cls)


binary("Add", {"n": "a + b"}, since=7, symbolic=lambda a, b: a + b)
binary("Sub", {"n": "a - b"}, since=7, symbolic=lambda a, b: a - b)
binary("Mul", {"n": "a * b"}, since=7, symbolic=lambda a, b: a * b)
binary("Equal", {"n": "a == b"}, (*NUMERIC, D.BOOL), 7, D.BOOL)
binary("Less", {"n": "a < b"}, NUMERIC, 7, D.BOOL)
binary("Greater", {"n": "a > b"}, NUMERIC, 7, D.BOOL)
binary("LessOrEqual", {"n": "a <= b"}, NUMERIC, 12, D.BOOL)
binary("GreaterOrEqual", {"n": "a >= b"}, NUMERIC, 12, D.BOOL)
binary("And", {"b": "a && b"}, (D.BOOL,), 7)
binary("Or", {"b": "a || b"}, (D.BOOL,), 7)
binary("Xor", {"b": "a != b"}, (D.BOOL,), 7)
binary("BitwiseAnd", {"n": "a & b"}, INTS, 18)
binary("BitwiseOr", {"n": "a | b"}, INTS, 18)
binary("BitwiseXor", {"n": "a ^ b"}, INTS, 18)


@register
class Div(Binary):
    """Integer division by zero ends the run with an error (wasm would trap)."""

    OP = "Div"
    SINCE = 7

    @staticmethod
    def SYMBOLIC(a: Any, b: Any) -> Any:
        return a // b

    # b == -1 negates: INT_MIN / -1 would trap in wasm (the result wraps, as numpy)
    EXPR = {"f": "a / b", "u": "b == 0 ? 0 : a / b", "n": "b == 0 ? 0 : (b == -1 ? -a : a / b)"}

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        if dtype.is_float:
            return super().emit(e)
        # C truncates toward zero, as ONNX's integer Div (onnxruntime, the reference)
        guard = e.error("integer division by zero")
        check = loops.nest(
            self.shape(1), [], lambda o, _ins: f"if ({e.inp(1)}[{o}] == 0) {guard}", "z"
        )
        return check + "\n" + super().emit(e)


@register
class Mod(Binary):
    OP = "Mod"
    SINCE = 10

    def infer(self) -> list[tuple[DType, Shape]]:
        out = super().infer()
        self.fmod = int(self.attr("fmod", 0))
        return out

    def exprs(self) -> dict[str, str]:
        if self.fmod:  # C's: the result takes the dividend's sign
            return {"f": "($T)mf_fmod(a, b)", "n": "a % b"}
        # Python's: the result takes the divisor's sign
        return {
            "f": "mf_pymod(a, b)",
            "u": "a % b",
            "n": "((a % b) != 0 && (((a % b) < 0) != (b < 0))) ? (a % b) + b : (a % b)",
        }

    def emit(self, e: Emitter) -> str:
        check = ""
        if not self.x(0).dtype.is_float:
            guard = e.error("integer modulo by zero")
            check = (
                loops.nest(
                    self.shape(1), [], lambda o, _ins: f"if ({e.inp(1)}[{o}] == 0) {guard}", "z"
                )
                + "\n"
            )
        return check + super().emit(e)


@register
class Pow(Binary):
    OP = "Pow"
    SINCE = 7

    def infer(self) -> list[tuple[DType, Shape]]:
        base = self.need(0, NUMERIC)
        self.need(1, NUMERIC)
        self.attrs = {}
        out = loops.broadcast([self.shape(0), self.shape(1)], f"{self.where}: {self.node.label}")
        return [(base, out)]

    EXPR = {"f": "($T)mf_pow((double)a, (double)b)", "n": "($T)(i64)mf_pow((double)a, (double)b)"}

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        out = self.oshape()

        def body(o: str, ins: list[str]) -> str:
            return (
                f"const {self.x(0).dtype.c} a = {e.inp(0)}[{ins[0]}]; "
                f"const {self.x(1).dtype.c} b = {e.inp(1)}[{ins[1]}]; "
                f"{e.out(0)}[{o}] = ({dtype.c})({self.expr(dtype)});"
            )

        return loops.nest(out, [loops.bstrides(self.shape(i), out) for i in (0, 1)], body, "j")


@register
class BitShift(Binary):
    OP = "BitShift"
    SINCE = 11
    TYPES = UNSIGNED

    def exprs(self) -> dict[str, str]:
        direction = self.attr("direction")
        if direction not in ("LEFT", "RIGHT"):
            self.fail(f"direction={direction!r} is not LEFT or RIGHT")
        bits = self.x(0).dtype.size * 8
        op = "<<" if direction == "LEFT" else ">>"
        return {"n": f"b >= {bits} ? 0 : (a {op} b)"}


# ----------------------------------------------------------------------------------- variadic
class Variadic(Broadcast):
    REDUCE: ClassVar[dict[str, str]] = {}  # C combining `acc` and `v`

    def emit(self, e: Emitter) -> str:
        idx = self.operands()
        out = self.oshape()
        dtype = self.x(idx[0]).dtype
        comb = _fill(_pick(self.REDUCE, dtype), dtype, {})
        final = ""
        if self.OP == "Mean":
            final = f" acc = acc / ({dtype.c}){len(idx)};"

        def body(o: str, ins: list[str]) -> str:
            parts = [f"{dtype.c} acc = {e.inp(idx[0])}[{ins[0]}];"]
            for i, ix in zip(idx[1:], ins[1:], strict=True):
                parts.append(f"{{ const {dtype.c} v = {e.inp(i)}[{ix}]; acc = {comb}; }}")
            return " ".join(parts) + final + f" {e.out(0)}[{o}] = acc;"

        return loops.nest(out, [loops.bstrides(self.shape(i), out) for i in idx], body, "j")


def variadic(op: str, comb: dict[str, str], types: tuple[DType, ...], since: int) -> type[Op]:
    return register(
        type(op, (Variadic,), {"OP": op, "REDUCE": comb, "TYPES": types, "SINCE": since})
    )


variadic(
    "Max",
    {"float": "mf_maxf(acc, v)", "double": "mf_max(acc, v)", "n": "v > acc ? v : acc"},
    NUMERIC,
    8,
)
variadic(
    "Min",
    {"float": "mf_minf(acc, v)", "double": "mf_min(acc, v)", "n": "v < acc ? v : acc"},
    NUMERIC,
    8,
)
variadic("Sum", {"n": "acc + v"}, FLOATS, 8)
variadic("Mean", {"n": "acc + v"}, FLOATS, 8)


@register
class Where(Broadcast):
    OP = "Where"
    SINCE = 9
    EXPR = {"n": "a ? b : c", "b": "a ? b : c"}

    def infer(self) -> list[tuple[DType, Shape]]:
        if self.x(0).dtype != D.BOOL:
            self.fail("condition must be bool")
        dtype = self.same_dtype(1, 2)
        self.attrs = {}
        out = loops.broadcast(
            [self.shape(i) for i in (0, 1, 2)], f"{self.where}: {self.node.label}"
        )
        return [(dtype, out)]

    def emit(self, e: Emitter) -> str:
        out = self.oshape()
        dtype = self.x(1).dtype

        def body(o: str, ins: list[str]) -> str:
            return f"{e.out(0)}[{o}] = {e.inp(0)}[{ins[0]}] ? {e.inp(1)}[{ins[1]}] : {e.inp(2)}[{ins[2]}];"

        del dtype
        return loops.nest(out, [loops.bstrides(self.shape(i), out) for i in (0, 1, 2)], body, "j")


@register
class PRelu(Broadcast):
    OP = "PRelu"
    SINCE = 9
    TYPES = (*FLOATS, D.INT32, D.INT64)
    EXPR = {"n": "a < 0 ? a * b : a"}


@register
class Clip(Op):
    """min/max as inputs (opset 11+); each is a scalar, known at build or read at run time."""

    OP = "Clip"
    SINCE = 11

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, NUMERIC)
        for i in (1, 2):
            if self.has(i) and self.x(i).shape not in ((), (1,)):
                self.fail(f"input {i} must be a scalar")
        return [(dtype, self.shape(0))]

    def emit(self, e: Emitter) -> str:
        dtype = self.x(0).dtype
        lo = f"{e.inp(1)}[0]" if self.has(1) else None
        hi = f"{e.inp(2)}[0]" if self.has(2) else None
        expr = "x"
        if lo:
            expr = f"({expr} < lo ? lo : {expr})"
        if hi:
            expr = f"({expr} > hi ? hi : {expr})"
        decl = (f"const {dtype.c} lo = {lo}; " if lo else "") + (
            f"const {dtype.c} hi = {hi};" if hi else ""
        )
        n = self.numel_c(self.shape(0))
        return (
            f"{decl}\nfor (u32 k = 0; k < {n}; k++) {{ const {dtype.c} x = {e.inp(0)}[k]; "
            f"{e.out(0)}[k] = {expr}; }}"
        )


_ = (Batch, numel)
