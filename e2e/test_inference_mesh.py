"""The inference API through the mesh (`meshfn up` on policies/examples): the reference clients
reach the backend through the gateway, mTLS and the backend's sidecar, with JWT, RBAC and the
audit trail exactly as for any REST call; gRPC goes over HTTP/2 to the endpoint's grpcPort.
Denials are gRPC statuses for gRPC clients; Triton's load/unload only for the named caller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from meshfn_e2e import Processes, http, remap_examples
from tritonclient.utils import InferenceServerException

from meshfn.testing.processes import MESHFN, Proc, meshfn, wait_for

FLOWERS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)


@dataclass
class Mesh:
    up: Proc
    gateway: str  # host:port of the edge listener
    state: Path

    def token(self, sub: str, tenant: str = "acme") -> str:
        out = meshfn(
            "token", "issue", "--state-dir", str(self.state), "--sub", sub, "--aud", "meshfn",
            "--claim", f"tenant={tenant}",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def auth(self, sub: str = "alice") -> dict[str, str]:
        # a fresh dict each call: tritonclient adds its own headers to the one it is given
        return {"authorization": f"Bearer {self.token(sub)}"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("mesh")
    procs = Processes(tmp)
    mapping = remap_examples(tmp / "examples")
    state = tmp / "state"
    try:
        up = procs.start(
            "up",
            [MESHFN, "up", "--policies", str(tmp / "examples"), "--state-dir", str(state),
             "--functions-registry", str(tmp / "functions"), "--publish-examples",
             "--envoy-concurrency", "1"],
        )  # fmt: skip
        wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
        yield Mesh(up, f"127.0.0.1:{mapping[10000]}", state)
    finally:
        procs.stop_all()


def test_tritonclient_http_through_the_gateway(mesh: Mesh) -> None:
    client = thttp.InferenceServerClient(mesh.gateway)
    assert client.is_server_live() and client.is_server_ready()  # health needs no token
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    for binary in (True, False):
        tensor = thttp.InferInput("features", [2, 4], "FP32")
        tensor.set_data_from_numpy(FLOWERS, binary_data=binary)
        outputs = None if binary else [thttp.InferRequestedOutput("label", binary_data=False)]
        result = client.infer("iris", [tensor], outputs=outputs, headers=mesh.auth())
        assert result.as_numpy("label").tolist() == [0, 2]
    with pytest.raises(InferenceServerException) as info:
        client.infer("iris", [tensor])  # no token: the sidecar's RBAC
    assert info.value.status() == "403"
    models = http(f"http://{mesh.gateway}/v2/models", headers=mesh.auth()).json()
    assert models == {"models": ["cancer", "digits", "digits-cnn", "embedder", "iris", "tiny-lm"]}
    assert http(f"http://{mesh.gateway}/v2/models").status == 403  # a tenant lists models
    index = client.get_model_repository_index(headers=mesh.auth())
    assert {m["name"]: m["state"] for m in index} == {
        "cancer": "READY", "digits": "READY", "digits-cnn": "READY", "embedder": "READY",
        "iris": "READY", "tiny-lm": "READY",
    }  # fmt: skip
    stats = client.get_inference_statistics("iris", headers=mesh.auth())["model_stats"]
    assert stats[0]["inference_count"] >= 4
    config = client.get_model_config("iris", headers=mesh.auth())  # what perf_analyzer reads
    assert config["name"] == "iris" and config["input"][0]["data_type"] == "TYPE_FP32"
    grpc_config = tgrpc.InferenceServerClient(mesh.gateway).get_model_config(
        "iris", headers=mesh.auth()
    )
    assert grpc_config.config.name == "iris"


def test_tritonclient_grpc_through_the_gateway(mesh: Mesh) -> None:
    client = tgrpc.InferenceServerClient(mesh.gateway)
    assert client.is_server_live() and client.is_server_ready()
    tensor = tgrpc.InferInput("features", [2, 4], "FP32")
    tensor.set_data_from_numpy(FLOWERS)
    result = client.infer("iris", [tensor], headers=mesh.auth(), request_id="m1")
    assert result.as_numpy("label").tolist() == [0, 2] and result.get_response().id == "m1"
    meta = client.get_model_metadata("digits", headers=mesh.auth(), as_json=True)
    assert meta["inputs"][0]["shape"] == ["-1", "64"] and meta["platform"] == "meshfn-wasm-onnx"
    # the compiled CNN and gradient-boosted trees through the mesh: raw tensors both ways
    images = np.zeros((3, 1, 8, 8), np.float32)
    images[:, 0, 1:7, 3:5] = 1.0  # a vertical bar: the same answer for the three rows
    pixels = tgrpc.InferInput("pixels", [3, 1, 8, 8], "FP32")
    pixels.set_data_from_numpy(images)
    cnn = client.infer("digits-cnn", [pixels], headers=mesh.auth())
    assert cnn.as_numpy("probabilities").shape == (3, 10)
    assert len(set(cnn.as_numpy("label").tolist())) == 1
    np.testing.assert_allclose(cnn.as_numpy("probabilities").sum(axis=1), 1, rtol=1e-5)
    cells = tgrpc.InferInput("features", [1, 30], "FP32")
    cells.set_data_from_numpy(np.full((1, 30), 0.5, np.float32))
    assert client.infer("cancer", [cells], headers=mesh.auth()).as_numpy("label").shape == (1,)
    text = tgrpc.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello mesh"], dtype=np.object_))
    assert client.infer("embedder", [text], headers=mesh.auth()).as_numpy("tokens").tolist() == [2]
    denials = [
        (None, "StatusCode.PERMISSION_DENIED"),  # no token: the tenant rule
        ({"authorization": "Bearer x.y.z"}, "StatusCode.UNAUTHENTICATED"),  # jwt_authn
        (
            {"authorization": f"Bearer {mesh.token('bob', tenant='evil')}"},
            "StatusCode.PERMISSION_DENIED",
        ),
    ]
    for headers, code in denials:
        with pytest.raises(InferenceServerException) as info:
            client.infer("iris", [tensor], headers=headers)
        assert info.value.status() == code, info.value


def test_a_grpc_stream_through_the_gateway_outlives_a_call_timeout(mesh: Mesh) -> None:
    """tritonclient's stream through the gateway and the sidecar: answered per request, and
    open longer than the gRPC route's timeout (Envoy starts it once the request stream ends),
    with the same authentication as a call."""
    import queue

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tgrpc.InferenceServerClient(mesh.gateway)
    client.start_stream(lambda result, error: answers.put((result, error)), headers=mesh.auth())
    tensor = tgrpc.InferInput("features", [2, 4], "FP32")
    tensor.set_data_from_numpy(FLOWERS)
    labels = []
    try:
        for i in range(3):  # 3 x 1.5 s: past the unary gRPC route's timeout
            client.async_stream_infer("iris", [tensor], request_id=f"t{i}")
            result, error = answers.get(timeout=20)
            assert error is None, error
            labels.append((result.get_response().id, result.as_numpy("label").tolist()))
            time.sleep(1.5)
    finally:
        client.stop_stream()
    assert labels == [(f"t{i}", [0, 2]) for i in range(3)]
    client.start_stream(lambda result, error: answers.put((result, error)))  # no token
    try:
        # the denial may come first: the stream is then over, its error in the callback
        with contextlib.suppress(InferenceServerException):
            client.async_stream_infer("iris", [tensor])
        result, error = answers.get(timeout=20)
    finally:
        client.stop_stream()
        client.close()
    assert result is None and "PERMISSION_DENIED" in str(error), error


def test_repository_load_unload_only_for_the_named_caller(mesh: Mesh) -> None:
    """iris names https://issuer.meshfn.local/ops; anybody else is refused by the sidecar, and
    over gRPC everybody is (the model name is inside the message)."""
    client = thttp.InferenceServerClient(mesh.gateway)
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("iris", headers=mesh.auth("alice"))
    assert info.value.status() == "403"
    with pytest.raises(InferenceServerException) as info:
        tgrpc.InferenceServerClient(mesh.gateway).unload_model("iris", headers=mesh.auth("ops"))
    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("digits", headers=mesh.auth("ops"))  # digits names nobody
    assert info.value.status() == "403"
    # The service has two endpoints (one backend each): unload reaches one of them, so the
    # gateway's readiness may still say ready; load puts it back.
    client.unload_model("iris", headers=mesh.auth("ops"))
    client.load_model("iris", headers=mesh.auth("ops"))
    for _ in range(4):  # whichever endpoint answers, iris serves
        assert client.is_model_ready("iris", headers=mesh.auth())


def test_status_shows_each_functions_warm_up(mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """`meshfn status` asks every backend for its functions: digits predicts (its Function sets
    warmup.mode predictive), the others are reactive or off."""
    client = thttp.InferenceServerClient(mesh.gateway)
    pixels = thttp.InferInput("pixels", [1, 64], "FP32")
    pixels.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
    client.infer("digits", [pixels], headers=mesh.auth())
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    out = meshfn("status", "--state-dir", str(mesh.state))
    assert out.returncode == 0, out.stderr
    rows = {line.split("│")[2].strip(): line for line in out.stdout.splitlines() if "@1" in line}
    assert "predictive" in rows["digits@1"] and "reactive" in rows["iris@1"], out.stdout


def test_batched_requests_keep_their_own_answers_and_audit_records(mesh: Mesh) -> None:
    """iris batches (maxBatchSize 16): concurrent callers through the mesh each get their rows;
    every request is its own audit record (checked after shutdown, when the store is complete)."""
    rng = np.random.default_rng(7)
    flowers = [
        rng.uniform(1, 7, (1 + i % 3, 4)).astype(np.float32) for i in range(16)
    ]  # iris: maxConcurrency 16
    headers = {**mesh.auth("batcher"), "content-type": "application/json"}

    async def run() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as session:

            async def one(rows: np.ndarray[Any, Any]) -> tuple[int, Any]:
                body = {"inputs": [{"name": "features", "datatype": "FP32",
                                    "shape": list(rows.shape), "data": rows.flatten().tolist()}]}  # fmt: skip
                url = f"http://{mesh.gateway}/v2/models/iris/infer"
                async with session.post(url, data=json.dumps(body), headers=headers) as reply:
                    return reply.status, await reply.json()

            return await asyncio.gather(*(one(rows) for rows in flowers))

    replies = asyncio.run(run())
    client = thttp.InferenceServerClient(mesh.gateway)
    for rows, (status, body) in zip(flowers, replies, strict=True):
        assert status == 200, body
        alone = thttp.InferInput("features", list(rows.shape), "FP32")
        alone.set_data_from_numpy(rows)
        expected = client.infer("iris", [alone], headers=mesh.auth()).as_numpy("label").tolist()
        label = next(o for o in body["outputs"] if o["name"] == "label")
        assert label["data"] == expected and label["shape"] == [len(rows)]
    assert mesh.up.stop() == 0
    out = meshfn(
        "audit", "query", "--store", str(mesh.state / "audit" / "audit.db"), "--json",
        "--limit", "10000", "--subject-raw", "batcher",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    ours = [r for r in records if r["path"] == "/v2/models/iris/infer"]
    assert len(ours) == len(flowers) and {r["status"] for r in ours} == {200}, ours
    # bob's gRPC call, denied by the tenant rule (test_tritonclient_grpc_through_the_gateway):
    # HTTP 200 with grpc-status 7 on the wire, a 403 in the trail
    out = meshfn(
        "audit", "query", "--store", str(mesh.state / "audit" / "audit.db"), "--json",
        "--subject-raw", "bob",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    denied = [json.loads(line) for line in out.stdout.splitlines()]
    grpc = [r for r in denied if r["path"] == "/inference.GRPCInferenceService/ModelInfer"]
    assert grpc and {r["status"] for r in grpc} == {403}, denied
