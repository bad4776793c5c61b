"""The elementary functions of compiler/c/mf_rt.h (there is no libm in the guest) against
Python's, through compiled unary models: float32 activations within a few ulp (or 1e-16
absolute), float64 versions within 1e-14 relative."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from meshfn.compiler import compile_model
from meshfn.compiler.runner import Runner

GRID = np.concatenate(
    [np.linspace(-30, 30, 6001), np.linspace(-1, 1, 2001), [0.0, 1e-8, -1e-8, 1e-30]]
)
ERF = np.vectorize(math.erf)
ERFC = np.vectorize(math.erfc)
REFERENCE: dict[str, Any] = {
    "Exp": np.exp,
    "Log": np.log,
    "Tanh": np.tanh,
    "Sigmoid": lambda v: 1 / (1 + np.exp(-v)),
    "Erf": ERF,
    "Sin": np.sin,
    "Cos": np.cos,
    "Atan": np.arctan,
    "Gelu": lambda v: 0.5 * v * ERFC(-v / math.sqrt(2)),  # 1 + erf would cancel
}
FLOAT_ULPS = {
    "Exp": 2,
    "Tanh": 4,
    "Sigmoid": 3,
    "Erf": 4,
    "Gelu": 6,
    "Log": 1,
    "Sin": 1,
    "Cos": 1,
    "Atan": 1,
}


def run(op: str, x: np.ndarray[Any, Any], elem: int) -> np.ndarray[Any, Any]:
    vi = [helper.make_tensor_value_info(n, elem, [len(x)]) for n in ("x", "y")]
    model = helper.make_model(
        helper.make_graph([helper.make_node(op, ["x"], ["y"])], op, vi[:1], vi[1:]),
        opset_imports=[helper.make_opsetid("", 20)],
    )
    return Runner(compile_model(model).wasm)([x])[0]


@pytest.mark.parametrize("op", sorted(REFERENCE))
def test_float32_within_a_few_ulp(op: str) -> None:
    x = GRID.astype(np.float32)
    if op == "Log":
        x = np.abs(x) + np.float32(1e-30)
    got = run(op, x, TensorProto.FLOAT).astype(np.float64)
    with np.errstate(all="ignore"):
        want = REFERENCE[op](x.astype(np.float64))
        ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        err = np.abs(got - want) / np.maximum(ulp, np.float64(np.spacing(np.float32(0))))
    # or within 1e-16 absolute: in Gelu's far negative tail (|result| < 1e-12) the float
    # rounding of erfc's exponent costs relative accuracy, never absolute
    err[np.abs(got - want) < 1e-16] = 0
    worst = float(np.nanmax(err))
    print(f"{op}: {worst:.2f} ulp")
    assert worst <= FLOAT_ULPS[op], (op, worst, x[np.nanargmax(err)])


@pytest.mark.parametrize("op", sorted(set(REFERENCE) - {"Gelu"}))
def test_float64_within_1e_14(op: str) -> None:
    x = GRID.copy()
    if op == "Log":
        x = np.abs(x) + 1e-300
    got = run(op, x, TensorProto.DOUBLE)
    want = REFERENCE[op](x)
    with np.errstate(all="ignore"):
        rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-300)
    assert float(np.nanmax(rel)) < 1e-14, (op, float(np.nanmax(rel)))
