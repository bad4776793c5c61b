"""The way into a generative function, for every generate front end (OpenAI, Triton's generate
extension, gRPC streaming): admission as for any request (draining, refusals, protocol switches,
the concurrency limit, QoS), the prompt's tokens and the model's context, the tenant's token
budget (a reservation of prompt + max_tokens, reconciled with the usage when the stream ends),
then a Stream from the function's engine (generation.py); and when it ends, one place that
counts it: statistics, metrics (contracts.genai), the QoS ticket, the in-flight count.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from meshfn.common.logs import trace_context
from meshfn.contracts import genai
from meshfn.contracts.function import FunctionGeneration

from .dispatch import Dispatcher, Lane, Protocol
from .engine import deadline_ticks
from .generation import (
    After,
    Engine,
    Finished,
    GenerationError,
    GeneratorCalls,
    GeneratorEngine,
    Sampling,
    StepCall,
    StepEngine,
    StepShape,
    Stream,
    TextDigest,
    run_steps,
)
from .host import CallResult, ComponentInstance, Instance, Outcome, TensorCall, TensorInstance
from .kserve import KServeError
from .metrics import Metrics
from .openai_api import Bounds
from .pool import FunctionRuntime
from .qos import Ticket, TokenGrant
from .tracing import RequestSpan, TraceContext

log = logging.getLogger("meshfn.inference")
T = TypeVar("T")

Operation = str  # contracts.genai.OPERATIONS
DEFAULT_GENERATION = FunctionGeneration()


@dataclass(frozen=True, slots=True)
class Opened:
    """A started generation and what its front end reports besides the text: response headers
    (x-ratelimit-* of a token budget)."""

    stream: Stream
    headers: tuple[tuple[bytes, bytes], ...] = ()


def generate_section(rt: FunctionRuntime) -> dict[str, Any] | None:
    """The function's `generate` metadata (signed), or None: not a generative artifact."""
    verified = rt.verified
    section = verified.metadata.get("generate") if verified is not None else None
    return section if isinstance(section, dict) else None


def embeddings_section(rt: FunctionRuntime) -> dict[str, Any] | None:
    verified = rt.verified
    section = verified.metadata.get("openai") if verified is not None else None
    embeddings = section.get("embeddings") if isinstance(section, dict) else None
    return embeddings if isinstance(embeddings, dict) else None


def bounds_of(settings: FunctionGeneration) -> Bounds:
    return Bounds(
        settings.maxTokens, settings.defaultMaxTokens, settings.maxTemperature, settings.maxStop
    )


def generation_record(rt: FunctionRuntime, operation: str, done: Finished) -> bytes:
    """The generation's usage record (contracts.genai.GENERATION_KEYS), as header bytes."""
    note = done.reason if done.reason in ("budget", "deadline") else None
    value = {
        "model": rt.name,
        "operation": operation,
        "prompt_tokens": done.usage.prompt_tokens,
        "completion_tokens": done.usage.completion_tokens,
        "ttft_ms": None if done.ttft_s is None else round(done.ttft_s * 1000, 3),
        "finish_reason": done.reason,
        "outcome": done.outcome,
        "note": note,
        **(done.text_digests or {}),
    }
    return json.dumps(value, separators=(",", ":")).encode("ascii")


async def collect(stream: Stream) -> tuple[str, Finished]:
    """A whole generation's text and how it ended (a response that is not streamed)."""
    texts: list[str] = []
    async for event in stream.events():
        if isinstance(event, Finished):
            return "".join(texts), event
        texts.append(event.text)
    raise AssertionError("a stream always ends with Finished")


class Generative:
    """The backend's generative functions: one engine per function, made on first use."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        metrics: Metrics,
        defaults: bool = False,
        text_key: bytes | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.text_key = text_key  # auditText hmac's key (BackendConfig.auditTextKey)
        # a backend serving its whole registry without a configuration: generative functions
        # get the default generation settings
        self.defaults = defaults
        self.engines: dict[str, Engine] = {}
        self.recent: dict[str, GenerationStats] = {}

    @staticmethod
    def generates(rt: FunctionRuntime) -> bool:
        """Whether the function's artifact generates text (its signed metadata says so)."""
        return generate_section(rt) is not None

    def settings(self, rt: FunctionRuntime) -> FunctionGeneration:
        """The function's generation bounds (404 for a function that does not generate; 503
        for one whose Function does not say how: the gateway's timeouts for its streams
        derive from `generation`, and without them they would cut the streams)."""
        if generate_section(rt) is None:
            raise KServeError(404, f"model {rt.name} does not generate text")
        settings = rt.spec.generation
        if settings is None:
            if not self.defaults:
                raise KServeError(
                    503,
                    f"model {rt.name} generates text but its Function has no spec.generation: "
                    "add it (the proxies' timeouts for its streams derive from it)",
                )
            return DEFAULT_GENERATION
        if settings.auditText == "hmac" and self.text_key is None:
            raise KServeError(
                503,
                f"model {rt.name}'s Function asks for generation.auditText hmac, but this "
                "backend has no auditTextKey to make the digests with",
            )
        return settings

    def engine(self, rt: FunctionRuntime) -> Engine:
        engine = self.engines.get(rt.label)
        if engine is None:
            engine = self.engines[rt.label] = self._make_engine(rt)
        return engine

    def _make_engine(self, rt: FunctionRuntime) -> Engine:
        section = generate_section(rt)
        settings = self.settings(rt)
        assert section is not None
        if section.get("engine") == "generator":
            return GeneratorEngine(self._generator_calls(rt, settings))
        shape = StepShape(
            int(section["vocab"]), int(section["state"]), section.get("eos"), section.get("bos")
        )
        batching = settings.batching
        return StepEngine(
            shape,
            self._step_call(rt, settings),
            batching.maxStreams if batching is not None else 1,
            int(section.get("context", 1024)),
            settings.truncatePrompt,
            on_step=self.metrics.gen_step_rows.labels(rt.label).observe,
            contended=lambda: self.dispatcher.gate.contended,
        )

    async def _on_worker(self, rt: FunctionRuntime, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a worker thread, through the worker gate like any guest call."""
        dispatcher = self.dispatcher
        await dispatcher.gate.acquire(dispatcher.lane(rt), 0, None)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(dispatcher.executor, work, *args)
        finally:
            dispatcher.gate.release()

    def _step_call(self, rt: FunctionRuntime, settings: FunctionGeneration) -> StepCall:
        """Decode steps on a worker thread, each bounded by the token budget."""
        ticks = deadline_ticks(settings.tokenTimeout.total_seconds())

        def run(
            batch: int, steps: list[bytes], states: bytes, yield_: threading.Event, after: After
        ) -> tuple[CallResult, int, int]:
            instance, generation = rt.lease()
            cpu = time.thread_time_ns()
            result = CallResult(Outcome.INTERNAL, "not a step function")
            ran = 0
            try:
                if isinstance(instance, TensorInstance):
                    tensor = instance

                    def step(tokens: bytes, states: bytes) -> CallResult:
                        return tensor.call(TensorCall(batch, (tokens, states), 2), ticks)

                    result, ran = run_steps(step, steps, states, yield_, after)
            except BaseException:
                instance.close()
                raise
            cpu_ns = time.thread_time_ns() - cpu
            rt.give_back(instance, generation, result.outcome)
            return result, ran, cpu_ns

        async def call(
            batch: int, steps: list[bytes], states: bytes, yield_: threading.Event, after: After
        ) -> tuple[CallResult, int, int]:
            return await self._on_worker(rt, run, batch, steps, states, yield_, after)

        return call

    def _generator_calls(self, rt: FunctionRuntime, settings: FunctionGeneration) -> GeneratorCalls:
        """A Python generator's calls: the start gets the whole generation's deadline (the
        guest reads the prompt), each piece the token budget."""
        token_ticks = deadline_ticks(settings.tokenTimeout.total_seconds())
        start_ticks = deadline_ticks(settings.timeout.total_seconds())

        def start(request: str) -> tuple[Any, CallResult]:
            instance, generation = rt.lease()
            if not isinstance(instance, ComponentInstance):
                return (instance, generation), CallResult(Outcome.INTERNAL, "not a generator")
            return (instance, generation), instance.generate_start(request, start_ticks)

        def piece(lease: tuple[ComponentInstance, int]) -> CallResult:
            return lease[0].generate_next(token_ticks)

        def end(lease: tuple[Instance, int], outcome: Outcome) -> None:
            rt.give_back(lease[0], lease[1], outcome)

        async def start_call(request: str) -> tuple[Any, CallResult]:
            return await self._on_worker(rt, start, request)

        async def next_call(lease: Any) -> CallResult:
            return await self._on_worker(rt, piece, lease)

        return GeneratorCalls(start_call, next_call, end)

    @contextlib.contextmanager
    def traced(
        self, rt: FunctionRuntime, protocol: Protocol, operation: Operation, trace: TraceContext,
        tenant: str,
    ) -> Iterator[RequestSpan | None]:  # fmt: skip
        """The request's server span (`{operation} {model}`, as the GenAI conventions name
        it) from `trace` (its traceparent and tracestate), and its ids on every log line
        meanwhile (and on those of the generation's own task, which `open` starts in it).
        Parse the request and `open` the generation inside: a refusal ends the span with its
        status; a generation ends it when it ends."""
        tracer = self.dispatcher.tracer
        span = tracer.begin(genai.span_name(operation, rt.name), *trace)
        token = tracer.logged(span) if span is not None else None
        try:
            yield span
        except BaseException as exc:
            if span is not None and span.sampled and not span.end:
                status = exc.status if isinstance(exc, KServeError | GenerationError) else 500
                span.attrs.update(genai.span_attributes(operation, rt.name))
                self.dispatcher.finish_span(span, rt, protocol, status, tenant)
            raise
        finally:
            if token is not None:
                trace_context.reset(token)

    async def open(
        self,
        rt: FunctionRuntime,
        protocol: Protocol,
        text: str,
        sampling: Sampling,
        tenant: str,
        operation: Operation,
        span: RequestSpan | None = None,
    ) -> Opened:
        """Admit and start one generation (KServeError or GenerationError if refused: nothing
        is generated then); `span`: from `traced`."""
        dispatcher = self.dispatcher
        dispatcher.admit(rt, protocol)
        settings = self.settings(rt)
        engine = self.engine(rt)
        lane = dispatcher.lane(rt)
        limit = rt.spec.limits.maxConcurrency
        if rt.inflight >= limit:
            raise KServeError(429, f"function {rt.label} is at its concurrency limit ({limit})")
        admission = lane.admission
        ticket = admission.admit(tenant) if admission is not None else None
        try:
            prepared = await engine.prepare(text, sampling)
        except BaseException:
            if ticket is not None:
                ticket.done(0)
            raise
        try:
            grant = (
                await admission.reserve(ticket, prepared.prompt_tokens, sampling.max_tokens)
                if admission is not None and ticket is not None
                else None
            )
        except BaseException:  # a token budget refused it: nothing is generated
            engine.abandon(prepared)
            if ticket is not None:
                ticket.done(0)
            raise
        started = time.monotonic()
        begun_ns = time.perf_counter_ns()  # the span's clock for the same moment
        stream = Stream(
            prepared.prompt_tokens, sampling, started + settings.timeout.total_seconds()
        )
        stream.budget = grant.completion if grant is not None else None
        stream.interval = settings.streamInterval
        if settings.auditText == "hmac" and self.text_key is not None:
            stream.audit_text = TextDigest(self.text_key, text)
        traced = None
        if span is not None and span.sampled:
            span.child("admission", span.start, begun_ns)
            traced = _Traced(span, protocol, begun_ns)
        stream.on_finish = self._finisher(
            rt, lane, stream, (ticket, grant), tenant, operation, traced
        )
        rt.inflight += 1
        dispatcher.inflight += 1
        dispatcher.drained.clear()
        engine.start(stream, prepared)
        return Opened(stream, grant.headers if grant is not None else ())

    def _finisher(
        self,
        rt: FunctionRuntime,
        lane: Lane,
        stream: Stream,
        qos: tuple[Ticket | None, TokenGrant | None],
        tenant: str,
        operation: Operation,
        traced: _Traced | None = None,
    ) -> Any:
        dispatcher = self.dispatcher
        labels = (operation, genai.PROVIDER_NAME, rt.name, tenant)
        ticket, grant = qos

        def finished(done: Finished) -> None:
            rt.inflight -= 1
            dispatcher.inflight -= 1
            if not dispatcher.inflight:
                dispatcher.drained.set()
            rt.last_used = time.monotonic()
            if ticket is not None:
                if grant is not None:  # the budget pays for what was generated, cut or not
                    ticket.admission.settle(ticket, grant, done.usage.total_tokens)
                ticket.done(stream.cpu_ns)
            seconds = time.monotonic() - stream.started
            status = 200 if done.reason != "error" else 500
            lane.answered(status, seconds)
            self._measure(rt, labels, stream, done, seconds)
            if traced is not None:
                self._trace(traced, rt, stream, done, status, tenant, operation)

        return finished

    def _trace(
        self,
        traced: _Traced,
        rt: FunctionRuntime,
        stream: Stream,
        done: Finished,
        status: int,
        tenant: str,
        operation: Operation,
    ) -> None:
        """The generation's spans: from its start to the first token (the prompt read, the
        first token sampled), then the decode loop to its end."""
        span, begun = traced.span, traced.begun_ns
        end = time.perf_counter_ns()
        decoding = begun
        if done.ttft_s is not None:
            decoding = begun + round(done.ttft_s * 1e9)
            span.child("time to first token", begun, decoding)
            span.event("first token", decoding, {genai.TIME_TO_FIRST_TOKEN: done.ttft_s})
        span.child(
            "decode loop", decoding, end, {genai.OUTPUT_TOKENS: done.usage.completion_tokens}
        )
        span.attrs.update(genai.span_attributes(operation, rt.name))
        span.attrs.update(
            {
                genai.REQUEST_MAX_TOKENS: stream.sampling.max_tokens,
                genai.INPUT_TOKENS: done.usage.prompt_tokens,
                genai.OUTPUT_TOKENS: done.usage.completion_tokens,
                genai.FINISH_REASONS: [done.client_reason],
                genai.FINISH_REASON: done.reason,  # why, where the client reads "length"
            }
        )
        if done.reason in ("cancelled", "error"):
            span.attrs[genai.ERROR_TYPE] = done.reason
        self.dispatcher.finish_span(span, rt, traced.protocol, status, tenant)

    def _measure(
        self,
        rt: FunctionRuntime,
        labels: tuple[str, str, str, str],
        stream: Stream,
        done: Finished,
        seconds: float,
    ) -> None:
        m = self.metrics
        usage = done.usage
        m.gen_tokens.labels(*labels, "input").observe(usage.prompt_tokens)
        m.gen_tokens.labels(*labels, "output").observe(usage.completion_tokens)
        error = {"cancelled": "cancelled", "error": "error"}.get(done.reason, "")
        m.gen_duration.labels(*labels, error).observe(seconds)
        m.gen_finished.labels(rt.label, done.reason).inc()
        tpot = None
        if done.ttft_s is not None:
            m.gen_ttft.labels(*labels).observe(done.ttft_s)
            if usage.completion_tokens > 1:
                tpot = (seconds - done.ttft_s) / (usage.completion_tokens - 1)
                m.gen_tpot.labels(*labels).observe(tpot)
        stats = self.recent.setdefault(rt.label, GenerationStats())
        stats.add(done, tpot)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


@dataclass(frozen=True, slots=True)
class _Traced:
    """A sampled generation's server span, until the generation ends."""

    span: RequestSpan
    protocol: Protocol
    begun_ns: int  # perf_counter_ns when generation began (after admission)


class GenerationStats:
    """Recent generations of one function, for `meshfn status` and the console."""

    def __init__(self) -> None:
        self.ttft: deque[float] = deque(maxlen=512)
        self.tpot: deque[float] = deque(maxlen=512)
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, done: Finished, tpot: float | None) -> None:
        self.finished[done.reason] = self.finished.get(done.reason, 0) + 1
        self.prompt_tokens += done.usage.prompt_tokens
        self.completion_tokens += done.usage.completion_tokens
        if done.ttft_s is not None:
            self.ttft.append(done.ttft_s)
        if tpot is not None:
            self.tpot.append(tpot)
