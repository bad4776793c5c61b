"""The warm request path's faster pieces agree with the plain ones they stand in for: the
orjson decode with the standard library's, the C-pass range check with the element loop, the
piecewise guest JSON with one json.dumps, the cached ORCA header with orca_text, the cached
route with the parser. Each case is run both ways and must give the same value or the same
error."""

from __future__ import annotations

import base64
import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest

from meshfn.contracts.qos import orca_text
from meshfn.inference import kserve, tensors
from meshfn.inference.kserve import (
    HEADER_LENGTH,
    InferRequest,
    KServeError,
    Signature,
    header_length,
    parse_http,
)
from meshfn.inference.qos import Load
from meshfn.inference.server import _model_route, _parse_model_path
from meshfn.inference.tensors import DTYPES, TensorError, flatten_checked
from meshfn.testing.fuzz_targets import SIGNATURES

CORPUS = Path(__file__).resolve().parents[1] / "fuzz" / "corpus" / "kserve"

SIG = Signature.from_metadata(
    {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "n", "datatype": "INT64", "shape": [-1]},
            {"name": "s", "datatype": "BYTES", "shape": [-1]},
            {"name": "b", "datatype": "BOOL", "shape": [-1]},
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }
)


def body(**over: Any) -> dict[str, Any]:
    inputs = {
        "x": {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2]},
        "n": {"name": "n", "datatype": "INT64", "shape": [2], "data": [-(2**63), 2**63 - 1]},
        "s": {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["héllo"]},
        "b": {"name": "b", "datatype": "BOOL", "shape": [2], "data": [True, False]},
    }
    for name, fields in over.items():
        inputs[name] = {**inputs[name], **fields}
    return {"inputs": list(inputs.values())}


def raw_bodies() -> list[bytes]:
    """What the JSON decoders may disagree on, inside a request and as the request."""
    ok = json.dumps(body()).encode()
    cases = [
        ok,
        b"\xef\xbb\xbf" + ok,  # BOM: json.loads accepts it, orjson does not
        ok.decode().encode("utf-16"),  # json.loads detects UTF-16/32 in bytes
        ok.decode().encode("utf-32-le"),
        ok + b" \n\t",
        ok + b"x",
        ok + b"{}",  # "Extra data"
        ok[:-1],
        b"",
        b"\xff\xfe\x00",
        b"[" * 5000 + b"]" * 5000,  # past both decoders' nesting limits
        b'{"inputs": [], "inputs": [1]}',  # duplicate keys: the last wins in both
        b'{"id": "\\ud800", "inputs": []}',  # a lone surrogate escape
        b'{"id": "\xed\xa0\x80"}',  # a surrogate as raw bytes: invalid UTF-8
        b'{"id": "a\x00b"}',  # a raw control character
        b"  null ",
        b"1e400",
    ]
    for data in (
        "[NaN, 1]",
        "[Infinity, 1]",
        "[-Infinity, 1]",
        "[1e400, 1]",
        "[-1e400, 1]",
        "[1, 18446744073709551616]",  # past u64 (orjson's limit): json.loads reads it
        "[1, 18446744073709551615]",
        "[1, -9223372036854775809]",
        "[-0, -0.0]",
        "[1E2, 1e-400]",
        "[1.7976931348623157e308, 1]",
        "[3.4028235e38, 1]",  # past FP32's range
        "[true, 1]",
        "[[1], [2]]",
        "[1, 2, 3]",
        "[1.00000000000000011102230246251565404236316680908203125, 2]",  # exact rounding
    ):
        cases.append(json.dumps(body()).replace("[1.5, 2]", data).encode())
    for data in (
        "[NaN, 1]",
        "[9223372036854775808, 1]",
        "[18446744073709551616, 1]",  # orjson would read it as a float: "not an integer"
        "[1.0, 2]",
        "[-1e400, 1]",
    ):
        cases.append(
            json.dumps(body()).replace("[-9223372036854775808, 9223372036854775807]", data).encode()
        )
    cases.append(json.dumps({**body(), "parameters": {"k": float("nan")}}).encode())
    cases.append(json.dumps({**body(), "parameters": {"timeout": 2**70}}).encode())
    cases.append(json.dumps({**body(), "id": "\u2603", "outputs": [{"name": "y"}]}).encode())
    return cases


def parsed_or_error(data: bytes, signature: Signature, json_length: int | None = None) -> Any:
    try:
        request = parse_http(data, signature, json_length)
    except KServeError as exc:
        return ("error", exc.status, exc.message)
    return ("ok", request, request.guest_json(True), request.guest_json(False))


def stdlib_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every orjson decode fails, so kserve.loads is json.loads: the behaviour before orjson."""

    def refuse(data: Any) -> Any:
        raise orjson.JSONDecodeError("refused", "", 0)

    monkeypatch.setattr(kserve.orjson, "loads", refuse)


def nan_safe(value: Any) -> Any:
    """NaN != NaN: compare the repr of parsed requests that may hold one."""
    return repr(value) if value[0] == "ok" else value


def test_orjson_decode_agrees_with_json_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [(data, SIG, None) for data in raw_bodies()]
    for path in sorted(CORPUS.iterdir()):  # the fuzzer's seeds, decoded as the target does
        data = path.read_bytes()
        if not data:
            continue
        signature = SIGNATURES[(data[0] >> 1) % len(SIGNATURES)]
        binary = data[0] & 1 and len(data) >= 3
        payload = data[3:] if binary else data[1:]
        length = None
        if binary:
            declared = str(struct.unpack_from("<H", data, 1)[0]).encode()
            try:
                length = header_length({HEADER_LENGTH: declared}, len(payload))
            except KServeError:
                continue
        cases.append((payload, signature, length))
    fast = [parsed_or_error(*case) for case in cases]
    stdlib_only(monkeypatch)
    slow = [parsed_or_error(*case) for case in cases]
    for case, a, b in zip(cases, fast, slow, strict=True):
        assert nan_safe(a) == nan_safe(b), case[0][:200]
    assert {r[0] for r in fast} == {"ok", "error"}  # every branch is reached
    # deeper than json.loads goes is a 400 too, never a RecursionError (a 500)
    assert any(r[0] == "error" and "nested too deeply" in r[2] for r in fast)


def test_binary_extension_and_large_bodies_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    values = [rng.uniform(-1e6, 1e6) for _ in range(2 * 50_000)]
    big = json.dumps(body(x={"shape": [50_000, 2], "data": values})).encode()
    header = json.dumps(
        body(x={"shape": [1, 2], "parameters": {"binary_data_size": 8}, "data": None})
    ).replace(', "data": null', "")
    blob = struct.pack("<2f", 1.5, -2.0)
    cases = [
        (big, None),
        (header.encode() + blob, len(header)),
        (header.encode() + blob + b"!", len(header)),  # a byte too many
        (header.encode() + blob[:-1], len(header)),  # a byte short
    ]
    fast = [parsed_or_error(data, SIG, n) for data, n in cases]
    stdlib_only(monkeypatch)
    assert fast == [parsed_or_error(data, SIG, n) for data, n in cases]
    assert fast[0][0] == "ok" and fast[1][0] == "ok"
    assert fast[2][0] == fast[3][0] == "error"


def reference_loop(flat: list[Any], dt: tensors.DType, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        m.setattr(tensors, "_all_in_range", lambda flat, dt: False)
        try:
            return ("ok", flatten_checked(flat, dt))
        except TensorError as exc:
            return ("error", str(exc))


@pytest.mark.parametrize("name", ["FP16", "FP32", "FP64", "INT8", "UINT8", "INT64", "UINT64"])
def test_range_check_agrees_with_the_element_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dt = DTYPES[name]
    specials: list[Any] = [
        0, -1, 1.5, -0.0, True, False, None, "1", math.nan, math.inf, -math.inf, 2**64,
        2**64 - 1, -(2**63), -(2**63) - 1, 10**400, 65504, 65505, 3.4028234663852886e38,
        3.5e38, 1.7976931348623157e308, [1], 255, 256, 127, -128, -129,
    ]  # fmt: skip
    rng = random.Random(name)
    cases = [[], [[1, 2], [3, 4]], [1e308, 1e308], [10**400, 0.5]]
    for _ in range(400):
        cases.append([rng.choice(specials) for _ in range(rng.randint(1, 4))])
    for case in cases:
        expected = reference_loop(case, dt, monkeypatch)
        try:
            got: Any = ("ok", flatten_checked(case, dt))
        except TensorError as exc:
            got = ("error", str(exc))
        assert repr(got) == repr(expected), case


def test_guest_json_is_the_same_text_as_one_json_dumps() -> None:
    """The guest's request, piece by piece, is byte for byte what one json.dumps gave."""
    request = parse_http(
        json.dumps(
            {
                **body(s={"name": "s", "parameters": {"note": 'ünï "q"', "n": 1.5}}),
                "parameters": {"flag": True, "z": "\u2603"},
                "outputs": [{"name": "y", "parameters": {"k": 1}}],
            }
        ).encode(),
        SIG,
    )
    for raw in (True, False):
        assert request.guest_json(raw) == old_guest_json(request, raw)
    plain = parse_http(json.dumps(body()).encode(), SIG)
    assert plain.guest_json(True) == old_guest_json(plain, True)
    assert json.loads(plain.guest_json(True))["inputs"][0] == {
        "name": "x",
        "datatype": "FP32",
        "shape": [1, 2],
        "raw": base64.b64encode(struct.pack("<2f", 1.5, 2)).decode(),
    }


def old_guest_json(request: InferRequest, raw: bool) -> str:
    """The dict + json.dumps formulation the piecewise writer replaced."""
    inputs = []
    for t in request.inputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.dt.name, "shape": list(t.shape)}
        if raw:
            entry["raw"] = base64.b64encode(t.raw).decode("ascii")
        else:
            entry["data"] = tensors.unpack(t.raw, t.dt, tensors.element_count(t.shape))
        if t.parameters:
            entry["parameters"] = t.parameters
        inputs.append(entry)
    out: dict[str, Any] = {"inputs": inputs}
    if request.outputs is not None:
        out["outputs"] = [
            {"name": o.name, **({"parameters": o.parameters} if o.parameters else {})}
            for o in request.outputs
        ]
    if request.parameters:
        out["parameters"] = request.parameters
    return json.dumps(out, separators=(",", ":"))


def test_cached_orca_header_is_orca_text() -> None:
    load = Load(3)
    rng = random.Random(3)
    now = 100.0
    for _ in range(6000):  # more distinct (inflight, rate) pairs than the cache holds
        now += rng.uniform(0, 0.002)
        inflight = rng.randint(0, 40)
        name, value = load.header(inflight, now)
        assert name == b"endpoint-load-metrics"
        assert value == orca_text(inflight, 3, len(load.recent)).encode()
    assert len(load._headers) <= 4096


def test_cached_route_is_the_parser() -> None:
    paths = [
        "/v2/models/m/infer",
        "/v2/models/m/versions/2/infer",
        "/v2/models/m/versions//infer",
        "/v2/models/m/versions",
        "/v2/models//infer",
        "/v2/models/m/bogus",
        "/v2/models/m",
        "/v2/models/" + "m" * 300 + "/infer",  # past the cached length: parsed each time
    ]
    for path in paths * 2:
        assert _model_route(path) == _parse_model_path(path.strip("/").split("/"))
