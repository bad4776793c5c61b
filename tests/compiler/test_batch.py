"""One module for every batch: graphs that move, merge and recompute the symbolic batch
(Transpose across it, Reshape to -1, shapes computed with Shape/Gather/Concat, reductions and
broadcasts around it) give onnxruntime's answers at several batch sizes."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshfn.compiler import compile_model
from meshfn.compiler.runner import FastRunner, Runner


def init(name: str, value: Any) -> Any:
    return numpy_helper.from_array(np.asarray(value), name)


def batch_graph() -> Any:
    rng = np.random.default_rng(7)
    n = helper.make_node
    nodes = [
        n("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),  # [3, N, 4]
        n("Reshape", ["xt", "flat"], ["xf"]),  # [3N, 4]
        n("MatMul", ["xf", "w"], ["h"]),  # [3N, 5]
        n("Shape", ["x"], ["shp"]),
        n("Gather", ["shp", "zero"], ["nb"], axis=0),
        n("Unsqueeze", ["nb", "zero1"], ["nb1"]),
        n("Concat", ["three", "nb1", "five"], ["back"], axis=0),
        n("Reshape", ["h", "back"], ["h3"]),  # [3, N, 5]
        n("Transpose", ["h3"], ["hn"], perm=[1, 0, 2]),  # [N, 3, 5]
        n("Softmax", ["hn"], ["p"], axis=1),
        n("ReduceMean", ["p", "axes1"], ["m"], keepdims=0),  # [N, 5]
        n("Concat", ["m", "side"], ["mc"], axis=1),  # [N, 7]
        n("Flatten", ["hn"], ["hf"], axis=1),  # [N, 15]
        n("Sub", ["hf", "bias"], ["hb"]),
        n("ReduceMax", ["hb", "axes1"], ["top"], keepdims=1),  # [N, 1]
        n("Mul", ["mc", "top"], ["y"]),
        n("ArgMax", ["hb"], ["label"], axis=1, keepdims=0),
        n("Gather", ["table", "label"], ["picked"], axis=0),  # [N, 2]
    ]
    inits = [
        init("flat", np.array([-1, 4], np.int64)),
        init("w", rng.normal(size=(4, 5)).astype(np.float32)),
        init("zero", np.array(0, np.int64)),
        init("zero1", np.array([0], np.int64)),
        init("three", np.array([3], np.int64)),
        init("five", np.array([5], np.int64)),
        init("axes1", np.array([1], np.int64)),
        init("bias", rng.normal(size=15).astype(np.float32)),
        init("table", rng.normal(size=(15, 2)).astype(np.float32)),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4]),
        helper.make_tensor_value_info("side", TensorProto.FLOAT, ["batch", 2]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 7]),
        helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
        helper.make_tensor_value_info("picked", TensorProto.FLOAT, ["batch", 2]),
    ]
    return helper.make_model(
        helper.make_graph(nodes, "batch", inputs, outputs, inits),
        opset_imports=[helper.make_opsetid("", 18)],
    )


@pytest.mark.parametrize("runner_class", [Runner, FastRunner])
def test_batch_is_symbolic_through_the_graph(runner_class: type) -> None:
    model = batch_graph()
    compiled = compile_model(model)
    assert compiled.metadata["batch"] == "dynamic"
    runner = runner_class(compiled.wasm)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch in (1, 2, 5, 3, 64, 1):
        x = rng.normal(size=(batch, 3, 4)).astype(np.float32)
        side = rng.normal(size=(batch, 2)).astype(np.float32)
        got = runner([x, side])
        want = session.run(None, {"x": x, "side": side})
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
