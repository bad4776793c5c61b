"""End to end: the inference backend as a process behind a real Envoy (static config; the
translator's routes belong to the control plane), standard KServe v2 requests."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from meshfn.inference.build import FUNCTIONS_DIR, build
from meshfn.inference.devtools import write_envoy_config
from meshfn.inference.examples import publish_examples
from meshfn.testing.envoy import argv as envoy_argv
from meshfn.testing.envoy import start as start_envoy
from meshfn.testing.ports import free_ports, retry_on_port_clash
from meshfn.testing.processes import Processes, wait_for

PY = sys.executable


@dataclass
class Reply:
    status: int
    body: Any


def call(url: str, body: Any = None, method: str | None = None, raw: bytes | None = None) -> Reply:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return Reply(r.status, json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        text = exc.read()
        return Reply(exc.code, json.loads(text) if text.startswith(b"{") else text)


def tensor(name: str, datatype: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


X = {"inputs": [tensor("x", "FP32", [1], [1.0])]}


def chaos(mode: str) -> dict[str, Any]:
    return {**X, "parameters": {"mode": mode}}


FUNCTIONS = [
    {"name": "iris", "version": "1", "pool": {"minIdle": 1}},
    {"name": "embedder"},
    {"name": "digits"},
    {"name": "cancer"},
    {"name": "digits-cnn"},
    {"name": "chaos", "limits": {"timeout": "500ms", "memoryMiB": 32, "maxConcurrency": 2}},
    {"name": "chaos-core", "limits": {"timeout": "300ms"}},
]


@dataclass
class Stack:
    backend: str
    envoy: str
    procs: Processes
    registry: Path
    key: Path


def start_backend(
    procs: Processes,
    tmp: Path,
    registry: Path,
    key: Path,
    functions: list[dict[str, Any]],
    name: str,
) -> tuple[Any, str]:
    (port,) = free_ports(1)
    config = tmp / f"{name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "registry": str(registry),
                "trustedKeys": [str(key)],
                "workers": 2,
                "functions": functions,
            }
        )
    )
    proc = procs.start(
        name,
        [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(config), "--port", str(port)],
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.popen is not None and proc.popen.poll() is not None:
            raise AssertionError(f"backend exited:\n{proc.output()}")
        return call(url + "/v2/health/ready").status == 200

    wait_for("backend ready", ready, timeout=60)
    return proc, url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("inference")
    procs = Processes(tmp)
    try:
        _, key = publish_examples(tmp / "registry", include_testing=True)
        _, backend = start_backend(procs, tmp, tmp / "registry", key, FUNCTIONS, "backend")

        def envoy_in_front() -> int:
            listener, admin = free_ports(2)
            config = write_envoy_config(
                tmp / "envoy.json", listener, admin, int(backend.rsplit(":", 1)[1])
            )
            envoy = start_envoy(procs, "envoy", envoy_argv(config), admin)
            assert envoy.popen is not None and envoy.popen.poll() is None
            return listener

        listener = retry_on_port_clash(envoy_in_front)
        yield Stack(backend, f"http://127.0.0.1:{listener}", procs, tmp / "registry", key)
    finally:
        procs.stop_all()


def test_kserve_v2_api_through_envoy(stack: Stack) -> None:
    e = stack.envoy
    assert call(e + "/v2/health/live").body == {"live": True}
    assert call(e + "/v2/health/ready").status == 200
    meta = call(e + "/v2/models/iris").body
    assert meta["name"] == "iris" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}]
    assert call(e + "/v2/models/iris/versions/1").body["platform"] == "meshfn-wasm-onnx"
    assert call(e + "/v2/models/embedder").body["platform"] == "meshfn-wasm-python"
    assert call(e + "/v2/models/digits/ready").body == {"name": "digits", "ready": True}
    reply = call(
        e + "/v2/models/embedder/versions/1/infer",
        {
            "id": "q-7",
            "inputs": [tensor("text", "BYTES", [2], ["hello mesh", "wasm model functions"])],
        },
    )
    assert reply.status == 200
    assert (reply.body["model_name"], reply.body["model_version"], reply.body["id"]) == (
        "embedder",
        "1",
        "q-7",
    )
    emb = {o["name"]: o for o in reply.body["outputs"]}
    assert emb["embedding"]["shape"] == [2, 32] and emb["tokens"]["data"] == [2, 3]
    first = emb["embedding"]["data"][:32]
    assert abs(sum(v * v for v in first) - 1) < 1e-3


@pytest.mark.parametrize(
    ("name", "input_name", "batch"),
    [
        ("iris", "features", 15),
        ("digits", "pixels", 60),
        ("cancer", "features", 40),
        ("digits-cnn", "pixels", 50),
    ],
)
def test_heldout_accuracy_through_envoy(
    stack: Stack, name: str, input_name: str, batch: int
) -> None:
    """The served model scores the build-time held-out rows exactly as the build reported (the
    build scores the compiled module itself), and as scikit-learn scored them where it made
    the model."""
    report = build(FUNCTIONS_DIR / "examples" / name).report
    xs, ys = report["heldout"]["x"], report["heldout"]["y"]
    correct = 0
    for i in range(0, len(xs), batch):
        rows = xs[i : i + batch]
        shape = [len(rows), *np.asarray(rows[0]).shape]
        reply = call(
            f"{stack.envoy}/v2/models/{name}/infer",
            {
                "inputs": [tensor(input_name, "FP32", shape, rows)],
                "outputs": [{"name": "label"}],
            },
        )
        assert reply.status == 200, reply.body
        (label,) = reply.body["outputs"]
        correct += sum(int(p == t) for p, t in zip(label["data"], ys[i : i + batch], strict=True))
    accuracy = correct / len(ys)
    assert round(accuracy, 4) == report["heldout_accuracy"]
    if "sklearn_heldout_accuracy" in report:
        assert accuracy == pytest.approx(report["sklearn_heldout_accuracy"], abs=0.01)
    assert accuracy > 0.9


BAD = [
    ("iris", b"{", 400, "not valid JSON"),
    ("iris", json.dumps({"inputs": [tensor("features", "INT32", [1, 4], [1, 2, 3, 4])]}).encode(), 400, "expected FP32"),
    ("iris", json.dumps({"inputs": [tensor("features", "FP32", [1, 3], [1, 2, 3])]}).encode(), 400, "does not match"),
    ("iris", json.dumps({"inputs": [tensor("features", "FP32", [1, 4], [1, 2, 3])]}).encode(), 400, "3 elements"),
    ("iris", json.dumps({"inputs": [tensor("petals", "FP32", [1, 4], [1, 2, 3, 4])]}).encode(), 400, "unknown input"),
    ("iris", json.dumps({"inputs": []}).encode(), 400, "non-empty"),
    ("nope", json.dumps(X).encode(), 404, "unknown model"),
    ("iris/versions/2", json.dumps(X).encode(), 404, "no version '2'"),
    ("chaos", json.dumps(chaos("reject")).encode(), 400, "rejected the input"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "body", "status", "message"), BAD)
def test_bad_requests_get_kserve_errors_through_envoy(
    stack: Stack, model: str, body: bytes, status: int, message: str
) -> None:
    reply = call(f"{stack.envoy}/v2/models/{model}/infer", raw=body)
    assert reply.status == status
    assert message in reply.body["error"]


def test_oversized_and_wrong_method(stack: Stack) -> None:
    big = json.dumps({"inputs": [tensor("text", "BYTES", [1], ["x" * (2 << 20)])]}).encode()
    reply = call(f"{stack.envoy}/v2/models/embedder/infer", raw=big)
    assert reply.status == 413 and "exceeds" in reply.body["error"]
    assert call(f"{stack.envoy}/v2/models/iris/infer", method="GET").status == 405
    assert call(f"{stack.backend}/v2/models/iris/infer", method="DELETE").status == 405


def in_flight(backend: str, function: str) -> bool:
    """The backend has a request of `function` running (its meshfn_fn_inflight gauge)."""
    metrics = urllib.request.urlopen(backend + "/metrics", timeout=5).read().decode()
    return f'meshfn_fn_inflight{{function="{function}"}} 1.0' in metrics


def test_runaway_is_interrupted_while_other_functions_serve(stack: Stack) -> None:
    results: dict[str, Reply] = {}
    spin_answered: list[float] = []

    def runaway() -> None:
        results["spin"] = call(f"{stack.envoy}/v2/models/chaos/infer", chaos("spin"))
        spin_answered.append(time.monotonic())

    thread = threading.Thread(target=runaway)
    started = time.monotonic()
    thread.start()
    wait_for("the runaway request at the backend", lambda: in_flight(stack.backend, "chaos@1"))
    iris_answered: list[float] = []
    body = {"inputs": [tensor("features", "FP32", [1, 4], [5.1, 3.5, 1.4, 0.2])]}
    # iris while chaos spins (until its 500 ms deadline; 5 s only stops a spin that never ends)
    while thread.is_alive() and time.monotonic() - started < 5:
        assert call(f"{stack.envoy}/v2/models/iris/infer", body).status == 200
        iris_answered.append(time.monotonic())
    thread.join()
    # iris kept answering while chaos spun: answers that came back before the spin's own
    # answer did (a backend blocked by the spin would answer iris only after it)
    during = [t for t in iris_answered if t < spin_answered[0]]
    assert len(during) >= 2, (len(during), len(iris_answered))
    assert results["spin"].status == 504
    assert results["spin"].body == {
        "error": "function chaos@1 exceeded its 500 ms deadline and was interrupted"
    }
    assert call(f"{stack.envoy}/v2/models/chaos/infer", X).status == 200  # fresh instance


def test_memory_hog_and_host_isolation(stack: Stack) -> None:
    hog = call(f"{stack.envoy}/v2/models/chaos/infer", chaos("hog"))
    assert hog.status == 500
    assert hog.body["error"].startswith("function chaos@1 exceeded its memory limit of 32 MiB")
    core = call(f"{stack.envoy}/v2/models/chaos-core/infer", chaos("hog"))
    assert core.status == 500 and "memory limit" in core.body["error"]
    env = call(f"{stack.envoy}/v2/models/chaos/infer", chaos("env"))
    assert json.loads(env.body["outputs"][0]["parameters"]["probe"]) == {"env": {}}
    fs = call(f"{stack.envoy}/v2/models/chaos/infer", chaos("fs"))
    assert (
        fs.status == 500 and "host capability that model functions do not have" in fs.body["error"]
    )
    metrics = urllib.request.urlopen(stack.backend + "/metrics", timeout=5).read().decode()
    assert (
        'meshfn_fn_instances_discarded_total{function="chaos@1",reason="out-of-memory"}' in metrics
    )
    assert call(f"{stack.envoy}/v2/models/iris/ready").status == 200


def test_tampered_function_refused_others_serve(stack: Stack, tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    for name in ("chaos-core", "digits", "cancer"):
        shutil.copytree(stack.registry / name, registry / name)
    cwasm = next((registry / "chaos-core/1/compiled").glob("*.cwasm"))
    data = bytearray(cwasm.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cwasm.write_bytes(bytes(data))
    # a compiled model's ONNX file is part of its artifact: changed after signing, refused
    model = registry / "cancer/1/model/model.onnx"
    model.write_bytes(model.read_bytes() + b"\0")
    procs = Processes(tmp_path)
    try:
        proc, url = start_backend(
            procs,
            tmp_path,
            registry,
            stack.key,
            [{"name": "chaos-core"}, {"name": "digits"}, {"name": "cancer"}],
            "tampered",
        )
        reply = call(url + "/v2/models/chaos-core/infer", X)
        assert reply.status == 403
        assert "refused" in reply.body["error"] and "digest mismatch" in reply.body["error"]
        features = {"inputs": [tensor("features", "FP32", [1, 30], [1.0] * 30)]}
        reply = call(url + "/v2/models/cancer/infer", features)
        assert (
            reply.status == 403
            and "model.onnx: the model file does not match" in reply.body["error"]
        )
        assert call(url + "/v2/models/chaos-core/ready").status == 503
        pixels = {"inputs": [tensor("pixels", "FP32", [1, 64], [0] * 64)]}
        assert call(url + "/v2/models/digits/infer", pixels).status == 200
        assert '"msg": "function refused"' in proc.output()
    finally:
        procs.stop_all()


def test_sigterm_drains_in_flight_requests_and_exits_zero(stack: Stack, tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    try:
        proc, url = start_backend(
            procs, tmp_path, stack.registry, stack.key,
            [{"name": "chaos-core", "limits": {"timeout": "800ms"}}], "drain",
        )  # fmt: skip
        results: dict[str, Reply] = {}
        thread = threading.Thread(
            target=lambda: results.setdefault(
                "r", call(url + "/v2/models/chaos-core/infer", chaos("spin"))
            )
        )
        thread.start()
        wait_for("the request in flight", lambda: in_flight(url, "chaos-core@1"))
        proc.send(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        thread.join(timeout=15)
        assert "r" in results, "the in-flight request got no answer before the backend exited"
        assert results["r"].status == 504  # the in-flight request got its answer
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url + "/v2/health/live", timeout=2)
    finally:
        procs.stop_all()
