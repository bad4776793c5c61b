"""Resize compiled to wasm gives onnxruntime's answers beyond ONNX's own cases: bicubic
upsampling and downsampling of a batch of images (PyTorch's `interpolate(mode="bicubic")`
exports half_pixel with a = -0.75; TensorFlow's asymmetric with a = -0.5 and exclude_outside),
the batch symbolic; integer images are refused for cubic."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshfn.compiler import compile_model
from meshfn.compiler.errors import UnsupportedError
from meshfn.compiler.runner import Runner


def model(scales: list[float], elem: int, out: list[Any], **attrs: Any) -> Any:
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="cubic", **attrs)
    graph = helper.make_graph(
        [node], "resize",
        [helper.make_tensor_value_info("x", elem, ["batch", 3, 6, 5])],
        [helper.make_tensor_value_info("y", elem, out)],
        [numpy_helper.from_array(np.array(scales, np.float32), "scales")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize(
    ("scales", "out", "attrs"),
    [
        ([1, 1, 2, 2], ["batch", 3, 12, 10], {}),
        ([1, 1, 0.5, 0.6], ["batch", 3, 3, 3], {}),
        ([1, 1, 1.5, 3], ["batch", 3, 9, 15], {"coordinate_transformation_mode": "align_corners"}),
        (
            [1, 1, 2, 1.6],
            ["batch", 3, 12, 8],
            {"coordinate_transformation_mode": "asymmetric", "cubic_coeff_a": -0.5,
             "exclude_outside": 1},
        ),
        ([1, 1, 2, 2], ["batch", 3, 12, 10], {"coordinate_transformation_mode": "pytorch_half_pixel"}),
    ],
)  # fmt: skip
def test_bicubic_images_match_onnxruntime(
    scales: list[float], out: list[Any], attrs: dict[str, Any]
) -> None:
    m = model(scales, TensorProto.FLOAT, out, **attrs)
    run = Runner(compile_model(m).wasm)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for batch in (1, 4):
        x = rng.normal(0, 1, (batch, 3, 6, 5)).astype(np.float32)
        np.testing.assert_allclose(
            run([x])[0], session.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5
        )


def test_bicubic_8_bit_images_are_refused() -> None:
    """onnxruntime has no integer cubic kernel either: refused when compiled, never guessed."""
    with pytest.raises(UnsupportedError, match="cubic resizing of integer images"):
        compile_model(model([1, 1, 2, 2], TensorProto.UINT8, ["batch", 3, 12, 10]))


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("opset", [7, 9])
def test_upsample_of_older_exports_matches_onnxruntime(mode: str, opset: int) -> None:
    scales = [1.0, 1.0, 2.0, 3.0]
    if opset == 7:
        node = helper.make_node("Upsample", ["x"], ["y"], mode=mode, scales=scales)
        inits = []
    else:
        node = helper.make_node("Upsample", ["x", "scales"], ["y"], mode=mode)
        inits = [numpy_helper.from_array(np.array(scales, np.float32), "scales")]
    graph = helper.make_graph(
        [node], "upsample",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 12, 15])],
        inits,
    )  # fmt: skip
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).normal(0, 1, (2, 3, 6, 5)).astype(np.float32)
    got = Runner(compile_model(m).wasm)([x])[0]
    np.testing.assert_allclose(got, session.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("corners", [0, 1])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_grid_sample_matches_onnxruntime(mode: str, padding: str, corners: int) -> None:
    """Spatial-transformer sampling with grid points beyond the image (-1.4..1.4), the batch
    symbolic."""
    node = helper.make_node(
        "GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding,
        align_corners=corners,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "gridsample",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 5, 6]),
         helper.make_tensor_value_info("grid", TensorProto.FLOAT, ["batch", 4, 7, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 4, 7])],
    )  # fmt: skip
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    run = Runner(compile_model(m).wasm)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    for batch in (1, 3):
        x = rng.normal(0, 1, (batch, 2, 5, 6)).astype(np.float32)
        grid = rng.uniform(-1.4, 1.4, (batch, 4, 7, 2)).astype(np.float32)
        want = session.run(None, {"x": x, "grid": grid})[0]
        np.testing.assert_allclose(run([x, grid])[0], want, rtol=1e-5, atol=1e-5)
