"""Generation against the backend alone (a real process, its REST and gRPC ports), with the
official clients: the unchanged `openai` SDK (chat and text completions, with and without
streaming, usage chunks, embeddings, the model list, its error classes), Triton's generate
extension (raw HTTP: the exact SSE framing) and tritonclient's gRPC streaming API for a
decoupled model; the example tiny-lm really generating (deterministic with a seed), the Python
generator SDK (chaos-gen), the per-token budget, the deadline, cancellation by a client that
goes away, and every bad input of the issue refused before anything is generated."""

from __future__ import annotations

import asyncio
import hmac
import json
import queue
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as tgrpc
from meshfn_e2e import Processes, http

from meshfn.testing.processes import metric_sum, wait_for

TINY = {"generation": {"maxTokens": 1000, "defaultMaxTokens": 24}, "limits": {"maxConcurrency": 64}}
FUNCTIONS: list[dict[str, Any]] = [
    {"name": "tiny-lm", **TINY},
    {"name": "tiny-solo", "artifact": "tiny-lm@1", "limits": {"maxConcurrency": 64},
     "generation": {"maxTokens": 1000, "batching": None}},
    {"name": "tiny-joined", "artifact": "tiny-lm@1",
     "generation": {"maxTokens": 1000, "streamInterval": 4}},
    {"name": "tiny-short", "artifact": "tiny-lm@1",
     "generation": {"maxTokens": 1000, "timeout": "50ms", "tokenTimeout": "40ms"}},
    {"name": "tiny-trunc", "artifact": "tiny-lm@1",
     "generation": {"maxTokens": 64, "truncatePrompt": True}},
    {"name": "chaos-gen", "generation": {"maxTokens": 64, "tokenTimeout": "150ms"}},
    {"name": "tiny-idle", "artifact": "tiny-lm@1",
     "generation": {"maxTokens": 8, "defaultMaxTokens": 8, "tokenTimeout": "5ms",
                    "idleTimeout": "10ms"}},
    {"name": "embedder"},
    {"name": "iris"},
    {"name": "tiny-budget", "artifact": "tiny-lm@1", "generation": {"maxTokens": 100},
     "qos": {"policy": "default/tokens", "defaultClass": "std",
             "classes": [{"name": "std", "tokens": [{"tokens": 200, "per": "month"}]}]}},
    {"name": "tiny-hashed", "artifact": "tiny-lm@1",
     "generation": {"maxTokens": 100, "auditText": "hmac"}},
    {"name": "tiny-partial", "artifact": "tiny-lm@1", "generation": {"maxTokens": 100},
     "qos": {"policy": "default/tokens", "defaultClass": "std", "tokenReservation": "partial",
             "classes": [{"name": "std", "tokens": [{"tokens": 60, "per": "day"}]}]}},
]  # fmt: skip
CONTEXT = 1024  # tiny-lm's (function.toml)
TEXT_KEY = "5e" * 32  # the backend's auditTextKey


@dataclass
class Backend:
    rest: str
    grpc: str

    @property
    def url(self) -> str:
        return f"http://{self.rest}"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include `labels`."""
        return metric_sum(http(f"{self.url}/metrics").body.decode(), name, **labels)

    def status(self, function: str) -> dict[str, Any]:
        doc = http(f"{self.url}/meshfn/functions").json()
        return next(f for f in doc["functions"] if f["name"] == function)


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    tmp = tmp_path_factory.mktemp("generative")
    procs = Processes(tmp)
    try:
        found = Backend(*procs.backend(FUNCTIONS, auditTextKey=TEXT_KEY))
        yield found
    finally:
        procs.stop_all()


def test_the_model_list_names_what_serves_an_openai_operation(backend: Backend) -> None:
    models = {m.id for m in backend.client().models.list()}
    assert {"tiny-lm", "chaos-gen", "embedder"} <= models
    assert "iris" not in models  # a tabular KServe model is no OpenAI model
    assert backend.client().models.retrieve("tiny-lm").owned_by == "meshfn"
    with pytest.raises(openai.NotFoundError):
        backend.client().models.retrieve("iris")


def test_chat_completion_really_generates_and_counts_its_own_tokens(backend: Backend) -> None:
    client = backend.client()
    messages = [{"role": "user", "content": "The for statement"}]
    first = client.chat.completions.create(
        model="tiny-lm", messages=messages, max_tokens=40, seed=7, temperature=0.7
    )
    again = client.chat.completions.create(
        model="tiny-lm", messages=messages, max_tokens=40, seed=7, temperature=0.7
    )
    text = first.choices[0].message.content
    assert text and text == again.choices[0].message.content  # deterministic with a seed
    assert first.choices[0].finish_reason in ("stop", "length")
    # byte-level: the begin token, then the template's text "The for statement\n" as bytes
    assert first.usage.prompt_tokens == 1 + len(b"The for statement\n")
    assert 1 <= first.usage.completion_tokens <= 40
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    words = re.findall(r"[a-z]{3,}", text.lower())
    assert words, f"no words in {text!r}"  # trained on Python's docs: it writes words


def test_streamed_chat_with_usage_is_what_the_sdk_expects(backend: Backend) -> None:
    client = backend.client()
    messages = [{"role": "user", "content": "Classes"}]
    whole = client.chat.completions.create(
        model="tiny-lm", messages=messages, max_tokens=30, seed=3
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-lm",
            messages=messages,
            max_tokens=30,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in content)
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1
    # without include_usage there is no usage chunk
    plain = list(
        client.chat.completions.create(
            model="tiny-lm", messages=messages, max_tokens=5, seed=3, stream=True
        )
    )
    assert all(c.choices for c in plain)


def test_text_completions_with_and_without_stream(backend: Backend) -> None:
    client = backend.client()
    whole = client.completions.create(model="tiny-lm", prompt="def ", max_tokens=20, seed=11)
    streamed = client.completions.create(
        model="tiny-lm", prompt="def ", max_tokens=20, seed=11, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed)
    assert text == whole.choices[0].text
    assert whole.usage.prompt_tokens == 1 + len(b"def ")
    # OpenAI's default max_tokens for /v1/completions is 16
    default = client.completions.create(model="tiny-lm", prompt="x", seed=1, temperature=0)
    assert default.usage.completion_tokens <= 16


def test_a_stream_interval_joins_tokens_into_fewer_events_of_the_same_text(
    backend: Backend,
) -> None:
    """generation.streamInterval 4: the same text and usage as one event per token, the first
    text alone, then about one event per four tokens (OpenAI's SDK and Triton's framing)."""
    client = backend.client()
    texts: dict[str, list[str]] = {}
    for model in ("tiny-lm", "tiny-joined"):
        options = {"include_usage": True}
        stream = client.completions.create(
            model=model, prompt="def ", max_tokens=41, seed=5, stream=True, stream_options=options
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 41
        texts[model] = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts["tiny-joined"]) == "".join(texts["tiny-lm"])
    assert len(texts["tiny-lm"]) >= 35  # a byte-level model: (nearly) one event per token
    # 1 + 40/4 when the steps come quicker than JOIN_WAIT_S; a paused backend lets some go early
    assert 11 <= len(texts["tiny-joined"]) <= 20, texts["tiny-joined"]
    assert texts["tiny-joined"][0] == texts["tiny-lm"][0]
    body = {"text_input": "The ", "parameters": {"max_tokens": 21, "temperature": 0}}
    streamed = {}
    for model in ("tiny-lm", "tiny-joined"):
        _, raw = _raw(backend, f"/v2/models/{model}/generate_stream", body)
        events = [e for e in raw.split(b"\x00TRAILERS\x00")[0].split(b"\n\n") if e]
        streamed[model] = [json.loads(e[6:])["text_output"] for e in events]
    assert "".join(streamed["tiny-joined"]) == "".join(streamed["tiny-lm"])
    assert len(streamed["tiny-joined"]) < len(streamed["tiny-lm"]) / 2


def test_stop_sequences_end_the_text_before_them(backend: Backend) -> None:
    client = backend.client()
    args = {"model": "tiny-lm", "prompt": "The ", "max_tokens": 60, "seed": 5, "temperature": 0}
    text = client.completions.create(**args).choices[0].text
    assert len(text) > 12, text
    stop = text[8:11]
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**args, stop=stop, stream=True)
    )
    assert streamed == cut.choices[0].text


def test_bad_input_is_a_400_naming_the_field_and_generates_nothing(backend: Backend) -> None:
    client = backend.client()
    before = backend.metric("meshfn_gen_streams_total")
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"max_tokens": 1001}, "max_tokens"),
        ({"temperature": 3.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": True}, "logprobs"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="tiny-lm", messages=[{"role": "user", "content": "hi"}], **extra
            )
        assert caught.value.body["param"] == param, (extra, caught.value.body)
        assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-lm", messages=[])
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-lm", messages=[{"role": "tool", "content": "x"}])  # type: ignore[list-item]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["code"] == "model_not_found"
    for body, param in (
        (b"{not json", None),
        (b'{"model": "tiny-lm"}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "tiny-lm", "model": "iris", "messages": []}', "model"),
        # deeper than json.loads recurses: a 400 like any malformed body, never a 500
        (b'{"model": "tiny-lm", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
        # a lone surrogate is valid JSON but no text: the tokenizer reads UTF-8
        (
            b'{"model": "tiny-lm", "messages": [{"role": "user", "content": "a\\ud800"}]}',
            "messages[0].content",
        ),
        (
            b'{"model": "tiny-lm", "messages": [{"role": "user", "content": "a"}], '
            b'"stop": ["\\udfff"]}',
            "stop",
        ),
    ):
        reply = http(f"{backend.url}/v1/chat/completions", method="POST", body=body)
        assert reply.status == 400, body
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    for body, param in (
        (b'{"model": "tiny-lm"}', "prompt"),
        (b'{"model": "tiny-lm", "prompt": "\\ud800"}', "prompt"),
    ):
        reply = http(f"{backend.url}/v1/completions", method="POST", body=body)
        assert reply.status == 400 and reply.json()["error"]["param"] == param, reply.body
    reply = http(
        f"{backend.url}/v1/embeddings",
        method="POST",
        body=b'{"model": "embedder", "input": ["x", "\\udc00"]}',
    )
    assert reply.status == 400 and reply.json()["error"]["param"] == "input", reply.body
    for body in (
        b'{"text_input": "\\ud83d"}',
        b'{"text_input": "a", "parameters": {"stop": ' + b"[" * 3000 + b"]" * 3000 + b"}}",
    ):
        reply = http(f"{backend.url}/v2/models/tiny-lm/generate", method="POST", body=body)
        assert reply.status == 400 and "error" in reply.json(), reply.body
    assert backend.metric("meshfn_gen_streams_total") == before  # nothing was generated


def test_a_prompt_over_the_context_is_refused_saying_the_limit_or_cut_by_policy(
    backend: Backend,
) -> None:
    client = backend.client()
    long = "x" * (CONTEXT + 10)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-lm", prompt=long, max_tokens=8)
    assert f"maximum context length is {CONTEXT} tokens" in caught.value.message
    cut = client.completions.create(model="tiny-trunc", prompt=long, max_tokens=8)
    assert cut.usage.prompt_tokens == CONTEXT - 8


def test_the_body_and_the_path_must_name_the_same_model(backend: Backend) -> None:
    body = json.dumps({"model": "tiny-lm", "prompt": "x", "max_tokens": 2}).encode()
    good = http(f"{backend.url}/v2/models/tiny-lm/openai/v1/completions", method="POST", body=body)
    assert good.status == 200
    bad = http(f"{backend.url}/v2/models/chaos-gen/openai/v1/completions", method="POST", body=body)
    assert bad.status == 400 and bad.json()["error"]["param"] == "model"
    kserve = http(f"{backend.url}/openai/v1/completions", method="POST", body=body)
    assert kserve.status == 200  # KServe's spelling


def _raw(
    backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[bytes, bytes]:
    """A request over a plain socket: the response head and its decoded chunked body, with
    the trailers (what a proxy reads)."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    host, port = backend.rest.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body_out = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return head, body_out + b"\x00TRAILERS\x00" + rest
        body_out, rest = body_out + rest[:size], rest[size + 2 :]


def test_sse_framing_and_the_usage_trailer(backend: Backend) -> None:
    head, raw = _raw(
        backend,
        "/v1/chat/completions",
        {"model": "tiny-lm", "messages": [{"role": "user", "content": "a"}], "max_tokens": 6,
         "stream": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    body, trailers = raw.split(b"\x00TRAILERS\x00")
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        assert event.startswith(b"data: {") and b"\n" not in event
        json.loads(event[6:])
    name, _, value = trailers.strip().partition(b": ")
    assert name.lower() == b"x-meshfn-generation"
    record = json.loads(value)
    assert record["model"] == "tiny-lm" and record["outcome"] == "completed"
    assert record["prompt_tokens"] == 1 + len(b"a\n") and record["completion_tokens"] >= 1
    assert record["ttft_ms"] > 0 and record["finish_reason"] in ("stop", "length")


def test_audit_text_hmac_puts_digests_never_text_in_the_usage_record(backend: Backend) -> None:
    """generation.auditText hmac: the usage record carries HMAC-SHA256 digests of the prompt
    and of the text the client got, under the backend's key; other functions' records carry
    neither."""
    prompt = "The class "
    for model, hashed in (("tiny-hashed", True), ("tiny-lm", False)):
        _, raw = _raw(backend, "/v1/completions", {"model": model, "prompt": prompt,
                                                   "max_tokens": 12, "stream": True})  # fmt: skip
        body, trailers = raw.split(b"\x00TRAILERS\x00")
        text = "".join(
            json.loads(e[6:])["choices"][0]["text"]
            for e in body.split(b"\n\n")
            if e.startswith(b"data: {")
        )
        record = json.loads(trailers.strip().partition(b": ")[2])
        if not hashed:
            assert not {"prompt_hmac", "completion_hmac", "text_salt_id"} & set(record)
            continue
        key = bytes.fromhex(TEXT_KEY)
        assert record["prompt_hmac"] == hmac.new(key, prompt.encode(), "sha256").hexdigest()
        assert record["completion_hmac"] == hmac.new(key, text.encode(), "sha256").hexdigest()
        assert len(record["text_salt_id"]) == 16 and text and text not in trailers.decode()


def test_triton_generate_and_generate_stream(backend: Backend) -> None:
    body = {"text_input": "The ", "parameters": {"max_tokens": 12, "temperature": 0}}
    whole = http(
        f"{backend.url}/v2/models/tiny-lm/generate", method="POST", body=json.dumps(body).encode()
    )
    assert whole.status == 200
    out = whole.json()
    assert out["model_name"] == "tiny-lm" and out["text_output"]
    _, raw = _raw(backend, "/v2/models/tiny-lm/generate_stream", body)
    events = [e for e in raw.split(b"\x00TRAILERS\x00")[0].split(b"\n\n") if e]
    assert all(e.startswith(b"data: {") for e in events)  # Triton sends no [DONE]
    parsed = [json.loads(e[6:]) for e in events]
    assert "".join(p["text_output"] for p in parsed) == out["text_output"]
    assert parsed[-1]["finish_reason"] == out["finish_reason"]
    bad = http(
        f"{backend.url}/v2/models/tiny-lm/generate",
        method="POST",
        body=json.dumps({"text_input": "x", "parameters": {"best_of": 2}}).encode(),
    )
    assert bad.status == 400 and "best_of" in bad.json()["error"]
    # KServe's /infer of a generative model: the whole text as text_output
    infer = http(
        f"{backend.url}/v2/models/tiny-lm/infer",
        method="POST",
        body=json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                                      "data": ["The "]}],
                         "parameters": {"max_tokens": 12, "temperature": 0}}).encode(),
    )  # fmt: skip
    assert infer.status == 200
    assert infer.json()["outputs"][0]["data"] == [out["text_output"]]


def test_tritonclient_grpc_streams_a_decoupled_model(backend: Backend) -> None:
    config = tgrpc.InferenceServerClient(backend.grpc).get_model_config("tiny-lm", as_json=True)
    assert config["config"]["model_transaction_policy"]["decoupled"] is True
    results: queue.Queue[Any] = queue.Queue()
    client = tgrpc.InferenceServerClient(backend.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    text_input = tgrpc.InferInput("text_input", [1], "BYTES")
    text_input.set_data_from_numpy(np.array([b"The "], dtype=np.object_))
    client.async_stream_infer(
        "tiny-lm",
        [text_input],
        request_id="r1",
        parameters={"max_tokens": 12, "temperature": 0.0},
        enable_empty_final_response=True,
    )
    pieces: list[str] = []
    while True:
        result, error = results.get(timeout=30)
        assert error is None, error
        response = result.get_response()
        assert response.id == "r1"
        if response.parameters["triton_final_response"].bool_param:
            assert not response.outputs
            assert response.parameters["finish_reason"].string_param in ("stop", "length")
            break
        pieces.append(result.as_numpy("text_output")[0].decode())
    client.stop_stream()
    whole = http(
        f"{backend.url}/v2/models/tiny-lm/generate",
        method="POST",
        body=json.dumps(
            {"text_input": "The ", "parameters": {"max_tokens": 12, "temperature": 0}}
        ).encode(),
    ).json()
    assert "".join(pieces) == whole["text_output"]


def test_python_generators_stream_through_the_sdk(backend: Backend) -> None:
    client = backend.client()
    out = client.completions.create(model="chaos-gen", prompt="alpha beta gamma", max_tokens=5)
    assert out.choices[0].text == "alpha beta gamma alpha beta "
    assert out.usage.prompt_tokens == 3  # the guest's own tokens (words)
    assert out.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="chaos-gen", prompt="count", max_tokens=4, stream=True)]  # fmt: skip
    assert "".join(pieces) == "1 2 3 4 "
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="chaos-gen", prompt="refuse")


def test_a_stuck_guest_is_interrupted_by_the_token_budget(backend: Backend) -> None:
    client = backend.client()
    started = time.monotonic()
    with pytest.raises(openai.APIError) as caught:
        list(client.completions.create(model="chaos-gen", prompt="spin a b c", stream=True))
    assert time.monotonic() - started < 5  # 150 ms per piece, not the 60 s deadline
    assert "timeout" in str(caught.value.message)
    status = backend.status("chaos-gen")
    assert status["generation"]["finished"].get("error", 0) >= 1
    # the trapped instance was dropped; the function still serves
    out = client.completions.create(model="chaos-gen", prompt="again a", max_tokens=2)
    assert out.choices[0].text == "again a "


def test_the_deadline_ends_a_long_generation(backend: Backend) -> None:
    _, raw = _raw(
        backend,
        "/v1/completions",
        # greedy from "The ": 1,000 tokens without the end token (it loops), so only the
        # 50 ms deadline can end it early
        {
            "model": "tiny-short",
            "prompt": "The ",
            "max_tokens": 1000,
            "stream": True,
            "temperature": 0,
        },
    )
    record = json.loads(raw.split(b"\x00TRAILERS\x00")[1].strip().partition(b": ")[2])
    assert record["finish_reason"] == "deadline" and record["note"] == "deadline"
    assert b'"finish_reason":"length"' in raw  # the client reads "length"
    assert record["completion_tokens"] < 1000


async def _read_then_leave(url: str, body: dict[str, Any], chunks: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    seen = 0
    while seen < chunks:
        line = await reader.readline()
        assert line, "the stream ended before the client left"
        if line.startswith(b"data: "):
            seen += 1
    writer.close()


def test_a_client_that_leaves_stops_the_generation_and_frees_the_instance(backend: Backend) -> None:
    for model in ("tiny-lm", "tiny-solo"):
        streams = {"function": f"{model}@1", "finish": "cancelled"}
        cancelled = backend.metric("meshfn_gen_streams_total", **streams)
        output = {"gen_ai_request_model": model, "gen_ai_token_type": "output"}
        tokens_before = backend.metric("gen_ai_client_token_usage_sum", **output)
        body = {"model": model, "prompt": "a", "max_tokens": 1000, "stream": True}
        asyncio.run(_read_then_leave(backend.url, body, chunks=3))
        wait_for(
            "cancelled stream",
            lambda s=streams, c=cancelled: backend.metric("meshfn_gen_streams_total", **s) == c + 1,
            timeout=10,
        )
        used = backend.metric("gen_ai_client_token_usage_sum", **output) - tokens_before
        assert 3 <= used < 1000, used  # stopped (what the socket buffers took, not 1000)
        assert backend.status(model)["inflight"] == 0


def test_concurrent_streams_share_decode_steps(backend: Backend) -> None:
    """Eight concurrent streams share decode steps: more than two streams per step over this
    test's own steps (the status's ratio also counts the module's single-stream tests), and a
    seed draws the same text batched or alone."""

    def stepped() -> tuple[float, float]:
        """(streams stepped, steps) of tiny-lm so far: its steps' rows histogram."""
        labels = {"function": "tiny-lm@1"}
        return (
            backend.metric("meshfn_gen_step_rows_sum", **labels),
            backend.metric("meshfn_gen_step_rows_count", **labels),
        )

    rows_before, steps_before = stepped()

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{backend.url}/v1", api_key="x", max_retries=0)

        async def one(i: int) -> str:
            out = await client.completions.create(
                model="tiny-lm", prompt="The ", max_tokens=40, seed=i, temperature=0.8
            )
            return out.choices[0].text

        return await asyncio.gather(*(one(i) for i in range(8)))

    texts = asyncio.run(run())
    rows, steps = stepped()
    assert steps > steps_before and (rows - rows_before) / (steps - steps_before) > 2
    alone = backend.client().completions.create(
        model="tiny-solo", prompt="The ", max_tokens=40, seed=3, temperature=0.8
    )
    assert texts[3] == alone.choices[0].text  # batched or alone, a seed draws the same text
    status = backend.status("tiny-lm")["generation"]
    assert status["batched_tokens_ratio"] > 1, status


def test_embeddings_through_the_sdk(backend: Backend) -> None:
    client = backend.client()
    out = client.embeddings.create(model="embedder", input=["hello world", "one more text"])
    assert [d.index for d in out.data] == [0, 1]
    assert len(out.data[0].embedding) == 32
    assert abs(sum(v * v for v in out.data[0].embedding) - 1.0) < 1e-3
    assert out.usage.prompt_tokens == 5  # the embedder counts words
    as_float = client.embeddings.create(
        model="embedder", input="hello world", encoding_format="float"
    )
    assert np.allclose(as_float.data[0].embedding, out.data[0].embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny-lm", input="x")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="embedder", input="x", dimensions=8)


def test_genai_metrics_and_status(backend: Backend) -> None:
    backend.client().completions.create(model="tiny-lm", prompt="x", max_tokens=4)
    text = http(f"{backend.url}/metrics").body.decode()
    for name in (
        "gen_ai_client_token_usage_bucket",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "gen_ai_server_request_duration_seconds_bucket",
    ):
        assert name in text
    assert 'gen_ai_request_model="tiny-lm"' in text and 'gen_ai_token_type="output"' in text
    assert 'gen_ai_operation_name="text_completion"' in text and "meshfn_tenant=" in text
    generation = backend.status("tiny-lm")["generation"]
    assert generation["ttft_p50_ms"] > 0 and generation["completion_tokens"] > 0


def test_a_long_prefill_sends_keep_alives_the_sdk_skips(backend: Backend) -> None:
    """While a long prompt is read (no token yet) the stream sends an SSE comment every half
    idle timeout, so a proxy's idle timeout only cuts a stuck stream; clients skip comments."""
    body = {"model": "tiny-idle", "prompt": "x" * 1000, "max_tokens": 8, "stream": True}
    head, raw = _raw(backend, "/v1/completions", body)
    assert head.startswith(b"HTTP/1.1 200")
    assert raw.startswith(b": keep-alive\n\n"), raw[:80]
    events = raw.split(b"\x00TRAILERS\x00")[0].split(b"\n\n")
    assert events[-2] == b"data: [DONE]"
    streamed = backend.client().completions.create(**body)  # type: ignore[call-overload]
    assert sum(len(c.choices[0].text) for c in streamed) > 0


def test_token_budgets_reserve_report_and_refuse(backend: Backend) -> None:
    """A tenant's token budget: each request reserves prompt + max_tokens, x-ratelimit-remaining
    (in tokens) goes down with every request, the reservation settles to what was used, and a
    request the rest cannot hold is a 429 with OpenAI's error object (nothing generated)."""
    client = backend.client(default_headers={"x-meshfn-tenant": "acme"})
    remaining = []
    for _ in range(3):
        raw = client.completions.with_raw_response.create(
            model="tiny-budget", prompt="ab", max_tokens=40, temperature=0
        )
        remaining.append(int(raw.headers["x-ratelimit-remaining"]))
        assert raw.headers["x-ratelimit-remaining-tokens"] == raw.headers["x-ratelimit-remaining"]
        assert raw.headers["x-ratelimit-limit-tokens"] == "200"
    assert remaining[0] > remaining[1] > remaining[2]  # it moves, in tokens
    # greedy from "ab" runs its 40 tokens: each request reserved 3 + 40 and used 43
    assert remaining == [200 - 43, 200 - 86, 200 - 129]
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="tiny-budget", prompt="ab", max_tokens=100)
    error = caught.value.body
    assert error["code"] == "insufficient_quota" and error["limit"] == "tokens"
    assert error["window"] == "month" and error["tokens_left"] == 200 - 129
    assert caught.value.response.headers["x-meshfn-qos-limit"] == "tokens"
    status = backend.status("tiny-budget")["qos"]["tenants"]
    (acme,) = [t for t in status if t["tenant"] == "acme"]
    assert acme["token_budget_used"] == {"month": 129} and acme["tokens_reserved"] == {"month": 0}
    # another tenant has a budget of its own
    other = backend.client(default_headers={"x-meshfn-tenant": "globex"})
    assert other.completions.create(model="tiny-budget", prompt="ab", max_tokens=100).usage


def test_a_partial_reservation_stops_the_stream_when_the_budget_runs_out(
    backend: Backend,
) -> None:
    body = {"model": "tiny-partial", "prompt": "The ", "max_tokens": 100, "stream": True,
            "temperature": 0}  # fmt: skip
    _, raw = _raw(backend, "/v1/completions", body, {"x-meshfn-tenant": "initech"})
    record = json.loads(raw.rsplit(b"x-meshfn-generation: ", 1)[1].split(b"\r\n")[0])
    # 60 tokens a day: the prompt (5) and 55 completion tokens, then "length", noted budget
    assert record["finish_reason"] == "budget" and record["note"] == "budget"
    assert record["completion_tokens"] == 55 and record["prompt_tokens"] == 5
    assert b'"finish_reason":"length"' in raw
