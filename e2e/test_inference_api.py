"""The inference API with the reference clients against the backend alone (a real process with
its REST and gRPC ports): tritonclient HTTP (its defaults: the binary tensor extension; and
binary_data=False) and tritonclient gRPC, every KServe/Triton endpoint, dynamic batching, the
repository and statistics extensions, and bad input that must never reach the function (the
statistics' execution count proves it)."""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from meshfn_e2e import Processes, http
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

OPS = "https://issuer.test/ops"
WIDE = {"limits": {"maxConcurrency": 64}}
FUNCTIONS: list[dict[str, Any]] = [
    {"name": "iris", "pool": {"minIdle": 1}, **WIDE},
    {"name": "digits28"},
    {"name": "embedder"},
    {"name": "digits", "protocols": {"grpc": False}},
    {"name": "chaos-core", "limits": {"maxRequestBytes": 4096}},
    {"name": "iris-batched", "artifact": "iris@1",
     "batching": {"maxBatchSize": 8, "maxQueueDelay": "20ms"}, **WIDE},
    {"name": "chaos-b", "artifact": "chaos@1",
     "batching": {"maxBatchSize": 6, "maxQueueDelay": "30ms", "oversize": "split"}, **WIDE},
    {"name": "chaos-r", "artifact": "chaos@1", "batching": {"maxBatchSize": 4}},
    {"name": "ops-iris", "artifact": "iris@1", "repository": {"callers": [OPS]}},
    {"name": "rated-iris", "artifact": "iris@1",
     "qos": {"policy": "default/tenants", "defaultClass": "std",
             "classes": [{"name": "std", "rate": {"requests": 100, "per": "1s"}}]}},
]  # fmt: skip
FLOWERS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)


@dataclass
class Backend:
    rest: str  # host:port
    grpc: str

    @property
    def url(self) -> str:
        return f"http://{self.rest}"

    def http_client(self) -> thttp.InferenceServerClient:
        return thttp.InferenceServerClient(self.rest)

    def grpc_client(self) -> tgrpc.InferenceServerClient:
        return tgrpc.InferenceServerClient(self.grpc)

    def executions(self, model: str) -> int:
        (stats,) = http(f"{self.url}/v2/models/{model}/stats").json()["model_stats"]
        return int(stats["execution_count"])


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    tmp = tmp_path_factory.mktemp("api")
    procs = Processes(tmp)
    try:
        found = Backend(*procs.backend(FUNCTIONS))
        yield found
    finally:
        procs.stop_all()


def http_input(x: np.ndarray[Any, Any], name: str, datatype: str, binary: bool) -> Any:
    tensor = thttp.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


def grpc_input(x: np.ndarray[Any, Any], name: str, datatype: str) -> Any:
    tensor = tgrpc.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    return tensor


# ---------------------------------------------------------------- the reference clients


@pytest.mark.parametrize("binary", [True, False], ids=["defaults", "binary_data=False"])
def test_tritonclient_http(backend: Backend, binary: bool) -> None:
    client = backend.http_client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("iris") and client.is_model_ready("iris", "1")
    outputs = None if binary else [thttp.InferRequestedOutput("label", binary_data=False)]
    result = client.infer(
        "iris", [http_input(FLOWERS, "features", "FP32", binary)], outputs=outputs, request_id="q1"
    )
    assert result.as_numpy("label").tolist() == [0, 2]
    assert result.get_response()["id"] == "q1"
    if binary:  # every output binary (tritonclient asked with binary_data_output)
        probabilities = result.as_numpy("probabilities")
        assert probabilities.shape == (2, 3) and abs(float(probabilities.sum()) - 2) < 1e-4
        assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
    pixels = np.full((3, 784), 4.0, dtype=np.float32)
    digits = client.infer("digits28", [http_input(pixels, "pixels", "FP32", binary)])
    assert digits.as_numpy("label").shape == (3,)
    text = np.array([b"hello mesh", b"wasm model functions"], dtype=np.object_)
    embedded = client.infer("embedder", [http_input(text, "text", "BYTES", binary)])
    assert embedded.as_numpy("tokens").tolist() == [2, 3]
    assert embedded.as_numpy("embedding").shape == (2, 32)
    client.close()


def test_tritonclient_grpc(backend: Backend) -> None:
    client = backend.grpc_client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("iris") and client.is_model_ready("iris", "1") is not False
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "meshfn-inference" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("digits28", as_json=True)
    assert model["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": ["-1", "784"]}]
    result = client.infer("iris", [grpc_input(FLOWERS, "features", "FP32")], request_id="g1")
    assert result.as_numpy("label").tolist() == [0, 2] and result.get_response().id == "g1"
    for coding in ("gzip", "deflate"):  # gRPC's own message compression
        squeezed = client.infer(
            "iris", [grpc_input(FLOWERS, "features", "FP32")], compression_algorithm=coding
        )
        assert squeezed.as_numpy("label").tolist() == [0, 2], coding
    http_result = backend.http_client().infer(
        "iris", [http_input(FLOWERS, "features", "FP32", True)]
    )
    assert np.allclose(result.as_numpy("probabilities"), http_result.as_numpy("probabilities"))
    text = np.array([b"hello mesh", b"wasm"], dtype=np.object_)
    embedded = client.infer("embedder", [grpc_input(text, "text", "BYTES")])
    assert embedded.as_numpy("tokens").tolist() == [2, 1]
    only = client.infer(
        "iris",
        [grpc_input(FLOWERS[:1], "features", "FP32")],
        outputs=[tgrpc.InferRequestedOutput("label")],
    )
    assert [o.name for o in only.get_response().outputs] == ["label"]
    # typed contents (no raw_input_contents) work too
    message = pb.ModelInferRequest(model_name="iris")
    tensor = message.inputs.add(name="features", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([5.1, 3.5, 1.4, 0.2])
    stub = _stub(backend)
    reply = stub.ModelInfer(message, timeout=10)
    assert np.frombuffer(reply.raw_output_contents[0], np.int64).tolist() == [0]
    client.close()


def test_model_configuration(backend: Backend) -> None:
    """Triton's model configuration extension, as perf_analyzer reads it: with dynamic
    batching the batch dimension leaves `dims`; REST and gRPC say the same."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    http_client, grpc_client = backend.http_client(), backend.grpc_client()
    batched = http_client.get_model_config("iris-batched")
    assert batched["max_batch_size"] == 8
    assert batched["input"] == [{"name": "features", "data_type": "TYPE_FP32", "dims": [4]}]
    assert batched["dynamic_batching"]["max_queue_delay_microseconds"] == 20_000
    assert batched["model_transaction_policy"] == {"decoupled": False}
    plain = http_client.get_model_config("iris", "1")
    assert plain["max_batch_size"] == 0 and "dynamic_batching" not in plain
    assert plain["input"][0]["dims"] == [-1, 4]
    assert http_client.get_model_config("embedder")["input"][0]["data_type"] == "TYPE_STRING"
    for name in ("iris", "iris-batched", "chaos-b"):
        from_grpc = grpc_client.get_model_config(name).config
        rest = json_format.ParseDict(
            http_client.get_model_config(name), model_config_pb2.ModelConfig()
        )
        assert from_grpc == rest, name
    with pytest.raises(InferenceServerException, match="unknown model"):
        http_client.get_model_config("nope")
    with pytest.raises(InferenceServerException, match="unknown model") as grpc_error:
        grpc_client.get_model_config("nope")
    assert grpc_error.value.status() == "StatusCode.NOT_FOUND"
    assert http(backend.url + "/v2/models/iris/versions/9/config").status == 404


def test_streaming_inference(backend: Backend) -> None:
    """tritonclient's stream: every request answered once, matched by id, a bad request
    answered with its error in the stream, which goes on serving."""
    import queue

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = backend.grpc_client()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, flowers in enumerate((FLOWERS, FLOWERS[:1], FLOWERS[1:])):
            client.async_stream_infer(
                "iris", [grpc_input(flowers, "features", "FP32")], request_id=f"s{i}"
            )
        bad = grpc_input(np.zeros((1, 3), np.float32), "features", "FP32")
        client.async_stream_infer("iris", [bad], request_id="bad")
        client.async_stream_infer("nope", [grpc_input(FLOWERS, "features", "FP32")], request_id="x")
        client.async_stream_infer(
            "iris", [grpc_input(FLOWERS, "features", "FP32")], request_id="after"
        )
        results, errors = {}, []
        for _ in range(6):
            result, error = answers.get(timeout=20)
            if error is not None:
                errors.append(str(error))
            else:
                results[result.get_response().id] = result.as_numpy("label").tolist()
    finally:
        client.stop_stream()
        client.close()
    assert results == {"s0": [0, 2], "s1": [0], "s2": [2], "after": [0, 2]}
    # more requests than the stream's window (64): each answered, in whatever order
    client = backend.grpc_client()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(200):
            client.async_stream_infer(
                "iris", [grpc_input(FLOWERS[i % 2 :][:1], "features", "FP32")], request_id=f"w{i}"
            )
        many = [answers.get(timeout=30) for _ in range(200)]
    finally:
        client.stop_stream()
        client.close()
    assert not [error for _, error in many if error is not None]
    labels = {r.get_response().id: r.as_numpy("label").tolist() for r, _ in many}
    assert labels == {f"w{i}": [[0], [2]][i % 2] for i in range(200)}
    assert len(errors) == 2
    assert any("does not match [-1, 4]" in e for e in errors), errors
    assert any("unknown model 'nope'" in e for e in errors), errors


def test_no_stream_for_a_function_whose_gateway_counts_requests(backend: Backend) -> None:
    """A QoSPolicy's rate and concurrency limits are counted per request at the gateway: a
    stream of many calls would pass as one, so the backend answers each streamed call to such
    a function with an error (a unary call is served)."""
    import queue

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = backend.grpc_client()
    tensor = grpc_input(FLOWERS, "features", "FP32")
    assert client.infer("rated-iris", [tensor]).as_numpy("label").tolist() == [0, 2]
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("rated-iris", [tensor])
        result, error = answers.get(timeout=20)
    finally:
        client.stop_stream()
        client.close()
    assert result is None and "under QoSPolicy default/tenants" in str(error), error
    assert "use ModelInfer" in str(error)


def test_unsupported_extensions_say_so(backend: Backend) -> None:
    rest = backend.http_client()
    for rest_call, message in (
        (rest.get_system_shared_memory_status, "does not support system shared memory"),
        (rest.get_cuda_shared_memory_status, "does not support CUDA shared memory"),
        (rest.get_trace_settings, "does not support Triton's trace extension"),
        (lambda: rest.get_trace_settings("iris"), "does not support Triton's trace extension"),
        (rest.get_log_settings, "does not support Triton's logging extension"),
    ):
        with pytest.raises(InferenceServerException, match=message):
            rest_call()
    client = backend.grpc_client()
    for call, message in (
        (client.get_system_shared_memory_status, "does not support system shared memory"),
        (client.get_cuda_shared_memory_status, "does not support CUDA shared memory"),
        (client.get_trace_settings, "does not support Triton's trace extension"),
        (client.get_log_settings, "does not support Triton's logging extension"),
    ):
        with pytest.raises(InferenceServerException, match=message) as error:
            call()
        assert error.value.status() == "StatusCode.UNIMPLEMENTED"
    client.close()


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_compressed_requests_and_responses(backend: Backend, coding: str) -> None:
    """tritonclient's request_compression_algorithm and response_compression_algorithm, JSON
    and binary: the same answers as uncompressed. Responses of 1 KiB or more are compressed
    when the client accepts it."""
    client = backend.http_client()
    many = np.tile(FLOWERS, (100, 1))
    for binary in (True, False):
        plain = client.infer("iris", [http_input(many, "features", "FP32", binary)])
        squeezed = client.infer(
            "iris",
            [http_input(many, "features", "FP32", binary)],
            request_compression_algorithm=coding,
            response_compression_algorithm=coding,
        )
        for output in ("label", "probabilities"):
            assert np.array_equal(plain.as_numpy(output), squeezed.as_numpy(output)), output
    body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [200, 4],
                                   "data": many.tolist()}]}).encode()  # fmt: skip
    packed = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
    headers = {"Content-Encoding": coding, "Accept-Encoding": f"{coding};q=0.5, br"}
    reply = http(backend.url + "/v2/models/iris/infer", "POST", headers, packed)
    named = {k.lower(): v for k, v in reply.headers.items()}
    assert reply.status == 200 and named.get("content-encoding") == coding, reply.headers
    inflated = gzip.decompress(reply.body) if coding == "gzip" else zlib.decompress(reply.body)
    assert json.loads(inflated)["outputs"][0]["data"] == [0, 2] * 100
    refused = http(backend.url + "/v2/models/iris/infer", "POST",
                   {"Accept-Encoding": f"{coding};q=0"}, body)  # fmt: skip
    assert refused.status == 200
    assert "content-encoding" not in {k.lower() for k in refused.headers}
    assert json.loads(refused.body)["outputs"][0]["data"] == [0, 2] * 100


def _stub(backend: Backend) -> Any:
    from tritonclient.grpc import service_pb2_grpc

    return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(backend.grpc))


def test_request_parameters_reach_the_function(backend: Backend) -> None:
    """Request parameters pass through (chaos reads `mode`); tensor and output parameters too;
    the guest's output parameters come back; `id` is echoed, as KServe says."""
    x = np.array([1.0, 2.0], dtype=np.float32)
    client = backend.http_client()
    counted = client.infer(
        "chaos-core", [http_input(x, "x", "FP32", True)], parameters={"mode": "counter"}
    )
    assert counted.as_numpy("y").tolist()[0] >= 1  # counter mode answered, not echo
    probe = backend.grpc_client().infer(
        "chaos-b", [grpc_input(x, "x", "FP32")], parameters={"mode": "env"}, request_id="p"
    )
    response = probe.get_response()
    assert response.id == "p" and json.loads(response.outputs[0].parameters["probe"].string_param)
    # Triton's reserved `timeout` (microseconds) bounds the request: 0 means already late
    with pytest.raises(InferenceServerException, match="deadline"):
        client.infer("chaos-core", [http_input(x, "x", "FP32", True)], timeout=0)


# ---------------------------------------------------------------- server endpoints


def test_server_endpoints(backend: Backend) -> None:
    url = backend.url
    assert http(url + "/v2/health/live").json() == {"live": True}
    assert http(url + "/v2/health/ready").json() == {"ready": True}
    meta = http(url + "/v2").json()
    assert meta["extensions"] == [
        "binary_tensor_data",
        "parameters",
        "model_repository",
        "statistics",
        "model_configuration",
    ]
    names = [f["name"] for f in FUNCTIONS]
    assert http(url + "/v2/models").json() == {"models": sorted(names)}
    index = http(url + "/v2/repository/index", "POST", body=b"{}").json()
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        (n, "1", "READY") for n in names
    }
    assert backend.http_client().get_model_repository_index() == index
    grpc_index = backend.grpc_client().get_model_repository_index(as_json=True)["models"]
    assert {m["name"] for m in grpc_index} == set(names)
    assert http(url + "/v2/repository/index", "POST", body=b'{"ready": 1}').status == 400
    assert http(url + "/v2/models/stats").json()["model_stats"][0]["name"] == "chaos-b"
    for path in ("/v2/models/iris/versions/1", "/v2/models/iris/versions/1/ready",
                 "/v2/models/iris/versions/1/stats", "/v2/models/iris/stats"):  # fmt: skip
        assert http(url + path).status == 200, path
    assert http(url + "/v2/models/iris/versions/9/stats").status == 404
    assert http(url + "/v2/models/iris/infer").status == 405
    assert http(url + "/v2/health/ready", "POST", body=b"").status == 405
    assert http(url + "/v2/repository/models/iris/explode", "POST", body=b"").status == 404
    grpc_stats = backend.grpc_client().get_inference_statistics("iris", "1", as_json=True)
    (iris,) = grpc_stats["model_stats"]
    assert int(iris["inference_count"]) >= 2 and "compute_infer" in iris["inference_stats"]


def test_what_clients_send_at_the_protocol_edges(backend: Backend) -> None:
    """Spellings and modes of the protocol that real clients use: the OpenAPI document's
    `/v2/`, a 405's Allow, polling readiness of a model that is not there over gRPC (False, as
    Triton answers), an empty `outputs` list (all of them, as over gRPC), a body that names its
    model (as Triton's examples do), and Triton's raw binary request."""
    url = backend.url
    assert http(url + "/v2/").json()["name"] == http(url + "/v2").json()["name"]
    assert http(url + "/v2/health/ready/").status == 200
    refused = http(url + "/v2/models/iris/infer")
    assert refused.status == 405 and refused.headers["Allow"] == "POST"
    assert http(url + "/v2/health/live", "POST", body=b"").headers["Allow"] == "GET"
    client = backend.grpc_client()
    assert client.is_model_ready("iris") is True
    assert client.is_model_ready("no-such-model") is False
    assert client.is_model_ready("iris", "9") is False
    flower = {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}
    infer = url + "/v2/models/iris/infer"
    every = http(infer, "POST", body=json.dumps({"inputs": [flower]}).encode()).json()
    empty = http(infer, "POST", body=json.dumps({"inputs": [flower], "outputs": []}).encode())
    assert empty.status == 200 and empty.json()["outputs"] == every["outputs"]
    named = {"model_name": "iris", "model_version": "1", "inputs": [flower]}
    assert http(infer, "POST", body=json.dumps(named).encode()).json() == every
    other = http(infer, "POST", body=json.dumps({**named, "model_name": "digits"}).encode())
    assert other.status == 400 and "names 'iris'" in other.json()["error"]
    # raw binary: the body is the only input's data; its one variable dimension from the size
    raw = http(infer, "POST", {"Inference-Header-Content-Length": "0"}, FLOWERS.tobytes())
    assert raw.status == 200, raw.body
    length = int(raw.headers["Inference-Header-Content-Length"])
    head = json.loads(raw.body[:length])
    assert [o["shape"] for o in head["outputs"]] == [[2], [2, 3]]
    labels = np.frombuffer(raw.body[length:][: 2 * 8], dtype=np.int64)
    expected = backend.http_client().infer("iris", [http_input(FLOWERS, "features", "FP32", True)])
    assert labels.tolist() == expected.as_numpy("label").tolist()
    short = http(infer, "POST", {"Inference-Header-Content-Length": "0"}, b"\0" * 15)
    assert short.status == 400 and "do not fill input 'features'" in short.json()["error"]


def test_non_finite_outputs_reach_every_client(backend: Backend) -> None:
    """A model's output may hold NaN and the infinities (log(0), an overflow): binary data and
    gRPC carry them as the IEEE-754 values they are, JSON as Python's json writes them."""
    x = np.array([1.5, np.nan, np.inf, -np.inf], dtype=np.float32)
    out = backend.http_client().infer("chaos-r", [http_input(x, "x", "FP32", True)])
    np.testing.assert_array_equal(out.as_numpy("y"), x)
    out = backend.http_client().infer(
        "chaos-r",
        [http_input(x[:1], "x", "FP32", False)],
        outputs=[thttp.InferRequestedOutput("y", binary_data=True)],
    )
    np.testing.assert_array_equal(out.as_numpy("y"), x[:1])
    grpc_out = backend.grpc_client().infer("chaos-r", [grpc_input(x, "x", "FP32")])
    np.testing.assert_array_equal(grpc_out.as_numpy("y"), x)
    tensor = {"name": "x", "datatype": "FP32", "shape": [4]}
    head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": 16}}]}).encode()
    reply = http(
        backend.url + "/v2/models/chaos-r/infer",
        "POST",
        {"Inference-Header-Content-Length": str(len(head))},
        head + x.tobytes(),
    )
    assert reply.status == 200
    assert str(json.loads(reply.body)["outputs"][0]["data"]) == "[1.5, nan, inf, -inf]"


def test_versions_on_the_infer_path(backend: Backend) -> None:
    flower = {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}
    body = json.dumps({"inputs": [flower]}).encode()
    reply = http(backend.url + "/v2/models/iris/versions/1/infer", "POST", body=body)
    assert reply.status == 200 and reply.json()["model_version"] == "1"
    assert http(backend.url + "/v2/models/iris/versions/2/infer", "POST", body=body).status == 404
    result = backend.grpc_client().infer(
        "iris", [grpc_input(FLOWERS, "features", "FP32")], model_version="1"
    )
    assert result.get_response().model_version == "1"


def test_protocol_switch(backend: Backend) -> None:
    """digits sets protocols.grpc: false: REST serves it, gRPC says it is not found."""
    pixels = np.zeros((1, 64), dtype=np.float32)
    assert backend.http_client().infer("digits", [http_input(pixels, "pixels", "FP32", True)])
    with pytest.raises(InferenceServerException, match="not served over gRPC") as info:
        backend.grpc_client().infer("digits", [grpc_input(pixels, "pixels", "FP32")])
    assert info.value.status() == "StatusCode.NOT_FOUND"


# ---------------------------------------------------------------- repository


def test_repository_load_unload(backend: Backend) -> None:
    http_client, grpc_client = backend.http_client(), backend.grpc_client()
    with pytest.raises(InferenceServerException, match="load/unload are off by default") as info:
        http_client.unload_model("iris")
    assert info.value.status() == "403"
    with pytest.raises(InferenceServerException) as info:
        grpc_client.load_model("iris")
    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
    with pytest.raises(InferenceServerException, match="not supported"):
        http_client.load_model("ops-iris", config='{"backend": "python"}')
    http_client.unload_model("ops-iris")
    assert not http_client.is_model_ready("ops-iris")
    index = {m["name"]: m for m in http_client.get_model_repository_index()}
    assert index["ops-iris"]["state"] == "UNAVAILABLE" and index["iris"]["state"] == "READY"
    assert http(backend.url + "/v2/health/ready").status == 200  # an unload is no failure
    with pytest.raises(InferenceServerException, match="unloaded") as info:
        grpc_client.infer("ops-iris", [grpc_input(FLOWERS, "features", "FP32")])
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    grpc_client.load_model("ops-iris")
    assert grpc_client.is_model_ready("ops-iris")
    http_client.unload_model("ops-iris")
    reply = http(backend.url + "/v2/repository/models/ops-iris/versions/1/load", "POST", body=b"")
    assert reply.status == 200 and http_client.is_model_ready("ops-iris", "1")
    result = http_client.infer("ops-iris", [http_input(FLOWERS, "features", "FP32", True)])
    assert result.as_numpy("label").tolist() == [0, 2]


# ---------------------------------------------------------------- batching


async def _echo_many(url: str, model: str, rows: list[list[float]]) -> list[tuple[int, Any]]:
    async def one(session: aiohttp.ClientSession, xs: list[float]) -> tuple[int, Any]:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(xs)], "data": xs}]}
        async with session.post(f"{url}/v2/models/{model}/infer", json=body) as reply:
            return reply.status, await reply.json()

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, xs) for xs in rows))


def test_batching_returns_each_caller_its_own_rows(backend: Backend) -> None:
    """Concurrent requests of mixed sizes share guest calls; each gets exactly its rows back;
    a poisoned row (chaos rejects -13) fails only its own request; one request larger than
    maxBatchSize is split (oversize: split) and joined."""
    before = backend.executions("chaos-b")
    rows = [[float(i * 10 + j) for j in range(1 + i % 4)] for i in range(30)]
    rows[7] = [1.0, -13.0]
    rows[20] = [float(v) for v in range(17)]  # 17 rows > maxBatchSize 6: split in 3 calls
    replies = asyncio.run(_echo_many(backend.url, "chaos-b", rows))
    for i, (status, body) in enumerate(replies):
        if i == 7:
            assert status == 400 and "poisoned row" in body["error"], body
            continue
        assert status == 200, body
        (y,) = body["outputs"]
        assert y["data"] == rows[i] and y["shape"] == [len(rows[i])], (i, body)
    calls = backend.executions("chaos-b") - before
    assert calls < len(rows), calls  # requests really shared calls
    (stats,) = http(backend.url + "/v2/models/chaos-b/stats").json()["model_stats"]
    sizes = {b["batch_size"] for b in stats["batch_stats"]}
    assert max(sizes) > 1 and max(sizes) <= 6, sizes


def test_batched_iris_answers_like_unbatched(backend: Backend) -> None:
    flowers = np.random.default_rng(1).uniform(1, 7, (24, 4)).astype(np.float32)

    async def run(model: str) -> list[list[int]]:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> list[int]:
                rows = flowers[i : i + 1 + i % 3]
                body = {"inputs": [{"name": "features", "datatype": "FP32",
                                    "shape": list(rows.shape), "data": rows.flatten().tolist()}],
                        "outputs": [{"name": "label"}]}  # fmt: skip
                async with session.post(f"{backend.url}/v2/models/{model}/infer", json=body) as r:
                    assert r.status == 200, await r.text()
                    return list((await r.json())["outputs"][0]["data"])

            return await asyncio.gather(*(one(i) for i in range(20)))

    assert asyncio.run(run("iris-batched")) == asyncio.run(run("iris"))


def test_a_deadline_passing_in_the_batch_queue_is_504_and_never_runs(backend: Backend) -> None:
    x = np.array([1.0], dtype=np.float32)
    before = backend.executions("chaos-b")
    with pytest.raises(InferenceServerException, match="while queued for a batch") as info:
        backend.http_client().infer("chaos-b", [http_input(x, "x", "FP32", True)], timeout=0)
    assert info.value.status() == "504"
    with pytest.raises(InferenceServerException) as info:  # a gRPC deadline does the same
        backend.grpc_client().infer("chaos-b", [grpc_input(x, "x", "FP32")], client_timeout=0.001)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert backend.executions("chaos-b") == before


def test_oversize_refused_by_policy(backend: Backend) -> None:
    x = np.arange(5, dtype=np.float32)
    with pytest.raises(InferenceServerException, match="at most 4 per call") as info:
        backend.http_client().infer("chaos-r", [http_input(x, "x", "FP32", True)])
    assert info.value.status() == "400"
    with pytest.raises(InferenceServerException) as info:
        backend.grpc_client().infer("chaos-r", [grpc_input(x, "x", "FP32")])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


# ---------------------------------------------------------------- bad input


def _binary(
    inputs: list[dict[str, Any]], blob: bytes, length: int | None = None
) -> tuple[bytes, dict[str, str]]:
    head = json.dumps({"inputs": inputs}).encode()
    body = head + blob
    return body, {"Inference-Header-Content-Length": str(len(head) if length is None else length)}


X4 = np.arange(4, dtype=np.float32).tobytes()
XT = {"name": "x", "datatype": "FP32", "shape": [4]}
JSON4 = json.dumps({"inputs": [{**XT, "data": [1, 2, 3, 4]}]}).encode()
BAD_REST = [
    ("a binary size that contradicts the shape",
     _binary([{**XT, "parameters": {"binary_data_size": 12}}], X4[:12]), "the shape needs 4 x 4"),
    ("a header length past the end of the body",
     _binary([{**XT, "parameters": {"binary_data_size": 16}}], X4, length=10_000), "past the end"),
    ("an unknown binary parameter",
     _binary([{**XT, "parameters": {"binary_data_size": 16, "binary_data_offset": 0}}], X4),
     "unknown binary tensor parameter 'binary_data_offset'"),
    ("binary data left over",
     _binary([{**XT, "parameters": {"binary_data_size": 16}}], X4 + b"\0"), "after the inputs"),
    ("tritonclient's binary body without its header",
     (_binary([{**XT, "parameters": {"binary_data_size": 16}}], X4)[0], {}), "Inference-Header"),
    ("a body in an unsupported coding", (JSON4, {"Content-Encoding": "br"}),
     "Content-Encoding br is not supported (gzip, deflate)"),
    ("a body that is not the gzip it says", (JSON4, {"Content-Encoding": "gzip"}),
     "not valid gzip data"),
    ("a body that is not the deflate it says", (JSON4, {"Content-Encoding": "deflate"}),
     "not valid deflate data"),
    ("a truncated gzip stream", (gzip.compress(JSON4)[:-6], {"Content-Encoding": "gzip"}),
     "truncated gzip stream"),
    ("bytes after the gzip stream", (gzip.compress(JSON4) + b"{}", {"Content-Encoding": "gzip"}),
     "2 bytes after the end of the gzip stream"),
    # chaos-core takes 4096 bytes: 1 MiB of zeros arrives as ~1 KiB
    ("a gzip bomb", (gzip.compress(b"0" * (1 << 20)), {"Content-Encoding": "gzip"}),
     "inflates past 4096 bytes"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "request_", "message"), BAD_REST, ids=[c[0] for c in BAD_REST])
def test_bad_binary_input_never_reaches_the_function(
    backend: Backend, what: str, request_: tuple[bytes, dict[str, str]], message: str
) -> None:
    body, headers = request_
    before = backend.executions("chaos-core")
    reply = http(backend.url + "/v2/models/chaos-core/infer", "POST", headers, body)
    assert 400 <= reply.status < 500 and message in reply.json()["error"], reply.body
    assert backend.executions("chaos-core") == before


def _raw_count_mismatch() -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="chaos-core")
    message.inputs.add(name="x", datatype="FP32", shape=[4])
    message.raw_input_contents.extend([X4, X4])
    return message


def _over_function_limit() -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="chaos-core")  # maxRequestBytes 4096
    message.inputs.add(name="x", datatype="FP32", shape=[2048])
    message.raw_input_contents.append(np.zeros(2048, np.float32).tobytes())
    return message


def _over_server_limit() -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="chaos-core")  # every limit is 1 MiB or less
    message.inputs.add(name="x", datatype="FP32", shape=[300_000])
    message.raw_input_contents.append(np.zeros(300_000, np.float32).tobytes())
    return message


def _bad_bytes_framing() -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="embedder")
    message.inputs.add(name="text", datatype="BYTES", shape=[2])
    message.raw_input_contents.append(struct.pack("<I", 2) + b"hi" + struct.pack("<I", 9) + b"x")
    return message


BAD_GRPC = [
    ("raw contents whose count does not match the inputs", _raw_count_mismatch,
     "INVALID_ARGUMENT", "2 raw_input_contents for 1 inputs"),
    ("a message over the function's size limit", _over_function_limit,
     "RESOURCE_EXHAUSTED", "exceeds 4096 bytes"),
    ("a message over the server's size limit", _over_server_limit, "RESOURCE_EXHAUSTED", ""),
    ("BYTES framing that lies", _bad_bytes_framing, "INVALID_ARGUMENT", "claims 9 bytes"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "build", "code", "message"), BAD_GRPC, ids=[c[0] for c in BAD_GRPC]
)
def test_bad_grpc_input_never_reaches_the_function(
    backend: Backend, what: str, build: Any, code: str, message: str
) -> None:
    request = build()
    before = backend.executions(request.model_name)
    with pytest.raises(grpc.RpcError) as info:
        _stub(backend).ModelInfer(request, timeout=10)
    assert info.value.code().name == code, info.value
    assert message in (info.value.details() or "")
    assert backend.executions(request.model_name) == before
