"""Generation: the decode loop the backend runs for generative functions, under the function's
deadline with a per-token time budget, and what every generate front end (OpenAI, Triton's
generate extension, gRPC streaming) reads from it.

Two engines, one stream of events (`Piece`s of text, then one `Finished`):

- **step** functions (`kind = "onnx"`: an ONNX decode step compiled by meshfn's model
  compiler, core ABI v2, e.g. tiny-lm): the guest computes one decode step for a batch of
  streams, (tokens, state) -> (logits, state_out). The host tokenises (bytes), keeps
  each stream's recurrent state, feeds the prompt one token per step, samples (temperature,
  top_p, a seeded generator per stream), and with `batching` runs one step of every active
  stream in ONE guest call: continuous batching, streams joining and leaving between steps.
  Every step is bounded by the token budget (epoch deadline); a step is pure, so any instance
  runs any stream's step and none is held between steps.
- **generator** functions (Python, `meshfn_sdk.Model.generate`): the guest tokenises and
  samples itself; an instance is leased for the stream and each piece it yields is one call
  (`generate-next`), bounded by the token budget.

The host applies what is common: max_tokens, stop sequences (text held back while it may still
begin one), the whole generation's deadline, and cancellation: a stream whose consumer went away
(client disconnect, gateway reset) leaves before the next step, so generation stops within one
token and the instance is free.
"""

from __future__ import annotations

import asyncio
import codecs
import contextvars
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .host import CallResult, Outcome

log = logging.getLogger("meshfn.inference")

# Why a generation ended. The client sees "stop" or "length" (OpenAI's finish_reason): a
# token budget or the deadline ending it early reads as "length", with the reason in the audit.
Reason = Literal["stop", "length", "budget", "deadline", "cancelled", "error"]
CLIENT_REASON: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "budget": "length",
    "deadline": "length",
    "cancelled": "cancelled",
    "error": "error",
}
# How the stream ended, for the audit record: every reason is one of these.
OUTCOME = {"stop": "completed", "length": "completed", "budget": "completed",
           "deadline": "completed", "cancelled": "cancelled", "error": "failed"}  # fmt: skip
# Events a stream's consumer may fall behind before the stream skips steps (it is reading
# slowly, or its client is): generation waits for the reader instead of buffering ahead.
MAX_QUEUED = 64
# A joined stream (generation.streamInterval > 1) lets what waited go with a token that comes
# this long after its last event: a slow model's tokens then go one by one, as without joining.
JOIN_WAIT_S = 0.050


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's generation settings, already checked against the function's bounds."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def guest_json(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
        }


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Piece:
    """Text produced by `tokens` more completion tokens (text may be empty: a token inside a
    multi-byte character, or text held back while it may begin a stop sequence)."""

    text: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Finished:
    reason: Reason
    usage: Usage
    ttft_s: float | None  # from the stream's start to its first completion token
    error: str | None = None
    text_digests: Mapping[str, str] | None = None  # auditText hmac: the usage record's digests

    @property
    def client_reason(self) -> str:
        return CLIENT_REASON[self.reason]

    @property
    def outcome(self) -> str:
        return OUTCOME[self.reason]


Event = Piece | Finished


class GenerationError(Exception):
    """A generation that cannot start: the status and message its front end answers with,
    and the field it concerns (OpenAI's error `param`)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


# ---------------------------------------------------------------- sampling


def sample(
    logits: np.ndarray, sampling: list[Sampling], rngs: list[np.random.Generator]
) -> list[int]:
    """One token per row of `logits` [B, V], each row with its own settings and generator, in
    a few array operations for the whole batch. Each row's arithmetic is the same whatever the
    rows beside it (elementwise, or reductions along the row), so a seeded stream draws the
    same tokens alone or batched. Temperature 0 is greedy; top_p keeps the most likely tokens
    whose probabilities reach top_p (at least one)."""
    temperature = np.array([s.temperature for s in sampling], np.float64)
    greedy = temperature == 0
    out = np.argmax(logits, axis=1)
    if greedy.all():
        return [int(t) for t in out]
    top_p = np.array([s.top_p for s in sampling], np.float64)
    for rows, nucleus in ((np.flatnonzero(~greedy & (top_p >= 1)), False),
                          (np.flatnonzero(~greedy & (top_p < 1)), True)):  # fmt: skip
        if len(rows):
            out[rows] = _draw(logits[rows], temperature[rows], top_p[rows], rows, rngs, nucleus)
    return [int(t) for t in out]


def _draw(
    logits: np.ndarray,
    temperature: np.ndarray,
    top_p: np.ndarray,
    rows: np.ndarray,
    rngs: list[np.random.Generator],
    nucleus: bool,
) -> np.ndarray:
    """Draw from softmax(logits / temperature) per row; with `nucleus` only from the most
    likely tokens reaching top_p (sorted: the costly part, so only rows that ask for it)."""
    scaled = logits.astype(np.float64) / temperature[:, None]
    scaled -= scaled.max(axis=1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=1, keepdims=True)
    order = None
    if nucleus:
        order = np.argsort(-probs, axis=1, kind="stable")
        probs = np.take_along_axis(probs, order, axis=1)
        before = np.cumsum(probs, axis=1) - probs  # mass of the more likely tokens
        probs = np.where(before < top_p[:, None], probs, 0.0)
    cumulative = np.cumsum(probs, axis=1)
    draws = np.array([rngs[i].random() for i in rows], np.float64) * cumulative[:, -1]
    picks = np.minimum((cumulative <= draws[:, None]).sum(axis=1), logits.shape[1] - 1)
    if order is None:
        return np.asarray(picks)
    return np.asarray(order[np.arange(len(rows)), picks])


def generator_for(seed: int | None) -> np.random.Generator:
    """A stream's own random generator: seeded (deterministic), else from the OS."""
    entropy = seed if seed is not None else int.from_bytes(os.urandom(16), "little")
    return np.random.Generator(np.random.PCG64(entropy))


# ---------------------------------------------------------------- text: bytes and stop sequences


class TextAssembler:
    """Completion text as it grows: bytes decoded incrementally (a character split across
    tokens comes out whole), and text held back while it may still begin a stop sequence.
    `add` returns the text that may go to the client now and whether a stop sequence ended
    it (the stop sequence itself is never sent)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.text_len = 0

    def add_bytes(self, data: bytes) -> tuple[str, bool]:
        return self.add(self._decoder.decode(data))

    def add(self, text: str) -> tuple[str, bool]:
        if not self._stop:
            self.text_len += len(text)
            return text, False
        held = self._held + text
        cut = min((i for s in self._stop if (i := held.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.text_len += cut
            return held[:cut], True
        keep = max((k for s in self._stop for k in range(1, len(s)) if held.endswith(s[:k])),
                   default=0)  # fmt: skip
        out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text_len += len(out)
        return out, False

    def flush(self) -> str:
        """The rest at the end of a generation (held text, an unfinished character)."""
        rest = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        self.text_len += len(rest)
        return rest


# ---------------------------------------------------------------- one stream


OnFinish = Callable[[Finished], None]


class TextDigest:
    """A Function's `generation.auditText: hmac`: HMAC-SHA256 of the prompt and of the text the
    client got, under the backend's audit text key, for the usage record (the audit trail can
    then match a text someone presents without ever holding any). `salt_id` names the key."""

    def __init__(self, key: bytes, prompt: str) -> None:
        self.key = key
        self.prompt = hmac.new(key, prompt.encode("utf-8", "surrogatepass"), "sha256").hexdigest()
        self.text = hmac.new(key, digestmod="sha256")

    def add(self, text: str) -> None:
        self.text.update(text.encode("utf-8", "surrogatepass"))

    def digests(self) -> dict[str, str]:
        return {
            "prompt_hmac": self.prompt,
            "completion_hmac": self.text.hexdigest(),
            "text_salt_id": salt_id(self.key),
        }


def salt_id(key: bytes) -> str:
    return hashlib.sha256(b"meshfn audit text key:" + key).hexdigest()[:16]


@dataclass(eq=False)
class Stream:
    """One generation as its front end sees it: `prompt_tokens` once started, then `events()`
    until a Finished; `cancel()` when the client is gone. `on_finish` hears the Finished
    exactly once, also when nobody reads it (QoS reconciliation, metrics, statistics)."""

    prompt_tokens: int
    sampling: Sampling
    deadline: float  # time.monotonic() by which the generation ends ("deadline")
    on_finish: OnFinish | None = None
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    completion_tokens: int = 0
    cancelled: bool = False
    finished: Finished | None = None
    budget: int | None = None  # most completion tokens the tenant's token budget allows
    cpu_ns: int = 0  # guest CPU time on its behalf (a batched step's split by streams)
    audit_text: TextDigest | None = None  # auditText hmac: digests of the prompt and the text
    interval: int = 1  # completion tokens per event after the first text (streamInterval)
    _queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    _held: list[str] = field(default_factory=list)  # joined pieces not yet an event
    _held_tokens: int = 0
    _last_event: float | None = None  # when the last text went (None: no text yet)

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def emit(self, piece: Piece) -> None:
        if self.finished is not None:
            return
        if self.first_token_at is None and piece.tokens:
            self.first_token_at = time.monotonic()
        self.completion_tokens += piece.tokens
        if self.audit_text is not None:
            self.audit_text.add(piece.text)
        if self.interval == 1:
            self._queue.put_nowait(piece)
            return
        if self._last_event is None:  # the first text goes at once
            if piece.text:
                self._last_event = time.monotonic()
            self._queue.put_nowait(piece)
            return
        # Joined: every event wakes the reader and each proxy on the way (a chunk costs an
        # Envoy ~80 us of CPU here, whatever its size), so N tokens go as one.
        self._held.append(piece.text)
        self._held_tokens += piece.tokens
        now = time.monotonic()
        if self._held_tokens >= self.interval or now - self._last_event >= JOIN_WAIT_S:
            self._release(now)

    def _release(self, now: float) -> None:
        if not self._held:
            return
        self._queue.put_nowait(Piece("".join(self._held), self._held_tokens))
        self._held.clear()
        self._held_tokens = 0
        self._last_event = now

    def finish(self, reason: Reason, error: str | None = None) -> Finished:
        """End the stream (once: later calls return the first Finished)."""
        if self.finished is not None:
            return self.finished
        self._release(time.monotonic())
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        digests = self.audit_text.digests() if self.audit_text is not None else None
        usage = Usage(self.prompt_tokens, self.completion_tokens)
        done = Finished(reason, usage, ttft, error, digests)
        self.finished = done
        self._queue.put_nowait(done)
        if self.on_finish is not None:
            try:
                self.on_finish(done)
            except Exception:
                log.exception("generation on_finish failed")
        return done

    def cancel(self) -> None:
        """The consumer is gone: the engine drops the stream before its next step."""
        self.cancelled = True

    def limit(self, generated: int | None = None) -> Reason | None:
        """Whether the stream must end before its next token: max_tokens, its token budget,
        its deadline (the reason), else None. `generated`: the completion tokens so far where
        the caller counts ahead of `emit` (a decode loop on a worker thread)."""
        done = self.completion_tokens if generated is None else generated
        if done >= self.sampling.max_tokens:
            return "length"
        if self.budget is not None and done >= self.budget:
            return "budget"
        if time.monotonic() >= self.deadline:
            return "deadline"
        return None

    async def events(self) -> AsyncGenerator[Event, None]:
        """Pieces as they come, then the Finished; leaving early cancels the generation."""
        try:
            while True:
                event = await self._queue.get()
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            if self.finished is None:
                self.cancel()


# ---------------------------------------------------------------- step functions


@dataclass(frozen=True, slots=True)
class StepShape:
    vocab: int
    state: int
    eos: int | None
    bos: int | None


# What a StepCall hands the result of its last fed step (run_steps).
After = Callable[[CallResult], bytes | None]
# Steps on a worker thread, each a guest call under the token budget, the state of one fed to
# the next, stopping early after a step once `yield_` is set, then decoding on with `after`
# (run_steps): (batch, each step's tokens, states, yield_, after) -> (the last step's result,
# the steps run, the guest's CPU time).
StepCall = Callable[
    [int, list[bytes], bytes, threading.Event, After], Awaitable[tuple[CallResult, int, int]]
]
# Most steps in one StepCall while every stream of a batch still reads its prompt; a stream that
# starts meanwhile sets `yield_`, and the call ends after its current step so it can join.
PREFILL_STEPS = 32
# Most decode steps one StepCall runs after its fed steps before the event loop looks at the
# batch again (a stream waiting for its turn, the worker gate's order).
MAX_CHAIN = 16


def run_steps(
    step: Callable[[bytes, bytes], CallResult],
    steps: list[bytes],
    states: bytes,
    yield_: threading.Event,
    after: After,
) -> tuple[CallResult, int]:
    """A StepCall's steps on its worker thread: `step(tokens, states)` for each of `steps`,
    then, once all of them ran, `after` gets each result and says what to step next (None:
    return). The decode loop then goes on where the guest runs: each token was a hop to the
    event loop and back (two thread wake-ups, each the other CPU's on a small VM), which
    doubled the inter-token latency of a stream alone. -> (the last result, the steps run)"""
    result = CallResult(Outcome.INTERNAL, "no step to run")
    ran = 0
    for tokens in steps:
        result = step(tokens, states)
        ran += 1
        if result.outcome is not Outcome.OK or yield_.is_set():
            break
        states = result.outputs[1]
    if result.outcome is not Outcome.OK or ran < len(steps):
        return result, ran
    following = after(result)
    while following is not None:
        result = step(following, result.outputs[1])
        ran += 1
        if result.outcome is not Outcome.OK:
            break
        following = after(result)
    return result, ran


@dataclass(eq=False)
class _StepStream:
    stream: Stream
    feed: deque[int]  # tokens still to feed: the prompt, then each sampled token
    state: np.ndarray
    rng: np.random.Generator
    text: TextAssembler
    generated: int = 0  # tokens sampled (the stream counts them as they reach it)
    ended: bool = False  # its end is decided (the stream hears it when the loop runs next)


# What a decode step decided for a stream, for the event loop: a piece to emit, then an end.
_Action = tuple[Stream, Piece | None, Reason | None]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A generation ready to start: its prompt's length in the model's tokens, and what its
    engine needs to run it (the prompt's tokens; a leased instance)."""

    prompt_tokens: int
    handle: Any


class StepEngine:
    """The decode loop of one step function. `call(batch, steps, states, yield_, after)` runs
    steps on a worker thread (lease an instance, run each under the token budget, give it
    back): up to PREFILL_STEPS while every stream reads its prompt, then on while the batch
    stays as it is, sampling there (_Decoding, at most MAX_CHAIN steps): a step per call was a
    hop through the event loop and the worker pool per token. With `max_streams` > 1 one loop
    steps every active stream together (continuous batching, at most `max_streams` per call,
    the others in turn); with 1 each stream runs its own loop. `contended`: whether other
    calls wait for a worker thread (a decoding call then gives its thread back)."""

    def __init__(
        self,
        shape: StepShape,
        call: StepCall,
        max_streams: int,
        context: int,
        truncate: bool = False,
        on_step: Callable[[int], None] = lambda batch: None,
        contended: Callable[[], bool] = lambda: False,
    ) -> None:
        self.shape = shape
        self._contended = contended  # other calls wait for a worker thread (read off the loop)
        self._call = call
        self.max_streams = max_streams
        self.context = context  # most prompt + completion tokens
        self.truncate = truncate  # cut a prompt that does not fit, rather than refuse it
        self._on_step = on_step  # rows per guest call (metrics)
        self._active: deque[_StepStream] = deque()
        self._loop: asyncio.Task[None] | None = None
        self._solo: dict[asyncio.Task[None], _StepStream] = {}
        self._joining = threading.Event()  # a stream started: a prompt's call yields to it
        self.steps = 0  # guest calls so far
        self.stepped_tokens = 0  # stream steps so far (their sum over calls)

    def tokenize(self, text: str) -> list[int]:
        """The prompt's tokens as the model reads them: its bytes, after its begin token."""
        ids = list(text.encode("utf-8"))
        begin = self.shape.bos if self.shape.bos is not None else self.shape.eos
        return ([begin] if begin is not None else []) + ids

    async def prepare(self, text: str, sampling: Sampling) -> Prepared:
        """The prompt's tokens within the model's context: a 400 that says the limit, or with
        `truncate` the prompt's last tokens that fit (after its begin token)."""
        ids = self.tokenize(text)
        room = self.context - sampling.max_tokens
        if room < 2:
            raise GenerationError(
                400,
                f"max_tokens {sampling.max_tokens} leaves no room for a prompt in this model's "
                f"context of {self.context} tokens",
                "max_tokens",
            )
        if len(ids) > room:
            if not self.truncate:
                raise GenerationError(
                    400,
                    f"this model's maximum context length is {self.context} tokens; the prompt "
                    f"has {len(ids)} tokens and max_tokens is {sampling.max_tokens}: shorten the "
                    f"prompt to at most {room} tokens or ask for fewer",
                    "prompt",
                )
            ids = ids[:1] + ids[len(ids) - room + 1 :]
        return Prepared(len(ids), ids)

    def abandon(self, prepared: Prepared) -> None:
        """A prepared generation that will not start (refused by a token budget)."""

    def start(self, stream: Stream, prepared: Prepared) -> None:
        entry = _StepStream(
            stream,
            deque(prepared.handle),
            np.zeros(self.shape.state, np.float32),
            generator_for(stream.sampling.seed),
            TextAssembler(stream.sampling.stop),
        )
        if self.max_streams <= 1:
            task = asyncio.get_running_loop().create_task(self._run_alone(entry))
            self._solo[task] = entry
            task.add_done_callback(self._solo.pop)
            return
        self._active.append(entry)
        self._joining.set()
        if self._loop is None or self._loop.done():
            # the streams' loop, not the first stream's: an empty context, so its log lines
            # carry no request's trace ids (a stream alone runs in its request's context)
            self._loop = asyncio.get_running_loop().create_task(
                self._run_batched(), context=contextvars.Context()
            )

    @property
    def streams(self) -> int:
        return len(self._active) + len(self._solo)

    async def _run_alone(self, entry: _StepStream) -> None:
        while entry.stream.finished is None:
            if not self._ready(entry):
                await asyncio.sleep(0.001)
                continue
            await self._step([entry])

    async def _run_batched(self) -> None:
        while self._active:
            ready = [e for e in list(self._active)[: self.max_streams * 2] if self._ready(e)]
            batch = ready[: self.max_streams]
            if not batch:  # every stream waits for its reader (or was dropped)
                self._active = deque(e for e in self._active if e.stream.finished is None)
                await asyncio.sleep(0.001)
                continue
            self._active.rotate(-len(batch))  # the others first next time
            await self._step(batch)
            self._active = deque(e for e in self._active if e.stream.finished is None)

    def _ready(self, entry: _StepStream) -> bool:
        """Whether a stream takes part in the next step: it ends first if it must (cancelled,
        a limit reached), and waits while its reader is MAX_QUEUED events behind."""
        stream = entry.stream
        if stream.finished is not None:
            return False
        if stream.cancelled:
            stream.finish("cancelled")
            return False
        if not entry.feed:  # nothing to feed: cannot happen while unfinished
            stream.finish("error", "the stream has no token to feed")
            return False
        return stream.backlog < MAX_QUEUED

    async def _step(self, batch: list[_StepStream]) -> None:
        # Every stream samples after its last fed token: steps up to the first of them run in
        # one call (only the last step's logits are read), then the call decodes on (_Decoding)
        count = min(PREFILL_STEPS, *(len(e.feed) for e in batch))
        fed = [[e.feed.popleft() for _ in range(count)] for e in batch]
        steps = [np.array(column, np.int32).tobytes() for column in zip(*fed, strict=True)]
        states = np.stack([e.state for e in batch])
        self._joining.clear()
        decoding = _Decoding(self, batch, asyncio.get_running_loop(), self._joining)
        result, ran, cpu_ns = await self._call(
            len(batch), steps, states.tobytes(), self._joining, decoding.after
        )
        for entry, tokens in zip(batch, fed, strict=True):
            entry.stream.cpu_ns += cpu_ns // len(batch)
            entry.feed.extendleft(reversed(tokens[ran:]))  # a joining stream cut it short
        self.steps += ran
        self.stepped_tokens += ran * len(batch)
        for _ in range(ran):
            self._on_step(len(batch))
        if result.outcome is not Outcome.OK:
            why = f"the step function failed ({result.outcome.value}): {result.body}"
            for entry in batch:
                entry.stream.finish("error", why)
            return
        if ran < count:  # every stream still reads its prompt: no logits to sample yet
            _keep_states(batch, result)

    def _decide(self, entry: _StepStream, token: int) -> list[_Action]:
        """What a sampled token means for its stream (on the worker thread: the stream hears
        it on the event loop, `_deliver`); the token is fed next unless the stream ends."""
        stream = entry.stream
        if stream.cancelled:
            entry.ended = True
            return [(stream, None, "cancelled")]
        entry.generated += 1
        if token == self.shape.eos or token >= 256:  # the end token (or one outside bytes)
            entry.ended = True
            return [(stream, Piece(entry.text.flush(), 1), "stop")]
        text, stopped = entry.text.add_bytes(bytes((token,)))
        if stopped:
            entry.ended = True
            return [(stream, Piece(text, 1), "stop")]
        reason = stream.limit(entry.generated)
        if reason is not None:
            entry.ended = True
            rest = entry.text.flush()
            return [
                (stream, Piece(text, 1), None),
                (stream, Piece(rest, 0) if rest else None, reason),
            ]
        entry.feed.append(token)
        return [(stream, Piece(text, 1), None)]

    @staticmethod
    def _deliver(actions: list[_Action]) -> None:
        """On the event loop: each stream's pieces and ends, in the order they were decided."""
        for stream, piece, reason in actions:
            if piece is not None:
                stream.emit(piece)
            if reason is not None:
                stream.finish(reason)

    def close(self) -> None:
        for entry in [*self._active, *self._solo.values()]:
            entry.stream.finish("error", "the inference backend is shutting down")
        self._active.clear()
        if self._loop is not None:
            self._loop.cancel()
        for task in list(self._solo):
            task.cancel()


def _keep_states(batch: list[_StepStream], result: CallResult) -> None:
    """Each stream's state after a step: its row of the step's second output."""
    states = np.frombuffer(result.outputs[1], np.float32).reshape(len(batch), -1)
    for i, entry in enumerate(batch):
        entry.state = states[i].copy()


class _Decoding:
    """One StepCall's decoding, on its worker thread (`after`, run_steps): each step's
    states kept, its streams sampled, what that means sent to the event loop (`_deliver`,
    which runs before the call's own return there), and the next step's tokens while the
    batch stays as it is: no stream ended or cancelled or too far ahead of its reader, no
    stream joining or waiting for its turn, no other call waiting for a worker thread, at
    most MAX_CHAIN steps."""

    def __init__(
        self,
        engine: StepEngine,
        batch: list[_StepStream],
        loop: asyncio.AbstractEventLoop,
        joining: threading.Event,
    ) -> None:
        self.engine = engine
        self.batch = batch
        self.loop = loop
        self.joining = joining
        self.chained = 0

    def after(self, result: CallResult) -> bytes | None:
        batch, engine = self.batch, self.engine
        logits = np.frombuffer(result.outputs[0], np.float32).reshape(len(batch), -1)
        _keep_states(batch, result)
        sampling = [
            i
            for i, e in enumerate(batch)
            if not e.feed and not e.ended and e.stream.finished is None
        ]
        if sampling:
            chosen = sample(
                logits[sampling],
                [batch[i].stream.sampling for i in sampling],
                [batch[i].rng for i in sampling],
            )
            actions = [
                a
                for i, t in zip(sampling, chosen, strict=True)
                for a in engine._decide(batch[i], t)
            ]
            self.loop.call_soon_threadsafe(engine._deliver, actions)
        if not self._goes_on():
            return None
        self.chained += 1
        return np.array([e.feed.popleft() for e in batch], np.int32).tobytes()

    def _goes_on(self) -> bool:
        engine = self.engine
        if self.chained >= MAX_CHAIN or self.joining.is_set() or engine._contended():
            return False
        if len(engine._active) > len(self.batch):  # streams waiting for their turn
            return False
        return all(
            e.feed
            and not e.ended
            and e.stream.finished is None  # ended on the loop too: the backend shuts down
            and not e.stream.cancelled
            and e.stream.backlog < MAX_QUEUED
            for e in self.batch
        )


# ---------------------------------------------------------------- generator functions


@dataclass(frozen=True, slots=True)
class GeneratorCalls:
    """A generator function's guest calls, each on a worker thread: `start(request)` leases an
    instance and starts the generation there (-> the lease and the call's result); `next(lease)`
    is one piece under the token budget; `end(lease, outcome)` gives the instance back (dropped
    if the outcome poisons it)."""

    start: Callable[[str], Awaitable[tuple[Any, CallResult]]]
    next: Callable[[Any], Awaitable[CallResult]]
    end: Callable[[Any, Outcome], None]


class GeneratorEngine:
    """The decode loop of a Python generator function: one instance per stream, one guest call
    per piece (the guest samples; the host counts, stops and cancels)."""

    def __init__(self, calls: GeneratorCalls) -> None:
        self._calls = calls
        self._tasks: dict[asyncio.Task[None], Stream] = {}

    @property
    def streams(self) -> int:
        return len(self._tasks)

    async def prepare(self, text: str, sampling: Sampling) -> Prepared:
        request = json.dumps({"prompt": text, **sampling.guest_json()})
        lease, result = await self._calls.start(request)
        if result.outcome is not Outcome.OK:
            self._calls.end(lease, result.outcome)
            status = 400 if result.outcome is Outcome.BAD_REQUEST else 500
            raise GenerationError(status, f"the model refused the generation: {result.body}")
        try:
            count = int(json.loads(result.body)["prompt_tokens"])
        except (ValueError, KeyError, TypeError):
            self._calls.end(lease, Outcome.INTERNAL)
            raise GenerationError(
                500, "the model's generate-start answered no prompt_tokens"
            ) from None
        return Prepared(count, lease)

    def abandon(self, prepared: Prepared) -> None:
        self._calls.end(prepared.handle, Outcome.OK)

    def start(self, stream: Stream, prepared: Prepared) -> None:
        task = asyncio.get_running_loop().create_task(self._run(stream, prepared.handle))
        self._tasks[task] = stream
        task.add_done_callback(self._tasks.pop)

    async def _run(self, stream: Stream, lease: Any) -> None:
        outcome = Outcome.OK
        text = TextAssembler(stream.sampling.stop)
        try:
            while stream.finished is None:
                if stream.cancelled:
                    stream.finish("cancelled")
                elif (reason := stream.limit()) is not None:
                    _flush(stream, text)
                    stream.finish(reason)
                elif stream.backlog >= MAX_QUEUED:
                    await asyncio.sleep(0.001)
                else:
                    outcome = await self._piece(stream, lease, text)
        finally:
            stream.finish("error", "the generation was interrupted")  # no-op once finished
            self._calls.end(lease, outcome)

    async def _piece(self, stream: Stream, lease: Any, text: TextAssembler) -> Outcome:
        result = await self._calls.next(lease)
        if result.outcome is not Outcome.OK:
            stream.finish("error", f"the model failed ({result.outcome.value}): {result.body}")
            return result.outcome
        try:
            piece = json.loads(result.body)
            if piece.get("done"):
                _flush(stream, text)
                stream.finish("length" if piece.get("finish_reason") == "length" else "stop")
                return Outcome.OK
            out, stopped = text.add(str(piece["text"]))
            tokens = int(piece.get("tokens", 1))
        except (ValueError, KeyError, TypeError, AttributeError):
            stream.finish("error", "the model's generate-next answered no piece")
            return Outcome.INTERNAL
        stream.emit(Piece(out, max(0, tokens)))
        if stopped:
            stream.finish("stop")
        return Outcome.OK

    def close(self) -> None:
        for task, stream in list(self._tasks.items()):
            stream.finish("error", "the inference backend is shutting down")
            task.cancel()


def _flush(stream: Stream, text: TextAssembler) -> None:
    rest = text.flush()
    if rest:
        stream.emit(Piece(rest, 0))


Engine = StepEngine | GeneratorEngine
