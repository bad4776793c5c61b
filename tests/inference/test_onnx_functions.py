"""`kind = "onnx"` functions from a model file to a served function, in-process: init from the
graph, build (the real compiler and clang), sign, publish, verify and serve through the
Backend (REST, batching, statistics, scale to zero), against onnxruntime's answers; and every
way a model, a limit or a file can be wrong."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshfn.inference import signing
from meshfn.inference.backend import Backend
from meshfn.inference.build import build
from meshfn.inference.config import parse_config
from meshfn.inference.errors import BuildError, SignatureError
from meshfn.inference.onnxfn import init
from meshfn.inference.registry import Registry, sign_module
from meshfn.testing import onnx_models


@dataclass
class Keys:
    private: Path
    public: Path

    @property
    def key(self) -> Any:
        return signing.load_private_key(self.private)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    private, public = signing.generate_key(tmp_path_factory.mktemp("keys"))
    return Keys(private, public)


@pytest.fixture(scope="module")
def iris() -> tuple[onnx.ModelProto, np.ndarray[Any, Any]]:
    """The iris example's model (scikit-learn's MLP through skl2onnx) and held-out rows."""
    model, report = onnx_models.sklearn_function("iris", "features")
    return model, np.asarray(report["heldout"]["x"], dtype=np.float32)


def function_dir(root: Path, model: onnx.ModelProto, file: str = "iris.onnx", **kw: Any) -> Path:
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(src / file))
    init(src / file, root / "fn", **kw)
    return root / "fn"


def publish(directory: Path, keys: Keys, registry: Path) -> Path:
    result = build(directory, directory.parent / "dist")
    sign_module(result.wasm, keys.key)
    return Registry(registry).publish(result.wasm, keys.key)


def serve(registry: Path, keys: Keys, functions: list[dict[str, Any]]) -> Backend:
    config = {"registry": str(registry), "trustedKeys": [str(keys.public)], "functions": functions}
    return Backend(parse_config(config, "test"))


def features(rows: np.ndarray[Any, Any], binary_output: bool = False) -> bytes:
    body: dict[str, Any] = {
        "inputs": [
            {"name": "features", "datatype": "FP32", "shape": list(rows.shape),
             "data": rows.ravel().tolist()}
        ]
    }  # fmt: skip
    if binary_output:
        body["parameters"] = {"binary_data_output": True}
    return json.dumps(body).encode()


# ---------------------------------------------------------------------- init


def test_init_writes_the_graphs_signature(tmp_path: Path, iris: Any) -> None:
    directory = function_dir(tmp_path, iris[0])
    spec = tomllib.loads((directory / "function.toml").read_text())
    assert (spec["name"], spec["version"], spec["kind"], spec["model"]) == (
        "iris", "1", "onnx", "iris.onnx",
    )  # fmt: skip
    assert spec["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}]
    assert spec["outputs"] == [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]},
    ]
    assert (directory / "iris.onnx").read_bytes() == (tmp_path / "src/iris.onnx").read_bytes()
    with pytest.raises(BuildError, match="already exists"):
        init(tmp_path / "src/iris.onnx", directory)
    # a fixed shape stays fixed; --name and --version are taken; external data is copied too
    fixed = onnx_models.cnn_example(tmp_path / "cnn")
    fixed_dir = tmp_path / "fixed"
    made = init(tmp_path / "cnn/model.onnx", fixed_dir, name="digits-cnn", version="2")
    assert made.files == ["model.onnx", "model.onnx.data"]
    assert (fixed_dir / "model.onnx.data").is_file()
    spec = tomllib.loads((fixed_dir / "function.toml").read_text())
    assert (spec["name"], spec["version"]) == ("digits-cnn", "2")
    assert spec["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert fixed.name == "cnn-digits"


def _cyclic() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["b"], ["a"], name="first"),
        helper.make_node("Relu", ["a"], ["b"], name="second"),
    ]
    graph = helper.make_graph(
        nodes, "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 2])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_init_and_build_refuse_bad_files_naming_them(tmp_path: Path, iris: Any) -> None:
    good = iris[0].SerializeToString()
    cases = {
        "corrupt.onnx": (b"\x08\x07garbage" * 10, "not a valid ONNX model"),
        "truncated.onnx": (good[: len(good) // 3], "not a valid ONNX model"),
        "cyclic.onnx": (_cyclic().SerializeToString(), "cycle"),
    }
    for file, (data, message) in cases.items():
        (tmp_path / file).write_bytes(data)
        with pytest.raises(BuildError, match=message) as caught:
            init(tmp_path / file, tmp_path / f"fn-{file}")
        assert str(tmp_path / file) in str(caught.value)
        assert not (tmp_path / f"fn-{file}" / "function.toml").exists()
    onnx_models.cnn_example(tmp_path / "ext")
    (tmp_path / "ext/model.onnx.data").unlink()
    with pytest.raises(BuildError, match=r"model\.onnx\.data.*missing") as caught:
        init(tmp_path / "ext/model.onnx", tmp_path / "fn-ext")
    assert str(tmp_path / "ext/model.onnx") in str(caught.value)
    # a model that breaks after init: the build names the function's file, not its staging copy
    directory = function_dir(tmp_path / "later", iris[0])
    (directory / "iris.onnx").write_bytes(good[: len(good) // 2])
    with pytest.raises(BuildError, match="not a valid ONNX model") as caught:
        build(directory)
    assert str(directory / "iris.onnx") in str(caught.value)


def test_build_refuses_what_function_toml_gets_wrong(tmp_path: Path, iris: Any) -> None:
    directory = function_dir(tmp_path, iris[0])
    toml = directory / "function.toml"
    toml.write_text(toml.read_text().replace("shape = [-1, 4]", "shape = [-1, 5]"))
    with pytest.raises(BuildError, match=r"function.toml's inputs .* are not the model's"):
        build(directory)


def _wide() -> onnx.ModelProto:
    """x [N, 256] @ w [256, 4096]: 16 KiB of activations per row."""
    w = numpy_helper.from_array(np.ones((256, 4096), np.float32) / 256, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4096])], [w],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_model_larger_than_its_memory_is_refused_at_build(tmp_path: Path) -> None:
    directory = function_dir(tmp_path, _wide(), "wide.onnx", max_batch=512)
    toml = directory / "function.toml"
    text = toml.read_text()
    assert "memory_mib = 64" in text  # init bounds the need from below: the default here
    toml.write_text(text.replace("memory_mib = 64", "memory_mib = 8"))
    with pytest.raises(BuildError, match=r"needs (\d+) bytes \((\d+\.\d) MiB\).*batch 512") as e:
        build(directory)
    needed = int(str(e.value).split("needs ", 1)[1].split(" ", 1)[0])
    assert needed > 512 * (256 + 4096) * 4  # inputs and outputs of 512 rows at least
    assert str(directory) in str(e.value)
    toml.write_text(text.replace("memory_mib = 64", f"memory_mib = {-(-needed // 2**20)}"))
    built = build(directory).info()
    assert built["metadata"]["memory"]["peak_bytes"] == needed


# ---------------------------------------------------------------------- sign, publish, verify


def test_the_model_is_signed_published_and_checked(tmp_path: Path, keys: Keys, iris: Any) -> None:
    directory = function_dir(tmp_path, iris[0])
    result = build(directory, tmp_path / "dist")
    digest = signing.sha256_file(directory / "iris.onnx")
    sig = sign_module(result.wasm, keys.key)
    payload = json.loads(sig.read_text())["payload"]
    assert payload["kind"] == "onnx"
    assert payload["model"] == {
        "file": "iris.onnx", "sha256": digest, "files": {"iris.onnx": digest},
    }  # fmt: skip
    report = payload["build"]["report"]
    assert report["opset"]["ai.onnx"] >= 17 and report["parameters"] > 100
    assert report["module_bytes"] == result.wasm.stat().st_size
    assert report["memory"]["peak_bytes"] == payload["metadata"]["memory"]["peak_bytes"]
    assert {"MatMul", "Relu", "ai.onnx.ml.Scaler"} <= set(report["operators"])

    # tampered after signing: refused at publish, nothing installed
    registry = Registry(tmp_path / "reg")
    onnx_file = tmp_path / "dist/iris-1.model/iris.onnx"
    original = onnx_file.read_bytes()
    onnx_file.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(SignatureError, match=r"iris\.onnx: the model file does not match"):
        registry.publish(result.wasm, keys.key)
    onnx_file.unlink()
    with pytest.raises(SignatureError, match=r"iris\.onnx: missing"):
        registry.publish(result.wasm, keys.key)
    assert not (tmp_path / "reg/iris").exists()
    onnx_file.write_bytes(original)
    entry = registry.publish(result.wasm, keys.key)
    assert (entry / "model/iris.onnx").read_bytes() == original

    # tampered in the registry: refused at load (verification), as every artifact is
    trusted = signing.TrustedKeys([keys.key.public_key()])
    verified = registry.verify("iris", "1", trusted)
    assert verified.kind == "onnx" and verified.intact()
    stored = entry / "model/iris.onnx"
    stored.write_bytes(original + b"\0")
    assert not verified.intact()  # the backend re-verifies before it loads
    with pytest.raises(SignatureError, match="does not match its signature"):
        registry.verify("iris", "1", trusted)


def test_signing_refuses_a_model_changed_after_the_build(
    tmp_path: Path, keys: Keys, iris: Any
) -> None:
    directory = function_dir(tmp_path, iris[0])
    result = build(directory, tmp_path / "dist")
    (tmp_path / "dist/iris-1.model/iris.onnx").write_bytes(b"other")
    with pytest.raises(SignatureError, match="does not match its signature"):
        sign_module(result.wasm, keys.key)


# ---------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, keys: Keys, iris: Any) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("served")
    publish(function_dir(root, iris[0]), keys, root / "reg")
    yield root / "reg"
    shutil.rmtree(root, ignore_errors=True)


def test_served_answers_match_onnxruntime(registry: Path, keys: Keys, iris: Any) -> None:
    model, rows = iris
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want_label, want_probs = session.run(None, {"features": rows})

    async def main() -> None:
        backend = serve(registry, keys, [{"name": "iris"}])
        await backend.start()
        meta = backend.model_metadata("iris", None)
        assert meta["platform"] == "meshfn-wasm-onnx"
        reply = await backend.infer("iris", None, features(rows))
        assert reply.status == 200, reply.body
        out = {o["name"]: o for o in json.loads(reply.body)["outputs"]}
        assert out["label"]["data"] == want_label.tolist()
        assert out["probabilities"]["shape"] == [len(rows), 3]
        got = np.asarray(out["probabilities"]["data"], np.float32).reshape(-1, 3)
        np.testing.assert_allclose(got, want_probs, rtol=1e-5, atol=1e-6)
        # binary output: the module's bytes as they are
        binary = await backend.infer("iris", None, features(rows[:2], binary_output=True))
        length = int(dict(binary.headers)[b"Inference-Header-Content-Length"])
        head = json.loads(binary.body[:length])
        assert [o["parameters"]["binary_data_size"] for o in head["outputs"]] == [16, 24]
        labels = struct.unpack("<2q", binary.body[length : length + 16])
        assert list(labels) == want_label[:2].tolist()
        await backend.drain()

    asyncio.run(main())


def _binary(name: str, rows: np.ndarray[Any, Any]) -> tuple[bytes, dict[bytes, bytes]]:
    """A request in the binary tensor extension (large batches stay under the body limit)."""
    head = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(rows.shape),
                                   "parameters": {"binary_data_size": rows.nbytes}}]}).encode()  # fmt: skip
    return head + rows.tobytes(), {b"inference-header-content-length": str(len(head)).encode()}


def test_shape_errors_are_400s_before_the_guest_runs(tmp_path: Path, keys: Keys, iris: Any) -> None:
    publish(
        function_dir(tmp_path / "wide", _wide(), "wide.onnx", max_batch=4), keys, tmp_path / "reg"
    )
    publish(function_dir(tmp_path / "iris", iris[0]), keys, tmp_path / "reg")

    async def main() -> None:
        backend = serve(
            tmp_path / "reg",
            keys,
            [
                {"name": "iris"},
                {"name": "wide", "limits": {"memoryMiB": 13}},
                {"name": "wide-split", "artifact": "wide@1", "limits": {"memoryMiB": 13},
                 "batching": {"maxBatchSize": 4096, "oversize": "split"}},
            ],
        )  # fmt: skip
        await backend.start()
        wrong = json.dumps({"inputs": [{"name": "features", "datatype": "FP32",
                                        "shape": [1, 3], "data": [1, 2, 3]}]}).encode()  # fmt: skip
        reply = await backend.infer("iris", None, wrong)
        assert reply.status == 400 and "does not match [-1, 4]" in json.loads(reply.body)["error"]
        empty = await backend.infer("iris", None, features(np.zeros((0, 4), np.float32)))
        assert empty.status == 400 and "at least one row" in json.loads(empty.body)["error"]
        # 16 KiB of activations a row: 13 MiB hold a few hundred rows, and the host knows how many
        wide = backend.lookup("wide", None).tensors
        assert wide is not None and 500 < wide.max_rows < 800
        most = wide.max_rows
        many = await backend.infer(
            "wide", None, *_binary("x", np.ones((most + 1, 256), np.float32))
        )
        assert many.status == 400, many.body
        assert f"at most {most} per call" in json.loads(many.body)["error"]
        fits = await backend.infer("wide", None, *_binary("x", np.ones((most, 256), np.float32)))
        assert fits.status == 200, fits.body
        stats = backend.statistics("wide", None)[0]
        assert stats["execution_count"] == 1  # only the request that fitted reached the guest
        assert backend.statistics("iris", None)[0]["execution_count"] == 0
        await backend.drain()

    asyncio.run(main())


def _big_constant() -> onnx.ModelProto:
    """y = x + sum(ones(4096, 1024)): a 16 MiB constant-size tensor computed at run time."""
    shape = numpy_helper.from_array(np.array([4096, 1024], np.int64), "shape")
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [
            helper.make_node("ConstantOfShape", ["shape"], ["c"], value=one),
            helper.make_node("ReduceSum", ["c"], ["s"], keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"]),
        ],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_memory_limit_below_one_row_refuses_the_function(tmp_path: Path, keys: Keys) -> None:
    publish(
        function_dir(tmp_path, _big_constant(), "big.onnx", max_batch=4), keys, tmp_path / "reg"
    )

    async def main() -> None:
        functions = [
            {"name": "big", "limits": {"memoryMiB": 13}},
            {"name": "big-enough", "artifact": "big@1", "limits": {"memoryMiB": 17}},
        ]
        backend = serve(tmp_path / "reg", keys, functions)
        await backend.start()
        body = features(np.ones((1, 4), np.float32)).replace(b"features", b"x")
        reply = await backend.infer("big", None, body)
        message = json.loads(reply.body)["error"]
        assert reply.status == 403, message
        assert "of linear memory for one row" in message
        assert "limits.memoryMiB allows (13 MiB)" in message
        assert not backend.is_ready(backend.lookup("big", None))
        ok = await backend.infer("big-enough", None, body)
        assert ok.status == 200 and json.loads(ok.body)["outputs"][0]["data"] == [4194305.0] * 4
        await backend.drain()

    asyncio.run(main())


def test_batching_merges_rows_into_one_call_and_scales_to_zero(
    registry: Path, keys: Keys, iris: Any
) -> None:
    rows = iris[1][:6]

    async def main() -> None:
        backend = serve(
            registry, keys,
            [{"name": "iris", "idleTtl": "50ms", "codeTtl": "50ms",
              "batching": {"maxBatchSize": 8, "maxQueueDelay": "20ms"}}],
        )  # fmt: skip
        await backend.start()
        alone = [await backend.infer("iris", None, features(r[None])) for r in rows]
        replies = await asyncio.gather(
            *(backend.infer("iris", None, features(r[None])) for r in rows)
        )
        assert [r.body for r in replies] == [r.body for r in alone]  # batched = one by one
        stats = backend.statistics("iris", None)[0]
        sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
        assert max(sizes) > 1, sizes  # concurrent requests shared a guest call
        rt = backend.lookup("iris", None)
        assert rt.loaded and rt.cold_starts == 1
        deadline = asyncio.get_running_loop().time() + 10
        while rt.loaded and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert not rt.loaded  # scaled to zero
        again = await backend.infer("iris", None, features(rows[:1]))
        assert again.body == alone[0].body and rt.cold_starts == 2
        await backend.drain()

    asyncio.run(main())
