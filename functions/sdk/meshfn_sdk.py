"""meshfn guest SDK: write a model as a plain Python class; the SDK speaks KServe v2 JSON.

Runs inside the wasm guest (CPython via componentize-py) and, for unit tests, on the host. It
uses only the standard library: numpy does not exist inside the guest.

    class Model(meshfn_sdk.Model):
        def predict(self, inputs, parameters):
            x = inputs["input-0"].rows()
            return [meshfn_sdk.Tensor("label", "INT64", [len(x)], [...])]

The host has already checked input names, datatypes, shapes and element counts against the
function's metadata before `infer` is called, so models only check what metadata cannot express.
"""

from __future__ import annotations

import binascii
import contextlib
import json
import struct
import sys
from array import array
from collections.abc import Iterator
from typing import Any


class _Discard:
    """Guests have no console (WASI is stubbed out): print() goes nowhere instead of trapping."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


if sys.platform == "wasi":  # inside the guest only; never on a host importing the SDK
    sys.stdout = sys.stderr = _Discard()  # type: ignore[assignment]


class BadRequest(Exception):
    """Raise from `predict` when the input is well-formed but unacceptable (HTTP 400)."""


class Tensor:
    """One KServe v2 tensor with row-major flat `data`."""

    __slots__ = ("data", "datatype", "name", "parameters", "shape")

    def __init__(
        self,
        name: str,
        datatype: str,
        shape: list[int],
        data: list[Any],
        parameters: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.datatype = datatype
        self.shape = shape
        self.data = data
        self.parameters = parameters or {}

    def rows(self) -> list[list[Any]]:
        """The data split along the first dimension (a batch of flat rows)."""
        if not self.shape:
            return [self.data]
        n = self.shape[0]
        width = len(self.data) // n if n else 0
        return [self.data[i * width : (i + 1) * width] for i in range(n)]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "datatype": self.datatype,
            "shape": self.shape,
            "data": self.data,
        }
        if self.parameters:
            out["parameters"] = self.parameters
        return out


class Settings:
    """A generation's settings, already checked by the host against the function's bounds."""

    __slots__ = ("max_tokens", "seed", "stop", "temperature", "top_p")

    def __init__(self, values: dict[str, Any]) -> None:
        self.max_tokens: int = int(values.get("max_tokens", 16))
        self.temperature: float = float(values.get("temperature", 1.0))
        self.top_p: float = float(values.get("top_p", 1.0))
        seed = values.get("seed")
        self.seed: int | None = None if seed is None else int(seed)
        self.stop: list[str] = list(values.get("stop") or [])


class Piece:
    """Text a generator yields with how many completion tokens made it (a plain str counts
    as one token)."""

    __slots__ = ("text", "tokens")

    def __init__(self, text: str, tokens: int = 1) -> None:
        self.text = text
        self.tokens = tokens


class Model:
    """Subclass and implement `predict` (KServe inference) or `generate` (a generative model:
    function.toml `[generate] engine = "generator"`)."""

    def predict(self, inputs: dict[str, Tensor], parameters: dict[str, Any]) -> list[Tensor]:
        raise NotImplementedError

    def generate(self, prompt: str, settings: Settings) -> Iterator[str | Piece]:
        """Yield the completion of `prompt` piece by piece (str or Piece); return "length" if
        it ended at max_tokens, else it ended with "stop". The host stops asking for pieces
        once max_tokens, a stop sequence or the deadline is reached, or the client is gone."""
        raise BadRequest("this model does not generate text")

    def count_tokens(self, prompt: str) -> int:
        """The prompt's length in the model's own tokens (usage.prompt_tokens); default: its
        UTF-8 bytes."""
        return len(prompt.encode("utf-8"))


class ModelError(Exception):
    """Carries the WIT `infer-error` case from `handle` to the component glue."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def flatten(data: Any) -> list[Any]:
    """KServe allows nested row-major arrays in JSON; the models see flat lists."""
    if not isinstance(data, list):
        return [data]
    if not data or not isinstance(data[0], list):
        return data
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


# Raw input data is little-endian (as wasm memory is); array type codes of the fixed sizes.
_CODES = {
    "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q",
    "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q",
    "FP32": "f", "FP64": "d",
}  # fmt: skip


def decode_raw(datatype: str, text: str) -> list[Any]:
    """An input's base64 `raw` data (what the host sends: functions/wit/model.wit) as a flat
    list: numbers, booleans, or for BYTES each element as str (bytes if not UTF-8)."""
    raw = binascii.a2b_base64(text)
    if datatype == "BYTES":
        out: list[Any] = []
        offset = 0
        while offset < len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            element = raw[offset + 4 : offset + 4 + length]
            offset += 4 + length
            try:
                out.append(element.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(element)
        return out
    if datatype == "BOOL":
        return [b != 0 for b in raw]
    if datatype == "FP16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    return array(_CODES[datatype], raw).tolist()


def _data(spec: dict[str, Any]) -> list[Any]:
    if "raw" in spec:
        return decode_raw(spec["datatype"], spec["raw"])
    return flatten(spec["data"])


def handle(model: Model, request_json: str) -> str:
    """One KServe v2 request body in, the response body out; errors as ModelError."""
    try:
        request = json.loads(request_json)
        inputs = {
            spec["name"]: Tensor(
                spec["name"],
                spec["datatype"],
                list(spec["shape"]),
                _data(spec),
                spec.get("parameters"),
            )
            for spec in request["inputs"]
        }
        outputs = model.predict(inputs, request.get("parameters") or {})
        wanted = [o["name"] for o in request.get("outputs") or []]
        if wanted:
            by_name = {t.name: t for t in outputs}
            missing = [n for n in wanted if n not in by_name]
            if missing:
                raise BadRequest(f"unknown output(s) requested: {', '.join(missing)}")
            outputs = [by_name[n] for n in wanted]
        # The host adds model_name, model_version and id (it knows the served name).
        return json.dumps({"outputs": [t.to_json() for t in outputs]}, separators=(",", ":"))
    except MemoryError:
        # The big allocations are unreachable by now, so there is room to build this message.
        raise ModelError("out-of-memory", "the model ran out of memory") from None
    except BadRequest as exc:
        raise ModelError("bad-request", str(exc)) from None
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError("internal", f"{type(exc).__name__}: {exc}") from None


class _Generation:
    """The instance's current generation (one at a time; a new start ends the last). Its
    first piece is made at the start, so a generator that refuses its prompt (BadRequest
    before it yields) refuses the start: nothing is generated."""

    pieces: Iterator[str | Piece] | None = None
    first: str | Piece | None = None
    done: str | None = None


_GENERATION = _Generation()


def generate_start(model: Model, request_json: str) -> str:
    """Start a generation (WIT generate-start); errors as ModelError."""
    try:
        request = json.loads(request_json)
        prompt = request["prompt"]
        settings = Settings(request)
        _GENERATION.pieces, _GENERATION.first, _GENERATION.done = None, None, None
        count = model.count_tokens(prompt)
        pieces = iter(model.generate(prompt, settings))
        try:
            _GENERATION.first = next(pieces)
            _GENERATION.pieces = pieces
        except StopIteration as end:
            _GENERATION.done = "length" if end.value == "length" else "stop"
        return json.dumps({"prompt_tokens": int(count)})
    except Exception as exc:
        raise _model_error(exc) from None


def generate_next(model: Model) -> str:
    """The next piece of the current generation (WIT generate-next)."""
    if _GENERATION.first is not None:
        piece, _GENERATION.first = _GENERATION.first, None
        return _piece_json(piece)
    if _GENERATION.done is not None or _GENERATION.pieces is None:
        reason = _GENERATION.done or "stop"
        return json.dumps({"done": True, "finish_reason": reason})
    try:
        piece = next(_GENERATION.pieces)
    except StopIteration as end:
        _GENERATION.done = "length" if end.value == "length" else "stop"
        _GENERATION.pieces = None
        return json.dumps({"done": True, "finish_reason": _GENERATION.done})
    except Exception as exc:
        _GENERATION.pieces = None
        raise _model_error(exc) from None
    return _piece_json(piece)


def _piece_json(piece: str | Piece) -> str:
    if isinstance(piece, str):
        piece = Piece(piece)
    return json.dumps({"text": str(piece.text), "tokens": int(piece.tokens)})


def _model_error(exc: BaseException) -> ModelError:
    if isinstance(exc, ModelError):
        return exc
    if isinstance(exc, MemoryError):
        return ModelError("out-of-memory", "the model ran out of memory")
    if isinstance(exc, BadRequest):
        return ModelError("bad-request", str(exc))
    return ModelError("internal", f"{type(exc).__name__}: {exc}")


def _example(datatype: str) -> Any:
    if datatype == "BYTES":
        return "warm up"
    if datatype == "BOOL":
        return False
    return 0.0 if datatype.startswith("FP") else 0


def encode_raw(datatype: str, values: list[Any]) -> str:
    """The inverse of decode_raw (base64 text), for warm-up and tests."""
    if datatype == "BYTES":
        parts = []
        for v in values:
            data = v.encode() if isinstance(v, str) else bytes(v)
            parts.append(struct.pack("<I", len(data)) + data)
        raw = b"".join(parts)
    elif datatype == "BOOL":
        raw = bytes(1 if v else 0 for v in values)
    elif datatype == "FP16":
        raw = struct.pack(f"<{len(values)}e", *values)
    else:
        raw = array(_CODES[datatype], values).tobytes()
    return binascii.b2a_base64(raw, newline=False).decode("ascii")


def warm_up(model: Model, metadata_json: str) -> None:
    """Run one synthetic request while componentize-py pre-initialises the guest at build time.

    The pre-initialised memory is snapshotted into the component, so the first real request
    finds the decoder, the model's code paths and their caches already warm (about 2 ms less on
    a cold start). Errors are ignored: a model may reject all-zero input.
    """
    metadata = json.loads(metadata_json)
    inputs = []
    for spec in metadata["inputs"]:
        shape = [1 if d < 0 else d for d in spec["shape"]]
        count = 1
        for d in shape:
            count *= d
        inputs.append(
            {
                "name": spec["name"],
                "datatype": spec["datatype"],
                "shape": shape,
                # the host sends raw data: warm the decoder with it too
                "raw": encode_raw(spec["datatype"], [_example(spec["datatype"])] * count),
            }
        )
    with contextlib.suppress(ModelError):
        handle(model, json.dumps({"inputs": inputs}))


def component(model: Model, metadata_json: str) -> type:
    """The `WitWorld` class componentize-py instantiates (guest only: imports the bindings)."""
    import wit_world  # type: ignore[import-not-found]
    from componentize_py_types import Err  # type: ignore[import-not-found]

    errors = {
        "bad-request": wit_world.InferError_BadRequest,
        "out-of-memory": wit_world.InferError_OutOfMemory,
        "internal": wit_world.InferError_Internal,
    }

    class WitWorld(wit_world.WitWorld):  # type: ignore[misc]
        def metadata(self) -> str:
            return metadata_json

        def infer(self, request: str) -> str:
            try:
                return handle(model, request)
            except ModelError as exc:
                raise Err(errors[exc.kind](str(exc))) from None

        def generate_start(self, request: str) -> str:
            try:
                return generate_start(model, request)
            except ModelError as exc:
                raise Err(errors[exc.kind](str(exc))) from None

        def generate_next(self) -> str:
            try:
                return generate_next(model)
            except ModelError as exc:
                raise Err(errors[exc.kind](str(exc))) from None

    return WitWorld
