"""What a user hands the compiler that it must refuse, and how: a clear message naming the
file (and node, operator and what is supported), never a traceback or a wrong answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshfn.compiler import (
    CompileError,
    MemoryCapError,
    ModelFileError,
    Options,
    UnsupportedError,
    analyze,
    compile_model,
)
from meshfn.compiler.runner import RunError, Runner


def model(
    nodes: list[Any],
    inputs: list[Any],
    outputs: list[Any],
    inits: list[Any] = (),
    opset: int = 17,
    **kw: Any,
) -> onnx.ModelProto:  # type: ignore[assignment]
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", opset), *kw.get("extra", [])]
    )


def vi(name: str, shape: list[Any], t: int = TensorProto.FLOAT) -> Any:
    return helper.make_tensor_value_info(name, t, shape)


def relu_model() -> onnx.ModelProto:
    return model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["N", 4])], [vi("y", ["N", 4])])


def test_corrupt_truncated_and_empty_files_name_the_file(tmp_path: Path) -> None:
    good = relu_model().SerializeToString()
    cases = {
        "garbage.onnx": b"\x08\xff\xff\xff" + bytes(range(256)),
        "empty.onnx": b"",
        "truncated.onnx": good[: len(good) // 2],
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ModelFileError) as exc:
            compile_model(path)
        assert str(path) in str(exc.value), exc.value
    with pytest.raises(ModelFileError, match=r"missing\.onnx"):
        compile_model(tmp_path / "missing.onnx")


def test_cycle_is_refused_with_the_nodes_on_it() -> None:
    m = model(
        [
            helper.make_node(
                "Relu",
                [
                    "x",
                ],
                ["a"],
                name="first",
            ),
            helper.make_node("Add", ["a", "c"], ["b"], name="second"),
            helper.make_node("Relu", ["b"], ["c"], name="third"),
        ],
        [vi("x", ["N", 4])],
        [vi("b", ["N", 4])],
    )
    with pytest.raises(ModelFileError, match=r"cycle through .*second.*third"):
        compile_model(m)


def test_missing_or_escaping_external_data(tmp_path: Path) -> None:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    m = model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [vi("x", ["N", 4])],
        [vi("y", ["N", 4])],
        [w],
    )
    onnx.save_model(
        m,
        str(tmp_path / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    compile_model(tmp_path / "model.onnx")
    (tmp_path / "model.onnx.data").unlink()
    with pytest.raises(ModelFileError, match=r"model\.onnx.*model\.onnx\.data.*missing"):
        compile_model(tmp_path / "model.onnx")
    (tmp_path / "model.onnx.data").write_bytes(b"\0" * 8)  # truncated
    with pytest.raises(ModelFileError, match="truncated"):
        compile_model(tmp_path / "model.onnx")
    loaded = onnx.load_model(str(tmp_path / "model.onnx"), load_external_data=False)
    for entry in loaded.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../../etc/passwd"  # hostile path: refused, never read
    onnx.save_model(loaded, str(tmp_path / "evil.onnx"))
    with pytest.raises(ModelFileError, match=r"outside the model's folder"):
        compile_model(tmp_path / "evil.onnx")


def test_unsupported_operator_names_node_operator_and_the_supported() -> None:
    m = model(
        [helper.make_node("Det", ["x"], ["y"], name="mix")],
        [vi("x", ["N", 3, 3])],
        [vi("y", ["N"])],
    )
    with pytest.raises(UnsupportedError) as exc:
        compile_model(m)
    text = str(exc.value)
    assert "node mix (Det)" in text and "operator Det is not supported" in text
    assert "supported:" in text and "Gemm" in text


def test_zipmap_refusal_advises_zipmap_false() -> None:
    from skl2onnx import to_onnx
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    x, y = load_iris(return_X_y=True)
    m = to_onnx(LogisticRegression(max_iter=500).fit(x, y), x[:1].astype(np.float32))
    with pytest.raises(CompileError, match=r"ZipMap.*'zipmap': False"):
        compile_model(m)


def test_old_opset_and_unsupported_dtype_are_refused() -> None:
    clip = model(
        [helper.make_node("Clip", ["x"], ["y"], min=0.0)],
        [vi("x", ["N", 4])],
        [vi("y", ["N", 4])],
        opset=10,
    )
    with pytest.raises(UnsupportedError, match=r"Clip .*supported from version 11"):
        compile_model(clip)
    half = model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [vi("x", ["N", 4], TensorProto.FLOAT16)],
        [vi("y", ["N", 4], TensorProto.FLOAT16)],
    )
    with pytest.raises(UnsupportedError, match=r"FLOAT16 is not supported \(supported: float32"):
        compile_model(half)


def test_only_the_batch_may_be_symbolic_unless_pinned() -> None:
    m = model(
        [helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["N", "seq"])], [vi("y", ["N", "seq"])]
    )
    with pytest.raises(UnsupportedError, match=r"dims=\{'seq'"):
        compile_model(m)
    assert analyze(m, Options(dims={"seq": 5}))["inputs"][0]["shape"] == [-1, 5]


def test_memory_cap_refuses_with_the_bytes_needed() -> None:
    m = model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [vi("x", ["N", 100_000])],
        [vi("y", ["N", 100_000])],
    )
    ok = compile_model(m, Options(max_batch=8))
    need = ok.report["memory"]["peak_bytes"]
    assert need >= 2 * 8 * 400_000
    with pytest.raises(MemoryCapError) as exc:
        compile_model(m, Options(max_batch=8, memory_cap_bytes=need - 65536))
    assert exc.value.needed_bytes == need and str(need) in str(exc.value)
    compile_model(m, Options(max_batch=8, memory_cap_bytes=need))


def test_run_time_errors_are_statuses_not_traps() -> None:
    gather = model(
        [helper.make_node("Gather", ["t", "i"], ["y"])],
        [vi("i", ["N"], TensorProto.INT64)],
        [vi("y", ["N", 3])],
        [numpy_helper.from_array(np.ones((5, 3), np.float32), "t")],
    )
    runner = Runner(compile_model(gather).wasm)
    assert runner([np.array([0, 4, -1])])[0].shape == (3, 3)
    with pytest.raises(RunError, match="index out of range") as exc:
        runner([np.array([0, 5])])
    assert exc.value.status == 1
    assert runner([np.array([1])])[0].shape == (1, 3)  # the instance is still good
    div = model(
        [helper.make_node("Div", ["a", "b"], ["y"])],
        [vi("a", ["N"], TensorProto.INT64), vi("b", ["N"], TensorProto.INT64)],
        [vi("y", ["N"], TensorProto.INT64)],
    )
    with pytest.raises(RunError, match="division by zero"):
        Runner(compile_model(div).wasm)([np.array([1, 2]), np.array([1, 0])])
