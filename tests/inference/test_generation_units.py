"""Generation's units: sampling (seeded, the same alone or batched, top_p, temperature 0),
stop sequences and split characters, OpenAI's request checks and stream framing, the step
ABI's host side on a hand-written module, the decode loop's batching, limits and cancellation,
the manifest's generate rules, and tiny-lm's backward pass against numerical gradients."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import wasmtime

from meshfn.common.logs import trace_context
from meshfn.contracts import genai
from meshfn.contracts.qos import FunctionQoS
from meshfn.inference import generation, openai_api
from meshfn.inference.engine import new_engine
from meshfn.inference.generation import (
    After,
    Finished,
    GenerationError,
    Piece,
    Sampling,
    StepEngine,
    StepShape,
    Stream,
    TextAssembler,
    Usage,
    generator_for,
    run_steps,
    sample,
)
from meshfn.inference.host import CallResult, Outcome, TensorArtifact, TensorCall, TensorInstance
from meshfn.inference.manifest import FunctionManifest, module_metadata
from meshfn.inference.metrics import Metrics
from meshfn.inference.qos import Admission, Refusal, TokenGrant

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = openai_api.Bounds(max_tokens=100, default_max_tokens=10, max_temperature=2.0, max_stop=2)


# ---------------------------------------------------------------------- sampling


def test_sampling_is_seeded_and_the_same_alone_or_batched() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((12, 50)) * 3).astype(np.float32)
    settings = [
        Sampling(8, temperature=[0, 0.7, 1.0, 1.5][i % 4], top_p=[1.0, 0.9, 0.3][i % 3], seed=i)
        for i in range(12)
    ]
    batched = sample(logits, settings, [generator_for(s.seed) for s in settings])
    alone = [
        sample(logits[i : i + 1], [s], [generator_for(s.seed)])[0] for i, s in enumerate(settings)
    ]
    assert batched == alone
    assert batched == sample(logits, settings, [generator_for(s.seed) for s in settings])
    greedy = [i for i, s in enumerate(settings) if s.temperature == 0]
    assert [batched[i] for i in greedy] == [int(np.argmax(logits[i])) for i in greedy]


def test_sampling_follows_the_distribution_and_cuts_at_top_p() -> None:
    logits = np.log(np.array([[0.1, 0.2, 0.7]], np.float32))
    rng = generator_for(1)
    draws = np.bincount([sample(logits, [Sampling(1)], [rng])[0] for _ in range(6000)], minlength=3)
    assert np.allclose(draws / 6000, [0.1, 0.2, 0.7], atol=0.025)
    nucleus = {sample(logits, [Sampling(1, top_p=0.6)], [rng])[0] for _ in range(500)}
    assert nucleus == {2}  # 0.7 alone reaches 0.6
    hot = np.bincount(
        [sample(logits, [Sampling(1, temperature=100)], [rng])[0] for _ in range(6000)],
        minlength=3,
    )
    assert hot.min() > 1700  # a high temperature flattens it


# ---------------------------------------------------------------------- text


def test_stop_sequences_are_held_back_and_never_sent() -> None:
    text = TextAssembler(("END", "xyz"))
    out = [text.add(piece) for piece in ("hello E", "N", "x", "D", " more E", "ND tail")]
    sent = "".join(o for o, _ in out)
    assert sent == "hello ENxD more "
    assert out[-1][1] and not any(stopped for _, stopped in out[:-1])


def test_a_character_split_across_tokens_comes_out_whole() -> None:
    text = TextAssembler(())
    encoded = "é✓".encode()
    pieces = [text.add_bytes(bytes([b]))[0] for b in encoded]
    assert "".join(pieces) == "é✓" and pieces[0] == ""  # the first byte alone is no character
    assert text.flush() == ""
    broken = TextAssembler(())
    assert broken.add_bytes(b"\xe2\x9c")[0] == "" and broken.flush() == "\ufffd"


# ---------------------------------------------------------------------- OpenAI's requests


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": 2.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"n": 3}, "n"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens"),
        ({"surprise": 1}, "surprise"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_chat_requests_outside_the_bounds_name_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(GenerationError) as caught:
        openai_api.chat_request(chat(**fields), BOUNDS)
    assert caught.value.status == 400 and caught.value.param == param


def test_a_chat_request_within_the_bounds() -> None:
    request = openai_api.chat_request(
        chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            max_completion_tokens=7,
            temperature=0,
            seed=-1,
            stop="\n",
            stream=True,
            stream_options={"include_usage": True},
            service_tier="auto",
        ),
        BOUNDS,
    )
    assert request.prompt == "be brief\nab\n"
    assert request.sampling == Sampling(7, 0.0, 1.0, (1 << 64) - 1, ("\n",))
    assert request.stream and request.include_usage
    assert openai_api.chat_request(chat(), BOUNDS).sampling.max_tokens == 10  # the default
    completion = openai_api.completion_request({"model": "m", "prompt": ["p"]}, BOUNDS)
    assert completion.prompt == "p" and completion.sampling.max_tokens == 10  # min(16, default)


def test_a_body_is_one_json_object_naming_each_field_once() -> None:
    deep = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for body in (b"{", b"[1]", b'"x"', b'{"model": "a", "model": "b"}', b"\xff", deep):
        with pytest.raises(GenerationError) as caught:
            openai_api.loads(body)
        assert caught.value.status == 400
    with pytest.raises(GenerationError) as caught:
        openai_api.model_of({"model": ""})
    assert caught.value.param == "model"


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (openai_api.chat_request, chat(model="m\ud800"), "model"),
        (openai_api.chat_request, chat(user="\udfff"), "user"),
        (openai_api.chat_request, chat(stop=["ok", "\ud800"]), "stop"),
        (
            openai_api.chat_request,
            chat(messages=[{"role": "user", "content": "\ud83d"}]),
            "messages[0].content",
        ),
        (
            openai_api.chat_request,
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]),
            "messages[0].content",
        ),
        (openai_api.completion_request, {"model": "m", "prompt": ["\ud800"]}, "prompt"),
    ],
)
def test_text_with_a_lone_surrogate_is_a_400_naming_the_field(
    parse: Any, body: dict[str, Any], param: str
) -> None:
    """JSON can escape half of a UTF-16 pair (`"\\ud800"`): valid JSON, no text. The tokenizer
    reads UTF-8, so it used to fail there with a 500."""
    with pytest.raises(GenerationError) as caught:
        parse(body, BOUNDS)
    assert caught.value.status == 400 and caught.value.param == param
    with pytest.raises(GenerationError) as caught:
        openai_api.embeddings_request({"model": "e", "input": ["a", "\udc00"]})
    assert caught.value.param == "input"
    for empty in ("", ["a", ""]):
        with pytest.raises(GenerationError, match="cannot be an empty string") as caught:
            openai_api.embeddings_request({"model": "e", "input": empty})
        assert caught.value.param == "input"
    # a whole pair is one character, and fine
    emoji = openai_api.loads(b'{"model": "m", "prompt": "\\ud83d\\ude00"}')
    assert openai_api.completion_request(emoji, BOUNDS).prompt == "\U0001f600"


def test_stream_chunks_are_what_the_sdk_parses() -> None:
    writer = openai_api.ChunkWriter(chat=True, model="m", include_usage=True)
    first, second = writer.text("Hel"), writer.text("lo")
    done = Finished("budget", Usage(3, 2), 0.01)
    end = writer.end(done)
    events = (first + second + end).split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    parsed = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert parsed[1]["choices"][0]["delta"] == {"content": "lo"}
    assert parsed[2]["choices"][0]["finish_reason"] == "length"  # a token budget reads "length"
    assert parsed[3]["choices"] == [] and parsed[3]["usage"]["total_tokens"] == 5
    assert all(p["usage"] is None for p in parsed[:3])
    assert len({p["id"] for p in parsed}) == 1 and all(
        p["object"] == "chat.completion.chunk" for p in parsed
    )
    plain = openai_api.ChunkWriter(chat=False, model="m", include_usage=False)
    assert "usage" not in json.loads(plain.text("x").removeprefix(b"data: "))


def test_error_objects_have_the_openai_shape() -> None:
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"),
                         (403, "permission_error"), (429, "rate_limit_error"), (503, "server_error")):  # fmt: skip
        body = json.loads(openai_api.error_body(status, "why", "field"))
        assert body == {"error": {"message": "why", "type": kind, "param": "field", "code": None}}


# ---------------------------------------------------------------------- the step ABI


# A step function in WAT over a vocabulary of 4 and a state of 1: the next token's logits favour
# (token + 1) mod 4, and the state counts steps. Token 9 fails (bad request); token 8 loops
# forever (the token budget must interrupt it).
STEP = """(module
  (memory (export "memory") 1)
  (global $batch (mut i32) (i32.const 0))
  (func (export "meshfn_abi_version") (result i32) (i32.const 2))
  (func (export "meshfn_metadata") (result i64) (i64.const 0))
  (func (export "meshfn_error") (result i64) (i64.or (i64.shl (i64.const 4096) (i64.const 32)) (i64.const 3)))
  (data (i32.const 4096) "bad")
  (func (export "meshfn_plan") (param $b i32) (result i32)
    (global.set $batch (local.get $b))
    ;; table at 64: tokens at 1024, state at 2048, logits at 8192, state_out at 12288
    (i32.store (i32.const 64) (i32.const 1024)) (i32.store (i32.const 68) (i32.mul (local.get $b) (i32.const 4)))
    (i32.store (i32.const 72) (i32.const 2048)) (i32.store (i32.const 76) (i32.mul (local.get $b) (i32.const 4)))
    (i32.store (i32.const 80) (i32.const 8192)) (i32.store (i32.const 84) (i32.mul (local.get $b) (i32.const 16)))
    (i32.store (i32.const 88) (i32.const 12288)) (i32.store (i32.const 92) (i32.mul (local.get $b) (i32.const 4)))
    (i32.const 64))
  (func (export "meshfn_run") (param $b i32) (result i32) (local $i i32) (local $t i32)
    (block $done (loop $rows
      (br_if $done (i32.ge_u (local.get $i) (local.get $b)))
      (local.set $t (i32.load (i32.add (i32.const 1024) (i32.mul (local.get $i) (i32.const 4)))))
      (if (i32.eq (local.get $t) (i32.const 9)) (then (return (i32.const 1))))
      (if (i32.eq (local.get $t) (i32.const 8)) (then (loop $spin (br $spin))))
      (v128.store (i32.add (i32.const 8192) (i32.mul (local.get $i) (i32.const 16))) (v128.const i32x4 0 0 0 0))
      (f32.store (i32.add (i32.add (i32.const 8192) (i32.mul (local.get $i) (i32.const 16)))
                          (i32.mul (i32.rem_u (i32.add (local.get $t) (i32.const 1)) (i32.const 4)) (i32.const 4)))
                 (f32.const 50))
      (f32.store (i32.add (i32.const 12288) (i32.mul (local.get $i) (i32.const 4)))
                 (f32.add (f32.load (i32.add (i32.const 2048) (i32.mul (local.get $i) (i32.const 4)))) (f32.const 1)))
      (local.set $i (i32.add (local.get $i) (i32.const 1))) (br $rows)))
    (i32.const 0)))"""


@pytest.fixture(scope="module")
def step_instance() -> TensorInstance:
    engine = new_engine()
    instance = TensorArtifact(engine, wasmtime.Module(engine, STEP)).instantiate(1 << 20)
    assert isinstance(instance, TensorInstance)
    return instance


def test_a_v2_module_runs_tensors_through_its_io_table(step_instance: TensorInstance) -> None:
    tokens = np.array([0, 3], np.int32).tobytes()
    state = np.array([5, 7], np.float32).tobytes()
    result = step_instance.call(TensorCall(2, (tokens, state), 2), 100)
    assert result.outcome is Outcome.OK
    logits = np.frombuffer(result.outputs[0], np.float32).reshape(2, 4)
    assert [int(np.argmax(row)) for row in logits] == [1, 0]
    assert np.frombuffer(result.outputs[1], np.float32).tolist() == [6, 8]
    failed = step_instance.call(
        TensorCall(1, (np.array([9], np.int32).tobytes(), b"\0" * 4), 2), 100
    )
    assert failed == CallResult(Outcome.BAD_REQUEST, "bad")
    short = step_instance.call(TensorCall(1, (b"\0\0", b"\0" * 4), 2), 100)
    assert short.outcome is Outcome.INTERNAL


def _engine(
    max_streams: int,
    steps: list[int],
    calls: list[int] | None = None,
    traces: list[tuple[str, str] | None] | None = None,
    stepped: list[int] | None = None,
    contended: bool = False,
    hold: tuple[int, threading.Event] | None = None,
) -> StepEngine:
    """A StepEngine over the WAT step function, its steps on a worker thread as the backend
    runs them (run_steps): each call's batch size goes to `steps`, its number of steps to
    `calls`, the trace ids its log lines would carry to `traces`, and a 1 to `stepped` as each
    step ends (from the worker thread); `contended`: other calls always wait for a worker;
    `hold` (n, go): the worker waits for `go` after the n-th step (a test's moment)."""
    calls = [] if calls is None else calls
    traces = [] if traces is None else traces
    stepped = [] if stepped is None else stepped
    engine = new_engine()
    instance = TensorArtifact(engine, wasmtime.Module(engine, STEP)).instantiate(1 << 20)
    assert isinstance(instance, TensorInstance)
    ticker = __import__("meshfn.inference.engine", fromlist=["EpochTicker"]).EpochTicker(engine)
    ticker.start()

    async def call(
        batch: int, tokens: list[bytes], states: bytes, yield_: threading.Event, after: After
    ) -> tuple[CallResult, int, int]:
        steps.append(batch)
        traces.append(trace_context.get())

        def step(fed: bytes, state: bytes) -> CallResult:
            result = instance.call(TensorCall(batch, (fed, state), 2), 4)
            stepped.append(1)
            if hold is not None and len(stepped) == hold[0]:
                assert hold[1].wait(10)
            return result

        def run() -> tuple[CallResult, int]:
            # counted here: the streams may hear their end (and the test stop) before the
            # call's return reaches the event loop; asyncio.run waits for this thread
            result, ran = run_steps(step, tokens, states, yield_, after)
            calls.append(ran)
            return result, ran

        result, ran = await asyncio.get_running_loop().run_in_executor(None, run)
        return result, ran, 0

    return StepEngine(
        StepShape(4, 1, None, None), call, max_streams, context=64, contended=lambda: contended
    )


async def _generate(
    engine: StepEngine, prompt: bytes, sampling: Sampling, interval: int = 1
) -> tuple[list[Piece], Finished]:
    stream = Stream(0, sampling, deadline=float("inf"), interval=interval)
    engine.start(stream, type("P", (), {"handle": list(prompt)})())  # type: ignore[arg-type]
    pieces: list[Piece] = []
    async for event in stream.events():
        if isinstance(event, Finished):
            return pieces, event
        pieces.append(event)
    raise AssertionError


def test_the_decode_loop_batches_streams_and_stops_at_limits() -> None:
    steps: list[int] = []

    async def run() -> list[tuple[list[Piece], Finished]]:
        engine = _engine(8, steps)
        return await asyncio.gather(
            *(_generate(engine, bytes([i % 4]), Sampling(6, temperature=0)) for i in range(4))
        )

    results = asyncio.run(run())
    for i, (pieces, done) in enumerate(results):
        # greedy: each token is the last plus one, mod 4; bytes 0-3 are control characters
        assert "".join(p.text for p in pieces) == "".join(chr((i + k) % 4) for k in range(1, 7))
        assert done.reason == "length" and done.usage.completion_tokens == 6
    assert max(steps) == 4  # the four streams stepped together


def test_the_shared_decode_loop_logs_under_no_request_and_a_lone_stream_under_its_own() -> None:
    """The batched loop outlives the request that started it: its log lines carry no trace
    ids (not the first request's); a stream stepped alone runs in its request's context."""
    request = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    shared: list[tuple[str, str] | None] = []
    alone: list[tuple[str, str] | None] = []

    async def run() -> None:
        trace_context.set(request)
        await _generate(_engine(8, [], traces=shared), b"\x01", Sampling(3, temperature=0))
        await _generate(_engine(1, [], traces=alone), b"\x01", Sampling(3, temperature=0))

    asyncio.run(run())
    assert shared and set(shared) == {None}
    assert alone and set(alone) == {request}


def test_prompts_are_read_in_one_call_with_the_same_text_as_step_by_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While every stream of a batch reads its prompt, its steps go in one call (up to the
    first stream's last prompt token), and the call decodes on; the text is the same as one
    step per call."""

    async def run(calls: list[int]) -> list[tuple[list[Piece], Finished]]:
        engine = _engine(8, [], calls)
        prompts = [bytes([1] * 9), bytes([2] * 4)]  # 9 and 4 tokens to feed
        return await asyncio.gather(
            *(_generate(engine, p, Sampling(5, temperature=0)) for p in prompts)
        )

    together: list[int] = []
    joined = asyncio.run(run(together))
    monkeypatch.setattr(generation, "PREFILL_STEPS", 1)
    monkeypatch.setattr(generation, "MAX_CHAIN", 0)
    alone: list[int] = []
    stepwise = asyncio.run(run(alone))
    for (pieces, done), (pieces1, done1) in zip(joined, stepwise, strict=True):
        assert "".join(p.text for p in pieces) == "".join(p.text for p in pieces1)
        assert done.usage == done1.usage
    assert set(alone) == {1}
    # both read 4 prompt tokens in the first call, which goes on with the shorter's tokens
    # beside the longer's last 5 prompt tokens (each stream samples after its own prompt)
    assert together[0] > 4 and len(together) < len(alone) and sum(together) == sum(alone)


def test_a_decode_loop_goes_on_where_the_guest_runs_and_stops_for_what_changes_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After its fed steps a call samples and steps on on its worker thread (no hop to the
    event loop and back per token), at most MAX_CHAIN steps, and not past a stream's end: the
    text is the same as one token per call."""
    monkeypatch.setattr(generation, "MAX_CHAIN", 5)

    async def run(calls: list[int]) -> list[tuple[list[Piece], Finished]]:
        engine = _engine(8, [], calls)
        return await asyncio.gather(
            *(
                _generate(engine, bytes([i]), Sampling(n, temperature=0))
                for i, n in ((1, 14), (2, 3))
            )
        )

    chained: list[int] = []
    results = asyncio.run(run(chained))
    monkeypatch.setattr(generation, "MAX_CHAIN", 0)
    stepwise = asyncio.run(run([]))
    assert [(p, d.usage) for p, d in results] == [(p, d.usage) for p, d in stepwise]
    assert [d.reason for _, d in results] == ["length", "length"]
    # both: the fed step and 2 more (the second stream ends at its 3rd token); the first
    # alone: its fed step and 5 more, then its fed step and 4 more (its 14th token ends it)
    assert chained == [3, 6, 5]


def test_a_stream_that_starts_during_a_prompts_call_joins_after_its_current_step() -> None:
    """A long prompt's call does not keep a new stream waiting for all its steps: the start
    makes it stop after the step it is in, and the rest of the prompt is fed with the new one."""

    async def run(calls: list[int], late: bool) -> list[str]:
        go = threading.Event()
        stepped: list[int] = []
        engine = _engine(8, [], calls, stepped=stepped, hold=(5, go) if late else None)
        prompt = bytes([1] * 30)
        first = asyncio.ensure_future(_generate(engine, prompt, Sampling(4, temperature=0)))
        if late:
            while len(stepped) < 5:  # the first call is in its 5th step
                await asyncio.sleep(0.001)
        short = bytes([2] * 3)
        second = asyncio.ensure_future(_generate(engine, short, Sampling(4, temperature=0)))
        while late and not engine._joining.is_set():
            await asyncio.sleep(0)
        go.set()
        return ["".join(p.text for p in (await t)[0]) for t in (first, second)]

    cut: list[int] = []
    texts = asyncio.run(run(cut, late=True))
    assert cut[0] == 5  # the first call stopped for the second stream
    assert texts == asyncio.run(run([], late=False))


def test_a_stuck_step_fails_its_streams_within_the_token_budget() -> None:
    async def run() -> Finished:
        engine = _engine(1, [])
        _, done = await _generate(engine, bytes([8]), Sampling(5, temperature=0))
        return done

    done = asyncio.run(run())
    assert done.reason == "error" and "timeout" in (done.error or "")


def test_a_decode_loop_stays_with_the_event_loop_while_streams_or_calls_wait_their_turn() -> None:
    """Three streams for a batch of two take turns step by step; the call decodes on only once
    the batch holds every stream; with other calls waiting for a worker thread, never."""

    async def run(calls: list[int], contended: bool) -> list[int]:
        engine = _engine(2, [], calls, contended=contended)
        done = await asyncio.gather(
            *(_generate(engine, bytes([i]), Sampling(4 + i, temperature=0)) for i in range(3))
        )
        return [d.usage.completion_tokens for _, d in done]

    taking_turns: list[int] = []
    assert asyncio.run(run(taking_turns, False)) == [4, 5, 6]
    # A, B | C, A | B, C | A, B | C, A (A's 4th token ends it) | B and C decode on together
    assert taking_turns[:5] == [1] * 5 and max(taking_turns[5:]) > 1
    waited: list[int] = []
    assert asyncio.run(run(waited, True)) == [4, 5, 6]
    assert set(waited) == {1}


@pytest.mark.parametrize("end", ["the client went away", "the backend shuts down"])
def test_a_stream_ended_from_the_event_loop_stops_its_decoding_within_a_step(end: str) -> None:
    """Generation stops within one token of a cancel (or of the backend's shutdown), also
    while a call decodes on its worker thread."""
    stepped: list[int] = []

    async def run() -> tuple[Finished, int]:
        engine = _engine(4, [], stepped=stepped)
        stream = Stream(0, Sampling(10_000, temperature=0), deadline=float("inf"))
        engine.start(stream, type("P", (), {"handle": [0]})())  # type: ignore[arg-type]
        events = stream.events()
        async for event in events:
            assert isinstance(event, Piece)
            break
        if end == "the client went away":
            await events.aclose()
        else:
            engine.close()
        at_end = len(stepped)
        await asyncio.sleep(0.05)
        assert stream.finished is not None
        return stream.finished, len(stepped) - at_end

    done, after_end = asyncio.run(run())
    if end == "the client went away":
        assert done.reason == "cancelled"
    else:
        assert done.reason == "error" and "shutting down" in (done.error or "")
    assert after_end <= 1 and done.usage.completion_tokens <= len(stepped)


def _events(stream: Stream) -> list[Piece | Finished]:
    async def read() -> list[Piece | Finished]:
        return [event async for event in stream.events()]

    return asyncio.run(read())


def test_a_joined_stream_sends_its_first_text_at_once_then_n_tokens_per_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(generation, "time", type("Clock", (), {"monotonic": lambda: now[0]}))
    stream = Stream(3, Sampling(100), deadline=float("inf"), interval=3)
    stream.emit(Piece("", 1))  # inside a character: no text yet, nothing to join onto
    for text in ["a", "b", "", "c", "d", "e", "f"]:
        stream.emit(Piece(text, 1))
    now[0] += generation.JOIN_WAIT_S + 0.001  # a slow token takes what waited with it
    stream.emit(Piece("g", 1))
    stream.emit(Piece("h", 1))
    stream.emit(Piece("i", 0))  # text held back for a stop sequence, let go at the end
    stream.finish("stop")
    *pieces, done = _events(stream)
    assert [(p.text, p.tokens) for p in pieces if isinstance(p, Piece)] == [
        ("", 1), ("a", 1), ("bc", 3), ("def", 3), ("g", 1), ("hi", 1),
    ]  # fmt: skip
    assert isinstance(done, Finished) and done.usage.completion_tokens == 10
    assert stream.first_token_at == 100.0  # the first token is when it came, not when it went


def test_a_joined_stream_from_the_decode_loop_has_the_same_text_in_fewer_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(generation, "JOIN_WAIT_S", 60.0)  # a loaded machine's pause splits none

    async def run(interval: int) -> tuple[list[Piece], Finished]:
        engine = _engine(8, [])
        return await _generate(engine, bytes([1]), Sampling(13, temperature=0), interval)

    single, done1 = asyncio.run(run(1))
    joined, done4 = asyncio.run(run(4))
    assert "".join(p.text for p in joined) == "".join(p.text for p in single)
    assert done4.usage == done1.usage and done4.usage.completion_tokens == 13
    assert len(single) == 13 and [p.tokens for p in joined] == [1, 4, 4, 4]


# ---------------------------------------------------------------------- manifests and names


def _manifest(**fields: Any) -> FunctionManifest:
    base: dict[str, Any] = {
        "name": "g", "version": "1", "kind": "onnx", "model": "step.onnx",
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}],
        "generate": {"engine": "step", "tokenizer": "bytes", "vocab": 257, "state": 8, "eos": 256},
    }  # fmt: skip
    return FunctionManifest.model_validate(base | fields)


def test_generative_manifests_contradicting_themselves_are_refused() -> None:
    assert _manifest().problems() == []
    signed = _manifest().metadata()
    assert module_metadata("onnx", signed) == signed["generate"]["step"]  # what the module says
    assert module_metadata("onnx", signed)["inputs"][0]["name"] == "tokens"
    c_step = _manifest(kind="core", model=None, source="x.c").problems()
    assert any('needs kind "onnx"' in p for p in c_step)
    wrong_io = _manifest(inputs=[{"name": "x", "datatype": "FP32", "shape": [1]}]).problems()
    assert any("text_input" in p for p in wrong_io)
    no_vocab = _manifest(generate={"engine": "step", "tokenizer": "bytes", "state": 8}).problems()
    assert any("vocab" in p for p in no_vocab)
    small = _manifest(generate={"engine": "step", "tokenizer": "bytes", "vocab": 10, "state": 8})
    assert any("vocab >= 256" in p for p in small.problems())
    python_step = _manifest(kind="python", module="m", model=None)
    assert python_step.problems()


def test_genai_names_follow_the_conventions_in_one_place() -> None:
    assert genai.TOKEN_USAGE == "gen_ai.client.token.usage"
    assert genai.PROM_TIME_TO_FIRST_TOKEN == "gen_ai_server_time_to_first_token_seconds"
    assert genai.PROM_TIME_PER_OUTPUT_TOKEN == "gen_ai_server_time_per_output_token_seconds"
    assert genai.PROM_REQUEST_DURATION == "gen_ai_server_request_duration_seconds"
    assert genai.LABELS == (
        "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "meshfn_tenant"
    )  # fmt: skip


# ---------------------------------------------------------------------- tiny-lm's training


def test_tiny_lm_backward_pass_matches_numerical_gradients() -> None:
    path = ROOT / "functions" / "examples" / "tiny-lm" / "gru.py"
    spec = importlib.util.spec_from_file_location("tiny_lm_gru", path)
    assert spec is not None and spec.loader is not None
    gru = importlib.util.module_from_spec(spec)
    sys.modules["tiny_lm_gru"] = gru
    spec.loader.exec_module(gru)
    gru.F = np.float64  # numerical gradients need double precision
    rng = np.random.default_rng(1)
    p = gru.Params(*(a.astype(np.float64) for a in gru.Params.init(7, 5, rng).arrays()))
    inputs, targets = rng.integers(0, 7, (4, 3)), rng.integers(0, 7, (4, 3))
    h0 = rng.standard_normal((3, 5)) * 0.1
    _, grads, _ = gru.loss_and_grads(p, inputs, targets, h0)
    worst = 0.0
    for array, grad in zip(p.arrays(), grads, strict=True):
        for index in np.ndindex(array.shape):
            old = array[index]
            array[index] = old + 1e-6
            up = gru.loss_and_grads(p, inputs, targets, h0)[0]
            array[index] = old - 1e-6
            down = gru.loss_and_grads(p, inputs, targets, h0)[0]
            array[index] = old
            worst = max(worst, abs((up - down) / 2e-6 - grad[index]))
    assert worst < 1e-7
    logits, state = gru.step(p, inputs[0], h0)  # the step the served graph computes
    assert logits.shape == (3, 7) and state.shape == (3, 5)


# ---------------------------------------------------------------------- token budgets


def _admission(reservation: str = "full", **limits: Any) -> Admission:
    qos = FunctionQoS.model_validate(
        {
            "policy": "default/tokens",
            "defaultClass": "std",
            "classes": [{"name": "std", **limits}],
            "tokenReservation": reservation,
        }
    )
    return Admission("tiny-lm@1", qos, 64, Metrics())


# the middle of a month, so the windows below do not roll over under the test
MID_MONTH = 1_800_000_000.0  # 2027-01-15


def _reserve(admission: Admission, tenant: str, prompt: int, max_tokens: int,
             now: float = MID_MONTH) -> TokenGrant | None:  # fmt: skip
    return asyncio.run(admission.reserve(admission.admit(tenant), prompt, max_tokens, now))


def test_a_reservation_is_prompt_plus_max_tokens_and_settles_to_what_was_used() -> None:
    admission = _admission(
        tokens=[{"tokens": 1000, "per": "month"}, {"tokens": 300, "per": "minute"}]
    )
    ticket = admission.admit("acme")
    grant = asyncio.run(admission.reserve(ticket, prompt=20, max_tokens=100, now=MID_MONTH))
    assert grant is not None and grant.reservation.reserved == 120 and grant.completion is None
    headers = dict(grant.headers)
    assert headers[b"x-ratelimit-limit-tokens"] == b"300"  # the tightest window: the minute
    assert headers[b"x-ratelimit-remaining-tokens"] == headers[b"x-ratelimit-remaining"] == b"180"
    # a second request while the first runs sees the first's reservation
    second = _reserve(admission, "acme", 10, 100)
    assert second is not None and dict(second.headers)[b"x-ratelimit-remaining"] == b"70"
    with pytest.raises(Refusal) as caught:  # 10 + 100 > 70 left: refused, nothing generated
        _reserve(admission, "acme", 10, 100)
    refusal = caught.value
    assert refusal.status == 429 and refusal.limit == "tokens"
    assert refusal.payload["window"] == "minute" and refusal.payload["tokens_left"] == 70
    assert (
        dict(refusal.headers)[b"retry-after"]
        and dict(refusal.headers)[b"x-ratelimit-remaining"] == b"0"
    )
    admission.settle(ticket, grant, used=20 + 35)  # it stopped early: charged what it used
    usage = admission.book.usage(("tiny-lm@1", "acme"))
    assert usage["minute"] == (55, 110) and usage["month"] == (55, 110)
    assert admission.tenants["acme"].tokens_used == 55
    assert admission.tenants["acme"].tokens_window == {"minute": 55, "month": 55}
    third = _reserve(admission, "acme", 10, 100)
    assert third is not None and dict(third.headers)[b"x-ratelimit-remaining"] == b"25"


def test_partial_reservations_cap_the_completion() -> None:
    admission = _admission("partial", tokens=[{"tokens": 100, "per": "hour"}])
    grant = _reserve(admission, "t", 30, 200)
    assert grant is not None and grant.reservation.reserved == 100 and grant.completion == 70
    with pytest.raises(Refusal):  # nothing left, not even for the prompt
        _reserve(admission, "t", 1, 1)
    assert _reserve(_admission(concurrency=2), "t", 1, 1) is None


def test_token_budgets_follow_calendar_months() -> None:
    admission = _admission(tokens=[{"tokens": 50, "per": "month"}])
    ticket = admission.admit("t")
    end_of_january = 1_801_439_999.0  # 2027-01-31T23:59:59Z
    grant = asyncio.run(admission.reserve(ticket, 10, 40, end_of_january))
    assert grant is not None
    admission.settle(ticket, grant, 50)
    with pytest.raises(Refusal) as caught:
        _reserve(admission, "t", 1, 1, end_of_january)
    assert dict(caught.value.headers)[b"retry-after"] == b"1"  # February starts in a second
    assert _reserve(admission, "t", 10, 40, end_of_january + 2) is not None
