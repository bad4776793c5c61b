"""In-process benchmark of compiled models (bench/models_inproc.py): the ONNX compiler's wasm
through wasmtime against onnxruntime's InferenceSession.run, on the same models and rows.

Per model (meshfn.testing.onnx_models): per-call latency at batch 1 and 32 (median and p99 of
--calls calls after a warm-up; wasm through the C-API call path a serving host uses,
compiler.runner.FastRunner; onnxruntime with one intra-op thread, its fastest for small
models here), and the cold start: load + instantiate + first call of the precompiled module
(.cwasm, as the backend keeps it) vs session creation + first run (default session options, as
users create them; one thread also recorded). `measure(example)` is what
bench/models.py can call. Prints one summary line and writes bench/results/models_inproc.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import wasmtime

from meshfn.compiler import compile_model
from meshfn.compiler.runner import FastRunner
from meshfn.testing import onnx_models

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = (
    "logreg-iris", "mlp-digits", "forest-cancer", "gboost-cancer", "svc-proba-iris", "knn-iris",
    "cnn-digits", "mlp-onnx", "decoder-block",
)  # fmt: skip


def _session(model: Any, one_thread: bool = True) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if one_thread:
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _rows(x: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
    reps = -(-n // len(x))
    return np.ascontiguousarray(np.concatenate([x] * reps)[:n])


def _times(fn: Any, calls: int) -> tuple[float, float]:
    for _ in range(min(200, calls)):
        fn()
    samples = []
    for _ in range(calls):
        t = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t)
    samples.sort()
    return samples[len(samples) // 2] / 1000, samples[int(len(samples) * 0.99)] / 1000


def measure(
    example: onnx_models.Example, calls: int = 2000, cold_samples: int = 15
) -> dict[str, Any]:
    t0 = time.perf_counter()
    compiled = compile_model(example.model)
    build_s = time.perf_counter() - t0
    engine = wasmtime.Engine()
    with tempfile.TemporaryDirectory() as tmp:
        cwasm = Path(tmp) / "model.cwasm"
        cwasm.write_bytes(wasmtime.Module(engine, compiled.wasm).serialize())
        first = example.x[:1]
        colds = []
        for _ in range(cold_samples):
            t = time.perf_counter_ns()
            module = wasmtime.Module.deserialize_file(engine, str(cwasm))
            runner = FastRunner(module=module, engine=engine, metadata=compiled.metadata)
            runner([first])
            colds.append(time.perf_counter_ns() - t)
    ort_colds: dict[bool, list[int]] = {True: [], False: []}
    for _ in range(max(3, cold_samples // 3)):
        for one in (False, True):
            t = time.perf_counter_ns()
            session = _session(example.model, one)
            name = session.get_inputs()[0].name
            session.run(None, {name: first})
            ort_colds[one].append(time.perf_counter_ns() - t)
    out: dict[str, Any] = {
        "model": example.name,
        "operators": compiled.report["operators"],
        "parameters": compiled.report["parameters"],
        "module_bytes": compiled.report["module_bytes"],
        "build_s": round(build_s, 3),
        # ort: default session options (what users create); ort_1thread: one intra-op thread
        "cold_ms": {
            "wasm": statistics.median(colds) / 1e6,
            "ort": statistics.median(ort_colds[False]) / 1e6,
            "ort_1thread": statistics.median(ort_colds[True]) / 1e6,
        },
    }
    for batch in (1, 32):
        x = _rows(example.x, batch) if compiled.metadata["batch"] == "dynamic" else example.x[:1]
        want = session.run(None, {name: x})
        got = runner([x])
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            if np.asarray(w).dtype.kind == "f":
                out.setdefault("max_abs_err", 0.0)
                out["max_abs_err"] = max(out["max_abs_err"], float(np.abs(g - w).max()))
            elif k in example.label_outputs and not np.array_equal(g, w):
                out["label_mismatch"] = True
        w50, w99 = _times(lambda x=x: runner([x]), calls)
        o50, o99 = _times(lambda x=x: session.run(None, {name: x}), calls)
        out[f"batch{batch}"] = {
            "wasm_p50_us": w50,
            "wasm_p99_us": w99,
            "ort_p50_us": o50,
            "ort_p99_us": o99,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    examples = {e.name: e for e in onnx_models.all_examples()}
    rows = []
    print(
        f"{'model':16} {'b1 wasm/ort p50 us':>22} {'b32 wasm/ort p50 us':>22} {'cold wasm/ort ms':>20}  max_abs_err"
    )
    for name in args.models:
        r = measure(examples[name], args.calls)
        rows.append(r)
        b1, b32, cold = r["batch1"], r["batch32"], r["cold_ms"]
        print(
            f"{name:16} {b1['wasm_p50_us']:9.1f} / {b1['ort_p50_us']:8.1f}   {b32['wasm_p50_us']:9.1f} / "
            f"{b32['ort_p50_us']:8.1f}   {cold['wasm']:8.3f} / {cold['ort']:8.2f}   {r.get('max_abs_err', 0):.2g}",
            flush=True,
        )
    p50_ratio = max(r["batch1"]["wasm_p50_us"] / r["batch1"]["ort_p50_us"] for r in rows)
    p50_ratio32 = max(r["batch32"]["wasm_p50_us"] / r["batch32"]["ort_p50_us"] for r in rows)
    cold_ratio = max(r["cold_ms"]["wasm"] / r["cold_ms"]["ort"] for r in rows)
    err = max(r.get("max_abs_err", 0.0) for r in rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "models_inproc.json").write_text(json.dumps(rows, indent=2))
    print(
        f"models_inproc: wasm_vs_ort_p50_ratio={p50_ratio:.2f} (worst model, batch 1; batch 32: "
        f"{p50_ratio32:.2f}) wasm_vs_ort_cold_ratio={cold_ratio:.3f} max_abs_err={err:.2g}"
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
