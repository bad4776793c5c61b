"""The inference API's pure parts: tensor data layouts, the binary tensor extension, gRPC
ModelInfer messages (tritonclient's generated stubs), batch merging and splitting, statistics."""

from __future__ import annotations

import gzip
import json
import random
import re
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from meshfn.contracts.function import ServedFunction
from meshfn.inference.batching import join, merge, slice_rows, split
from meshfn.inference.grpc_api import encode_infer, parse_infer, status_code
from meshfn.inference.kserve import (
    KServeError,
    Output,
    Signature,
    header_length,
    http_response,
    inflate,
    loads,
    parse_http,
    response_coding,
)
from meshfn.inference.results import Completed
from meshfn.inference.stats import ModelStats, Timing
from meshfn.inference.tensors import DTYPES, TensorError, check_raw, frame, json_to_raw, unpack

SIG = Signature.from_metadata(
    {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "t", "datatype": "BYTES", "shape": [-1]},
        ],
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "n", "datatype": "INT64", "shape": [-1]},
        ],
    }
)
X = np.array([[1.0, 2.5], [3.0, -4.0]], dtype=np.float32)
T = frame([b"hi", b"\xff\x00"])


def binary_body(
    inputs: list[dict[str, Any]], blobs: list[bytes], **request: Any
) -> tuple[bytes, int]:
    head = json.dumps({"inputs": inputs, **request}).encode()
    return head + b"".join(blobs), len(head)


def good_inputs(x_size: int | None = None, t_size: int | None = None) -> list[dict[str, Any]]:
    return [
        {"name": "x", "datatype": "FP32", "shape": [2, 2],
         "parameters": {"binary_data_size": X.nbytes if x_size is None else x_size}},
        {"name": "t", "datatype": "BYTES", "shape": [2],
         "parameters": {"binary_data_size": len(T) if t_size is None else t_size}},
    ]  # fmt: skip


# ---------------------------------------------------------------- tensors


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_datatype_round_trips_json_and_raw(name: str) -> None:
    dt = DTYPES[name]
    values = {
        "bool": [True, False, True],
        "bytes": ["a", "", "ünï"],
        "float": [0.5, -2.0, 1.25],
    }.get(dt.kind, [int(dt.low), 0, int(dt.high)])
    raw = json_to_raw(values, dt, [3])
    check_raw(raw, dt, 3)
    assert unpack(raw, dt, 3) == values
    if dt.size:
        assert len(raw) == 3 * dt.size


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("FP32", [1e39], "out of range for FP32"),
        ("FP16", [70000.0], "out of range for FP16"),
        ("INT8", [128], "out of range for INT8"),
        ("UINT64", [-1], "out of range for UINT64"),
        ("INT32", [True], "is not an integer"),
        ("BOOL", [1], "is not true/false"),
        ("BYTES", [b"x".decode(), 3], "is not a string"),
        ("FP32", [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "6 elements for shape [2, 2]"),
    ],
)
def test_json_values_checked(datatype: str, data: list[Any], message: str) -> None:
    shape = [2, 2] if "shape [2, 2]" in message else [len(data)]
    with pytest.raises(TensorError, match=message.replace("[", r"\[").replace("]", r"\]")):
        json_to_raw(data, DTYPES[datatype], shape)


def test_float_limits_as_float_writers_print_them() -> None:
    """JSON from a float32 or float16 writer (Go, Java, numpy's str) prints the largest value
    rounded (3.4028235e38 is a little more than FLT_MAX): it is that value, as Triton reads it.
    The next value that rounds to infinity is refused."""
    fp32, fp16 = DTYPES["FP32"], DTYPES["FP16"]
    assert json_to_raw([3.4028235e38, -3.4028235e38], fp32, [2]) == struct.pack(
        "<2f", 3.4028234663852886e38, -3.4028234663852886e38
    )
    assert json_to_raw([65519.0], fp16, [1]) == struct.pack("<e", 65504.0)
    for too_large, dt in ((2.0**128 - 2.0**103, fp32), (65520.0, fp16)):  # ties go to infinity
        with pytest.raises(TensorError, match="out of range"):
            json_to_raw([too_large], dt, [1])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([[1.0, 2.0], [3.0]], "a list of 1 beside a list of 2"),
        # the right element count: read flat it would be a different tensor
        ([[1.0, 2.0, 3.0], [4.0]], "a list of 1 beside a list of 3"),
        ([[1.0], [2.0, 3.0, 4.0]], "a list of 3 beside a list of 1"),
        ([[1.0, 2.0], 3.0, 4.0], "3.0 beside a list of 2"),
        ([[[1.0, 2.0]], [[3.0], [4.0]]], "a list of 2 beside a list of 1"),
    ],
)
def test_ragged_nested_data_is_refused(data: list[Any], message: str) -> None:
    with pytest.raises(TensorError, match=f"ragged nested data: {re.escape(message)}"):
        json_to_raw(data, DTYPES["FP32"], [2, 2])


def test_rectangular_nesting_in_any_depth_is_row_major() -> None:
    """As numpy reads nested lists (and reshapes): flat, one level, or nested deeper."""
    expected = struct.pack("<4f", 1, 2, 3, 4)
    for data in ([1.0, 2.0, 3.0, 4.0], [[1.0, 2.0], [3.0, 4.0]], [[[1.0], [2.0]], [[3.0], [4.0]]]):
        assert json_to_raw(data, DTYPES["FP32"], [2, 2]) == expected, data
    with pytest.raises(TensorError, match=r"element \[3.0\] is not a number"):
        json_to_raw([1.0, 2.0, [3.0], 4.0], DTYPES["FP32"], [2, 2])


def test_json_nested_past_the_recursion_limit_is_a_client_error() -> None:
    body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":' + b"[" * 100_000
    body += b"]" * 100_000 + b"}]}"
    with pytest.raises(ValueError, match="nested too deeply"):
        loads(body)


def test_inflate_takes_only_whole_streams_within_the_limit() -> None:
    """Every mutation of a gzip or deflate stream is either its body (within the limit) or a
    KServeError with a client status: never another exception, never more than the limit."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [64],
                                   "data": [i / 7 for i in range(64)]}]}).encode()  # fmt: skip
    rng = random.Random(7)
    for coding, packed in ((b"gzip", gzip.compress(body)), (b"deflate", zlib.compress(body))):
        assert inflate(packed, coding, len(body)) == body
        assert inflate(packed, b" " + coding.upper(), len(body)) == body  # tokens are case-blind
        with pytest.raises(KServeError, match="inflates past") as over:
            inflate(packed, coding, len(body) - 1)
        assert over.value.status == 413
        for _ in range(1500):
            mutated = bytearray(packed)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            cut = rng.choice([len(mutated), rng.randrange(len(mutated) + 1)])
            try:
                out = inflate(bytes(mutated[:cut]), coding, 4096)
            except KServeError as exc:
                assert exc.status in (400, 413), exc.message
            else:
                assert len(out) <= 4096
    with pytest.raises(KServeError, match="Content-Encoding br is not supported") as other:
        inflate(body, b"br", 4096)
    assert other.value.status == 415
    assert inflate(body, b"identity", 4096) == body


@pytest.mark.parametrize(
    ("accept", "coding"),
    [
        (None, None),
        (b"", None),
        (b"gzip", b"gzip"),
        (b"deflate, gzip", b"gzip"),
        (b"gzip;q=0, deflate", b"deflate"),
        (b"GZIP ; Q=0.5", b"gzip"),
        (b"*", b"gzip"),
        (b"*;q=0, identity", None),
        (b"br", None),
        (b"gzip;q=nonsense", None),
        (b",,;;=,", None),
    ],
)
def test_response_coding_follows_accept_encoding(
    accept: bytes | None, coding: bytes | None
) -> None:
    assert response_coding(accept) == coding


@pytest.mark.parametrize(
    ("raw", "datatype", "count", "message"),
    [
        (b"\0" * 7, "FP32", 2, "7 bytes of FP32 data, but the shape needs 2 x 4 = 8"),
        (b"\x02", "BOOL", 1, "BOOL bytes must be 0 or 1"),
        (struct.pack("<I", 5) + b"abc", "BYTES", 1, "claims 5 bytes but only 3 remain"),
        (struct.pack("<I", 1) + b"a", "BYTES", 2, "ends before element 1 of 2"),
        (frame([b"a"]) + b"!", "BYTES", 1, "1 bytes left after the 1 BYTES elements"),
        (b"\1\0", "BYTES", 1, "no length prefix"),
    ],
)
def test_raw_data_checked(raw: bytes, datatype: str, count: int, message: str) -> None:
    with pytest.raises(TensorError, match=message):
        check_raw(raw, DTYPES[datatype], count)


# ---------------------------------------------------------------- binary extension


def test_binary_request_parses_like_json() -> None:
    body, length = binary_body(good_inputs(), [X.tobytes(), T], id="b1")
    parsed = parse_http(body, SIG, length)
    as_json = parse_http(
        json.dumps(
            {
                "id": "b1",
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": X.tolist()},
                    {"name": "t", "datatype": "BYTES", "shape": [2], "data": ["hi", "\0"]},
                ],
            }
        ).encode(),
        SIG,
    )
    assert parsed.inputs[0].raw == as_json.inputs[0].raw == X.tobytes()
    assert parsed.inputs[1].raw == T and parsed.inputs[0].parameters == {}
    # mixed: one input binary, the other JSON
    head = [good_inputs()[0], {"name": "t", "datatype": "BYTES", "shape": [1], "data": ["z"]}]
    mixed, length = binary_body(head, [X.tobytes()])
    assert parse_http(mixed, SIG, length).inputs[1].raw == frame([b"z"])


@pytest.mark.parametrize(
    ("inputs", "blobs", "extra", "message"),
    [
        (good_inputs(x_size=12), [X.tobytes()[:12], T], {}, "12 bytes of FP32 data, but the shape needs"),
        (good_inputs(t_size=len(T) + 4), [X.tobytes(), T], {}, "runs past the end of the binary data"),
        (good_inputs(), [X.tobytes(), T, b"xx"], {}, "2 bytes of binary data after the inputs"),
        (good_inputs(x_size=-1), [X.tobytes(), T], {}, "non-negative integer"),
        (good_inputs(t_size=10), [X.tobytes(), frame([b"hi"]) + b"\7\0\0\0"], {}, "claims 7 bytes"),
        ([{**good_inputs()[0], "data": [1, 2, 3, 4]}, good_inputs()[1]], [X.tobytes(), T], {},
         "both data and binary_data_size"),
        ([{**good_inputs()[0], "parameters": {"binary_data_size": 16, "binary_data": True}},
          good_inputs()[1]], [X.tobytes(), T], {}, "unknown binary tensor parameter 'binary_data'"),
        (good_inputs(), [X.tobytes(), T], {"parameters": {"binary_data_outputs": True}},
         "unknown binary tensor parameter 'binary_data_outputs'"),
        (good_inputs(), [X.tobytes(), T], {"parameters": {"binary_data_output": "yes"}},
         "binary_data_output must be true or false"),
        (good_inputs(), [X.tobytes(), T],
         {"outputs": [{"name": "y", "parameters": {"binary_data_size": 4}}]},
         "unknown binary tensor parameter 'binary_data_size'"),
        (good_inputs(), [X.tobytes(), T],
         {"outputs": [{"name": "y", "parameters": {"classification": 2}}]},
         "classification extension is not supported"),
        ([{**good_inputs()[0], "parameters": {"shared_memory_region": "r"}}, good_inputs()[1]],
         [X.tobytes(), T], {}, "shared-memory extensions are not supported"),
    ],
)  # fmt: skip
def test_bad_binary_requests_are_400(
    inputs: list[dict[str, Any]], blobs: list[bytes], extra: dict[str, Any], message: str
) -> None:
    body, length = binary_body(inputs, blobs, **extra)
    with pytest.raises(KServeError, match=message) as info:
        parse_http(body, SIG, length)
    assert info.value.status == 400


def test_header_length_checked_against_the_body() -> None:
    assert header_length({}, 10) is None
    assert header_length({b"inference-header-content-length": b"10"}, 10) == 10
    with pytest.raises(KServeError, match="is past the end of the 10-byte body"):
        header_length({b"inference-header-content-length": b"11"}, 10)
    with pytest.raises(KServeError, match="is not a byte count"):
        header_length({b"inference-header-content-length": b"-3"}, 10)
    body, _ = binary_body(good_inputs(), [X.tobytes(), T])
    with pytest.raises(KServeError, match="needs the Inference-Header-Content-Length"):
        parse_http(body, SIG)  # tritonclient's binary body sent as if it were JSON


def test_binary_response_per_output_and_default() -> None:
    outputs = [
        Output("y", "FP32", [2, 2], [[1, 2], [3, 4]], {"note": "kept"}),
        Output("n", "INT64", [2], [7, 8]),
    ]
    body, _ = binary_body(good_inputs(), [X.tobytes(), T], parameters={"binary_data_output": True},
                          outputs=[{"name": "y"}, {"name": "n", "parameters": {"binary_data": False}}])  # fmt: skip
    request = parse_http(body, SIG, len(body) - X.nbytes - len(T))
    data, length = http_response(request, outputs, {"p": 1}, "m", "1")
    assert length is not None
    head = json.loads(data[:length])
    assert head["parameters"] == {"p": 1} and head["model_name"] == "m"
    y, n = head["outputs"]
    assert y["parameters"] == {"note": "kept", "binary_data_size": 16} and "data" not in y
    assert n["data"] == [7, 8] and "parameters" not in n
    assert np.frombuffer(data[length:], np.float32).tolist() == [1, 2, 3, 4]
    json_only, none = http_response(parse_http(json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]},
                    {"name": "t", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}).encode(), SIG),
        outputs, None, "m", "1")  # fmt: skip
    assert none is None and json.loads(json_only)["outputs"][1]["data"] == [7, 8]
    bad = Output("n", "INT64", [3], [1, 2])
    with pytest.raises(KServeError, match="invalid output 'n'") as info:
        bad.raw()
    assert info.value.status == 500


# ---------------------------------------------------------------- gRPC


def grpc_request(**over: Any) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", id="g1")
    message.inputs.add(name="x", datatype="FP32", shape=[2, 2])
    message.inputs.add(name="t", datatype="BYTES", shape=[2])
    message.raw_input_contents.extend([X.tobytes(), T])
    for key, value in over.items():
        setattr(message, key, value) if not callable(value) else value(message)
    return message


def test_grpc_raw_and_typed_contents() -> None:
    parsed = parse_infer(grpc_request(), SIG)
    assert parsed.id == "g1" and parsed.inputs[0].raw == X.tobytes() and parsed.inputs[1].raw == T
    typed = pb.ModelInferRequest(model_name="m")
    x = typed.inputs.add(name="x", datatype="FP32", shape=[2, 2])
    x.contents.fp32_contents.extend(X.flatten().tolist())
    x.parameters["scale"].double_param = 0.5
    t = typed.inputs.add(name="t", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"hi", b"\xff\x00"])
    typed.parameters["mode"].string_param = "fast"
    typed.parameters["timeout"].int64_param = 250_000
    parsed = parse_infer(typed, SIG)
    assert parsed.inputs[0].raw == X.tobytes() and parsed.inputs[1].raw == T
    assert parsed.inputs[0].parameters == {"scale": 0.5}
    assert parsed.parameters == {"mode": "fast"} and parsed.timeout == 0.25


def _extra_raw(m: pb.ModelInferRequest) -> None:
    m.raw_input_contents.append(b"")


def _short_raw(m: pb.ModelInferRequest) -> None:
    m.raw_input_contents[0] = X.tobytes()[:12]


def _both(m: pb.ModelInferRequest) -> None:
    m.inputs[0].contents.fp32_contents.extend([1.0] * 4)


def _binary_param(m: pb.ModelInferRequest) -> None:
    m.parameters["binary_data_output"].bool_param = True


def _unknown_output(m: pb.ModelInferRequest) -> None:
    m.outputs.add(name="zz")


def _typed_wrong_field() -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name="m")
    m.inputs.add(name="x", datatype="FP32", shape=[2, 2]).contents.int_contents.extend([1] * 4)
    m.inputs.add(name="t", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a")
    return m


def _typed_count() -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name="m")
    m.inputs.add(name="x", datatype="FP32", shape=[2, 2]).contents.fp32_contents.extend([1.0] * 3)
    m.inputs.add(name="t", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a")
    return m


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (grpc_request(id="x", model_version="1").__class__(), "'inputs' must be a non-empty list"),
        (grpc_request(extra=_extra_raw), "3 raw_input_contents for 2 inputs"),
        (grpc_request(extra=_short_raw), "12 bytes of FP32 data"),
        (grpc_request(extra=_both), "contents given beside raw_input_contents"),
        (grpc_request(extra=_binary_param), "binary tensor parameter"),
        (grpc_request(extra=_unknown_output), "unknown output"),
        (_typed_wrong_field(), "contents.int_contents given for FP32"),
        (_typed_count(), "3 elements for 4 expected"),
    ],
)
def test_bad_grpc_requests_are_invalid_argument(message: pb.ModelInferRequest, error: str) -> None:
    with pytest.raises(KServeError, match=error) as info:
        parse_infer(message, SIG)
    assert info.value.status == 400 and status_code(400).name == "INVALID_ARGUMENT"


def test_grpc_response_is_raw() -> None:
    class Rt:
        label, name, version = "m@1", "m", "1"

    request = parse_infer(grpc_request(), SIG)
    completed = Completed(json.dumps({"outputs": [
        {"name": "n", "datatype": "INT64", "shape": [2], "data": [3, 4], "parameters": {"k": True}},
        {"name": "y", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]},
    ]}))  # fmt: skip
    response = encode_infer(completed, request, Rt())  # type: ignore[arg-type]
    assert response.id == "g1" and [o.name for o in response.outputs] == ["n", "y"]
    assert response.outputs[0].parameters["k"].bool_param is True
    assert np.frombuffer(response.raw_output_contents[0], np.int64).tolist() == [3, 4]
    assert [status_code(s).name for s in (403, 404, 413, 429, 503, 504, 500)] == [
        "PERMISSION_DENIED", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "UNAVAILABLE",
        "DEADLINE_EXCEEDED", "INTERNAL",
    ]  # fmt: skip


# ---------------------------------------------------------------- batching


def one(rows: list[list[float]], texts: list[bytes]) -> Any:
    x = np.array(rows, dtype=np.float32).reshape(len(rows), 2)
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype="FP32", shape=[len(rows), 2])
    message.inputs.add(name="t", datatype="BYTES", shape=[len(texts)])
    message.raw_input_contents.extend([x.tobytes(), frame(texts)])
    return parse_infer(message, SIG)


def test_merge_split_and_oversize_slices() -> None:
    a, b = one([[1, 2]], [b"a"]), one([[3, 4], [5, 6]], [b"b", b"cc"])
    assert a.batch_key() == b.batch_key()
    merged = merge([a, b])
    assert merged.rows == 3 and merged.inputs[0].shape == (3, 2)
    assert unpack(merged.inputs[1].raw, merged.inputs[1].dt, 3) == ["a", "b", "cc"]
    outputs = [
        Output("y", "FP32", [3, 2], [[1, 2], [3, 4], [5, 6]]),
        Output("n", "INT64", [3], [0, 1, 2]),
    ]
    first, second = split(outputs, [1, 2])
    assert (first[0].shape, first[0].data, first[1].data) == ([1, 2], [1, 2], [0])
    assert (second[0].shape, second[0].data, second[1].data) == ([2, 2], [3, 4, 5, 6], [1, 2])
    with pytest.raises(ValueError, match=r"not \[3, \.\.\.\]"):
        split([Output("n", "INT64", [1], [9])], [1, 2])
    head, tail = slice_rows(b, 0, 1), slice_rows(b, 1, 2)
    assert unpack(tail.inputs[1].raw, tail.inputs[1].dt, 1) == ["cc"] and head.rows == 1
    joined = join([(first, None), (second, {"p": 1})])
    assert joined.outputs is not None and joined.outputs[0].data == [1, 2, 3, 4, 5, 6]
    assert joined.outputs[1].shape == [3]
    with_params = one([[1, 2]], [b"a"])
    with_params.parameters = {"mode": "x"}
    assert with_params.batch_key() != a.batch_key()  # different parameters never share a call


def test_statistics_shape_is_tritons() -> None:
    stats = ModelStats()
    timing = Timing(admitted=1, started=11, compute_input=2, compute_infer=30, compute_output=4)
    stats.execution(3, 2, 30, 4)
    stats.request(timing, True, 3)
    stats.request(Timing(admitted=1), False, 1)
    doc = stats.as_json("m", "1")
    assert doc["inference_count"] == 3 and doc["execution_count"] == 1
    inference = doc["inference_stats"]
    assert inference["success"]["count"] == 1 and inference["fail"]["count"] == 1
    assert inference["queue"] == {"count": 1, "ns": 10}
    assert doc["batch_stats"] == [
        {"batch_size": 3, "compute_input": {"count": 1, "ns": 2},
         "compute_infer": {"count": 1, "ns": 30}, "compute_output": {"count": 1, "ns": 4}}
    ]  # fmt: skip
    # the same document is Triton's gRPC message
    from google.protobuf import json_format

    json_format.ParseDict({"model_stats": [doc]}, pb.ModelStatisticsResponse())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"batching": {"maxBatchSize": 8, "preferredBatchSizes": [4, 2]}},
            "distinct and ascending",
        ),
        ({"batching": {"maxBatchSize": 8, "preferredBatchSizes": [16]}}, "exceed maxBatchSize"),
        ({"batching": {"maxBatchSize": 8, "maxQueueDelay": "2s"}}, "between 0s and 1s"),
        ({"batching": {"maxBatchSize": 0}}, "greater than or equal to 1"),
        ({"batching": {"maxBatchSize": 8, "oversize": "drop"}}, "'refuse' or 'split'"),
        ({"protocols": {"rest": False, "grpc": False}}, "at least one of rest and grpc"),
        ({"repository": {"callers": ["nobody"]}}, "should match pattern"),
    ],
)
def test_function_settings_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServedFunction.model_validate({"name": "m", **settings})
