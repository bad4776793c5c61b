"""OpenAI's API as the backend speaks it: request checks, responses, stream chunks, errors.

Pure protocol (no backend state): `chat_request` / `completion_request` / `embeddings_request`
turn a JSON body into what the generation needs, refusing what meshfn does not do with a 400
that names the field (OpenAI's error object, `param`); `chat_chunk`, `completion_chunk` and
`sse` build the stream exactly as the official SDK parses it: `data: {json}` events, one per
chunk, the usage chunk last (empty `choices`) when `stream_options.include_usage` asks for it
(every other chunk then has `"usage": null`), and `data: [DONE]`. A generation that fails after
its first chunk ends the stream with `data: {"error": {...}}`, which the SDK raises.
"""

from __future__ import annotations

import base64
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from meshfn.common import peerjson

from .generation import Finished, GenerationError, Sampling

# Fields each endpoint accepts; anything else is a 400 naming it (OpenAI refuses unknown
# arguments too). Those meshfn does not implement are listed with what they may be.
CHAT_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "stream", "stream_options", "stop", "seed", "user", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "functions", "function_call", "parallel_tool_calls", "store", "metadata", "service_tier",
})  # fmt: skip
COMPLETION_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
    "stop", "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "echo", "best_of", "suffix",
})  # fmt: skip
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
ROLES = ("system", "developer", "user", "assistant")


def error_object(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for `status`."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    return json.dumps(error_object(status, message, param, code)).encode()


def bad(message: str, param: str | None = None) -> GenerationError:
    return GenerationError(400, message, param)


@dataclass(frozen=True, slots=True)
class Bounds:
    """What the function's policy allows (contracts.function.FunctionGeneration)."""

    max_tokens: int
    default_max_tokens: int
    max_temperature: float
    max_stop: int


@dataclass(frozen=True, slots=True)
class TextRequest:
    """A chat or text completion request, checked: the model it names, its prompt (messages
    already joined by the model's template), the sampling, and how to answer."""

    model: str
    prompt: str
    sampling: Sampling
    stream: bool
    include_usage: bool


def loads(body: bytes) -> dict[str, Any]:
    """A request body: one JSON object, no key twice (a body naming `model` twice could be read
    one way by the gateway and another by the backend)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise bad(f"the field {key!r} appears twice in one object", key)
            out[key] = value
        return out

    try:
        value = peerjson.loads(body, object_pairs_hook=pairs)
    except GenerationError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad("the request body must be a JSON object")
    return value


def text_field(value: str, param: str) -> str:
    """A string field as text: JSON may escape a lone UTF-16 surrogate (`"\\ud800"`), which
    decodes to a Python str that no UTF-8 reader (the tokenizer, stop matching, a span's
    attributes) can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{param} is not valid text: it holds a lone UTF-16 surrogate", param) from None
    return value


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad("you must provide a model parameter", "model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a non-empty string", "model")
    return text_field(model, "model")


def _unknown(body: dict[str, Any], allowed: frozenset[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise bad(f"unrecognized request argument supplied: {extra[0]}", extra[0])


def _number(body: dict[str, Any], key: str, low: float, high: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{key} must be a number", key)
    if not low <= value <= high:
        raise bad(f"{key} must be between {low:g} and {high:g}, not {value:g}", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer", key)
    if not low <= value <= high:
        raise bad(f"{key} must be between {low} and {high}, not {value}", key)
    return value


def _unsupported(body: dict[str, Any], key: str, allowed: tuple[Any, ...], what: str) -> None:
    """Refuse a feature meshfn does not implement, unless set to a value meaning "off"."""
    if key in body and body[key] not in allowed:
        raise bad(f"{key} is not supported: {what}", key)


def _stop(body: dict[str, Any], bounds: Bounds) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(items) > bounds.max_stop:
        raise bad(f"stop allows at most {bounds.max_stop} sequences, not {len(items)}", "stop")
    return tuple(text_field(s, "stop") for s in items)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options takes only include_usage", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("stream_options.include_usage must be true or false", "stream_options")
    return include


def _sampling(body: dict[str, Any], bounds: Bounds, default_max: int, key: str) -> Sampling:
    max_tokens = _integer(body, key, 1, 1 << 30)
    if max_tokens is not None and max_tokens > bounds.max_tokens:
        raise bad(f"{key} is {max_tokens}, above this model's limit of {bounds.max_tokens}", key)
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    return Sampling(
        max_tokens=max_tokens or min(default_max, bounds.max_tokens),
        temperature=_number(body, "temperature", 0, bounds.max_temperature, 1.0),
        top_p=_number(body, "top_p", 0, 1, 1.0) or 1e-9,  # top_p 0: the likeliest token
        seed=None if seed is None else seed % (1 << 64),
        stop=_stop(body, bounds),
    )


def completion_settings(params: dict[str, Any], bounds: Bounds) -> Sampling:
    """Generation settings given as named values (Triton's generate parameters, gRPC's request
    parameters), checked like OpenAI's fields; max_tokens defaults to the policy's."""
    return _sampling(params, bounds, bounds.default_max_tokens, "max_tokens")


def _common(body: dict[str, Any]) -> bool:
    """Checks shared by chat and text completions; returns `stream`."""
    n = _integer(body, "n", 1, 128)
    if n not in (None, 1):
        raise bad("n must be 1: meshfn generates one choice per request", "n")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    for key in ("presence_penalty", "frequency_penalty"):
        _unsupported(body, key, (None, 0, 0.0), "meshfn does not penalise repetition")
    _unsupported(body, "logit_bias", (None, {}), "meshfn does not bias logits")
    if body.get("user") is not None:
        if not isinstance(body["user"], str):
            raise bad("user must be a string", "user")
        text_field(body["user"], "user")
    return bool(stream)


def _content(message: dict[str, Any], index: int) -> str:
    content = message.get("content")
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return text_field(content, where)
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: only text parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}: a text part needs its text", where)
            texts.append(part["text"])
        return text_field("".join(texts), where)
    raise bad(f"{where} must be a string or a list of text parts", where)


def _messages(body: dict[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise bad("you must provide messages", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role == "tool" or "tool_calls" in message or "function_call" in message:
            raise bad(f"messages[{i}]: tool calls are not supported", f"messages[{i}]")
        if role not in ROLES:
            raise bad(
                f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role"
            )
        out.append((role, _content(message, i)))
    return out


def chat_prompt(messages: list[tuple[str, str]]) -> str:
    """The `lines` template (GenerateSpec.chat_template): each message's content on a line of
    its own; the model continues after the last."""
    return "".join(content + "\n" for _, content in messages)


def chat_request(body: dict[str, Any], bounds: Bounds) -> TextRequest:
    """POST /v1/chat/completions, checked."""
    _unknown(body, CHAT_FIELDS)
    model = model_of(body)
    stream = _common(body)
    for key in ("tools", "functions"):
        _unsupported(body, key, (None, []), "meshfn's models do not call tools")
    for key in ("tool_choice", "function_call"):
        _unsupported(body, key, (None, "none"), "meshfn's models do not call tools")
    _unsupported(body, "parallel_tool_calls", (None, False, True), "must be a boolean")
    _unsupported(body, "logprobs", (None, False), "meshfn does not return log probabilities")
    _unsupported(body, "top_logprobs", (None, 0), "meshfn does not return log probabilities")
    _unsupported(body, "response_format", (None, {"type": "text"}), "text responses only")
    _unsupported(body, "store", (None, False), "meshfn stores no completions")
    _unsupported(body, "service_tier", (None, "auto", "default"), "meshfn serves one tier")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if "max_completion_tokens" in body and "max_tokens" in body:
        raise bad("give max_tokens or max_completion_tokens, not both", "max_tokens")
    return TextRequest(
        model,
        chat_prompt(_messages(body)),
        _sampling(body, bounds, bounds.default_max_tokens, key),
        stream,
        _stream_options(body, stream),
    )


def completion_request(body: dict[str, Any], bounds: Bounds) -> TextRequest:
    """POST /v1/completions, checked."""
    _unknown(body, COMPLETION_FIELDS)
    model = model_of(body)
    stream = _common(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("you must provide a prompt", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt must be a string (one prompt per request)", "prompt")
    text_field(prompt, "prompt")
    _unsupported(body, "echo", (None, False), "the prompt is never echoed")
    _unsupported(body, "logprobs", (None,), "meshfn does not return log probabilities")
    _unsupported(body, "best_of", (None, 1), "meshfn generates one choice per request")
    _unsupported(body, "suffix", (None, ""), "meshfn's models do not insert text")
    # OpenAI's default for text completions, within the policy's own
    default = min(COMPLETION_DEFAULT_MAX_TOKENS, bounds.default_max_tokens)
    return TextRequest(
        model,
        prompt,
        _sampling(body, bounds, default, "max_tokens"),
        stream,
        _stream_options(body, stream),
    )


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    texts: list[str]
    base64: bool
    dimensions: int | None


def embeddings_request(body: dict[str, Any]) -> EmbeddingsRequest:
    """POST /v1/embeddings, checked."""
    _unknown(body, EMBEDDING_FIELDS)
    model = model_of(body)
    value = body.get("input")
    if value is None:
        raise bad("you must provide an input", "input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise bad("input must be a string or a non-empty list of strings", "input")
    if len(texts) > 2048:
        raise bad("input holds at most 2048 texts", "input")
    for item in texts:
        text_field(item, "input")
        if not item:  # OpenAI's too: an empty text has no embedding (a zero vector is no answer)
            raise bad("input cannot be an empty string", "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad("encoding_format must be float or base64", "encoding_format")
    return EmbeddingsRequest(
        model, texts, encoding == "base64", _integer(body, "dimensions", 1, 1 << 16)
    )


# ---------------------------------------------------------------- responses


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage_json(done: Finished) -> dict[str, int]:
    usage = done.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _head(ident: str, obj: str, model: str, created: int) -> dict[str, Any]:
    return {"id": ident, "object": obj, "created": created, "model": model}


def chat_response(ident: str, model: str, text: str, done: Finished, created: int) -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "logprobs": None,
        "finish_reason": done.client_reason,
    }
    body = _head(ident, "chat.completion", model, created) | {
        "choices": [choice],
        "usage": usage_json(done),
        "system_fingerprint": None,
    }
    return json.dumps(body).encode()


def completion_response(ident: str, model: str, text: str, done: Finished, created: int) -> bytes:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": done.client_reason}
    body = _head(ident, "text_completion", model, created) | {
        "choices": [choice],
        "usage": usage_json(done),
    }
    return json.dumps(body).encode()


class ChunkWriter:
    """The chunks of one streamed chat or text completion, as SSE events (bytes)."""

    def __init__(self, chat: bool, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.ident = completion_id(chat)
        self.created = int(time.time())
        self._head = _head(
            self.ident, "chat.completion.chunk" if chat else "text_completion", model, self.created
        )
        if chat:
            self._head["system_fingerprint"] = None
        self.include_usage = include_usage
        self._role_sent = False

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body = dict(self._head)
        body["choices"] = choices
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    def text(self, text: str) -> bytes:
        """A chunk carrying more text (the chat's first also says the role)."""
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": None}
        return self._event([choice])

    def end(self, done: Finished) -> bytes:
        """The last content chunk (its finish_reason), the usage chunk if asked, [DONE]."""
        reason = done.client_reason
        if self.chat:
            delta: dict[str, Any] = {} if self._role_sent else {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": reason}
        out = self._event([choice])
        if self.include_usage:
            out += self._event([], usage_json(done))
        return out + DONE


def sse(value: Any) -> bytes:
    """One server-sent event carrying `value` as JSON."""
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def stream_error(status: int, message: str) -> bytes:
    """An error after the stream began (HTTP 200 already sent): the SDK raises on it."""
    return sse(error_object(status, message))


def embeddings_response(
    model: str, vectors: list[list[float]], tokens: int, as_base64: bool
) -> bytes:
    import numpy as np

    data = []
    for i, vector in enumerate(vectors):
        value: Any = vector
        if as_base64:
            value = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": value})
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json.dumps(body).encode()


def model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "meshfn"}


def models_response(models: list[tuple[str, int]]) -> bytes:
    return json.dumps(
        {"object": "list", "data": [model_object(name, created) for name, created in models]}
    ).encode()
