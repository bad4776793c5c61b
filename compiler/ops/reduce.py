"""Reductions (ReduceSum, Mean, Max, Min, Prod, L1, L2, LogSum, LogSumExp, SumSquare) and
ArgMax/ArgMin over any set of axes. Floating sums are accumulated in double."""

from __future__ import annotations

from typing import ClassVar

from .. import dtypes as D
from ..dims import Batch, Dim, Shape, cdim, numel, static
from ..dtypes import DType
from . import loops
from .base import Emitter, Op, register

NUMERIC = D.NUMERIC


class _Reduce(Op):
    STATIC_INPUTS = (1,)
    AXES_INPUT: ClassVar[int] = 18  # the version from which axes is an input
    # init, step (with acc, v), final (with acc, count), accumulator type (None: the dtype)
    INIT: ClassVar[str] = "0"
    STEP: ClassVar[str] = "acc + v"
    FINAL: ClassVar[str] = "acc"
    ACC_DOUBLE: ClassVar[bool] = True
    TYPES: ClassVar[tuple[DType, ...]] = NUMERIC

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, self.TYPES)
        s = self.shape(0)
        if self.version >= self.AXES_INPUT:
            axes = self.ints(1) if self.has(1) else []
        else:
            axes = [int(a) for a in self.attr("axes", [])]
        keep = int(self.attr("keepdims", 1))
        noop = int(self.attr("noop_with_empty_axes", 0))
        if not axes:
            axes = [] if noop else list(range(len(s)))
        self.axes = sorted({self.axis(int(a), len(s)) for a in axes})
        self.keep = keep
        out: list[Dim] = []
        for k, d in enumerate(s):
            if k in self.axes:
                if keep:
                    out.append(1)
            else:
                out.append(d)
        return [(dtype, tuple(out))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        dtype = self.x(0).dtype
        st = loops.strides(s)
        kept = [k for k in range(len(s)) if k not in self.axes]
        red = self.axes
        count: Dim = numel([s[k] for k in red])
        acc_t = "double" if (self.ACC_DOUBLE and dtype.is_float) else dtype.c
        if any(isinstance(s[k], Batch) for k in red):
            pass  # the loops handle a symbolic count
        init = self.INIT.replace("$T", dtype.c)
        lowest = "-MF_INF" if dtype.is_float else _int_limit(dtype, low=True)
        highest = "MF_INF" if dtype.is_float else _int_limit(dtype, low=False)
        init = init.replace("$LOW", lowest).replace("$HIGH", highest)
        step = self.STEP
        final = self.FINAL.replace("$N", f"({cdim(count)})")
        kept_shape = tuple(s[k] for k in kept)
        red_shape = tuple(s[k] for k in red)

        def inner(o: str, ins: list[str]) -> str:
            body = (
                loops.nest(
                    red_shape,
                    [[st[k] for k in red]],
                    lambda _o, ix: (
                        f"const {acc_t} v = ({acc_t}){e.inp(0)}[base + {ix[0]}]; acc = {step};"
                    ),
                    "rr",
                    collapse=False,
                )
                if red_shape
                else f"const {acc_t} v = ({acc_t}){e.inp(0)}[base]; acc = {step};"
            )
            return (
                f"{{ const u32 base = {ins[0]}; {acc_t} acc = {init};\n{body}\n"
                f"{e.out(0)}[{o}] = ({dtype.c})({final}); }}"
            )

        return loops.nest(kept_shape, [[st[k] for k in kept]], inner, "kk", collapse=False)


def _int_limit(dtype: DType, low: bool) -> str:
    import numpy as np

    if dtype.is_bool:
        return "0" if low else "1"
    info = np.iinfo(dtype.np)  # type: ignore[type-var]
    v = int(info.min if low else info.max)
    if dtype.c == "i64" and low:
        return "(-9223372036854775807LL - 1)"
    return f"(({dtype.c}){v}{'ULL' if dtype.c == 'u64' else 'LL'})"


def _reduce(
    op: str,
    init: str,
    step: str,
    final: str,
    since: int,
    axes_input: int,
    types: tuple[DType, ...] = NUMERIC,
    acc_double: bool = True,
) -> None:
    register(
        type(
            op,
            (_Reduce,),
            {
                "OP": op,
                "INIT": init,
                "STEP": step,
                "FINAL": final,
                "SINCE": since,
                "AXES_INPUT": axes_input,
                "TYPES": types,
                "ACC_DOUBLE": acc_double,
            },
        )
    )


_reduce("ReduceSum", "0", "acc + v", "acc", 1, 13)
_reduce("ReduceMean", "0", "acc + v", "acc / $N", 1, 18)
_reduce(
    "ReduceMax", "$LOW", "(v > acc || v != v) ? v : acc", "acc", 1, 18, (*NUMERIC, D.BOOL), False
)
_reduce(
    "ReduceMin", "$HIGH", "(v < acc || v != v) ? v : acc", "acc", 1, 18, (*NUMERIC, D.BOOL), False
)
_reduce("ReduceProd", "1", "acc * v", "acc", 1, 18)
_reduce("ReduceL1", "0", "acc + (v < 0 ? -v : v)", "acc", 1, 18)
_reduce("ReduceL2", "0", "acc + v * v", "mf_sqrt((double)acc)", 1, 18)
_reduce("ReduceSumSquare", "0", "acc + v * v", "acc", 1, 18)
_reduce("ReduceLogSum", "0", "acc + v", "mf_log((double)acc)", 1, 18, D.FLOATS)
_reduce("ReduceLogSumExp", "0", "acc + mf_exp(v)", "mf_log(acc)", 1, 18, D.FLOATS)


class _Arg(Op):
    CMP: ClassVar[str] = ">"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, NUMERIC)
        s = self.shape(0)
        self.ax = self.axis(int(self.attr("axis", 0)), len(s))
        if isinstance(s[self.ax], Batch):
            self.fail("cannot reduce over the batch")
        self.keep = int(self.attr("keepdims", 1))
        self.last = int(self.attr("select_last_index", 0))
        out = list(s)
        if self.keep:
            out[self.ax] = 1
        else:
            del out[self.ax]
        return [(D.INT64, tuple(out))]

    def emit(self, e: Emitter) -> str:
        s = self.shape(0)
        t = self.x(0).dtype.c
        outer, length, inner = numel(s[: self.ax]), static(s[self.ax]), numel(s[self.ax + 1 :])
        cmp = self.CMP + ("=" if self.last else "")
        return (
            f"for (u32 r = 0; r < {cdim(outer)}; r++) for (u32 c = 0; c < {cdim(inner)}; c++) {{\n"
            f"  const {t} *x = {e.inp(0)} + r * {length} * {cdim(inner)} + c;\n"
            f"  u32 best = 0; {t} bv = x[0];\n"
            f"  for (u32 k = 1; k < {length}; k++) {{ const {t} v = x[k * {cdim(inner)}]; if (v {cmp} bv) {{ bv = v; best = k; }} }}\n"
            f"  {e.out(0)}[r * {cdim(inner)} + c] = best;\n}}"
        )


@register
class ArgMax(_Arg):
    OP = "ArgMax"
    CMP = ">"


@register
class ArgMin(_Arg):
    OP = "ArgMin"
    CMP = "<"
