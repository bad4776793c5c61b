"""KServe Open Inference Protocol v2 over HTTP/REST: JSON requests, Triton's binary tensor data
extension, and the protocol-neutral request every front end (REST, gRPC) produces.

Everything a request can get wrong is caught here, on the host, before any wasm runs: the
function is only called with inputs whose names, datatypes, shapes and element counts match its
metadata, whichever way the data arrived. Errors use KServe's body `{"error": "..."}`.

The binary extension: with the `Inference-Header-Content-Length: N` header the body is an
N-byte JSON header followed by raw tensor data; an input with `parameters.binary_data_size: S`
takes the next S bytes (in input order) instead of `data`. Responses put an output in binary
form when its `parameters.binary_data` says so, or, by default, when the request parameter
`binary_data_output` does; the header length then travels back in the same header.
"""

from __future__ import annotations

import base64
import functools
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from meshfn.common import peerjson

from .tensors import (
    DType,
    TensorError,
    check_raw,
    dtype,
    element_count,
    frame,
    json_to_raw,
    unpack,
)

HEADER_LENGTH = b"inference-header-content-length"
_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs", "model_name", "model_version"}
_INPUT_KEYS = {"name", "datatype", "shape", "data", "parameters"}
_OUTPUT_KEYS = {"name", "parameters"}
_SCALARS = (str, int, float, bool)
# Extensions meshfn does not implement: a request that relies on one is refused rather than
# answered as if the parameter were not there.
_UNSUPPORTED = {
    "shared_memory_region": "the shared-memory extensions are not supported",
    "shared_memory_byte_size": "the shared-memory extensions are not supported",
    "shared_memory_offset": "the shared-memory extensions are not supported",
    "classification": "the classification extension is not supported",
    "sequence_id": "sequence batching is not supported",
    "sequence_start": "sequence batching is not supported",
    "sequence_end": "sequence batching is not supported",
}


class KServeError(Exception):
    headers: tuple[tuple[bytes, bytes], ...] = ()  # e.g. a QoS refusal's Retry-After

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> bytes:
        return error_body(self.message)


def loads(data: bytes) -> Any:
    """JSON as `json.loads` reads it, decoded by orjson (~5x faster on request bodies) when it
    can. What orjson refuses (NaN/Infinity literals, floats that overflow, UTF-16/32 or
    BOM-prefixed bodies, nesting past 1,024, malformed JSON) is read again by `json.loads`, so
    the values accepted and the errors raised stay the standard library's. orjson reads an
    integer past 64 bits as a float where json.loads keeps it exact: a body with a run of 20 or
    more digits (every integer of 19 digits fits) goes to json.loads directly (found with
    bytes.translate + find, ~20x faster than a regular expression)."""
    if _LONG_RUN not in data.translate(_DIGIT_MAP):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return peerjson.loads(data)


_DIGIT_MAP = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))  # digit -> "0"
_LONG_RUN = b"0" * 20


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def bad(message: str) -> KServeError:
    return KServeError(400, message)


@dataclass(frozen=True, slots=True)
class TensorSig:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Signature:
    inputs: dict[str, TensorSig]
    outputs: dict[str, TensorSig]
    # Every input and output has a variable first dimension (the batch dimension); asked on
    # every request (statistics count rows), so computed once.
    batchable: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        tensors = [*self.inputs.values(), *self.outputs.values()]
        batchable = all(t.shape and t.shape[0] == -1 for t in tensors)
        object.__setattr__(self, "batchable", batchable)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Signature:
        def sig(t: dict[str, Any]) -> TensorSig:
            return TensorSig(str(t["name"]), str(t["datatype"]), tuple(int(d) for d in t["shape"]))

        return cls(
            {t["name"]: sig(t) for t in metadata["inputs"]},
            {t["name"]: sig(t) for t in metadata["outputs"]},
        )

    def check_shape(self, name: str, shape: Any) -> tuple[int, ...]:
        sig = self.inputs[name]
        want = sig.shape
        if isinstance(shape, list | tuple) and len(shape) == len(want):
            for w, d in zip(want, shape, strict=True):
                # exact int (bool is an int subclass); int subclasses take the general test
                if not (type(d) is int or (isinstance(d, int) and not isinstance(d, bool))):
                    break
                if d < 0 or w not in (-1, d):
                    break
            else:
                return tuple(shape)
        shown = list(shape) if isinstance(shape, list | tuple) else shape
        if isinstance(shape, list | tuple) and any(type(d) is int and d < 0 for d in shape):
            raise bad(
                f"input {name!r}: shape {shown!r} has a negative dimension (a request's shape "
                f"is its data's; -1 marks a variable dimension in metadata only: {list(want)})"
            )
        raise bad(f"input {name!r}: shape {shown!r} does not match {list(want)}")

    def input_named(self, name: Any, seen: set[str]) -> TensorSig:
        if not isinstance(name, str) or name not in self.inputs:
            known = ", ".join(sorted(self.inputs))
            raise bad(f"unknown input {name!r} (this model takes: {known})")
        if name in seen:
            raise bad(f"input {name!r} given twice")
        seen.add(name)
        return self.inputs[name]

    def check_complete(self, seen: set[str]) -> None:
        absent = set(self.inputs) - seen
        if absent:
            raise bad(f"missing input(s): {', '.join(sorted(absent))}")

    def check_outputs(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.outputs]
        if unknown:
            raise bad(f"unknown output(s) requested: {', '.join(unknown)}")
        if len(set(names)) != len(names):
            raise bad("an output is requested twice")


@dataclass(slots=True)
class Input:
    name: str
    dt: DType
    shape: tuple[int, ...]
    raw: bytes  # checked against shape and datatype (tensors.py layout)
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Requested:
    name: str
    binary: bool | None = None  # REST: parameters.binary_data; None: the request's default
    parameters: dict[str, Any] = field(default_factory=dict)  # passed to the function


@dataclass(slots=True)
class InferRequest:
    """A validated inference request, whichever front end it came through."""

    id: str | None
    inputs: list[Input]
    parameters: dict[str, Any] = field(default_factory=dict)  # passed to the function
    outputs: list[Requested] | None = None
    binary_output: bool = False  # REST: binary_data_output
    timeout: float | None = None  # seconds the client allows (Triton's `timeout` parameter)

    @property
    def rows(self) -> int:
        """The first dimension: how many rows this request adds to a batch."""
        return self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else 1

    def guest_json(self, raw: bool = True) -> str:
        """The request as the guest reads it (functions/wit/model.wit): every input's data as
        `raw` (base64 of the raw layout) for guests that take it, else as JSON `data`."""
        # Written piece by piece rather than through one json.dumps of a dict: the same text
        # (tests/inference/test_inference_units.py compares), at half the cost on small requests. Only
        # the name and the client's values need JSON escaping; datatype, shape and base64 do not.
        parts = []
        for t in self.inputs:
            shape = ",".join([str(d) for d in t.shape])
            head = f'{{"name":{_json_string(t.name)},"datatype":"{t.dt.name}","shape":[{shape}],'
            if raw:
                data = f'"raw":"{base64.b64encode(t.raw).decode("ascii")}"'
            else:
                data = '"data":' + _compact(unpack(t.raw, t.dt, element_count(t.shape)))
            if t.parameters:
                data += ',"parameters":' + _compact(t.parameters)
            parts.append(head + data + "}")
        text = '{"inputs":[' + ",".join(parts) + "]"
        if self.outputs is not None:
            outputs = [
                {"name": o.name, **({"parameters": o.parameters} if o.parameters else {})}
                for o in self.outputs
            ]
            text += ',"outputs":' + _compact(outputs)
        if self.parameters:
            text += ',"parameters":' + _compact(self.parameters)
        return text + "}"

    def batch_key(self) -> str:
        """Requests with equal keys may share one guest call: the same parameters, outputs and
        per-input trailing dimensions (only the first dimension may differ)."""
        return json.dumps(
            [
                self.parameters,
                [(t.name, t.shape[1:], t.parameters) for t in self.inputs],
                None if self.outputs is None else [(o.name, o.parameters) for o in self.outputs],
            ],
            sort_keys=True,
            separators=(",", ":"),
        )


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _json_string(text: str) -> str:
    """A name as a JSON string (names are the signature's: few, so cached)."""
    return json.dumps(text)


# ---------------------------------------------------------------- parameters


def check_parameters(params: Any, where: str) -> dict[str, Any]:
    """KServe parameters: an object of string, number or boolean values."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise bad(f"{where}: 'parameters' must be an object")
    for key, value in params.items():
        if not isinstance(value, _SCALARS):
            raise bad(f"{where}: parameter {key!r} must be a string, number or boolean")
        if key in _UNSUPPORTED:
            raise bad(f"{where}: parameter {key!r}: {_UNSUPPORTED[key]}")
    return params


def _flag(params: dict[str, Any], key: str, where: str) -> bool | None:
    value = params.pop(key, None)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{where}: {key} must be true or false")
    return value


def _no_other_binary(params: dict[str, Any], allowed: str | None, where: str) -> None:
    for key in params:
        if key.startswith("binary_data") and key != allowed:
            where_ok = f" (only {allowed} is known here)" if allowed else ""
            raise bad(f"{where}: unknown binary tensor parameter {key!r}{where_ok}")


def request_timeout(params: dict[str, Any]) -> float | None:
    """Triton's `timeout` request parameter (microseconds), consumed by the host."""
    value = params.pop("timeout", None)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad("parameter 'timeout' must be a non-negative integer (microseconds)")
    return value / 1e6


# ---------------------------------------------------------------- HTTP bodies


def header_length(headers: dict[bytes, bytes], body_length: int) -> int | None:
    """The binary extension's JSON header length, checked against the body."""
    raw = headers.get(HEADER_LENGTH)
    if raw is None:
        return None
    text = raw.decode("latin-1").strip()
    if not text.isdigit():
        raise bad(f"Inference-Header-Content-Length {text!r} is not a byte count")
    length = int(text)
    if length > body_length:
        raise bad(
            f"Inference-Header-Content-Length {length} is past the end of the "
            f"{body_length}-byte body"
        )
    return length


# Triton's extensions meshfn does not offer (the server metadata's `extensions` does not list
# them): what a client that calls one over REST or gRPC is told.
UNSUPPORTED = {
    "system_shared_memory": "system shared memory (send tensors in the request)",
    "cuda_shared_memory": "CUDA shared memory (send tensors in the request)",
    "trace": "Triton's trace extension",
    "logging": "Triton's logging extension",
}


def unsupported(extension: str) -> str:
    return f"meshfn does not support {UNSUPPORTED[extension]}"


# Content codings (RFC 9110 8.4.1) tritonclient sends and accepts: its
# request_compression_algorithm / response_compression_algorithm. "deflate" is the zlib format.
_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
COMPRESS_MIN_BYTES = 1024  # smaller responses go as they are: compressing them buys nothing


def inflate(body: bytes, encoding: bytes, limit: int) -> bytes:
    """A request body in its Content-Encoding, decoded to at most `limit` bytes: a body that
    inflates past the limit is a 413 however small it arrived (a compression bomb costs the
    limit, never memory), and a stream that is corrupt, cut short or followed by more bytes is
    a 400 rather than part of a body."""
    encoding = encoding.strip().lower()
    if encoding in (b"", b"identity"):
        return body
    wbits = _WBITS.get(encoding)
    name = encoding.decode("latin-1")
    if wbits is None:
        raise KServeError(415, f"Content-Encoding {name} is not supported (gzip, deflate)")
    decoder = zlib.decompressobj(wbits)
    try:
        out = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise bad(f"request body is not valid {name} data: {exc}") from None
    if len(out) > limit:
        raise KServeError(413, f"request body inflates past {limit} bytes ({name})")
    if not decoder.eof:
        raise bad(f"request body is a truncated {name} stream")
    if decoder.unused_data:
        raise bad(f"{len(decoder.unused_data)} bytes after the end of the {name} stream")
    return out


def response_coding(accept: bytes | None) -> bytes | None:
    """The coding to send a response in, from Accept-Encoding (gzip before deflate; a coding
    with q=0 is refused), or None for the body as it is."""
    if not accept:
        return None
    wanted = {}
    for item in accept.lower().split(b","):
        token, _, params = item.partition(b";")
        quality = 1.0
        for param in params.split(b";"):
            key, _, value = param.strip().partition(b"=")
            if key == b"q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        wanted[token.strip()] = quality
    for coding in (b"gzip", b"deflate"):
        if wanted.get(coding, wanted.get(b"*", 0.0)) > 0:
            return coding
    return None


def compress(body: bytes, coding: bytes) -> bytes:
    """`body` in `coding` (gzip or deflate), at zlib's fastest level: on a 13 KB JSON response
    of random floats level 1 was 4% larger than level 6 in 55% of its time (240 vs 433 us)."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, _WBITS[coding])
    return compressor.compress(body) + compressor.flush()


def parse_http(
    body: bytes,
    signature: Signature,
    json_length: int | None = None,
    model: tuple[str, str] | None = None,
) -> InferRequest:
    """A REST inference body (JSON, or with `json_length` the binary extension's layout; a
    `json_length` of 0 is its raw binary request: the body is the one input's data). `model`:
    the (name, version) the path chose, which a body's model_name/model_version must match."""
    if json_length == 0:
        return _raw_binary_request(body, signature)
    head = body if json_length is None else body[:json_length]
    blob = b"" if json_length is None else body[json_length:]
    request = _request_object(head, json_length)
    if "model_name" in request or "model_version" in request:
        _check_named_model(request, model)
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad("'id' must be a string")
    params, binary_output, timeout = _request_parameters(request.get("parameters"))
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise bad("'inputs' must be a non-empty list")
    seen: set[str] = set()
    parsed: list[Input] = []
    offset = 0
    for i, tensor in enumerate(inputs):
        tensor_in, offset = _input(i, tensor, signature, seen, blob, offset, json_length)
        parsed.append(tensor_in)
    if offset != len(blob):
        raise bad(
            f"{len(blob) - offset} bytes of binary data after the inputs that claim "
            f"{offset} (binary_data_size must cover the data exactly)"
        )
    signature.check_complete(seen)
    return InferRequest(
        request_id,
        parsed,
        params,
        _requested_outputs(request.get("outputs"), signature),
        binary_output,
        timeout,
    )


def _request_object(head: bytes, json_length: int | None) -> dict[str, Any]:
    """The request's JSON object, with only the fields KServe v2 defines."""
    try:
        request = loads(head)
    except (UnicodeDecodeError, ValueError) as exc:
        hint = ""
        trailing = isinstance(exc, UnicodeDecodeError) or "Extra data" in str(exc)
        if json_length is None and trailing:
            hint = " (binary tensor data needs the Inference-Header-Content-Length header)"
        raise bad(f"request body is not valid JSON: {exc}{hint}") from None
    if not isinstance(request, dict):
        raise bad("request body must be a JSON object")
    if not _REQUEST_KEYS.issuperset(request):
        unknown = set(request) - _REQUEST_KEYS
        raise bad(f"unknown request field(s): {', '.join(sorted(unknown))}")
    return request


def _input(
    i: int, tensor: Any, signature: Signature, seen: set[str], blob: bytes, offset: int,
    json_length: int | None,
) -> tuple[Input, int]:  # fmt: skip
    """inputs[i], checked against the signature (its name is added to `seen`), and the offset
    of the next input's binary data in `blob`."""
    if not isinstance(tensor, dict):
        raise bad(f"inputs[{i}] must be an object")
    if not ("name" in tensor and "datatype" in tensor and "shape" in tensor):
        missing = {"name", "datatype", "shape"} - set(tensor)
        raise bad(f"inputs[{i}] lacks {', '.join(sorted(missing))}")
    if not _INPUT_KEYS.issuperset(tensor):
        extra = set(tensor) - _INPUT_KEYS
        raise bad(f"inputs[{i}] has unknown field(s): {', '.join(sorted(extra))}")
    sig = signature.input_named(tensor["name"], seen)
    name = sig.name
    if tensor["datatype"] != sig.datatype:
        raise bad(f"input {name!r}: datatype {tensor['datatype']!r}, expected {sig.datatype}")
    shape = signature.check_shape(name, tensor["shape"])
    where = f"input {name!r}"
    tparams: dict[str, Any] = {}
    size = None
    if tensor.get("parameters") is not None:  # (none: nothing to check or take)
        tparams = dict(check_parameters(tensor["parameters"], where))
        size = tparams.pop("binary_data_size", None)
        _no_other_binary(tparams, None, where)
    dt, count = dtype(sig.datatype), element_count(shape)
    try:
        if size is None:
            if "data" not in tensor:
                raise bad(f"inputs[{i}] lacks data (or parameters.binary_data_size)")
            raw = json_to_raw(tensor["data"], dt, shape)
        else:
            raw = _binary_data(tensor, size, blob, offset, json_length, where)
            offset += size
            check_raw(raw, dt, count)
    except TensorError as exc:
        raise bad(f"{where}: {exc}") from None
    return Input(name, dt, shape, raw, tparams), offset


def _binary_data(
    tensor: dict[str, Any], size: Any, blob: bytes, offset: int, json_length: int | None,
    where: str,
) -> bytes:  # fmt: skip
    """An input's data from the binary extension's part of the body: `size` bytes at `offset`."""
    if json_length is None:
        raise bad(f"{where}: binary_data_size needs the Inference-Header-Content-Length header")
    if "data" in tensor:
        raise bad(f"{where}: both data and binary_data_size given")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"{where}: binary_data_size must be a non-negative integer")
    if offset + size > len(blob):
        raise bad(
            f"{where}: binary_data_size {size} runs past the end of the binary data "
            f"({len(blob) - offset} bytes left)"
        )
    return blob[offset : offset + size]


def _check_named_model(request: dict[str, Any], model: tuple[str, str] | None) -> None:
    """Triton's examples put model_name (and clients model_version) in the body too: taken
    when it names the model of the path, refused when it names another."""
    for key, chosen in zip(("model_name", "model_version"), model or (None, None), strict=True):
        if key not in request:
            continue
        value = request[key]
        if not isinstance(value, str):
            raise bad(f"'{key}' must be a string")
        if chosen is not None and value and value != chosen:  # "": none named, as over gRPC
            raise bad(f"'{key}' is {value!r}, but the request's path names {chosen!r}")


def _raw_binary_request(body: bytes, signature: Signature) -> InferRequest:
    """Triton's raw binary request (Inference-Header-Content-Length: 0): no JSON header, the
    body is the data of the model's only input, whose shape follows from the byte count (at
    most one variable dimension; BYTES: one element). Every output comes back binary."""
    where = "a raw binary request (Inference-Header-Content-Length: 0)"
    if len(signature.inputs) != 1:
        raise bad(
            f"{where} needs a model with exactly one input; this one takes "
            f"{', '.join(sorted(signature.inputs))}"
        )
    (sig,) = signature.inputs.values()
    dt = dtype(sig.datatype)
    if dt.kind == "bytes":
        if any(d not in (-1, 1) for d in sig.shape):
            raise bad(f"{where}: BYTES input {sig.name!r} of shape {list(sig.shape)} is not [1]")
        shape = tuple(1 for _ in sig.shape)
        raw = frame([body])
    else:
        variable = [i for i, d in enumerate(sig.shape) if d == -1]
        if len(variable) > 1:
            raise bad(
                f"{where}: input {sig.name!r} has {len(variable)} variable dimensions "
                f"({list(sig.shape)}); its shape cannot follow from the byte count"
            )
        fixed = element_count([d for d in sig.shape if d != -1])
        row = fixed * dt.size
        if row == 0 or len(body) % row or (not variable and len(body) != row):
            raise bad(
                f"{where}: {len(body)} bytes of {dt.name} do not fill input {sig.name!r} "
                f"of shape {list(sig.shape)} ({row} bytes per {'row' if variable else 'tensor'})"
            )
        shape = tuple(len(body) // row if d == -1 else d for d in sig.shape)
        raw = body
        try:
            check_raw(raw, dt, element_count(shape))
        except TensorError as exc:
            raise bad(f"{where}: input {sig.name!r}: {exc}") from None
    return InferRequest(None, [Input(sig.name, dt, shape, raw)], binary_output=True)


def _request_parameters(given: Any) -> tuple[dict[str, Any], bool, float | None]:
    """The request's own parameters (checked), binary_data_output and the timeout."""
    if given is None:  # the usual case: nothing to check or take
        return {}, False, None
    params = dict(check_parameters(given, "request"))
    binary_output = _flag(params, "binary_data_output", "request") or False
    _no_other_binary(params, None, "request")
    return params, binary_output, request_timeout(params)


def _requested_outputs(outputs: Any, signature: Signature) -> list[Requested] | None:
    if outputs is None or outputs == []:  # none named: all of them (as gRPC and Triton read it)
        return None
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise bad("'outputs' must be a list of objects with a name")
    requested = []
    for o in outputs:
        extra = set(o) - _OUTPUT_KEYS
        if extra:
            raise bad(f"output {o['name']!r} has unknown field(s): {', '.join(sorted(extra))}")
        where = f"output {o['name']!r}"
        params = dict(check_parameters(o.get("parameters"), where))
        binary = _flag(params, "binary_data", where)
        _no_other_binary(params, None, where)
        requested.append(Requested(o["name"], binary, params))
    signature.check_outputs([r.name for r in requested])
    return requested


# ---------------------------------------------------------------- responses


@dataclass(slots=True)
class Output:
    """One output as the guest returned it: JSON data (checked when it is encoded), or, from a
    compiled model (ABI v2), `packed` raw bytes whose size the host checked against the shape
    (`data` is then None: JSON responses unpack it, binary and gRPC ones send it as it is)."""

    name: str
    datatype: str
    shape: list[int]
    data: Any
    parameters: dict[str, Any] | None = None
    packed: bytes | None = None

    def raw(self) -> bytes:
        if self.packed is not None:
            return self.packed
        try:
            return json_to_raw(self.data, dtype(self.datatype), self.shape, finite=False)
        except TensorError as exc:
            raise KServeError(
                500, f"the function returned an invalid output {self.name!r}: {exc}"
            ) from None

    def values(self) -> Any:
        """The data as JSON values (flat, row-major, for packed outputs)."""
        if self.packed is None:
            return self.data
        return unpack(self.packed, dtype(self.datatype), element_count(self.shape))

    def as_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "datatype": self.datatype,
            "shape": self.shape,
            "data": self.values(),
        }
        if self.parameters:
            out["parameters"] = self.parameters
        return out


def parse_guest_outputs(text: str, label: str) -> tuple[list[Output], dict[str, Any] | None]:
    """The guest's `{"outputs": [...], "parameters"?: {...}}`; 500 if it is not that shape."""
    try:
        response = json.loads(text)
        outputs = [
            Output(
                str(o["name"]),
                str(o["datatype"]),
                [int(d) for d in o["shape"]],
                o["data"],
                o.get("parameters") or None,
            )
            for o in response["outputs"]
        ]
        params = response.get("parameters") or None
        if params is not None and not isinstance(params, dict):
            raise TypeError("parameters")
    except (ValueError, KeyError, TypeError) as exc:
        raise KServeError(
            500, f"function {label} returned a response that is not KServe outputs: {exc}"
        ) from None
    return outputs, params


def select(outputs: list[Output], requested: list[Requested] | None, label: str) -> list[Output]:
    """The requested outputs in the requested order (all of them if none were named)."""
    if requested is None:
        return outputs
    by_name = {o.name: o for o in outputs}
    missing = [r.name for r in requested if r.name not in by_name]
    if missing:
        raise KServeError(500, f"function {label} did not return output(s) {', '.join(missing)}")
    return [by_name[r.name] for r in requested]


def envelope(guest_body: str, model: str, version: str, request_id: str | None) -> bytes | None:
    """Add model_name, model_version and id to the guest's `{"outputs": ...}` object without
    re-parsing it (the JSON fast path); None if the guest did not return a JSON object."""
    body = guest_body.strip()
    if not body.startswith("{") or not body.endswith("}"):
        return None
    head = _envelope_head(model, version)
    if request_id is not None:
        head += f',"id":{json.dumps(request_id)}'
    rest = body[1:].lstrip()
    return (head + ("" if rest.startswith("}") else ",") + rest).encode()


@functools.lru_cache(maxsize=1024)
def _envelope_head(model: str, version: str) -> str:
    return f'{{"model_name":{json.dumps(model)},"model_version":{json.dumps(version)}'


def http_response(
    request: InferRequest,
    outputs: list[Output],
    parameters: dict[str, Any] | None,
    model: str,
    version: str,
) -> tuple[bytes, int | None]:
    """The REST response body, and the JSON header's length when some output is binary."""
    wanted = {r.name: r.binary for r in request.outputs or []}
    entries, blobs = [], []
    for out in outputs:
        binary = wanted.get(out.name)
        if binary is None:
            binary = request.binary_output
        if binary:
            raw = out.raw()
            blobs.append(raw)
            entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": out.shape}
            entry["parameters"] = {**(out.parameters or {}), "binary_data_size": len(raw)}
            entries.append(entry)
        else:
            entries.append(out.as_json())
    response: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.id is not None:
        response["id"] = request.id
    if parameters:
        response["parameters"] = parameters
    response["outputs"] = entries
    head = json.dumps(response, separators=(",", ":")).encode()
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)


def platform_of(metadata: dict[str, Any]) -> str:
    """The platform a function's metadata names (model metadata and model configuration)."""
    return str(metadata.get("platform", "meshfn-wasm"))


def model_metadata(name: str, versions: list[str], metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "versions": versions,
        "platform": platform_of(metadata),
        "inputs": metadata["inputs"],
        "outputs": metadata["outputs"],
    }


def model_config(
    name: str,
    signature: Signature,
    platform: str,
    instances: int,
    max_batch_size: int = 0,
    preferred_batch_sizes: tuple[int, ...] = (),
    max_queue_delay_us: int = 0,
    decoupled: bool = False,
) -> dict[str, Any]:
    """Triton's model configuration extension (GET /v2/models/{m}/config, gRPC ModelConfig), in
    the JSON form of Triton's ModelConfig message. perf_analyzer and model_analyzer read it
    before they send a request: max_batch_size > 0 (dynamic batching) takes the batch dimension
    out of `dims`, a tensor with no other dimension is dims [1] reshaped to [] as Triton writes
    it, and the model is not decoupled (one response per request, also on a stream) unless it
    generates text (`decoupled`: many responses per request on a stream)."""

    def tensor(sig: TensorSig) -> dict[str, Any]:
        dims = list(sig.shape[1:] if max_batch_size else sig.shape)
        out: dict[str, Any] = {
            "name": sig.name,
            "data_type": "TYPE_STRING" if sig.datatype == "BYTES" else f"TYPE_{sig.datatype}",
            "dims": dims or [1],
        }
        if not dims:
            out["reshape"] = {"shape": []}
        return out

    config: dict[str, Any] = {
        "name": name,
        "platform": platform,
        "backend": "meshfn",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": max_batch_size,
        "input": [tensor(t) for t in signature.inputs.values()],
        "output": [tensor(t) for t in signature.outputs.values()],
        "instance_group": [{"name": name, "kind": "KIND_CPU", "count": instances}],
        "model_transaction_policy": {"decoupled": decoupled},
    }
    if max_batch_size:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(preferred_batch_sizes),
            "max_queue_delay_microseconds": max_queue_delay_us,
        }
    return config
