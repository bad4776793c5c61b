"""Audit records: from one Envoy access-log line to the canonical form the hash chain covers.

The access log (meshfn.xds.fragments.plugins.access_log_format) writes one JSON object per
request: Envoy's own fields plus the audit filter's filter state (`wasm.meshfn_audit`) as a string. That state has
two shapes: a JSON object with every audit field, or (jwt_headers mode without body hashing,
`contracts.plugins.bare_filter_state`) just the subject as 64 hex digits or `null`, with salt_id,
subject_source, the record version (`audit_v`) and the tenant written by Envoy next to it. A line
that does not parse is kept as an `unparsed` record, never dropped: losing a line silently would
defeat the point of the trail.

A generative request (OpenAI's completions, Triton's generate, their paths below a model) also
gets `generation`, written when its stream ended: the model, prompt and completion tokens, the
backend's time to first token, the finish reason and how the stream ended (completed,
cancelled, failed), from the backend's usage record (contracts.genai, a trailer after a stream,
a header on a whole response), plus the proxy's own time to the first upstream byte. A stream
the client or a proxy cut (or a backend that crashed) carries no usage record: its outcome is
then read from the proxy's response flags, its token counts are null. No prompt or completion
text is ever recorded; with a Function's `generation.auditText: hmac` the backend's salted
digests of both are.

`route` is the MESH route (`namespace/name` of the Route or Function route), not the recording
proxy's own Envoy route (that is `envoy_route`: a sidecar's is always `local`). A gateway names
it from its own route table (`route_source: proxy`); a sidecar takes it from the gateway's
internal header `x-meshfn-route` only when the mTLS peer is one of the gateway identities its
configuration lists (`route_source: gateway`). A header from any other caller is not believed:
`route` stays null, `route_source` is `untrusted` and the claim is kept as `route_claimed`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from meshfn.contracts.journal import ERASED_SUBJECT

from .offline import canonical

RECORD_VERSION = 2
# Caps for values a client controls; the record says when it was cut.
LIMITS = {
    "id": 128,
    "authority": 256,
    "path": 2048,
    "tenant": 128,
    "principal": 2048,
    "route": 256,
    "route_claimed": 256,
    "envoy_route": 256,
    "qos_limit": 16,
    "model_version": 64,
}
_RAW_KEEP = 4096

FIELDS = (
    "v",
    "id",
    "time",
    "method",
    "authority",
    "path",
    "status",
    "duration_us",
    "upstream_cluster",
    "route",
    "route_source",
    "route_claimed",
    "envoy_route",
    "principal",
    "subject",
    "salt_id",
    "subject_source",
    "tenant",
    "body",
    "body_sha256",
    "trace_id",
    "flags",
    "qos_limit",
    "model_version",
    "source",
    "audited",
)


__all__ = ["FIELDS", "RECORD_VERSION", "canonical", "from_log_line", "trace_id", "unparsed"]


def _clean(text: str) -> str:
    """Text every store accepts: no NUL, no lone surrogates (PostgreSQL's JSON refuses both)."""
    if text.isascii():
        return text.replace("\x00", "\ufffd") if "\x00" in text else text
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")


def _str(value: Any, name: str, cut: list[str]) -> str | None:
    """A field as text. A non-string (a claim that is a number or an object, or a hostile log
    line) is kept as compact JSON, never a crash of the collector."""
    if value is None or value == "-" or value == "":  # noqa: PLR1714 (faster than a set)
        return None
    if type(value) is str:
        text = value
    else:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if not text.isascii() or "\x00" in text:
        text = _clean(text)
    limit = LIMITS.get(name)
    if limit is not None and len(text) > limit:
        cut.append(name)
        text = text[:limit]
    return text


def _int(value: Any) -> int | None:
    """An integer field, or None where the line has none that fits the stores' 64-bit column
    (a hostile or corrupt line must not fail the batch it is in)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            return None
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return value
    return None


def _hex(value: Any, length: int) -> str | None:
    if isinstance(value, str) and len(value) == length:
        try:
            bytes.fromhex(value)
        except ValueError:
            return None
        return value.lower()
    return None


def trace_id(traceparent: Any, b3: Any, traced: Any = None) -> str | None:
    """The trace the proxy's tracer put the request in (`traced`: Envoy's %TRACE_ID%, 32 hex
    digits), else the W3C traceparent (version-traceid-parentid-flags, non-zero trace id),
    else B3."""
    if isinstance(traced, str) and _hex(traced, 32) and traced.strip("0"):
        return traced.lower()
    if isinstance(traceparent, str):
        parts = traceparent.strip().split("-")
        if (
            len(parts) >= 4
            and len(parts[0]) == 2
            and len(parts[2]) == 16
            and _hex(parts[1], 32)
            and _hex(parts[0], 2)
            and _hex(parts[2], 16)
            and parts[1].strip("0")
        ):
            return parts[1].lower()
    if isinstance(b3, str):
        value = b3.strip()
        if len(value) in (16, 32) and _hex(value, len(value)):
            return value.lower()
    return None


# gRPC status -> the HTTP status it stands for (as grpc-gateway maps them)
_GRPC_HTTP = {
    1: 499, 2: 500, 3: 400, 4: 504, 5: 404, 6: 409, 7: 403, 8: 429,
    9: 400, 10: 409, 11: 400, 12: 501, 13: 500, 14: 503, 15: 500, 16: 401,
}  # fmt: skip


def _status(entry: dict[str, Any]) -> int:
    """The request's outcome. A gRPC call refused or failed in its trailers has HTTP status 200
    (Envoy's RBAC denial, a rate limit, the application's error): it is recorded with the HTTP
    status its gRPC status stands for (PERMISSION_DENIED: 403), so a query for the denials finds
    gRPC ones too instead of successes."""
    status = _int(entry.get("status")) or 0
    grpc = _int(entry.get("grpc_status"))
    if status == 200 and grpc:
        return _GRPC_HTTP.get(grpc, 500)
    return status


def _flags(entry: dict[str, Any]) -> Any:
    """Envoy's response flags; at a split gateway, for a request it sampled, those of its
    internal listener (a shed or no upstream there: the gateway's own listener reached that
    one) with any of the gateway's own (a client gone while the answer streamed)."""
    own, inner = entry.get("flags"), entry.get("traced_flags")
    if not isinstance(inner, str) or inner in ("", "-"):
        return own
    if not isinstance(own, str) or own in ("", "-"):
        return inner
    return ",".join(dict.fromkeys([*inner.split(","), *own.split(",")]))


def from_log_line(line: bytes, source: str) -> dict[str, Any]:
    """One access-log line (without the newline) -> a record."""
    try:
        entry = json.loads(line)
        if not isinstance(entry, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return unparsed(line, source, f"access log line is not a JSON object: {exc}")
    cut: list[str] = []
    record: dict[str, Any] = {
        "v": RECORD_VERSION,
        "source": source,
        "id": _str(entry.get("id"), "id", cut),
        "time": _str(entry.get("time"), "time", cut),
        "method": _str(entry.get("method"), "method", cut),
        "authority": _str(entry.get("authority"), "authority", cut),
        "path": _str(entry.get("path"), "path", cut),
        "status": _status(entry),
        "duration_us": _int(entry.get("duration_us")),
        # a split gateway's sampled request: the cluster its internal listener sent it to
        "upstream_cluster": _str(
            entry.get("traced_cluster") or entry.get("upstream_cluster"), "upstream_cluster", cut
        ),
        "envoy_route": _str(entry.get("route"), "envoy_route", cut),
        "principal": _str(entry.get("principal"), "principal", cut),
        "flags": _str(_flags(entry), "flags", cut),
        # A QoS refusal (429) names its limit: rate (gateway), concurrency, compute or shed.
        "qos_limit": _str(entry.get("qos_limit"), "qos_limit", cut),
        # The Function version that computed the answer (the backend's response header).
        "model_version": _str(entry.get("model_version"), "model_version", cut),
        "audited": False,
        "subject": None,
        "salt_id": None,
        "subject_source": None,
        "tenant": None,
        "body": None,
        "body_sha256": None,
        "trace_id": trace_id(
            entry.get("traceparent"), entry.get("b3_trace_id"), entry.get("trace_id")
        ),
    }
    record.update(mesh_route(entry, record["principal"], cut))
    if record["duration_us"] is None and (ms := _int(entry.get("duration_ms"))) is not None:
        record["duration_us"] = ms * 1000
    raw_state = entry.get("audit")
    if isinstance(raw_state, str) and raw_state not in ("", "-"):
        state: Any = None
        if raw_state in ("null", ERASED_SUBJECT) or _hex(raw_state, 64):
            state = _bare_state(raw_state, entry)
            if state is None:
                record["error"] = "audit filter state without its access log fields"
        else:
            try:
                state = json.loads(raw_state)
            except (ValueError, RecursionError):
                record["error"] = "audit filter state is not JSON"
            else:
                if not isinstance(state, dict):
                    record["error"] = "audit filter state is not a JSON object"
        if isinstance(state, dict):
            record.update(_audited(state, cut))
    return _finished(record, entry, cut)


def _finished(record: dict[str, Any], entry: dict[str, Any], cut: list[str]) -> dict[str, Any]:
    """The record with what is optional: a generation, and which fields were cut."""
    generation = generation_of(entry, record)
    if generation is not None:
        record["generation"] = generation
    if cut:
        record["truncated"] = sorted(set(cut))
    return record


# Paths whose responses generate text (OpenAI's, below a model or not; Triton's generate).
_GENERATIVE = re.compile(
    r"^(/v2/models/[^/]+(/versions/[^/]+)?)?(/openai)?/v1/(chat/completions|completions)$"
    r"|^/v2/models/[^/]+(/versions/[^/]+)?/generate(_stream)?$"
)
_MODEL_IN_PATH = re.compile(r"^/v2/models/([^/]+)")
# The usage record's fields (contracts.genai.GENERATION_KEYS) and their types.
_GENERATION_INTS = ("prompt_tokens", "completion_tokens")
_GENERATION_TEXT = ("model", "operation", "finish_reason", "outcome", "note",
                    "prompt_hmac", "completion_hmac", "text_salt_id")  # fmt: skip
# Response flags that say who ended a stream early: the client (or the proxy before us) went
# away, or the upstream failed or timed out.
_CANCELLED_FLAGS = {"DC", "DR", "DPE"}
_FAILED_FLAGS = {"UC", "UR", "UF", "UT", "SI", "URX", "UH", "UO", "UPE"}


def generation_of(entry: dict[str, Any], record: dict[str, Any]) -> dict[str, Any] | None:
    """The `generation` of a generative request's record (module docstring), else None."""
    given = [entry.get(k) for k in ("generation", "generation_whole")]
    raw = next((g for g in given if isinstance(g, str) and g not in ("", "-")), None)
    usage: Any = None
    if raw is not None:
        try:
            usage = json.loads(raw)
        except (ValueError, RecursionError):
            usage = None
    path = record.get("path") or ""
    if not isinstance(usage, dict) and not _GENERATIVE.match(path):
        return None
    out: dict[str, Any] = {key: None for key in ("model", "operation", *_GENERATION_INTS,
                                                   "ttft_ms", "finish_reason", "outcome", "note")}  # fmt: skip
    if isinstance(usage, dict):
        for key in _GENERATION_INTS:
            out[key] = _int(usage.get(key))
        for key in _GENERATION_TEXT:
            if usage.get(key) is not None:
                out[key] = _str(usage.get(key), key, [])
        ttft = usage.get("ttft_ms")
        out["ttft_ms"] = (
            ttft if isinstance(ttft, int | float) and not isinstance(ttft, bool) else None
        )
    else:
        out["outcome"] = _outcome_from_flags(record.get("flags") or "", record.get("status"))
        model = _MODEL_IN_PATH.match(path)
        out["model"] = model.group(1) if model else None
    out["proxy_ttft_us"] = _int(entry.get("upstream_first_byte_us"))
    return out


def _outcome_from_flags(flags: str, status: Any) -> str:
    """How a stream without a usage record ended, from the proxy's response flags."""
    given = set(flags.split(",")) if flags not in ("", "-") else set()
    if given & _CANCELLED_FLAGS:
        return "cancelled"
    if given & _FAILED_FLAGS or (isinstance(status, int) and status >= 500) or status == 0:
        return "failed"
    return "refused" if isinstance(status, int) and status >= 400 else "completed"


def _audited(state: dict[str, Any], cut: list[str]) -> dict[str, Any]:
    """The audit filter's fields of a record, from its filter state (either shape)."""
    fields: dict[str, Any] = {
        "audited": True,
        "subject": _hex(state.get("subject"), 64),
        "salt_id": _str(state.get("salt_id"), "salt_id", cut),
        "subject_source": _str(state.get("subject_source"), "subject_source", cut),
        "tenant": _str(state.get("tenant"), "tenant", cut),
        "body": _str(state.get("body"), "body", cut),
        "body_sha256": _hex(state.get("body_sha256"), 64),
    }
    if state.get("subject") == ERASED_SUBJECT:  # `meshfn audit erase` redacted the line
        fields["subject_erased"] = True
    return fields


def mesh_route(entry: dict[str, Any], principal: str | None, cut: list[str]) -> dict[str, Any]:
    """`route`, `route_source` and `route_claimed` (see the module docstring): what the access
    log's mesh-route fields (meshfn.xds.fragments.plugins.mesh_route_fields) say, believed only
    as far as the proxy's configuration lets it."""
    claimed = _str(entry.get("mesh_route"), "route", cut)
    if entry.get("mesh_route_by") == "proxy":
        return {"route": claimed, "route_source": "proxy" if claimed else None}
    trusted = entry.get("mesh_route_from")
    if claimed is None:
        return {"route": None, "route_source": None}
    if isinstance(trusted, str) and principal is not None and principal in trusted.split(" "):
        return {"route": claimed, "route_source": "gateway"}
    return {"route": None, "route_source": "untrusted", "route_claimed": claimed}


def _bare_state(subject: str, entry: dict[str, Any]) -> dict[str, Any] | None:
    """The bare filter state (a subject or `null`) with what the access log wrote next to it, in
    the shape of the full filter-state object; None if those fields are missing."""
    if entry.get("audit_v") != "1":
        return None
    return {
        "subject": None if subject == "null" else subject,  # ERASED_SUBJECT: see from_log_line
        "salt_id": entry.get("salt_id"),
        "subject_source": entry.get("subject_source"),
        "tenant": entry.get("tenant"),
        "body": "off",
        "body_sha256": None,
    }


# Hex runs as long as a subject hash: an unparsed line keeps its context, never a value that
# would link the record to a subject after an erasure (see store.AuditStore.erase).
_LONG_HEX = re.compile(r"[0-9a-fA-F]{32,}")


def unparsed(line: bytes, source: str, error: str) -> dict[str, Any]:
    raw = _clean(line[:_RAW_KEEP].decode("utf-8", errors="replace"))
    return {
        "v": RECORD_VERSION,
        "source": source,
        "error": _clean(error),
        "raw": _LONG_HEX.sub("<hex>", raw),
        "raw_sha256": hashlib.sha256(line).hexdigest(),
        "raw_bytes": len(line),
        "status": 0,
    }
