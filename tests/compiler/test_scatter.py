"""ScatterElements and ScatterND compiled to wasm give onnxruntime's answers beyond ONNX's own
cases: the batch symbolic (and, for ScatterND and GatherND, indexed: PyTorch's `x[:, i] = y`),
negative indices, every reduction; an index out of range ends the run with an error, never a
stray write."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from meshfn.compiler import compile_model
from meshfn.compiler.runner import RunError, Runner


def model(op: str, shapes: dict[str, list[Any]], out: list[Any], **attrs: Any) -> Any:
    types = {"data": TensorProto.FLOAT, "indices": TensorProto.INT64, "updates": TensorProto.FLOAT}
    node = helper.make_node(op, list(shapes), ["y"], **attrs)
    graph = helper.make_graph(
        [node], op.lower(),
        [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), s) for n, s in shapes.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def same(m: Any, given: dict[str, np.ndarray]) -> None:
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = Runner(compile_model(m).wasm)(list(given.values()))[0]
    np.testing.assert_array_equal(got, session.run(None, given)[0])


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_elements_along_an_axis_of_each_row(reduction: str) -> None:
    m = model(
        "ScatterElements",
        {"data": ["batch", 4, 5], "indices": ["batch", 4, 2], "updates": ["batch", 4, 2]},
        ["batch", 4, 5], axis=2, reduction=reduction,
    )  # fmt: skip
    rng = np.random.default_rng(1)
    for batch in (1, 3):
        # distinct indices per row when nothing combines them (onnxruntime's order is then moot)
        indices = np.stack([rng.permutation(5)[:2] - 5 * (k % 2) for k in range(batch * 4)])
        same(m, {
            "data": rng.normal(0, 1, (batch, 4, 5)).astype(np.float32),
            "indices": indices.reshape(batch, 4, 2).astype(np.int64),
            "updates": rng.normal(0, 1, (batch, 4, 2)).astype(np.float32),
        })  # fmt: skip


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_nd_into_the_batch_and_a_position(reduction: str) -> None:
    """`x[b, p] = y` rows: indices of depth 2 over [batch, positions, features]."""
    m = model(
        "ScatterND",
        {"data": ["batch", 6, 3], "indices": ["batch", 1, 2], "updates": ["batch", 1, 3]},
        ["batch", 6, 3], reduction=reduction,
    )  # fmt: skip
    rng = np.random.default_rng(2)
    for batch in (1, 4):
        rows = np.arange(batch)
        indices = np.stack([rows, rng.integers(-6, 6, batch)], axis=1).reshape(batch, 1, 2)
        same(m, {
            "data": rng.normal(0, 1, (batch, 6, 3)).astype(np.float32),
            "indices": indices.astype(np.int64),
            "updates": rng.normal(0, 1, (batch, 1, 3)).astype(np.float32),
        })  # fmt: skip


def test_gather_nd_indexes_the_batch_too() -> None:
    node = helper.make_node("GatherND", ["data", "indices"], ["y"])
    graph = helper.make_graph(
        [node], "gathernd",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["batch", 5, 2]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
    )  # fmt: skip
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    rng = np.random.default_rng(3)
    batch = 3
    same(m, {
        "data": rng.normal(0, 1, (batch, 5, 2)).astype(np.float32),
        "indices": np.stack([[2, 0, -1], [4, -5, 1]], axis=1).astype(np.int64),
    })  # fmt: skip


def test_an_index_out_of_range_ends_the_run() -> None:
    elements = model(
        "ScatterElements",
        {"data": ["batch", 3], "indices": ["batch", 1], "updates": ["batch", 1]},
        ["batch", 3], axis=1,
    )  # fmt: skip
    nd = model(
        "ScatterND",
        {"data": ["batch", 3], "indices": ["batch", 2], "updates": ["batch"]},
        ["batch", 3],
    )  # fmt: skip
    one = np.ones((2, 1), np.float32)
    with pytest.raises(RunError, match="index out of range"):
        Runner(compile_model(elements).wasm)(
            [np.zeros((2, 3), np.float32), np.array([[0], [3]]), one]
        )
    with pytest.raises(RunError, match="index out of range"):  # the batch has 2 rows, not 3
        Runner(compile_model(nd).wasm)(
            [np.zeros((2, 3), np.float32), np.array([[0, 0], [2, 1]]), np.ones(2, np.float32)]
        )
