"""A generative request's audit record: the backend's usage record (a trailer after a stream,
a header on a whole response) becomes `generation` with the model, the token counts, the time
to first token, the finish reason and how the stream ended; a cut stream has none and says
cancelled or failed from the proxy's flags; other requests have no `generation`; no text."""

from __future__ import annotations

import json
from typing import Any

from meshfn.audit.record import from_log_line

USAGE = {
    "model": "tiny-lm",
    "operation": "chat",
    "prompt_tokens": 12,
    "completion_tokens": 40,
    "ttft_ms": 5.25,
    "finish_reason": "budget",
    "outcome": "completed",
    "note": "budget",
}


def record(**entry: Any) -> dict[str, Any]:
    base = {"status": 200, "method": "POST", "flags": "-", "audit": None}
    return from_log_line(json.dumps(base | entry).encode(), "edge")


def test_a_streams_usage_record_is_its_generation() -> None:
    out = record(
        path="/v2/models/tiny-lm/openai/v1/chat/completions",
        generation=json.dumps(USAGE),
        generation_whole="-",
        upstream_first_byte_us="5400",
    )
    assert out["generation"] == {**USAGE, "proxy_ttft_us": 5400}
    whole = record(path="/v1/completions", generation="-", generation_whole=json.dumps(USAGE))
    assert whole["generation"]["completion_tokens"] == 40


def test_a_cut_stream_says_how_it_ended() -> None:
    path = "/v2/models/tiny-lm/generate_stream"
    cancelled = record(path=path, generation="-", flags="DC")["generation"]
    assert cancelled["outcome"] == "cancelled" and cancelled["model"] == "tiny-lm"
    assert cancelled["prompt_tokens"] is None and cancelled["completion_tokens"] is None
    failed = record(path=path, generation="-", flags="UC", status=200)["generation"]
    assert failed["outcome"] == "failed"
    broken = record(path=path, generation="{not json", flags="UR")["generation"]
    assert broken["outcome"] == "failed"


def test_other_requests_have_no_generation_and_no_text_is_kept() -> None:
    assert "generation" not in record(path="/v2/models/iris/infer", generation="-")
    assert "generation" not in record(path="/v1/models", generation="-")
    hostile = {**USAGE, "prompt": "secret", "completion": "secret too"}
    out = record(path="/v1/chat/completions", generation=json.dumps(hostile))
    assert "secret" not in json.dumps(out)
