"""`fn keygen|build|sign|publish` and `serve` as a user runs them (`python -P -m meshfn.inference`,
which the control plane mounts as `meshfn fn ...`), including their error paths."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from meshfn.inference.build import FUNCTIONS_DIR
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Processes, wait_for

CLI = [sys.executable, "-P", "-m", "meshfn.inference"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, check=False)


def failed(result: subprocess.CompletedProcess[str], message: str) -> bool:
    output = result.stdout + result.stderr
    return result.returncode == 1 and message in output and "Traceback" not in output


def test_keygen_build_sign_publish_serve(tmp_path: Path) -> None:
    keys, out, registry = tmp_path / "keys", tmp_path / "out", tmp_path / "registry"
    assert run("fn", "keygen", "--out", str(keys)).returncode == 0
    assert failed(run("fn", "keygen", "--out", str(keys)), "already exists")
    key, pub = keys / "meshfn-signing.key", keys / "meshfn-signing.pub"

    built = run("fn", "build", str(FUNCTIONS_DIR / "testing/chaos-core"), "--out", str(out))
    assert built.returncode == 0, built.stderr
    wasm = out / "chaos-core-1.wasm"
    assert wasm.exists() and (out / "chaos-core-1.json").exists()
    assert failed(
        run("fn", "publish", str(wasm), "--registry", str(registry), "--key", str(key)),
        "not signed",
    )
    signed = run("fn", "sign", str(wasm), "--key", str(key))
    assert signed.returncode == 0, signed.stderr
    sig = json.loads((out / "chaos-core-1.sig.json").read_text())
    assert sig["kind"] == "module" and sig["payload"]["metadata"]["name"] == "chaos-core"

    other = tmp_path / "other"
    run("fn", "keygen", "--out", str(other))
    untrusted = run(
        "fn", "publish", str(wasm), "--registry", str(registry), "--key", str(key),
        "--trusted-key", str(other / "meshfn-signing.pub"),
    )  # fmt: skip
    assert failed(untrusted, "untrusted key")
    published = run("fn", "publish", str(wasm), "--registry", str(registry), "--key", str(key))
    assert published.returncode == 0, published.stderr
    assert (registry / "chaos-core/1/module.wasm").exists()

    (port,) = free_ports(1)
    procs = Processes(tmp_path)
    try:
        proc = procs.start(
            "serve",
            [
                *CLI,
                "serve",
                "--registry",
                str(registry),
                "--trusted-key",
                str(pub),
                "--port",
                str(port),
            ],
        )
        url = f"http://127.0.0.1:{port}"
        wait_for("ready", lambda: urllib.request.urlopen(url + "/v2/health/ready").status == 200)
        body = json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [2]}]}
        )
        with urllib.request.urlopen(url + "/v2/models/chaos-core/infer", body.encode()) as r:
            assert json.loads(r.read())["model_name"] == "chaos-core"
        proc.send(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        procs.stop_all()


def test_cli_errors_are_messages_not_tracebacks(tmp_path: Path) -> None:
    assert failed(run("fn", "build", str(tmp_path)), "no function.toml")
    assert failed(
        run("fn", "sign", str(tmp_path / "x.wasm"), "--key", str(tmp_path / "k")), "not a readable"
    )
    assert failed(run("serve", "--registry", str(tmp_path)), "no trusted keys")
    assert failed(run("serve"), "pass --registry DIR or --config FILE")
    bad = tmp_path / "bad.yaml"
    bad.write_text("registry: r\nfunctions: [{name: a, isolation: sometimes}]\n")
    assert failed(run("serve", "--config", str(bad)), "functions.0.isolation")
    keys = tmp_path / "keys"
    run("fn", "keygen", "--out", str(keys))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(
            "serve", "--registry", str(tmp_path), "--trusted-key", str(keys / "meshfn-signing.pub"),
            "--port", str(port),
        )  # fmt: skip
        assert failed(result, "cannot serve on 127.0.0.1")
    # unix sockets: one per serving process, never both gRPC ways, never over another file
    key = str(keys / "meshfn-signing.pub")
    two = tmp_path / "two.yaml"
    two.write_text(f"registry: {tmp_path}\ntrustedKeys: [{key}]\nprocesses: 2\n")
    sock = str(tmp_path / "a.sock")
    result = run("serve", "--config", str(two), "--unix-socket", sock)
    assert failed(result, "--unix-socket given 1 time(s) for 2 serving process(es)"), result
    result = run(
        "serve", "--registry", str(tmp_path), "--trusted-key", key, "--unix-socket", sock,
        "--grpc-port", "1", "--grpc-unix-socket", str(tmp_path / "g.sock"),
    )  # fmt: skip
    assert failed(result, "give --grpc-port or --grpc-unix-socket, not both"), result
    (tmp_path / "file").write_text("not a socket")
    result = run(
        "serve", "--registry", str(tmp_path), "--trusted-key", key,
        "--unix-socket", str(tmp_path / "file"),
    )  # fmt: skip
    assert failed(result, "exists and is not a socket"), result
    assert (tmp_path / "file").read_text() == "not a socket"


def test_onnx_model_init_build_sign_publish_serve(tmp_path: Path) -> None:
    """Bring your own model: a scikit-learn model exported with skl2onnx becomes a signed,
    served function in five commands, and tritonclient gets the model's own answers."""
    import numpy as np
    import onnxruntime as ort
    import tritonclient.http as thttp

    from meshfn.testing import onnx_models

    model, report = onnx_models.sklearn_function("cancer", "features")
    (tmp_path / "cancer.onnx").write_bytes(model.SerializeToString())
    keys, registry = tmp_path / "keys", tmp_path / "registry"
    assert run("fn", "keygen", "--out", str(keys)).returncode == 0
    key, pub = keys / "meshfn-signing.key", keys / "meshfn-signing.pub"
    made = run("fn", "init", str(tmp_path / "fn"), "--from-onnx", str(tmp_path / "cancer.onnx"))
    assert made.returncode == 0, made.stderr
    assert "inputs: features FP32 [-1, 30]" in made.stdout
    assert "ai.onnx.ml.TreeEnsembleClassifier" in made.stdout
    built = run("fn", "build", str(tmp_path / "fn"), "--out", str(tmp_path / "dist"))
    assert built.returncode == 0, built.stderr
    digest = hashlib.sha256(model.SerializeToString()).hexdigest()
    for shown in ("opset ai.onnx", "parameters", "peak linear memory", f"model sha256 {digest}"):
        assert shown in built.stdout, built.stdout
    wasm = tmp_path / "dist" / "cancer-1.wasm"
    assert run("fn", "sign", str(wasm), "--key", str(key)).returncode == 0
    published = run("fn", "publish", str(wasm), "--registry", str(registry), "--key", str(key))
    assert published.returncode == 0, published.stderr
    assert (registry / "cancer/1/model/cancer.onnx").read_bytes() == model.SerializeToString()

    (port,) = free_ports(1)
    procs = Processes(tmp_path)
    try:
        procs.start(
            "serve",
            [*CLI, "serve", "--registry", str(registry), "--trusted-key", str(pub),
             "--port", str(port)],
        )  # fmt: skip
        url = f"127.0.0.1:{port}"
        wait_for("ready", lambda: urllib.request.urlopen(f"http://{url}/v2/health/ready"))
        client = thttp.InferenceServerClient(url)
        assert client.get_model_metadata("cancer")["platform"] == "meshfn-wasm-onnx"
        x = np.asarray(report["heldout"]["x"], dtype=np.float32)
        tensor = thttp.InferInput("features", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("cancer", [tensor])
        session = ort.InferenceSession(model.SerializeToString())
        label, probabilities = session.run(None, {"features": x})
        assert result.as_numpy("label").tolist() == label.tolist()  # trees: identical labels
        rtol, atol = onnx_models.TOLERANCE["trees"]
        got = result.as_numpy("probabilities")
        np.testing.assert_allclose(got, probabilities, rtol=rtol, atol=atol)
    finally:
        procs.stop_all()


def test_init_refuses_a_file_that_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"\x0a\x03abc" * 20)
    result = run("fn", "init", str(tmp_path / "fn"), "--from-onnx", str(tmp_path / "model.onnx"))
    assert failed(result, f"{tmp_path / 'model.onnx'}: not an ONNX model (no graph")
    assert not (tmp_path / "fn" / "function.toml").exists()
    missing = run("fn", "init", str(tmp_path / "fn"), "--from-onnx", str(tmp_path / "no.onnx"))
    assert failed(missing, "no.onnx: cannot read the model")
