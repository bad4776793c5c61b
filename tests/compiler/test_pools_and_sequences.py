"""LpPool, GlobalLpPool, ReverseSequence and CumProd compiled to wasm, beyond ONNX's own cases:
p-norms of 1, 2 and 3 against onnxruntime, sequences reversed per row with the batch symbolic
(either layout; lengths out of range end the run), running products against numpy (onnxruntime
has no CumProd of opset 26)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from meshfn.compiler import compile_model
from meshfn.compiler.runner import RunError, Runner


def model(node: Any, inputs: list[tuple[str, int, list[Any]]], out: list[Any], opset: int) -> Any:
    graph = helper.make_graph(
        [node], node.op_type.lower(),
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", inputs[0][1], out)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def ort_run(m: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pools_match_onnxruntime(p: int) -> None:
    x = np.random.default_rng(p).normal(0, 1, (3, 2, 7, 6)).astype(np.float32)
    pooled = model(
        helper.make_node("LpPool", ["x"], ["y"], p=p, kernel_shape=[3, 2], strides=[2, 2],
                         pads=[1, 0, 1, 1]),
        [("x", TensorProto.FLOAT, ["batch", 2, 7, 6])], ["batch", 2, 4, 3], 11,
    )  # fmt: skip
    np.testing.assert_allclose(
        Runner(compile_model(pooled).wasm)([x])[0], ort_run(pooled, {"x": x}), rtol=1e-5
    )
    whole = model(
        helper.make_node("GlobalLpPool", ["x"], ["y"], p=p),
        [("x", TensorProto.FLOAT, ["batch", 2, 7, 6])], ["batch", 2, 1, 1], 11,
    )  # fmt: skip
    np.testing.assert_allclose(
        Runner(compile_model(whole).wasm)([x])[0], ort_run(whole, {"x": x}), rtol=1e-5
    )


@pytest.mark.parametrize(("time_axis", "batch_axis"), [(0, 1), (1, 0)])
def test_reverse_sequence_per_row(time_axis: int, batch_axis: int) -> None:
    shape: list[Any] = [5, "batch", 3] if time_axis == 0 else ["batch", 5, 3]
    if time_axis == 0:  # the batch must lead a graph input: transpose in
        node_x = "xt"
        pre = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2])]
        given: list[Any] = ["batch", 5, 3]
    else:
        node_x, pre, given = "x", [], shape
    node = helper.make_node(
        "ReverseSequence", [node_x, "lens"], ["y"], time_axis=time_axis, batch_axis=batch_axis
    )
    graph = helper.make_graph(
        [*pre, node], "reverse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, given),
         helper.make_tensor_value_info("lens", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )  # fmt: skip
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    run = Runner(compile_model(m).wasm)
    x = np.random.default_rng(2).normal(0, 1, (4, 5, 3)).astype(np.float32)
    lens = np.array([5, 1, 3, 0], np.int64)
    np.testing.assert_array_equal(run([x, lens])[0], ort_run(m, {"x": x, "lens": lens}))
    with pytest.raises(RunError, match="sequence_lens must be between 0 and"):
        run([x, np.array([6, 1, 1, 1], np.int64)])


def test_cum_prod_against_numpy() -> None:
    x = np.random.default_rng(3).uniform(0.5, 1.5, (4, 6)).astype(np.float32)
    axis = helper.make_tensor("axis", TensorProto.INT64, [], [1])
    for exclusive, reverse in ((0, 0), (1, 0), (0, 1), (1, 1)):
        node = helper.make_node(
            "CumProd", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse
        )
        graph = helper.make_graph(
            [node], "cumprod", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])], [axis],
        )  # fmt: skip
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)])
        v = x[:, ::-1] if reverse else x
        want = np.cumprod(v, axis=1)
        if exclusive:
            want = np.concatenate([np.ones((4, 1), np.float32), want[:, :-1]], axis=1)
        want = want[:, ::-1] if reverse else want
        np.testing.assert_allclose(Runner(compile_model(m).wasm)([x])[0], want, rtol=1e-6)
