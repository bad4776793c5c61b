"""Quantised models compiled to wasm give onnxruntime's answers on the same quantised model, at
every batch: dynamically quantised ones (`quantize_dynamic`: DynamicQuantizeLinear,
MatMulInteger, ConvInteger, then the float rescale) and statically quantised ones in the
QOperator format (`quantize_static`: QLinearConv, QLinearMatMul, per tensor and per channel,
8-bit signed and unsigned); the integer units' zero points per tensor, per row, per column and
per channel, padding and groups, against onnxruntime or numpy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from meshfn.compiler import compile_model
from meshfn.compiler.runner import Runner
from meshfn.testing import onnx_models

EXAMPLES = {
    "mlp": onnx_models.mlp_example,
    "cnn": onnx_models.cnn_example,
    "decoder": onnx_models.decoder_block_example,
}


def session(model: Any, unsigned_activations: bool = True) -> ort.InferenceSession:
    """onnxruntime on x86-64 without VNNI (AVX2, as on AMD EPYC hosts) multiplies uint8 by
    int8 with VPMADDUBSW, whose int16 pair sums saturate: its answers then differ from the
    integer arithmetic ONNX defines (and the compiled model computes) by up to ~0.3 on these
    models. `session.x64quantprecision` makes it use exact uint8 kernels instead; it has none
    for int8 activations (QLinearMatMul), whose default ones matched the compiled model there."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if unsigned_activations:
        options.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


@pytest.mark.parametrize("weights", ["QInt8", "QUInt8"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_quantize_dynamic_models_match_onnxruntime(name: str, weights: str, tmp_path: Path) -> None:
    example = EXAMPLES[name]()
    onnx.save(example.model, tmp_path / "float.onnx")
    quantize_dynamic(
        tmp_path / "float.onnx", tmp_path / "int8.onnx", weight_type=getattr(QuantType, weights)
    )
    quantised = onnx.load(tmp_path / "int8.onnx")
    ops = {n.op_type for n in quantised.graph.node}
    assert "DynamicQuantizeLinear" in ops and "MatMulInteger" in ops
    assert name != "cnn" or "ConvInteger" in ops
    run = Runner(compile_model(quantised).wasm)
    reference = session(quantised)
    for rows in (len(example.x), 1, 5):
        x = example.x[:rows]
        got = run([x])
        want = reference.run(None, {reference.get_inputs()[0].name: x})
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
            else:
                assert np.array_equal(g, w)


def one_node(
    op: str, inputs: list[tuple[str, int, list[Any]]], inits: dict[str, np.ndarray],
    out: list[Any], **attrs: Any,
) -> Any:  # fmt: skip
    names = [name for name, _, _ in inputs] + list(inits)
    order = [n for n in names if n]
    node = helper.make_node(op, order, ["y"], **attrs)
    graph = helper.make_graph(
        [node], op.lower(),
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.INT32, out)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_matmul_integer_zero_points_per_tensor_and_per_column() -> None:
    rng = np.random.default_rng(1)
    b = rng.integers(-128, 128, (6, 5)).astype(np.int8)
    for a_type, a_np in ((TensorProto.UINT8, np.uint8), (TensorProto.INT8, np.int8)):
        info = np.iinfo(a_np)
        inits = {
            "b": b,
            "a_zero": np.array(7, a_np),
            "b_zero": rng.integers(-4, 4, 5).astype(np.int8),
        }
        model = one_node("MatMulInteger", [("a", a_type, ["batch", 6])], inits, ["batch", 5])
        a = rng.integers(info.min, int(info.max) + 1, (9, 6)).astype(a_np)
        got = Runner(compile_model(model).wasm)([a])[0]
        assert np.array_equal(got, session(model).run(None, {"a": a})[0])


def test_matmul_integer_per_row_zero_point_and_broadcast_batches() -> None:
    """onnxruntime takes A's zero point per tensor only: numpy is the reference per row."""
    rng = np.random.default_rng(2)
    b = rng.integers(0, 256, (2, 4, 3)).astype(np.uint8)
    a_zero = rng.integers(0, 20, 5).astype(np.uint8)
    model = one_node(
        "MatMulInteger", [("a", TensorProto.UINT8, ["batch", 2, 5, 4])],
        {"b": b, "a_zero": a_zero}, ["batch", 2, 5, 3],
    )  # fmt: skip
    a = rng.integers(0, 256, (3, 2, 5, 4)).astype(np.uint8)
    want = (a.astype(np.int32) - a_zero[:, None]) @ b.astype(np.int32)
    assert np.array_equal(Runner(compile_model(model).wasm)([a])[0], want)


def test_conv_integer_padding_strides_groups_and_zero_points() -> None:
    rng = np.random.default_rng(3)
    w = rng.integers(0, 256, (4, 2, 3, 3)).astype(np.uint8)
    model = one_node(
        "ConvInteger", [("x", TensorProto.UINT8, ["batch", 4, 7, 6])],
        {"w": w, "x_zero": np.array(9, np.uint8), "w_zero": np.array(120, np.uint8)},
        ["batch", 4, 4, 6], pads=[1, 2, 1, 0], strides=[2, 1], group=2,
    )  # fmt: skip
    x = rng.integers(0, 256, (3, 4, 7, 6)).astype(np.uint8)
    got = Runner(compile_model(model).wasm)([x])[0]
    assert np.array_equal(got, session(model).run(None, {"x": x})[0])


def test_conv_integer_per_channel_weight_zero_points() -> None:
    """Per output channel: numpy is the reference (a padded pixel is the image's zero point)."""
    rng = np.random.default_rng(4)
    w = rng.integers(-128, 128, (3, 1, 2, 2)).astype(np.int8)
    w_zero = np.array([-3, 0, 5], np.int8)
    model = one_node(
        "ConvInteger", [("x", TensorProto.INT8, ["batch", 1, 4, 4])],
        {"w": w, "x_zero": np.array(-2, np.int8), "w_zero": w_zero}, ["batch", 3, 5, 5],
        pads=[1, 1, 1, 1],
    )  # fmt: skip
    x = rng.integers(-128, 128, (2, 1, 4, 4)).astype(np.int8)
    padded = np.pad(x.astype(np.int32) + 2, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ws = w.astype(np.int32) - w_zero[:, None, None, None]
    want = np.zeros((2, 3, 5, 5), np.int32)
    for r in range(5):
        for c in range(5):
            want[:, :, r, c] = np.einsum("nkuv,mkuv->nm", padded[:, :, r : r + 2, c : c + 2], ws)
    assert np.array_equal(Runner(compile_model(model).wasm)([x])[0], want)


def test_dynamic_quantize_linear_of_a_flat_tensor_has_scale_one() -> None:
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"])
    graph = helper.make_graph(
        [node], "dql", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, ["batch", 3]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("zero", TensorProto.UINT8, [])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    run = Runner(compile_model(model).wasm)
    for x in (np.zeros((2, 3), np.float32), np.array([[-1.5, 0.25, 3.0]], np.float32)):
        for g, w in zip(run([x]), session(model).run(None, {"x": x}), strict=True):
            assert np.array_equal(g, w)


def conv_then_matmul() -> Any:
    """Conv (with bias) and Relu, flattened, then MatMul: what QOperator quantisation turns
    into QLinearConv (nine inputs) and QLinearMatMul."""
    rng = np.random.default_rng(8)
    inits = {
        "w": rng.normal(0, 0.3, (4, 2, 3, 3)).astype(np.float32),
        "b": rng.normal(0, 0.1, 4).astype(np.float32),
        "shape": np.array([-1, 4 * 6 * 6], np.int64),
        "w2": rng.normal(0, 0.1, (144, 5)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["f"]),
        helper.make_node("MatMul", ["f", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "qoperator",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


class Calibration(CalibrationDataReader):
    def __init__(self) -> None:
        rng = np.random.default_rng(9)
        self.batches = iter(
            [{"x": rng.normal(0, 1, (4, 2, 6, 6)).astype(np.float32)} for _ in range(8)]
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.batches, None)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize(
    ("activations", "weights"), [("QUInt8", "QInt8"), ("QInt8", "QInt8"), ("QUInt8", "QUInt8")]
)
def test_quantize_static_qoperator_models_match_onnxruntime(
    per_channel: bool, activations: str, weights: str, tmp_path: Path
) -> None:
    onnx.save(conv_then_matmul(), tmp_path / "float.onnx")
    quantize_static(
        tmp_path / "float.onnx", tmp_path / "int8.onnx", Calibration(),
        quant_format=QuantFormat.QOperator, per_channel=per_channel,
        activation_type=getattr(QuantType, activations), weight_type=getattr(QuantType, weights),
    )  # fmt: skip
    quantised = onnx.load(tmp_path / "int8.onnx")
    assert {"QLinearConv", "QLinearMatMul"} <= {n.op_type for n in quantised.graph.node}
    run = Runner(compile_model(quantised).wasm)
    reference = session(quantised, unsigned_activations=activations == "QUInt8")
    rng = np.random.default_rng(10)
    for rows in (1, 7):
        x = rng.normal(0, 1, (rows, 2, 6, 6)).astype(np.float32)
        np.testing.assert_array_equal(run([x])[0], reference.run(None, {"x": x})[0])
