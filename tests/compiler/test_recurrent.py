"""RNN, GRU and LSTM compiled to wasm give onnxruntime's answers beyond ONNX's own cases (which
the conformance test runs): both directions, per-row sequence lengths, initial states, either
layout, clip, the symbolic batch at several sizes; bad lengths are refused at run time and
attributes the unit does not claim when the model is compiled."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from meshfn.compiler import compile_model
from meshfn.compiler.errors import UnsupportedError
from meshfn.compiler.runner import RunError, Runner

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
SEQ, SIZE, HIDDEN = 5, 3, 4


def model(
    op: str, *, layout: int = 0, direction: str = "forward", lens: bool = False,
    initial: bool = False, peepholes: bool = False, outputs: tuple[str, ...] = ("y", "y_h"),
    dtype: Any = np.float32, **attrs: Any,
) -> Any:  # fmt: skip
    """One recurrent node over X [SEQ, batch, SIZE] (or [batch, SEQ, SIZE]) with random weights
    and bias; `lens`: a sequence_lens input, `initial`: initial states as inputs. Graph inputs
    are batch-first (the compiler's one symbolic dimension), moved for layout 0 by Transposes
    as PyTorch's exports do."""
    rng = np.random.default_rng(len(op) + len(direction))  # the same weights in either layout
    dirs = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.6, (dirs, g * HIDDEN, SIZE)).astype(dtype), "w"),
        numpy_helper.from_array(rng.normal(0, 0.6, (dirs, g * HIDDEN, HIDDEN)).astype(dtype), "r"),
        numpy_helper.from_array(rng.normal(0, 0.3, (dirs, 2 * g * HIDDEN)).astype(dtype), "b"),
    ]
    state: list[Any] = [dirs, "batch", HIDDEN] if layout == 0 else ["batch", dirs, HIDDEN]
    y: list[Any] = [SEQ, dirs, "batch", HIDDEN] if layout == 0 else ["batch", SEQ, dirs, HIDDEN]
    inputs = [helper.make_tensor_value_info("x", elem, ["batch", SEQ, SIZE])]
    nodes = []

    def time_major(name: str) -> str:
        if layout == 1:
            return name
        nodes.append(helper.make_node("Transpose", [name], [f"{name}_t"], perm=[1, 0, 2]))
        return f"{name}_t"

    names = [time_major("x"), "w", "r", "b", "", "", ""]
    if lens:
        inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["batch"]))
        names[4] = "lens"
    if initial:
        inputs.append(helper.make_tensor_value_info("h0", elem, ["batch", dirs, HIDDEN]))
        names[5] = time_major("h0")
        if op == "LSTM":
            inputs.append(helper.make_tensor_value_info("c0", elem, ["batch", dirs, HIDDEN]))
            names[6] = time_major("c0")
    if peepholes:
        inits.append(
            numpy_helper.from_array(rng.normal(0, 0.5, (dirs, 3 * HIDDEN)).astype(dtype), "p")
        )
        names.append("p")
    while names and not names[-1]:
        names.pop()
    shapes = {"y": y, "y_h": state, "y_c": state}
    outs = [o if o in outputs else "" for o in ("y", "y_h", "y_c")[: 3 if op == "LSTM" else 2]]
    while outs and not outs[-1]:
        outs.pop()
    nodes.append(
        helper.make_node(
            op, names, outs, hidden_size=HIDDEN, direction=direction, layout=layout, **attrs
        )
    )
    graph = helper.make_graph(
        nodes, op.lower(), inputs,
        [helper.make_tensor_value_info(o, elem, shapes[o]) for o in outs if o], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def feeds(m: Any, batch: int, rng: np.random.Generator, dtype: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i in m.graph.input:
        shape = [batch if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name == "lens":
            out[i.name] = rng.integers(1, SEQ + 1, batch).astype(np.int32)
        else:
            out[i.name] = rng.normal(0, 1, shape).astype(dtype)
    return out


def same_as_onnxruntime(
    m: Any, dtype: Any = np.float32, batches: tuple[int, ...] = (1, 3, 7)
) -> None:
    compiled = compile_model(m)
    run = Runner(compiled.wasm)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    for batch in batches:
        given = feeds(m, batch, rng, dtype)
        got = run([given[i.name] for i in m.graph.input])
        want = session.run(None, given)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_every_direction_with_lengths_and_initial_states(op: str, direction: str) -> None:
    outputs = ("y", "y_h", "y_c") if op == "LSTM" else ("y", "y_h")
    same_as_onnxruntime(model(op, direction=direction, lens=True, initial=True, outputs=outputs))


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_batch_major_layout(op: str) -> None:
    """onnxruntime refuses layout 1: the time-major model's answers, moved, are the reference."""
    outputs = ("y", "y_h", "y_c") if op == "LSTM" else ("y", "y_h")
    args: dict[str, Any] = {"direction": "bidirectional", "lens": True, "initial": True}
    batch_major = model(op, layout=1, outputs=outputs, **args)
    time_major = model(op, layout=0, outputs=outputs, **args)
    run = Runner(compile_model(batch_major).wasm)
    session = ort.InferenceSession(
        time_major.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(5)
    for batch in (1, 4):
        given = feeds(batch_major, batch, rng, np.float32)
        got = run([given[i.name] for i in batch_major.graph.input])
        want = session.run(None, given)
        moved = [want[0].transpose(2, 0, 1, 3)] + [w.transpose(1, 0, 2) for w in want[1:]]
        for g, w in zip(got, moved, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_double_against_onnx_reference(op: str) -> None:
    """onnxruntime has no double RNN kernels: ONNX's reference implementation is the reference."""
    m = model(op, dtype=np.float64, direction="bidirectional", initial=True)
    run = Runner(compile_model(m).wasm)
    reference = ReferenceEvaluator(m)
    rng = np.random.default_rng(9)
    for batch in (1, 3):
        given = feeds(m, batch, rng, np.float64)
        got = run([given[i.name] for i in m.graph.input])
        for g, w in zip(got, reference.run(None, given), strict=True):
            assert g.dtype == np.float64
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_gru_linear_before_reset_and_lstm_peepholes_clip_and_coupled_gates() -> None:
    same_as_onnxruntime(model("GRU", linear_before_reset=1, lens=True, initial=True))
    same_as_onnxruntime(
        model("LSTM", peepholes=True, clip=0.7, initial=True, outputs=("y_h", "y_c"))
    )
    same_as_onnxruntime(model("LSTM", input_forget=1, direction="bidirectional"))


def test_only_the_last_state_is_asked_for() -> None:
    same_as_onnxruntime(model("LSTM", outputs=("y_h",)))
    same_as_onnxruntime(model("GRU", outputs=("y",)))


def test_named_activations() -> None:
    same_as_onnxruntime(model("RNN", activations=["Relu"]))
    same_as_onnxruntime(model("GRU", activations=["HardSigmoid", "Softsign"], direction="reverse"))


def test_a_length_out_of_range_is_refused_when_run() -> None:
    m = model("GRU", lens=True)
    run = Runner(compile_model(m).wasm)
    x = np.ones((2, SEQ, SIZE), np.float32)
    for bad in ([0, 2], [SEQ + 1, 1], [-1, 1]):
        with pytest.raises(RunError, match="sequence_lens must be between 1"):
            run([x, np.array(bad, np.int32)])
    ok = run([x, np.array([SEQ, 1], np.int32)])
    assert ok[0].shape == (SEQ, 1, 2, HIDDEN) and not ok[0][1:, 0, 1].any()


def test_what_the_unit_does_not_claim_is_refused_when_compiled() -> None:
    with pytest.raises(UnsupportedError, match="activation_alpha"):
        compile_model(model("RNN", activations=["LeakyRelu"], activation_alpha=[0.3]))
    with pytest.raises(UnsupportedError, match="activation 'ScaledTanh' is not supported"):
        compile_model(model("RNN", activations=["ScaledTanh"]))
    with pytest.raises(UnsupportedError, match="2 functions per direction"):
        compile_model(model("GRU", activations=["Sigmoid", "Tanh", "Tanh"]))


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_weights_given_at_run_time(op: str) -> None:
    """W and R as graph inputs, not constants: transposed at run time, the same answers."""
    m = model(op, direction="bidirectional", lens=True)
    weights = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer if i.name in "wr"}
    kept = [i for i in m.graph.initializer if i.name not in weights]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    for name, value in weights.items():
        m.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, value.shape))
    run = Runner(compile_model(m).wasm)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    for batch in (1, 3):
        given = {**feeds(m, batch, rng, np.float32), **weights}
        got = run([given[i.name] for i in m.graph.input])
        for g, w in zip(got, session.run(None, given), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
