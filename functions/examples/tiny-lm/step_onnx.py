"""tiny-lm's decode step as an ONNX graph, for meshfn's model compiler (meshfn.compiler).

gru.step with the step function's tensors (core ABI v2: tokens INT32 [N], state FP32 [N, H] ->
logits FP32 [N, V], state_out FP32 [N, H]): Gather for the input table, MatMul, Add, Split,
Sigmoid, Tanh, Mul, Sub. train.py writes it with the trained weights; the build compiles it
(function.toml `model`). The batch N is symbolic: one module serves every decode batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

OPSET = 18


def step_graph(x: Any, wh: Any, bh: Any, wo: Any, bo: Any) -> ModelProto:
    """The step for weights in gru.Params order (x [V, 3H], wh [H, 3H], bh [3H], wo [H, V],
    bo [V])."""
    hidden, vocab = int(wh.shape[0]), int(wo.shape[1])
    n = helper.make_node
    nodes = [
        n("Gather", ["x", "tokens"], ["gx"], axis=0),  # [N, 3H]
        n("MatMul", ["state", "wh"], ["hw"]),
        n("Add", ["hw", "bh"], ["gh"]),  # [N, 3H]
        n("Split", ["gx", "thirds"], ["xr", "xz", "xn"], axis=1),
        n("Split", ["gh", "thirds"], ["hr", "hz", "hn"], axis=1),
        n("Add", ["xr", "hr"], ["r0"]),
        n("Sigmoid", ["r0"], ["r"]),
        n("Add", ["xz", "hz"], ["z0"]),
        n("Sigmoid", ["z0"], ["z"]),
        n("Mul", ["r", "hn"], ["rhn"]),
        n("Add", ["xn", "rhn"], ["n0"]),
        n("Tanh", ["n0"], ["cand"]),
        n("Sub", ["one", "z"], ["keep"]),
        n("Mul", ["keep", "cand"], ["new"]),
        n("Mul", ["z", "state"], ["old"]),
        n("Add", ["new", "old"], ["state_out"]),  # [N, H]
        n("MatMul", ["state_out", "wo"], ["ow"]),
        n("Add", ["ow", "bo"], ["logits"]),  # [N, V]
    ]
    f32 = np.float32
    inits = [
        numpy_helper.from_array(np.asarray(x, f32), "x"),
        numpy_helper.from_array(np.asarray(wh, f32), "wh"),
        numpy_helper.from_array(np.asarray(bh, f32), "bh"),
        numpy_helper.from_array(np.asarray(wo, f32), "wo"),
        numpy_helper.from_array(np.asarray(bo, f32), "bo"),
        numpy_helper.from_array(np.array([hidden] * 3, np.int64), "thirds"),
        numpy_helper.from_array(np.array(1.0, f32), "one"),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "tiny_lm_step",
        [value("tokens", TensorProto.INT32, ["batch"]),
         value("state", TensorProto.FLOAT, ["batch", hidden])],
        [value("logits", TensorProto.FLOAT, ["batch", vocab]),
         value("state_out", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
