"""Triton's generate extension (provisional in Triton, HTTP only), as the backend speaks it.

`POST /v2/models/{model}/generate`: `{"text_input": "...", "parameters": {...}}` in, one JSON
object `{"model_name", "model_version", "text_output"}` out. `/generate_stream`: the same
request, server-sent events of that object each carrying the next text (no `[DONE]`: Triton
sends none); meshfn's last event also says `finish_reason` and `usage`. A failure after the
first event is `{"error": "..."}` under the 200 already sent, as Triton does. Top-level fields
other than the model's inputs (`text_input`) and `id`/`parameters` are refused, as are
parameters meshfn does not know (400 naming them).

Parameters: `max_tokens`, `temperature`, `top_p`, `seed`, `stop` (a string or a list), and
`stream`/`exclude_input_in_output` (accepted: the output never repeats the prompt).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from meshfn.common import peerjson
from meshfn.contracts.function import FunctionLimits

from . import openai_api
from .generation import Finished, GenerationError, Sampling
from .kserve import InferRequest
from .manifest import TEXT_INPUT, TEXT_OUTPUT
from .openai_api import Bounds, sse
from .pool import FunctionRuntime
from .tensors import element_count, unframe

PARAMETERS = frozenset({
    "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "exclude_input_in_output",
})  # fmt: skip


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    prompt: str
    sampling: Sampling
    id: str | None


def _bad(message: str, param: str | None = None) -> GenerationError:
    return GenerationError(400, message, param)


def parse(body: bytes, bounds: Bounds, limits: FunctionLimits) -> GenerateRequest:
    """A generate request body, checked against the model's bounds."""
    if len(body) > limits.maxRequestBytes:
        raise GenerationError(413, f"request body exceeds {limits.maxRequestBytes} bytes")
    data = openai_api.loads(body)
    extra = sorted(set(data) - {TEXT_INPUT, "parameters", "id"})
    if extra:
        raise _bad(f"unknown field {extra[0]!r}: this model's only input is {TEXT_INPUT}", extra[0])
    text = data.get(TEXT_INPUT)
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise _bad(f"{TEXT_INPUT} must be a string", TEXT_INPUT)
    openai_api.text_field(text, TEXT_INPUT)
    params = data.get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad("parameters must be an object", "parameters")
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise _bad(f"unknown parameter {unknown[0]!r}", unknown[0])
    for flag in ("stream", "exclude_input_in_output"):
        if flag in params and not isinstance(params[flag], bool):
            raise _bad(f"{flag} must be true or false", flag)
    request_id = data.get("id")
    if request_id is not None:
        if not isinstance(request_id, str):
            raise _bad("id must be a string", "id")
        openai_api.text_field(request_id, "id")
    sampling = sampling_of(params, bounds)
    return GenerateRequest(text, sampling, request_id)


def sampling_of(params: dict[str, Any], bounds: Bounds) -> Sampling:
    """Generation settings from request parameters (the generate extension's, and gRPC's)."""
    keys = ("max_tokens", "temperature", "top_p", "seed", "stop")
    settings: dict[str, Any] = {k: params[k] for k in keys if k in params}
    return openai_api.completion_settings(settings, bounds)


# Request parameters of an inference request (REST /infer, gRPC) that are not generation
# settings: Triton's flag for an empty final response of a decoupled model.
EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"


def from_infer(request: InferRequest, bounds: Bounds) -> tuple[GenerateRequest, bool]:
    """A KServe inference request (REST or gRPC) of a generative model: its text_input, its
    parameters as generation settings; and whether it asks for an empty final response (a
    decoupled model's last response, Triton's `triton_enable_empty_final_response`)."""
    (text_input,) = request.inputs  # the signature has exactly one input
    (text,) = unframe(text_input.raw, element_count(text_input.shape))
    params = dict(request.parameters)
    empty_final = params.pop(EMPTY_FINAL, False)
    if not isinstance(empty_final, bool):
        raise _bad(f"{EMPTY_FINAL} must be true or false", EMPTY_FINAL)
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise _bad(f"unknown parameter {unknown[0]!r}", unknown[0])
    if isinstance(params.get("stop"), str) and params["stop"].startswith("["):
        # a list of stop sequences travels as a JSON string in a string parameter
        with contextlib.suppress(ValueError):
            params["stop"] = peerjson.loads(params["stop"])
    prompt = text.decode("utf-8", "replace")
    return GenerateRequest(prompt, sampling_of(params, bounds), request.id), empty_final


def infer_response(rt: FunctionRuntime, request_id: str | None, text: str, done: Finished) -> bytes:
    """The REST /infer answer of a generative model: text_output, with the finish reason and
    the usage as response parameters."""
    body: dict[str, Any] = _head(rt)
    if request_id is not None:
        body["id"] = request_id
    body["parameters"] = usage_parameters(done)
    body["outputs"] = [{"name": TEXT_OUTPUT, "datatype": "BYTES", "shape": [1], "data": [text]}]
    return json.dumps(body).encode()


def usage_parameters(done: Finished) -> dict[str, Any]:
    return {
        "finish_reason": done.client_reason,
        "prompt_tokens": done.usage.prompt_tokens,
        "completion_tokens": done.usage.completion_tokens,
    }


def _head(rt: FunctionRuntime) -> dict[str, Any]:
    return {"model_name": rt.name, "model_version": rt.version}


def response(rt: FunctionRuntime, text: str, done: Finished) -> bytes:
    body = _head(rt) | {
        TEXT_OUTPUT: text,
        "finish_reason": done.client_reason,
        "usage": openai_api.usage_json(done),
    }
    return json.dumps(body).encode()


def event(rt: FunctionRuntime, text: str, done: Finished | None = None) -> bytes:
    body = _head(rt) | {TEXT_OUTPUT: text}
    if done is not None:
        body |= {"finish_reason": done.client_reason, "usage": openai_api.usage_json(done)}
    return sse(body)
