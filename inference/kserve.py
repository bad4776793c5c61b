"""KServe Open Inference Protocol v2 (JSON) request checks and response envelopes.

Everything a request can get wrong is caught here, on the host, before any wasm runs: the
function is only called with inputs whose names, datatypes, shapes and element counts match its
metadata. Errors use KServe's body `{"error": "..."}`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

_INT_RANGES = {
    "INT8": (-(1 << 7), (1 << 7) - 1),
    "INT16": (-(1 << 15), (1 << 15) - 1),
    "INT32": (-(1 << 31), (1 << 31) - 1),
    "INT64": (-(1 << 63), (1 << 63) - 1),
    "UINT8": (0, (1 << 8) - 1),
    "UINT16": (0, (1 << 16) - 1),
    "UINT32": (0, (1 << 32) - 1),
    "UINT64": (0, (1 << 64) - 1),
}
_FLOATS = {"FP16", "FP32", "FP64"}
_REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
_INPUT_KEYS = {"name", "datatype", "shape", "data", "parameters"}


class KServeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> bytes:
        return error_body(self.message)


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


@dataclass(frozen=True, slots=True)
class TensorSig:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Signature:
    inputs: dict[str, TensorSig]
    outputs: frozenset[str]

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Signature:
        def sig(t: dict[str, Any]) -> TensorSig:
            return TensorSig(str(t["name"]), str(t["datatype"]), tuple(int(d) for d in t["shape"]))

        return cls(
            {t["name"]: sig(t) for t in metadata["inputs"]},
            frozenset(str(t["name"]) for t in metadata["outputs"]),
        )


@dataclass(frozen=True, slots=True)
class Request:
    text: str  # the body as sent: the guest parses it itself
    id: str | None
    outputs: tuple[str, ...] | None = None  # names the client asked for, in its order


def _bad(message: str) -> KServeError:
    return KServeError(400, message)


def _count_and_check(data: Any, datatype: str, name: str) -> int:
    """Number of elements in (possibly nested) `data`, checking each element's type.

    `data` comes from json.loads, so exact type tests are complete (bool is the only subclass,
    of int, and it is rejected where a number is expected); this runs once per element of every
    request, hence one tight loop per kind of datatype.
    """
    count = 0
    stack = [data if type(data) is list else [data]]
    if datatype in _FLOATS:
        isfinite = math.isfinite
        while stack:
            for v in stack.pop():
                t = type(v)
                if t is float:
                    if not isfinite(v):
                        raise _bad(f"input {name!r}: non-finite {datatype} element")
                elif t is list:
                    stack.append(v)
                    continue
                elif t is not int:
                    raise _bad(f"input {name!r}: {datatype} element {v!r} is not a number")
                count += 1
        return count
    ints = _INT_RANGES.get(datatype)
    if ints is not None:
        low, high = ints
        while stack:
            for v in stack.pop():
                t = type(v)
                if t is int:
                    if not low <= v <= high:
                        raise _bad(f"input {name!r}: {v} is out of range for {datatype}")
                elif t is list:
                    stack.append(v)
                    continue
                else:
                    raise _bad(f"input {name!r}: {datatype} element {v!r} is not an integer")
                count += 1
        return count
    # BOOL, or BYTES (strings in JSON)
    want, what = (bool, "true/false") if datatype == "BOOL" else (str, "a string")
    while stack:
        for v in stack.pop():
            t = type(v)
            if t is list:
                stack.append(v)
                continue
            if t is not want:
                raise _bad(f"input {name!r}: {datatype} element {v!r} is not {what}")
            count += 1
    return count


def parse_request(body: bytes, signature: Signature) -> Request:
    try:
        text = body.decode("utf-8")
        request = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise _bad("request body must be a JSON object")
    unknown = set(request) - _REQUEST_KEYS
    if unknown:
        raise _bad(f"unknown request field(s): {', '.join(sorted(unknown))}")
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise _bad("'id' must be a string")
    if not isinstance(request.get("parameters", {}), dict):
        raise _bad("'parameters' must be an object")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _bad("'inputs' must be a non-empty list")
    seen: set[str] = set()
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict):
            raise _bad(f"inputs[{i}] must be an object")
        missing = {"name", "datatype", "shape", "data"} - set(tensor)
        if missing:
            raise _bad(f"inputs[{i}] lacks {', '.join(sorted(missing))}")
        extra = set(tensor) - _INPUT_KEYS
        if extra:
            raise _bad(f"inputs[{i}] has unknown field(s): {', '.join(sorted(extra))}")
        name = tensor["name"]
        if not isinstance(name, str) or name not in signature.inputs:
            known = ", ".join(sorted(signature.inputs))
            raise _bad(f"unknown input {name!r} (this model takes: {known})")
        if name in seen:
            raise _bad(f"input {name!r} given twice")
        seen.add(name)
        sig = signature.inputs[name]
        if tensor["datatype"] != sig.datatype:
            raise _bad(f"input {name!r}: datatype {tensor['datatype']!r}, expected {sig.datatype}")
        shape = tensor["shape"]
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or len(shape) != len(sig.shape)
            or any(want not in (-1, got) for want, got in zip(sig.shape, shape, strict=True))
        ):
            raise _bad(f"input {name!r}: shape {shape!r} does not match {list(sig.shape)}")
        params = tensor.get("parameters", {})
        if not isinstance(params, dict):
            raise _bad(f"input {name!r}: 'parameters' must be an object")
        if "binary_data_size" in params:
            raise _bad("the binary tensor extension is not supported: send JSON data")
        expected = math.prod(shape)
        count = _count_and_check(tensor["data"], sig.datatype, name)
        if count != expected:
            raise _bad(f"input {name!r}: {count} elements for shape {shape} ({expected} expected)")
    absent = set(signature.inputs) - seen
    if absent:
        raise _bad(f"missing input(s): {', '.join(sorted(absent))}")
    outputs = request.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
        ):
            raise _bad("'outputs' must be a list of objects with a name")
        unknown_out = [o["name"] for o in outputs if o["name"] not in signature.outputs]
        if unknown_out:
            raise _bad(f"unknown output(s) requested: {', '.join(unknown_out)}")
        return Request(text, request_id, tuple(o["name"] for o in outputs))
    return Request(text, request_id)


def select_outputs(guest_body: str, names: tuple[str, ...]) -> str | None:
    """Keep only the requested outputs (KServe `outputs`), whatever the guest returned; this is
    the one case where the host parses a guest response. None if it is not valid."""
    try:
        response = json.loads(guest_body)
        by_name = {o["name"]: o for o in response["outputs"]}
        response["outputs"] = [by_name[n] for n in names]
    except (ValueError, KeyError, TypeError):
        return None
    return json.dumps(response, separators=(",", ":"))


def envelope(guest_body: str, model: str, version: str, request_id: str | None) -> bytes | None:
    """Add model_name, model_version and id to the guest's `{"outputs": ...}` object without
    re-parsing it; None if the guest did not return a JSON object."""
    body = guest_body.strip()
    if not body.startswith("{") or not body.endswith("}"):
        return None
    head = f'{{"model_name":{json.dumps(model)},"model_version":{json.dumps(version)}'
    if request_id is not None:
        head += f',"id":{json.dumps(request_id)}'
    rest = body[1:].lstrip()
    return (head + ("" if rest.startswith("}") else ",") + rest).encode()


def model_metadata(name: str, versions: list[str], metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "versions": versions,
        "platform": metadata.get("platform", "meshfn-wasm"),
        "inputs": metadata["inputs"],
        "outputs": metadata["outputs"],
    }
