"""Compiled models against what users would pick instead (bench/models.py): one run, the same
models, the same client.

  conformance  ONNX's own node conformance cases through compiled wasm
               (meshfn.compiler.conformance; every case whose operators the compiler claims):
               passed / attempted
  in-process   per model of meshfn.testing.onnx_models (`--models`): per call at batch 1 and
               32, the compiled module through wasmtime (the C-API call path a serving host
               uses, compiler.runner.FastRunner) against onnxruntime's InferenceSession.run
               (one intra-op thread, its fastest for small models here): median and p99 of
               `--calls` calls after a warm-up; and the cold start: load the precompiled module
               (.cwasm, as the backend keeps it) + instantiate + first call, against session
               creation + first run (default session options, as users create them; one
               thread recorded too). The worst model's ratio is the headline; max_abs_err is
               the largest difference from onnxruntime's outputs over every model and batch
  server       the iris example's model (scikit-learn's MLP, fitted once here) served by
               meshfn's backend (compiled from its skl2onnx export, one serving process) and by
               MLServer 1.7.1 with mlserver-sklearn (the same fitted estimator, joblib): both
               driven by tritonclient's HTTP client (JSON tensors, binary_data=False, as a REST
               user sends them) with the same load: `--concurrency` requests in flight (closed
               loop: gevent greenlets in `--client-processes` processes), `--seconds` per
               round, the servers alternating in `--rounds` rounds; requests/s, p50 and p99
               (medians over the rounds). Before the load both answer the held-out rows, and
               their labels must agree. `--python-guest` adds the hand-written Python iris
               (functions/testing/iris-py) on the same backend, for calibration.

MLServer runs in a virtual environment of its own, created on first use under the meshfn cache
(~/.cache/meshfn/bench/mlserver-1.7.1: pip install mlserver==1.7.1 mlserver-sklearn==1.7.1 and
meshfn's own scikit-learn version, so the pickle loads with the version that wrote it and
MLServer's pins never touch meshfn's environment). It is configured as its documentation
recommends for small, fast models: `parallel_workers: 0` (inference in the server process
itself: no pool of worker processes to hand requests to, its fastest for a model of a few
microseconds), one server process, debug off, the metrics server on a port of its own;
settings.json and model-settings.json are written into bench/results/models.json.

Prints one line:
  models: ops_conformance=P/A wasm_vs_ort_p50_ratio=… wasm_vs_ort_cold_ratio=… rps_vs_mlserver=… p99_vs_mlserver=… max_abs_err=…
and writes bench/results/models.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import wasmtime

from meshfn.compiler import compile_model, conformance
from meshfn.compiler.runner import FastRunner
from meshfn.inference.build import FUNCTIONS_DIR, build, cache_root
from meshfn.inference.engine import EpochTicker, new_engine
from meshfn.inference.examples import dev_key, publish_dir
from meshfn.inference.host import Outcome, TensorCall, load_precompiled
from meshfn.inference.onnxfn import init
from meshfn.inference.registry import Registry, sign_module
from meshfn.inference.signing import load_private_key
from meshfn.testing import load, onnx_models
from meshfn.testing.load import pct
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Processes, http_ok, wait_for

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = (
    "logreg-iris", "mlp-digits", "forest-cancer", "gboost-cancer", "svc-proba-iris", "knn-iris",
    "cnn-digits", "mlp-onnx", "decoder-block", "recurrent-lstm-gru",
)  # fmt: skip
MLSERVER = "1.7.1"
SERVED = "iris"


# ------------------------------------------------------------------------ in-process


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


def _cold(
    example: onnx_models.Example, wasm: bytes, metadata: Any, engine: wasmtime.Engine, samples: int
) -> dict[str, Any]:
    """The backend's cold start, its own code on its own engine: load the precompiled module
    (.cwasm) + instantiate + first call; against session creation + first run (medians, ms)."""
    first = example.x[:1]
    call = TensorCall(1, (np.ascontiguousarray(first).tobytes(),), len(metadata["outputs"]))
    colds = []
    with tempfile.TemporaryDirectory() as tmp:
        cwasm = Path(tmp) / "model.cwasm"
        cwasm.write_bytes(wasmtime.Module(engine, wasm).serialize())
        for _ in range(samples):
            t = time.perf_counter_ns()
            instance = load_precompiled(engine, "onnx", cwasm).instantiate(64 << 20)
            result = instance.call(call, 1000)
            colds.append(time.perf_counter_ns() - t)
            assert result.outcome is Outcome.OK, result
    ort_colds: dict[bool, list[int]] = {True: [], False: []}
    for _ in range(max(3, samples // 3)):
        for one in (False, True):
            t = time.perf_counter_ns()
            session = _session(example.model, one)
            session.run(None, {session.get_inputs()[0].name: first})
            ort_colds[one].append(time.perf_counter_ns() - t)
    return {
        "instance": instance,
        "session": session,
        # ort: default session options (what users create); ort_1thread: one intra-op thread
        "cold_ms": {
            "wasm": statistics.median(colds) / 1e6,
            "ort": statistics.median(ort_colds[False]) / 1e6,
            "ort_1thread": statistics.median(ort_colds[True]) / 1e6,
        },
    }


def measure(
    example: onnx_models.Example, engine: wasmtime.Engine, calls: int, cold_samples: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    compiled = compile_model(example.model)
    build_s = time.perf_counter() - t0
    cold = _cold(example, compiled.wasm, compiled.metadata, engine, cold_samples)
    host, session = cold["instance"], cold["session"]
    runner = FastRunner(compiled.wasm)  # its own engine: no epoch deadlines, as in a library
    name = session.get_inputs()[0].name
    out: dict[str, Any] = {
        "model": example.name,
        "operators": compiled.report["operators"],
        "parameters": compiled.report["parameters"],
        "module_bytes": compiled.report["module_bytes"],
        "build_s": round(build_s, 3),
        "cold_ms": cold["cold_ms"],
        "max_abs_err": 0.0,
    }
    for batch in (1, 32):
        x = _rows(example.x, batch) if compiled.metadata["batch"] == "dynamic" else example.x[:1]
        want = session.run(None, {name: x})
        got = runner([x])
        call = TensorCall(len(x), (x.tobytes(),), len(got))
        served = host.call(call, 1000)
        assert served.outputs == tuple(g.tobytes() for g in got), "host and runner disagree"
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            if np.asarray(w).dtype.kind == "f":
                out["max_abs_err"] = max(out["max_abs_err"], float(np.abs(g - w).max()))
            elif k in example.label_outputs and not np.array_equal(g, w):
                out["label_mismatch"] = True
        w50, w99 = _times(lambda x=x: runner([x]), calls)
        h50, h99 = _times(lambda call=call: host.call(call, 1000), calls)
        o50, o99 = _times(lambda x=x: session.run(None, {name: x}), calls)
        out[f"batch{batch}"] = {
            "wasm_p50_us": w50, "wasm_p99_us": w99, "host_p50_us": h50, "host_p99_us": h99,
            "ort_p50_us": o50, "ort_p99_us": o99,
        }  # fmt: skip
    return out


def in_process(names: list[str], calls: int, cold_samples: int) -> list[dict[str, Any]]:
    examples = {e.name: e for e in onnx_models.all_examples()}
    engine = new_engine()  # the backend's engine settings (epoch deadlines: its ticker runs)
    ticker = EpochTicker(engine).start()
    rows = []
    try:
        for name in names:
            rows.append(measure(examples[name], engine, calls, cold_samples))
            _show(rows[-1])
    finally:
        ticker.stop()
    return rows


def _show(r: dict[str, Any]) -> None:
    """One model's figures on stderr while the run goes on (stdout is the summary line)."""
    b1, b32, cold = r["batch1"], r["batch32"], r["cold_ms"]
    print(
        f"{r['model']:16} b1 wasm/host/ort p50 {b1['wasm_p50_us']:6.1f} / "
        f"{b1['host_p50_us']:6.1f} / {b1['ort_p50_us']:6.1f} us  b32 {b32['wasm_p50_us']:7.1f}"
        f" / {b32['host_p50_us']:7.1f} / {b32['ort_p50_us']:7.1f} us  cold {cold['wasm']:6.3f}"
        f" / {cold['ort']:6.2f} ms  err {r['max_abs_err']:.2g}",
        file=sys.stderr,
        flush=True,
    )


# ------------------------------------------------------------------------ servers


def mlserver_venv() -> Path:
    """MLServer's own virtual environment under the meshfn cache, made once (pip's cache keeps
    the next one quick): its pins never move meshfn's."""
    sklearn = importlib.metadata.version("scikit-learn")
    root = cache_root() / "bench" / f"mlserver-{MLSERVER}"
    stamp = root / "meshfn-installed.json"
    wanted = {"mlserver": MLSERVER, "mlserver-sklearn": MLSERVER, "scikit-learn": sklearn}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    pins = [f"{name}=={version}" for name, version in wanted.items()]
    subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", *pins],
        check=True,
        timeout=1800,
    )
    stamp.write_text(json.dumps(wanted))
    return root


def mlserver_settings(folder: Path, ports: tuple[int, int, int]) -> dict[str, Any]:
    port, grpc_port, metrics_port = ports
    return {
        "debug": False,
        "host": "127.0.0.1",
        "http_port": port,
        "grpc_port": grpc_port,
        "metrics_port": metrics_port,
        # inference in the server process: no worker pool (its fastest for small models)
        "parallel_workers": 0,
        # its scratch folders (by default under the working directory)
        "metrics_dir": str(folder / ".metrics"),
        "environments_dir": str(folder / ".envs"),
    }


MODEL_SETTINGS = {
    "name": SERVED,
    "implementation": "mlserver_sklearn.SKLearnModel",
    "parameters": {"uri": "./model.joblib", "version": "1"},
}


def start_mlserver(procs: Processes, tmp: Path, estimator: Any) -> tuple[int, dict[str, Any]]:
    import joblib

    venv = mlserver_venv()
    folder = tmp / "mlserver"
    (folder / SERVED).mkdir(parents=True)
    joblib.dump(estimator, folder / SERVED / "model.joblib")
    ports = free_ports(3)
    port = ports[0]
    settings = mlserver_settings(folder, (ports[0], ports[1], ports[2]))
    (folder / "settings.json").write_text(json.dumps(settings))
    (folder / SERVED / "model-settings.json").write_text(json.dumps(MODEL_SETTINGS))
    proc = procs.start("mlserver", [str(venv / "bin" / "mlserver"), "start", str(folder)])
    wait_for(
        "MLServer ready",
        lambda: http_ok(f"http://127.0.0.1:{port}/v2/models/{SERVED}/ready"),
        timeout=180,
        proc=proc,
    )
    return port, {"settings.json": settings, "model-settings.json": MODEL_SETTINGS}


def start_meshfn(procs: Processes, tmp: Path, model: Any, python_guest: bool) -> int:
    """The backend serving the compiled model as `iris` (built, signed and published here) and
    with --python-guest the hand-written Python iris as `iris-py`."""
    registry = tmp / "registry"
    functions: list[dict[str, Any]] = [{"name": SERVED, "limits": {"maxConcurrency": 256}}]
    private, public = dev_key()
    if python_guest:
        publish_dir(FUNCTIONS_DIR / "testing" / "iris-py", Registry(registry), private)
        functions.append({"name": "iris-py", "limits": {"maxConcurrency": 256}})
    source = tmp / "model"
    source.mkdir()
    (source / f"{SERVED}.onnx").write_bytes(model.SerializeToString())
    init(source / f"{SERVED}.onnx", tmp / "function")
    built = build(tmp / "function", tmp / "dist")
    key = load_private_key(private)
    sign_module(built.wasm, key)
    Registry(registry).publish(
        built.wasm, key, compile_cache=cache_root() / "functions" / "compiled"
    )
    config = tmp / "backend.json"
    config.write_text(
        json.dumps(
            {"registry": str(registry), "trustedKeys": [str(public)], "functions": functions}
        )
    )
    (port,) = free_ports(1)
    proc = procs.start(
        "backend",
        [sys.executable, "-P", "-m", "meshfn.inference", "serve", "--config", str(config),
         "--port", str(port)],
    )  # fmt: skip
    wait_for(
        "backend ready", lambda: http_ok(f"http://127.0.0.1:{port}/v2/health/ready"), proc=proc
    )
    return port


def _client_process(
    url: str, model: str, output: str | None, greenlets: int, warmup: float, seconds: float,
    out: Any,
) -> None:  # fmt: skip
    """One client process: `greenlets` closed loops of tritonclient.http infer calls."""
    import gevent
    import tritonclient.http as thttp

    client = thttp.InferenceServerClient(url, concurrency=greenlets, network_timeout=30)
    row = np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32)
    latencies: list[float] = []
    start = time.perf_counter()
    begin, end = start + warmup, start + warmup + seconds

    def loop() -> None:
        tensor = thttp.InferInput("features", [1, 4], "FP32")
        tensor.set_data_from_numpy(row, binary_data=False)
        outputs = [thttp.InferRequestedOutput(output, binary_data=False)] if output else None
        while True:
            t = time.perf_counter()
            if t >= end:
                return
            client.infer(model, [tensor], outputs=outputs)
            if t >= begin:
                latencies.append((time.perf_counter() - t) * 1e3)

    gevent.joinall([gevent.spawn(loop) for _ in range(greenlets)])
    client.close()
    out.put(latencies)


def drive(port: int, model: str, output: str | None, args: argparse.Namespace) -> dict[str, float]:
    """tritonclient's HTTP client at `--concurrency` in flight for `--seconds`: rps, p50, p99."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    per = max(1, args.concurrency // args.client_processes)
    workers = [
        ctx.Process(
            target=_client_process,
            args=(f"127.0.0.1:{port}", model, output, per, args.warmup, args.seconds, queue),
        )
        for _ in range(args.client_processes)
    ]
    for w in workers:
        w.start()
    latencies = [ms for _ in workers for ms in queue.get(timeout=args.warmup + args.seconds + 120)]
    for w in workers:
        w.join(30)
    return {
        "rps": len(latencies) / args.seconds,
        "p50_ms": pct(latencies, 0.50),
        "p99_ms": pct(latencies, 0.99),
        "requests": len(latencies),
    }


def agree(meshfn_port: int, mlserver_port: int, x: np.ndarray[Any, Any]) -> int:
    """Both servers label the held-out rows alike (the same model on both); returns the rows."""
    import tritonclient.http as thttp

    labels = []
    for port, output in ((meshfn_port, "label"), (mlserver_port, None)):
        client = thttp.InferenceServerClient(f"127.0.0.1:{port}")
        tensor = thttp.InferInput("features", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=False)
        result = client.infer(SERVED, [tensor])
        name = output or result.get_response()["outputs"][0]["name"]
        labels.append(result.as_numpy(name).astype(np.int64).ravel().tolist())
        client.close()
    assert labels[0] == labels[1], f"meshfn and MLServer disagree: {labels}"
    return len(x)


def start_both(
    procs: Processes, tmp: Path, python_guest: bool = False
) -> tuple[int, int, dict[str, Any], Any]:
    """The backend and MLServer serving one fitted iris: their ports, MLServer's configuration
    and the fitted model (bench/idle.py starts them too)."""
    fitted = onnx_models.fit_function_model(SERVED)
    model, _ = onnx_models.sklearn_function(SERVED, "features", fitted)
    meshfn_port = start_meshfn(procs, tmp, model, python_guest)
    mlserver_port, config = start_mlserver(procs, tmp, fitted.estimator)
    return meshfn_port, mlserver_port, config, fitted


def servers(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-models-"))
    procs = Processes(tmp)
    try:
        meshfn_port, mlserver_port, config, fitted = start_both(procs, tmp, args.python_guest)
        rows = agree(meshfn_port, mlserver_port, fitted.x_test)
        targets = {
            "meshfn": (meshfn_port, SERVED, "label"),
            "mlserver": (mlserver_port, SERVED, None),
        }
        if args.python_guest:
            targets["meshfn_python"] = (meshfn_port, "iris-py", "label")
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
        raw: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                rounds[name].append(drive(*targets[name], args))
                if args.wrk:  # context: a C client, as the calibration measured
                    port, served, _ = targets[name]
                    url = f"http://127.0.0.1:{port}/v2/models/{served}/infer"
                    done = load.wrk(url, load.IRIS, args.seconds, args.concurrency, tmp)
                    raw[name].append(
                        {"rps": done.rps, "p50_ms": done.p50_ms, "p99_ms": done.p99_ms}
                    )
        keys = ("rps", "p50_ms", "p99_ms")
        summary = {
            name: {k: statistics.median(m[k] for m in ms) for k in keys}
            for name, ms in rounds.items()
        }
        out = {"rounds": rounds, "median": summary, "mlserver": config, "agreed_rows": rows}
        if args.wrk:
            out["wrk"] = {
                name: {k: statistics.median(m[k] for m in ms) for k in keys}
                for name, ms in raw.items()
            }
        return out
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------ the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    names = None if args.conformance == "all" else args.conformance.split(",")
    summary = conformance.run(names)
    data: dict[str, Any] = {
        "conformance": {
            "passed": summary.passed, "attempted": summary.attempted, "total": summary.total,
        },
    }  # fmt: skip
    data["in_process"] = in_process(args.models, args.calls, args.cold_samples)
    data["server"] = servers(args)
    data["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    return data


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    rows, server = data["in_process"], data["server"]["median"]
    c = data["conformance"]
    b1 = [r["batch1"]["wasm_p50_us"] / r["batch1"]["ort_p50_us"] for r in rows]
    return {
        "ops_conformance": f"{c['passed']}/{c['attempted']}",
        "wasm_vs_ort_p50_ratio": max(b1),  # the worst model at batch 1
        "wasm_vs_ort_cold_ratio": max(r["cold_ms"]["wasm"] / r["cold_ms"]["ort"] for r in rows),
        "rps_vs_mlserver": server["meshfn"]["rps"] / server["mlserver"]["rps"],
        "p99_vs_mlserver": server["meshfn"]["p99_ms"] / server["mlserver"]["p99_ms"],
        "max_abs_err": max(r["max_abs_err"] for r in rows),
        # beside the headline (the JSON only)
        "wasm_vs_ort_p50_ratio_median": statistics.median(b1),
        # the backend's own call path (deadline, bytes in and out, its result object)
        "host_vs_ort_p50_ratio": max(
            r["batch1"]["host_p50_us"] / r["batch1"]["ort_p50_us"] for r in rows
        ),
        "host_vs_ort_p50_ratio_median": statistics.median(
            r["batch1"]["host_p50_us"] / r["batch1"]["ort_p50_us"] for r in rows
        ),
        "cold_vs_ort_1thread_ratio": max(
            r["cold_ms"]["wasm"] / r["cold_ms"]["ort_1thread"] for r in rows
        ),
        "meshfn_rps": server["meshfn"]["rps"],
        "mlserver_rps": server["mlserver"]["rps"],
        "meshfn_p99_ms": server["meshfn"]["p99_ms"],
        "mlserver_p99_ms": server["mlserver"]["p99_ms"],
        "wasm_vs_ort_p50_ratio_b32": max(
            r["batch32"]["wasm_p50_us"] / r["batch32"]["ort_p50_us"] for r in rows
        ),
        "label_mismatch": any(r.get("label_mismatch") for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=list(MODELS), help="in-process models")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per model and batch")
    parser.add_argument("--cold-samples", type=int, default=15)
    parser.add_argument("--conformance", default="all", help="'all' or comma-separated case names")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5, help="measured seconds per round")
    parser.add_argument("--warmup", type=float, default=1, help="unmeasured seconds first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per server")
    parser.add_argument(
        "--python-guest",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also serve the hand-written Python iris (calibration)",
    )
    parser.add_argument(
        "--wrk",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also drive each server with wrk (JSON only; the headline is tritonclient's)",
    )
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = parser.parse_args()
    data = run(args)
    data["summary"] = s = summarise(data)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (args.json or RESULTS / "models.json").write_text(json.dumps(data, indent=1))
    print(
        f"models: ops_conformance={s['ops_conformance']} "
        f"wasm_vs_ort_p50_ratio={s['wasm_vs_ort_p50_ratio']:.2f} "
        f"wasm_vs_ort_cold_ratio={s['wasm_vs_ort_cold_ratio']:.3f} "
        f"rps_vs_mlserver={s['rps_vs_mlserver']:.2f} p99_vs_mlserver={s['p99_vs_mlserver']:.2f} "
        f"max_abs_err={s['max_abs_err']:.2g}"
    )


if __name__ == "__main__":
    main()
