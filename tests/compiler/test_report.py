"""The build report (opset, operators, parameters, module size, peak memory at the largest
batch), buffer reuse, the ABI v2 exports, and the registry's operator table."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from meshfn.compiler import Options, compile_model, wasmfile
from meshfn.compiler.ops import REGISTRY, table
from meshfn.compiler.runner import FastRunner, Runner
from meshfn.testing import onnx_models


def test_report_fields() -> None:
    example = onnx_models.cnn_example()
    compiled = compile_model(example.model, Options(max_batch=32))
    r = compiled.report
    assert r["opset"] == {"ai.onnx": 17}
    assert r["operators"]["Conv"] == 1 and r["operators"]["Gemm"] == 1
    assert r["parameters"] == 8 * 9 + 8 + 10 * 128 + 10
    assert r["module_bytes"] == len(compiled.wasm)
    mem = r["memory"]
    assert mem["max_batch"] == 32 and mem["arena_bytes_per_row"] > 0
    assert mem["peak_bytes"] % 65536 == 0
    assert (
        mem["peak_bytes"]
        >= mem["static_bytes"] + mem["arena_bytes"] + 32 * mem["arena_bytes_per_row"]
    )
    assert compiled.metadata["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1, 1, 8, 8]}
    ]


def test_module_exports_abi_v2_and_imports_nothing() -> None:
    compiled = compile_model(onnx_models.mlp_example().model)
    info = wasmfile.inspect(compiled.wasm)
    assert info.imports == []
    for name in (
        "memory",
        "meshfn_abi_version",
        "meshfn_metadata",
        "meshfn_plan",
        "meshfn_run",
        "meshfn_error",
    ):
        assert name in info.exports


def test_intermediate_buffers_are_reused() -> None:
    """Ten chained activations on [N, 1000] need the input, the output and two buffers that
    alternate, not eleven."""
    nodes = [
        helper.make_node("Relu" if k % 2 else "Neg", [f"t{k}"], [f"t{k + 1}"]) for k in range(10)
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 1000]) for n in ("t0", "t10")]
    model = helper.make_model(
        helper.make_graph(nodes, "chain", vi[:1], vi[1:]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    compiled = compile_model(model)
    assert compiled.report["memory"]["arena_bytes_per_row"] <= 4 * 4000
    x = np.random.default_rng(0).normal(size=(5, 1000)).astype(np.float32)
    want = x
    for k in range(10):
        want = np.maximum(want, 0) if k % 2 else -want
    for runner in (Runner(compiled.wasm), FastRunner(compiled.wasm)):
        np.testing.assert_array_equal(runner([x])[0], want)


def test_operator_table_lists_the_registry() -> None:
    text = table()
    assert text.count("\n") == len(REGISTRY) + 2
    assert "| ai.onnx.ml | TreeEnsembleClassifier | 1 |" in text


def test_onnx_functions_are_inlined() -> None:
    """MeanVarianceNormalization has no unit: its ONNX function body is compiled instead."""
    import onnxruntime as ort

    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 3, 4]) for n in ("x", "y")]
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=[0, 2])
    model = helper.make_model(
        helper.make_graph([node], "mvn", vi[:1], vi[1:]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    compiled = compile_model(model)
    assert compiled.report["inlined_functions"] == 1
    assert "MeanVarianceNormalization" not in compiled.report["operators"]
    x = np.random.default_rng(0).normal(size=(5, 3, 4)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    np.testing.assert_allclose(Runner(compiled.wasm)([x])[0], want, rtol=1e-5, atol=1e-6)
