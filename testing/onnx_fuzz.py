"""Fuzzing the model compiler's loader with mutated ONNX files: byte flips, truncations,
spliced and zeroed chunks of valid models, plus structural mutants (cycles, dangling inputs,
huge dimensions, missing external data).

`run(paths)` loads, checks and (when it loads) builds each file in a child process (`python -m meshfn.testing.onnx_fuzz
DIR`) so that a crash in a C++ extension (protobuf, the ONNX checker) is a finding rather than
the end of the test run; each file gets a time limit (a hang is a finding) and must end in a
success or a CompileError naming the file."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PER_FILE_S = 10


def seeds() -> dict[str, bytes]:
    """Small valid models that cover the loader's paths (initializers, attributes, ml ops)."""
    from meshfn.testing import onnx_models

    out = {
        "mlp": onnx_models.mlp_example().model.SerializeToString(),
        "tree": next(
            e for e in onnx_models.sklearn_examples() if e.name == "tree-iris"
        ).model.SerializeToString(),
        "cnn": onnx_models.cnn_example().model.SerializeToString(),
    }
    return out


def structural(directory: Path) -> Iterator[Path]:
    """Hand-made bad models: a cycle, a dangling input, a huge dimension, missing data."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graphs = {
        "cycle": [
            helper.make_node("Add", ["x", "b"], ["a"]),
            helper.make_node("Relu", ["a"], ["b"]),
            helper.make_node("Relu", ["a"], ["y"]),
        ],
        "dangling": [helper.make_node("Add", ["x", "nowhere"], ["y"])],
        "huge": [
            helper.make_node("ConstantOfShape", ["shape"], ["big"]),
            helper.make_node("Add", ["x", "big"], ["y"]),
        ],
    }
    for name, nodes in graphs.items():
        inits = (
            [numpy_helper.from_array(np.array([1 << 20, 4], np.int64), "shape")]
            if name == "huge"
            else []
        )
        out = (
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1 << 20, 4])
            if name == "huge"
            else y
        )
        xin = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]) if name == "huge" else x
        model = helper.make_model(
            helper.make_graph(nodes, name, [xin], [out], inits),
            opset_imports=[helper.make_opsetid("", 17)],
        )
        path = directory / f"structural-{name}.onnx"
        path.write_bytes(model.SerializeToString())
        yield path
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    model = helper.make_model(
        helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "ext", [x], [y], [w]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    path = directory / "structural-missing-data.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, location="gone.data", size_threshold=0
    )
    (directory / "gone.data").unlink()
    yield path


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:  # flip a few bytes
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:  # truncate
        del b[rng.randrange(1, len(b)) :]
    elif kind == 2:  # zero a chunk
        start = rng.randrange(len(b))
        b[start : start + rng.randint(1, 64)] = bytes(min(64, len(b) - start))
    elif kind == 3:  # duplicate a chunk somewhere else
        start = rng.randrange(len(b))
        chunk = b[start : start + rng.randint(1, 128)]
        at = rng.randrange(len(b))
        b[at:at] = chunk
    else:  # a varint made huge (lengths, dims, indices)
        at = rng.randrange(len(b))
        b[at:at] = b"\xff\xff\xff\xff\x0f"
    return bytes(b)


def _attribute(g: onnx.GraphProto, rng: random.Random) -> None:
    """An integer attribute gets another value."""
    node = rng.choice(list(g.node))
    ints = [
        a for a in node.attribute if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS)
    ]
    if not ints:
        return
    attr = rng.choice(ints)
    if attr.type == onnx.AttributeProto.INT:
        attr.i = rng.randint(-3, 10)
    elif attr.ints:
        attr.ints[rng.randrange(len(attr.ints))] = rng.randint(-3, 10)


def _dimension(g: onnx.GraphProto, rng: random.Random) -> None:
    """An input or output dimension changes."""
    dims = rng.choice([*g.input, *g.output]).type.tensor_type.shape.dim
    if dims:
        dims[rng.randrange(len(dims))].dim_value = rng.randint(0, 20)


def _operators(g: onnx.GraphProto, rng: random.Random) -> None:
    """Two nodes swap operators."""
    if len(g.node) > 1:
        i, j = rng.sample(range(len(g.node)), 2)
        g.node[i].op_type, g.node[j].op_type = g.node[j].op_type, g.node[i].op_type


def _edge(g: onnx.GraphProto, rng: random.Random) -> None:
    """An edge is rewired to another tensor."""
    node = rng.choice(list(g.node))
    names = [n for other in g.node for n in other.output] + [i.name for i in g.input]
    if node.input:
        node.input[rng.randrange(len(node.input))] = rng.choice(names)


def _initializer(g: onnx.GraphProto, rng: random.Random) -> None:
    """An initializer's dims stop matching its data."""
    if g.initializer:
        init = rng.choice(list(g.initializer))
        if init.dims:
            init.dims[rng.randrange(len(init.dims))] = rng.randint(0, 40)


def _drop(g: onnx.GraphProto, rng: random.Random) -> None:
    """A node disappears."""
    del g.node[rng.randrange(len(g.node))]


MODEL_MUTATIONS = (_attribute, _dimension, _operators, _edge, _initializer, _drop)


def mutate_model(data: bytes, rng: random.Random) -> bytes:
    """A well-formed protobuf with a wrong model inside, so the mutant gets past parsing into
    checking, lowering and code generation."""
    model = onnx.ModelProto()
    model.ParseFromString(data)
    for _ in range(rng.randint(1, 3)):
        if model.graph.node:
            rng.choice(MODEL_MUTATIONS)(model.graph, rng)
    return model.SerializeToString()


def write_corpus(directory: Path, count: int, seed: int = 0) -> list[Path]:
    """Structural cases, then `count` mutants: half byte-level, half model-level."""
    rng = random.Random(seed)
    base = seeds()
    paths = list(structural(directory))
    names = sorted(base)
    for i in range(count):
        name = names[i % len(names)]
        path = directory / f"mutant-{i:04d}-{name}.onnx"
        data = mutate(base[name], rng) if i % 2 else mutate_model(base[name], rng)
        path.write_bytes(data)
        paths.append(path)
    return paths


def _alarm(_signum: int, _frame: Any) -> None:
    raise TimeoutError


def check_one(path: Path) -> dict[str, Any]:
    from meshfn.compiler import CompileError, Options, ToolchainError, analyze, compile_model

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(PER_FILE_S)
    try:
        options = Options(memory_cap_bytes=8 << 20)
        analyze(path, options)
        compiled = compile_model(path, options)  # what loads is built too
        wrong = _differential(path, compiled)
        if wrong:
            return {"file": str(path), "result": "wrong", "message": wrong}
        return {"file": str(path), "result": "ok"}
    except ToolchainError as exc:  # clang refusing accepted C is a compiler bug, not a refusal
        return {"file": str(path), "result": "crash", "message": str(exc)[:500]}
    except CompileError as exc:
        named = str(path) in str(exc)
        return {"file": str(path), "result": "refused", "named": named, "message": str(exc)[:300]}
    except TimeoutError:
        return {"file": str(path), "result": "hang"}
    except Exception as exc:
        return {
            "file": str(path),
            "result": "crash",
            "message": f"{type(exc).__name__}: {exc}"[:500],
        }
    finally:
        signal.alarm(0)


def _differential(path: Path, compiled: Any) -> str | None:
    """Run a mutant that compiled on random rows here and in onnxruntime (when it accepts the
    model too): a disagreement is a wrong answer, the one thing the compiler must never give."""
    import onnxruntime as ort

    from meshfn.compiler.runner import Runner

    rng = np.random.default_rng(0)
    feeds = {}
    for spec in compiled.metadata["inputs"]:
        shape = [2 if d == -1 else d for d in spec["shape"]]
        kind = spec["datatype"]
        if kind.startswith("FP"):
            value = rng.normal(size=shape).astype(np.float32 if kind == "FP32" else np.float64)
        elif kind == "BOOL":
            value = rng.integers(0, 2, size=shape).astype(bool)
        else:
            value = rng.integers(0, 3, size=shape).astype(kind.lower())
        feeds[spec["name"]] = value
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 4
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        want = session.run([o["name"] for o in compiled.metadata["outputs"]], feeds)
    except Exception:
        return None
    try:
        got = Runner(compiled.wasm)([feeds[s["name"]] for s in compiled.metadata["inputs"]])
    except Exception as exc:
        return f"wasm failed where onnxruntime answered: {exc}"[:300]
    for k, (g, w0) in enumerate(zip(got, want, strict=True)):
        w = np.asarray(w0)
        if g.shape != w.shape:
            return f"output {k}: shape {g.shape}, onnxruntime {w.shape}"
        if w.dtype.kind == "f":
            if not np.allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True):
                return f"output {k}: max abs difference {np.nanmax(np.abs(g - w))}"
        elif not np.array_equal(g, w):
            return f"output {k}: {int((g != w).sum())} elements differ"
    return None


def run(paths: list[Path], timeout_s: float = 600) -> list[dict[str, Any]]:
    """Check `paths` in child processes; a child that dies is restarted after the file it was
    on (recorded as a crash)."""
    results: list[dict[str, Any]] = []
    todo = [str(p) for p in paths]
    while todo:
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "meshfn.testing.onnx_fuzz", *todo],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        results.extend(done)
        todo = todo[len(done) :]
        if todo and proc.returncode != 0:
            results.append(
                {
                    "file": todo[0],
                    "result": "crash",
                    "message": f"exit {proc.returncode}: {proc.stderr[-500:]}",
                }
            )
            todo = todo[1:]
        elif todo:
            break
    return results


def main() -> None:
    import warnings

    warnings.simplefilter("ignore")
    for arg in sys.argv[1:]:
        print(json.dumps(check_one(Path(arg))), flush=True)


if __name__ == "__main__":
    main()
