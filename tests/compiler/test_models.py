"""Whole models against onnxruntime on held-out rows: scikit-learn exports (skl2onnx), an MLP,
a CNN trained here (also saved with external data), a transformer decoder block.

onnxruntime runs with one intra-op thread: its multi-threaded batch path sums tree-ensemble
scores in another order (a random forest tied at exactly 0.5 then flips its label between
onnxruntime's own batched and row-by-row runs); the sequential order is the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from meshfn.compiler import compile_model
from meshfn.compiler.runner import Runner
from meshfn.testing import onnx_models

EXAMPLES = {e.name: e for e in onnx_models.all_examples()}


def reference(model: Any, x: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return [np.asarray(v) for v in session.run(None, {session.get_inputs()[0].name: x})]


def check(
    example: onnx_models.Example, got: list[np.ndarray[Any, Any]], want: list[np.ndarray[Any, Any]]
) -> float:
    rtol, atol = example.tolerance
    worst = 0.0
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (k, g.shape, w.shape)
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        if k in example.label_outputs or w.dtype.kind in "iub":
            assert np.array_equal(g, w), f"output {k}: {int((g != w).sum())} labels differ"
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"output {k}")
            worst = max(worst, float(np.abs(g.astype(np.float64) - w).max()))
    return worst


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_model_matches_onnxruntime(name: str) -> None:
    example = EXAMPLES[name]
    compiled = compile_model(example.model)
    runner = Runner(compiled.wasm)
    worst = check(example, runner([example.x]), reference(example.model, example.x))
    print(f"{name}: max abs error {worst:.3g}")
    # one module serves every batch: a single row and an odd batch give the same answers
    for rows in (1, 7):
        if compiled.metadata["batch"] == "dynamic":
            check(example, runner([example.x[:rows]]), reference(example.model, example.x[:rows]))


def test_external_data_is_baked_in(tmp_path: Path) -> None:
    example = onnx_models.cnn_example(tmp_path)
    assert (tmp_path / "model.onnx.data").stat().st_size > 1000
    compiled = compile_model(tmp_path / "model.onnx")
    (tmp_path / "model.onnx.data").unlink()  # the module carries the weights itself
    want = reference(onnx_models.cnn_example().model, example.x)
    check(example, Runner(compiled.wasm)([example.x]), want)
