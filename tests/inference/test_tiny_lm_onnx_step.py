"""tiny-lm's step as meshfn's model compiler builds it from ONNX (step_onnx.py): the module has
the metadata the signed function expects of its step (GenerateSpec.step_metadata, what the
registry checks), runs through the backend's ABI v2 host at any batch, computes gru.step (the
step the trained weights were trained for), and a stream's row is the same bits whichever batch
it ran in (a seeded generation does not depend on load)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import wasmtime

from meshfn.compiler import compile_model
from meshfn.inference.engine import new_engine
from meshfn.inference.host import Outcome, TensorArtifact, TensorCall, TensorInstance
from meshfn.inference.manifest import load_manifest

EXAMPLE = Path(__file__).resolve().parents[2] / "functions" / "examples" / "tiny-lm"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tiny_lm_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_compiled_onnx_step_is_the_step_function() -> None:
    gru, step_onnx = _load("gru"), _load("step_onnx")
    generate = load_manifest(EXAMPLE).generate
    assert generate is not None and generate.vocab is not None and generate.state is not None
    rng = np.random.default_rng(3)
    params = gru.Params.init(generate.vocab, generate.state, rng)
    params.bh[:] = rng.standard_normal(params.bh.shape) * 0.1
    params.bo[:] = rng.standard_normal(params.bo.shape) * 0.1
    compiled = compile_model(step_onnx.step_graph(*params.arrays()))
    assert compiled.metadata == generate.step_metadata()  # what the registry checks
    engine = new_engine()
    instance = TensorArtifact(engine, wasmtime.Module(engine, compiled.wasm)).instantiate(64 << 20)
    assert isinstance(instance, TensorInstance)
    tokens = rng.integers(0, generate.vocab, 16).astype(np.int32)
    state = (rng.standard_normal((16, generate.state)) * 0.5).astype(np.float32)
    rows = None
    for batch in (16, 1, 5, 2):
        inputs = (tokens[:batch].tobytes(), state[:batch].tobytes())
        result = instance.call(TensorCall(batch, inputs, 2), 1000)
        assert result.outcome is Outcome.OK, result.body
        logits = np.frombuffer(result.outputs[0], np.float32).reshape(batch, generate.vocab)
        state_out = np.frombuffer(result.outputs[1], np.float32).reshape(batch, generate.state)
        want_logits, want_state = gru.step(params, tokens[:batch], state[:batch])
        np.testing.assert_allclose(state_out, want_state, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
        rows = logits if rows is None else rows
        assert (logits == rows[:batch]).all()  # alone or batched: the same bits
    past = (np.array([generate.vocab], np.int32).tobytes(), state[:1].tobytes())
    bad = instance.call(TensorCall(1, past, 2), 1000)
    assert bad.outcome is Outcome.BAD_REQUEST  # a token past the table: Gather refuses it
