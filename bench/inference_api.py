"""Benchmark of the inference API (bench/inference_api.py): dynamic batching and the three ways
KServe clients send tensors, against one backend process on loopback.

  batching   the same function (iris-py, the hand-written Python iris) served twice by one backend, without and
             with `batching` (maxBatchSize 32, maxQueueDelay 1 ms); wrk with 32 connections
             (closed loop), the two alternating in `--rounds` rounds: requests/s and p99, as
             the median of the per-round ratios (batched / unbatched)
  protocols  a 1x784-float request to digits28 (a compiled model, core ABI v2) sequentially on one connection,
             three ways: REST JSON (data and outputs as JSON numbers), REST with the binary
             tensor extension (binary inputs and outputs) and gRPC ModelInfer with
             raw_input_contents; interleaved blocks, median of the per-round p50s.
             `client`: with the reference clients, as a KServe/Triton user calls (tritonclient
             HTTP with binary_data=False, with its defaults, and tritonclient.grpc; their own
             encoding and decoding included): the headline `binary_vs_json_us` and
             `grpc_vs_rest_us`. `wire`: the same three requests pre-encoded, sent with a
             minimal HTTP/1.1 client and a raw gRPC stub (what the server and the transport
             cost, no client work): `wire_*`. Differences in microseconds; negative: cheaper.

Prints one line:
  inference_api: batch_rps_ratio=… batch_p99_ratio=… binary_vs_json_us=… grpc_vs_rest_us=…
and writes bench/results/inference_api.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.grpc import service_pb2 as pb

from meshfn.inference.devtools import RawHttp, get_json
from meshfn.inference.examples import publish_examples
from meshfn.testing import load
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Proc, Processes, http_ok, wait_for

RESULTS = Path(__file__).resolve().parent / "results"
PY = sys.executable
IRIS = load.IRIS
MODEL = "digits28"


def backend(procs: Processes, tmp: Path, registry: Path, key: Path) -> tuple[Proc, int, int]:
    wide = {"limits": {"maxConcurrency": 64}}
    config = {
        "registry": str(registry),
        "trustedKeys": [str(key)],
        "workers": 2,
        "functions": [
            {"name": "iris", "artifact": "iris-py@1", "pool": {"minIdle": 2}, **wide},
            {
                "name": "iris-batched",
                "artifact": "iris-py@1",
                "pool": {"minIdle": 2},
                "batching": {"maxBatchSize": 32, "maxQueueDelay": "1ms"},
                **wide,
            },
            {"name": MODEL, "pool": {"minIdle": 1}},
        ],
    }
    path = tmp / "backend.json"
    path.write_text(json.dumps(config))
    port, grpc_port = free_ports(2)
    proc = procs.start(
        "backend",
        [
            *(PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(path)),
            *("--port", str(port), "--grpc-port", str(grpc_port), "--log-level", "warning"),
        ],
    )
    url = f"http://127.0.0.1:{port}/v2/health/ready"
    wait_for(url, lambda: http_ok(url), 60, every=0.05, proc=proc)
    return proc, port, grpc_port


def pixels(seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).uniform(0, 16, (1, 784)).astype(np.float32)


def bodies() -> dict[str, Any]:
    """The 1x784 request three ways, pre-encoded."""
    raw = pixels().tobytes()
    tensor = {"name": "pixels", "datatype": "FP32", "shape": [1, 784]}
    as_json = json.dumps({"inputs": [{**tensor, "data": pixels().flatten().tolist()}]}).encode()
    header = json.dumps(
        {
            "inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    message = pb.ModelInferRequest(model_name=MODEL)
    message.inputs.add(name="pixels", datatype="FP32", shape=[1, 784])
    message.raw_input_contents.append(raw)
    return {
        "json": as_json,
        "binary": (header + raw, len(header)),
        "grpc": message.SerializeToString(),
    }


def _timed(call: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e6)
    return times


def interleaved(calls: dict[str, Any], n: int, rounds: int) -> dict[str, list[float]]:
    """Per round, the p50 (us) of `n` sequential calls of each kind, after a warm-up."""
    out: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        _timed(call, max(20, n // 10))
    for _ in range(rounds):
        for name, call in calls.items():
            out[name].append(statistics.median(_timed(call, n)))
    return out


def clients(port: int, grpc_port: int, n: int, rounds: int) -> dict[str, list[float]]:
    """The three protocols through tritonclient, as its users call it."""
    x = pixels()
    http = thttp.InferenceServerClient(f"127.0.0.1:{port}")
    stub = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    json_outputs = [
        thttp.InferRequestedOutput(o, binary_data=False) for o in ("label", "probabilities")
    ]

    def rest(binary: bool) -> Any:
        def call() -> Any:
            tensor = thttp.InferInput("pixels", [1, 784], "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            result = http.infer(MODEL, [tensor], outputs=None if binary else json_outputs)
            return result.as_numpy("label")

        return call

    def grpc_call() -> Any:
        tensor = tgrpc.InferInput("pixels", [1, 784], "FP32")
        tensor.set_data_from_numpy(x)
        return stub.infer(MODEL, [tensor]).as_numpy("label")

    calls = {"json": rest(False), "binary": rest(True), "grpc": grpc_call}
    answers = {name: call().tolist() for name, call in calls.items()}
    assert len({json.dumps(a) for a in answers.values()}) == 1, answers
    try:
        return interleaved(calls, n, rounds)
    finally:
        http.close()
        stub.close()


def wire(port: int, grpc_port: int, n: int, rounds: int) -> dict[str, list[float]]:
    """The three protocols pre-encoded: the server's and the transport's cost only."""
    encoded = bodies()
    path = f"/v2/models/{MODEL}/infer"
    http = RawHttp("127.0.0.1", port)
    json_raw = http.encode("POST", path, encoded["json"])
    body, header_length = encoded["binary"]
    binary_raw = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {header_length}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    def rest(raw: bytes) -> Any:
        def call() -> None:
            status, reply = http.send(raw)
            assert status == 200, reply

        return call

    calls = {
        "json": rest(json_raw),
        "binary": rest(binary_raw),
        "grpc": lambda: infer(encoded["grpc"], timeout=10),
    }
    # The three must agree before they are timed.
    expected = pb.ModelInferResponse.FromString(infer(encoded["grpc"], timeout=10))
    label = np.frombuffer(expected.raw_output_contents[0], np.int64).tolist()
    status, reply = http.send(json_raw)
    assert status == 200 and json.loads(reply)["outputs"][0]["data"] == label, reply
    try:
        return interleaved(calls, n, rounds)
    finally:
        http.close()
        channel.close()


def batching(
    port: int, seconds: float, rounds: int, tmp: Path
) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode, model in (("off", "iris"), ("on", "iris-batched")):
            url = f"http://127.0.0.1:{port}/v2/models/{model}/infer"
            result = load.wrk(url, IRIS, seconds, 32, tmp, threads=2)
            out[mode].append({"rps": result.rps, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms})
    return out


def batch_rows(port: int) -> dict[str, float]:
    """How full the batches were: rows per guest call of the batched function."""
    (stats,) = get_json(port, "/v2/models/iris-batched/stats")["model_stats"]
    calls = sum(b["compute_infer"]["count"] for b in stats["batch_stats"])
    return {
        "executions": stats["execution_count"],
        "inferences": stats["inference_count"],
        "mean_rows_per_call": stats["inference_count"] / max(1, calls),
        "max_rows_per_call": max((b["batch_size"] for b in stats["batch_stats"]), default=0),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-bench-api-"))
    procs = Processes(tmp)
    try:
        _, key = publish_examples(tmp / "registry", include_testing=True)
        _, port, grpc_port = backend(procs, tmp, tmp / "registry", key)
        data: dict[str, Any] = {
            "client_p50_us": clients(port, grpc_port, args.requests, args.rounds),
            "wire_p50_us": wire(port, grpc_port, args.requests, args.rounds),
            "batching": batching(port, args.seconds, args.rounds, tmp),
        }
        data["batch_rows"] = batch_rows(port)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return data


def summarise(data: dict[str, Any]) -> dict[str, float]:
    off, on = data["batching"]["off"], data["batching"]["on"]
    p50 = {name: statistics.median(values) for name, values in data["client_p50_us"].items()}
    wired = {name: statistics.median(values) for name, values in data["wire_p50_us"].items()}
    return {
        "batch_rps_ratio": statistics.median(
            b["rps"] / a["rps"] for a, b in zip(off, on, strict=True)
        ),
        "batch_p99_ratio": statistics.median(
            b["p99_ms"] / a["p99_ms"] for a, b in zip(off, on, strict=True)
        ),
        "binary_vs_json_us": p50["binary"] - p50["json"],
        "grpc_vs_rest_us": p50["grpc"] - p50["json"],
        "rps_off": statistics.median(a["rps"] for a in off),
        "rps_on": statistics.median(b["rps"] for b in on),
        "p99_off_ms": statistics.median(a["p99_ms"] for a in off),
        "p99_on_ms": statistics.median(b["p99_ms"] for b in on),
        "json_us": p50["json"],
        "binary_us": p50["binary"],
        "grpc_us": p50["grpc"],
        "wire_binary_vs_json_us": wired["binary"] - wired["json"],
        "wire_grpc_vs_rest_us": wired["grpc"] - wired["json"],
        "wire_json_us": wired["json"],
        "wire_binary_us": wired["binary"],
        "wire_grpc_us": wired["grpc"],
        "rows_per_call": data["batch_rows"]["mean_rows_per_call"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4, help="wrk seconds per round and mode")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument(
        "--requests", type=int, default=500, help="sequential per protocol and round"
    )
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = parser.parse_args()
    data = run(args)
    data["summary"] = summary = summarise(data)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (args.json or RESULTS / "inference_api.json").write_text(json.dumps(data, indent=1))
    decimals = {"batch_rps_ratio": 2, "batch_p99_ratio": 2, "rows_per_call": 1}
    print(
        "inference_api: " + " ".join(f"{k}={v:.{decimals.get(k, 0)}f}" for k, v in summary.items())
    )


if __name__ == "__main__":
    main()
