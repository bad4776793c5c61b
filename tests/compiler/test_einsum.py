"""Einsum compiled to wasm gives onnxruntime's answers beyond ONNX's own cases: attention's
products with the batch symbolic, `...` broadcasting, diagonals, outer products, numpy's
implicit output, integers; equations that do not fit their operands are refused when the model
is compiled."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from meshfn.compiler import compile_model
from meshfn.compiler.errors import CompileError
from meshfn.compiler.runner import Runner

CASES: list[tuple[str, list[list[Any]]]] = [
    ("bij,bjk->bik", [["batch", 3, 4], ["batch", 4, 5]]),
    ("bhqd,bhkd->bhqk", [["batch", 2, 3, 4], ["batch", 2, 5, 4]]),  # attention scores
    ("bhqk,bhkd->bqhd", [["batch", 2, 3, 5], ["batch", 2, 5, 4]]),  # and its weighted sum
    ("...ij,jk->...ik", [["batch", 2, 3, 4], [4, 6]]),
    ("b...i,b...i->b...", [["batch", 3, 1, 4], ["batch", 1, 2, 4]]),  # broadcast inside ...
    ("bii->bi", [["batch", 4, 4]]),
    ("bij->b", [["batch", 3, 4]]),
    ("bi,j->bij", [["batch", 3], [5]]),
    ("bij,bjk", [["batch", 2, 3], ["batch", 3, 4]]),  # implicit output: letters seen once
    ("bji->bij", [["batch", 2, 3]]),
]


def model(
    equation: str, shapes: list[list[Any]], elem: int = TensorProto.FLOAT, rank: int | None = None
) -> Any:
    names = [f"x{i}" for i in range(len(shapes))]
    if rank is None:
        dummies = [np.zeros([2 if d == "batch" else d for d in s]) for s in shapes]
        rank = np.einsum(equation, *dummies).ndim
    node = helper.make_node("Einsum", names, ["y"], equation=equation)
    graph = helper.make_graph(
        [node], "einsum",
        [helper.make_tensor_value_info(n, elem, s) for n, s in zip(names, shapes, strict=True)],
        [helper.make_tensor_value_info("y", elem, [None] * rank)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def feeds(shapes: list[list[Any]], batch: int, dtype: Any, rng: np.random.Generator) -> list[Any]:
    out = []
    for s in shapes:
        shape = [batch if d == "batch" else d for d in s]
        if np.issubdtype(dtype, np.integer):
            out.append(rng.integers(-5, 6, shape).astype(dtype))
        else:
            out.append(rng.normal(0, 1, shape).astype(dtype))
    return out


@pytest.mark.parametrize(("equation", "shapes"), CASES)
def test_equations_match_onnxruntime(equation: str, shapes: list[list[Any]]) -> None:
    m = model(equation, shapes)
    run = Runner(compile_model(m).wasm)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(len(equation))
    for batch in (1, 3):
        given = feeds(shapes, batch, np.float32, rng)
        want = session.run(None, {f"x{i}": v for i, v in enumerate(given)})[0]
        got = run(given)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("elem", "dtype"),
    [
        (TensorProto.INT64, np.int64),
        (TensorProto.INT32, np.int32),
        (TensorProto.DOUBLE, np.float64),
    ],
)
def test_other_element_types(elem: int, dtype: Any) -> None:
    shapes: list[list[Any]] = [["batch", 3, 4], [4, 2]]
    m = model("bij,jk->bik", shapes, elem)
    given = feeds(shapes, 2, dtype, np.random.default_rng(1))
    got = Runner(compile_model(m).wasm)(given)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got, np.einsum("bij,jk->bik", *given), rtol=1e-12)


@pytest.mark.parametrize(
    ("equation", "shapes", "message"),
    [
        ("bij,bjk->bik", [["batch", 3, 4], ["batch", 5, 6]], "is 4 in one operand and 5"),
        ("bij->bik", [["batch", 3, 4]], "label missing from the inputs"),
        ("bi,bj->bij", [["batch", 3]], "Number of input tensors does not match"),
        ("bij->bi", [["batch", 3]], "does not match the equation indices"),
    ],
)
def test_equations_that_do_not_fit_are_refused(
    equation: str, shapes: list[list[Any]], message: str
) -> None:
    """ONNX's shape inference refuses most (its message names the problem); what passes it
    meets the unit's own checks."""
    with pytest.raises(CompileError, match=message):
        compile_model(model(equation, shapes, rank=3))
