"""The HTTP front ends of generation: OpenAI's API (`/v1/...`, KServe's `/openai/v1/...`, and the
mesh's `/v2/models/{model}/openai/v1/...`) and Triton's generate extension
(`/v2/models/{model}/generate` and `/generate_stream`).

Every generation goes through `Generative.open` (admission, context, token budget) and reads
the same Stream. A streamed response starts when the first text is there (its status line and
headers go with the first token, so a proxy's time to the first upstream byte is the time to
first token, and a generation that fails before any text is an HTTP error, not a 200 with an
error event); each piece of text is one server-sent event, written as it comes; the usage
record follows the last event as the `x-meshfn-generation` trailer (a header on a whole
response), for the proxies' audit records. A client that goes away cancels the generation.

Model-based routing: the mesh's gateway reads the body's `model` and sends the request to
`/v2/models/{model}/openai/v1/...`, so the path the sidecar authorises names the model; here a
body naming another model than the path is refused (400), so no client reaches a model by
naming it in the body and another in the path.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from meshfn.contracts.genai import GENERATION_HEADER
from meshfn.contracts.qos import TENANT_HEADER

from . import openai_api
from .backend import Backend, Reply
from .generation import Event, Finished, GenerationError, Piece
from .generative import (
    Opened,
    bounds_of,
    embeddings_section,
    generate_section,
    generation_record,
)
from .http import on_disconnect
from .kserve import KServeError
from .openai_api import ChunkWriter
from .pool import FunctionRuntime
from .qos import Refusal, tenant_of
from .tracing import TRACE_HEADERS, TraceContext, trace_of

_TENANT_KEY = TENANT_HEADER.encode()
_GENERATION_KEY = GENERATION_HEADER.encode()
OPENAI_OPERATIONS = {"chat/completions", "completions", "embeddings"}


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A streamed response: its chunks as they come, then its trailers."""

    status: int
    chunks: AsyncIterator[bytes]
    trailers: Callable[[], list[tuple[bytes, bytes]]]
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"text/event-stream"


@dataclass(slots=True)
class _Outcome:
    """What the server knows once a stream ended (read by its trailers)."""

    record: bytes = b""
    unregister: Callable[[], None] = field(default=lambda: None)


KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see a byte


async def _quiet_ticks(
    events: AsyncGenerator[Event, None], quiet: float
) -> AsyncGenerator[Event | None, None]:
    """The stream's events, and None whenever `quiet` seconds pass without one (a long prompt
    being read, a reader that fell behind): the response then sends a keep-alive, so the
    proxies' idle timeout (generation.idleTimeout, twice `quiet`) cuts only a stuck stream."""
    pending: asyncio.Future[Event] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=quiet)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
            if isinstance(event, Finished):
                return
    finally:
        if pending is not None:
            pending.cancel()
        await events.aclose()


@dataclass(slots=True)
class _Opening:
    """What a stream's response starts with: events up to its first text, its end, or a quiet
    spell (then it starts with a keep-alive)."""

    pieces: list[Piece]
    done: Finished | None
    quiet: bool


async def _opening(events: AsyncGenerator[Event | None, None]) -> _Opening:
    pieces: list[Piece] = []
    async for event in events:
        if event is None:
            return _Opening(pieces, None, True)
        if isinstance(event, Finished):
            return _Opening(pieces, event, False)
        pieces.append(event)
        if event.text:
            break
    return _Opening(pieces, None, False)


Render = Callable[[str], bytes]
End = Callable[[Finished], bytes]


async def _sse(
    events: AsyncGenerator[Event | None, None],
    opening: _Opening,
    text: Render,
    end: End,
    outcome: _Outcome,
) -> AsyncGenerator[bytes, None]:
    """A stream's response body: each text as its event, keep-alives while quiet, the end."""
    try:
        head = b"".join(text(p.text) for p in opening.pieces if p.text)
        if opening.quiet:
            head += KEEP_ALIVE
        if opening.done is not None:
            yield head + end(opening.done)
            return
        yield head
        async for event in events:
            if event is None:
                yield KEEP_ALIVE
            elif isinstance(event, Finished):
                yield end(event)
                return
            elif event.text:
                yield text(event.text)
    finally:
        outcome.unregister()
        await events.aclose()


def _openai_error(exc: KServeError | GenerationError, param: str | None = None) -> Reply:
    status = exc.status
    message = exc.message if isinstance(exc, KServeError) else str(exc)
    code = None
    if isinstance(exc, GenerationError):
        param = exc.param
    if status == 404:
        code = "model_not_found"
    if isinstance(exc, Refusal):
        code = "insufficient_quota" if exc.limit == "tokens" else "rate_limit_exceeded"
        body = openai_api.error_object(status, message, param, code)
        body["error"].update({k: v for k, v in exc.payload.items() if k != "error"})
        return Reply(status, json.dumps(body).encode(), exc.headers)
    headers = exc.headers if isinstance(exc, KServeError) else ()
    return Reply(status, openai_api.error_body(status, message, param, code), headers)


class GenerateFront:
    """OpenAI's and Triton's generate HTTP endpoints of one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    # ------------------------------------------------------------------ OpenAI

    def _model(self, body: dict[str, Any], path_model: str | None) -> FunctionRuntime:
        model = openai_api.model_of(body)
        if path_model is not None and model != path_model:
            raise GenerationError(
                400,
                f"the request body names model {model!r}, its path {path_model!r}: they must "
                "be the same",
                "model",
            )
        try:
            return self.backend.lookup(model, None)
        except KServeError:
            raise GenerationError(
                404, f"the model {model!r} does not exist or you do not have access to it", "model"
            ) from None

    async def openai(
        self, operation: str, body: bytes, headers: dict[bytes, bytes], path_model: str | None
    ) -> Reply | StreamReply:
        """POST /v1/{chat/completions|completions|embeddings}."""
        tenant = tenant_of(headers.get(_TENANT_KEY))
        try:
            data = openai_api.loads(body)
            rt = self._model(data, path_model)
            if len(body) > rt.spec.limits.maxRequestBytes:
                raise GenerationError(
                    413, f"request body exceeds {rt.spec.limits.maxRequestBytes} bytes"
                )
            if operation == "embeddings":
                return await self._embeddings(rt, data, tenant, headers)
            return await self._complete(
                rt, operation == "chat/completions", data, tenant, trace_of(headers)
            )
        except (GenerationError, KServeError) as exc:
            return _openai_error(exc)

    async def _complete(
        self,
        rt: FunctionRuntime,
        chat: bool,
        data: dict[str, Any],
        tenant: str,
        trace: TraceContext,
    ) -> Reply | StreamReply:
        generative = self.backend.generative
        if generate_section(rt) is None:
            what = "chat" if chat else "text"
            raise GenerationError(400, f"model {rt.name} is not a {what} completion model", "model")
        bounds = bounds_of(generative.settings(rt))
        parse = openai_api.chat_request if chat else openai_api.completion_request
        operation = "chat" if chat else "text_completion"
        with generative.traced(rt, "rest", operation, trace, tenant) as span:
            request = parse(data, bounds)
            opened = await generative.open(
                rt, "rest", request.prompt, request.sampling, tenant, operation, span
            )
        if request.stream:
            writer = ChunkWriter(chat, rt.name, request.include_usage)
            return await self._streamed(rt, operation, opened, writer)
        return await self._whole(rt, operation, opened, chat)

    async def _whole(
        self, rt: FunctionRuntime, operation: str, opened: Opened, chat: bool
    ) -> Reply:
        text, done = await _read_whole(opened)
        if done.reason == "error":
            raise GenerationError(500, f"model {rt.name} failed: {done.error}")
        build = openai_api.chat_response if chat else openai_api.completion_response
        body = build(openai_api.completion_id(chat), rt.name, text, done, int(time.time()))
        headers = (*opened.headers, (_GENERATION_KEY, generation_record(rt, operation, done)))
        return Reply(200, body, headers)

    async def _streamed(
        self, rt: FunctionRuntime, operation: str, opened: Opened, writer: ChunkWriter
    ) -> Reply | StreamReply:
        def end(event: Finished) -> bytes:
            if event.reason == "error":
                return openai_api.stream_error(500, f"model {rt.name} failed: {event.error}")
            return writer.end(event)

        reply = await self._stream(rt, operation, opened, writer.text, end)
        if isinstance(reply, str):
            raise GenerationError(500, reply)
        return reply

    async def _stream(
        self,
        rt: FunctionRuntime,
        operation: str,
        opened: Opened,
        text: Callable[[str], bytes],
        end: Callable[[Finished], bytes],
    ) -> StreamReply | str:
        """A streamed reply whose events `text` and `end` frame; or, for a generation that
        failed before any text, why (an HTTP error then, not a 200 with an error event)."""
        stream = opened.stream
        outcome = _Outcome(unregister=on_disconnect(stream.cancel))
        events = _quiet_ticks(stream.events(), self._quiet(rt))
        opening = await _opening(events)
        done = opening.done
        if done is not None and done.reason == "error" and not any(p.text for p in opening.pieces):
            outcome.unregister()
            await events.aclose()
            return f"model {rt.name} failed: {done.error}"

        def last(event: Finished) -> bytes:
            outcome.record = generation_record(rt, operation, event)
            return end(event)

        return StreamReply(
            200,
            _sse(events, opening, text, last, outcome),
            lambda: [(_GENERATION_KEY, outcome.record)],
            opened.headers,
        )

    def _quiet(self, rt: FunctionRuntime) -> float:
        """Seconds a stream may send nothing before a keep-alive: half its idle timeout."""
        return self.backend.generative.settings(rt).idleTimeout.total_seconds() / 2

    async def _embeddings(
        self, rt: FunctionRuntime, data: dict[str, Any], tenant: str, headers: dict[bytes, bytes]
    ) -> Reply:
        spec = embeddings_section(rt)
        if spec is None:
            raise GenerationError(400, f"model {rt.name} is not an embeddings model", "model")
        request = openai_api.embeddings_request(data)
        texts = request.texts
        kserve = {
            "inputs": [
                {"name": spec["input"], "datatype": "BYTES", "shape": [len(texts)], "data": texts}
            ]
        }
        # the KServe request continues the OpenAI request's trace (its span `embeddings {model}`)
        given = {key: headers[key] for key in TRACE_HEADERS if key in headers}
        if tenant:
            given[_TENANT_KEY] = tenant.encode()
        reply = await self.backend.infer(
            rt.name, None, json.dumps(kserve).encode(), given, "embeddings"
        )
        if reply.status != 200:
            message = json.loads(reply.body).get("error", "the embeddings model failed")
            raise KServeError(reply.status, message)
        outputs = {o["name"]: o for o in json.loads(reply.body)["outputs"]}
        flat = outputs[spec["output"]]["data"]
        width = len(flat) // len(texts) if texts else 0
        if request.dimensions is not None and request.dimensions != width:
            raise GenerationError(
                400, f"model {rt.name} makes {width}-dimensional embeddings", "dimensions"
            )
        vectors = [flat[i * width : (i + 1) * width] for i in range(len(texts))]
        tokens = sum(outputs[spec["tokens"]]["data"]) if spec.get("tokens") else 0
        body = openai_api.embeddings_response(rt.name, vectors, int(tokens), request.base64)
        return Reply(200, body)

    def models(self) -> Reply:
        """GET /v1/models: the functions that serve an OpenAI operation."""
        listed = [
            (rt.name, self._created(rt))
            for rt in sorted(self.backend.runtimes, key=lambda r: (r.name, r.version))
            if rt.version == self.backend.defaults.get(rt.name) and self._openai(rt)
        ]
        return Reply(200, openai_api.models_response(listed))

    def model(self, name: str) -> Reply:
        """GET /v1/models/{model}."""
        try:
            rt = self.backend.lookup(name, None)
        except KServeError:
            rt = None
        if rt is None or not self._openai(rt):
            return _openai_error(
                GenerationError(404, f"the model {name!r} does not exist", "model")
            )
        return Reply.json(openai_api.model_object(rt.name, self._created(rt)))

    @staticmethod
    def _openai(rt: FunctionRuntime) -> bool:
        generative = generate_section(rt) is not None and rt.spec.generation is not None
        return rt.refusal is None and (generative or embeddings_section(rt) is not None)

    @staticmethod
    def _created(rt: FunctionRuntime) -> int:
        """When the artifact was published (its files' modification time)."""
        verified = rt.verified
        if verified is None or not verified.identities:
            return 0
        return min(ident.mtime_ns for _, ident in verified.identities) // 1_000_000_000

    # ------------------------------------------------------------------ Triton's generate

    async def generate(
        self,
        name: str,
        version: str | None,
        body: bytes,
        headers: dict[bytes, bytes],
        streamed: bool,
    ) -> Reply | StreamReply:
        """POST /v2/models/{name}[/versions/{v}]/generate[_stream] (Triton's generate
        extension): `text_input` and `parameters` in, `text_output` out (SSE events when
        streamed, no [DONE]; a failure after the first event is `{"error": ...}`)."""
        from . import triton_generate

        tenant = tenant_of(headers.get(_TENANT_KEY))
        try:
            rt = self.backend.lookup(name, version)
            generative = self.backend.generative
            settings = generative.settings(rt)
            operation = "text_completion"
            with generative.traced(rt, "rest", operation, trace_of(headers), tenant) as span:
                request = triton_generate.parse(body, bounds_of(settings), rt.spec.limits)
                opened = await generative.open(
                    rt, "rest", request.prompt, request.sampling, tenant, operation, span
                )
        except (GenerationError, KServeError) as exc:
            status = exc.status
            message = exc.message if isinstance(exc, KServeError) else str(exc)
            headers_out = exc.headers if isinstance(exc, KServeError) else ()
            return Reply(status, json.dumps({"error": message}).encode(), headers_out)
        if streamed:
            return await self._generate_stream(rt, opened)
        return await self._generate_whole(rt, opened)

    async def _generate_whole(self, rt: FunctionRuntime, opened: Opened) -> Reply:
        from . import triton_generate

        text, done = await _read_whole(opened)
        if done.reason == "error":
            return Reply.error(500, f"model {rt.name} failed: {done.error}")
        body = triton_generate.response(rt, text, done)
        headers = (*opened.headers, (_GENERATION_KEY, generation_record(rt, "generate", done)))
        return Reply(200, body, headers)

    async def _generate_stream(self, rt: FunctionRuntime, opened: Opened) -> Reply | StreamReply:
        from . import triton_generate

        def text(piece: str) -> bytes:
            return triton_generate.event(rt, piece)

        def end(event: Finished) -> bytes:
            if event.reason == "error":
                return openai_api.sse({"error": f"model {rt.name} failed: {event.error}"})
            return triton_generate.event(rt, "", event)

        reply = await self._stream(rt, "generate", opened, text, end)
        return Reply.error(500, reply) if isinstance(reply, str) else reply


async def _read_whole(opened: Opened) -> tuple[str, Finished]:
    """A generation read to its end, for a reply that is not streamed (a client that goes away
    cancels it): its text and how it finished."""
    stream = opened.stream
    unregister = on_disconnect(stream.cancel)
    texts: list[str] = []
    done: Finished | None = None
    try:
        async for event in stream.events():
            if isinstance(event, Finished):
                done = event
            else:
                texts.append(event.text)
    finally:
        unregister()
    assert done is not None
    return "".join(texts), done


__all__ = ["OPENAI_OPERATIONS", "GenerateFront", "StreamReply"]
