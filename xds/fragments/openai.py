"""Envoy's own replies on OpenAI's paths, as OpenAI's error object.

A client of OpenAI's API (the official SDK) reads every error as `{"error": {"message", "type",
"param", "code"}}`. Envoy answers some requests itself: jwt_authn's 401, RBAC's 403, no route's
404, a QoS 429 (rate limited, or shed at the gateway), a 503 when no endpoint is left, a 504
when the upstream timed out or a stream went idle. On OpenAI's paths (`/v1/...`,
`/openai/v1/...`, and below a model `/v2/models/{model}/openai/v1/...`, where a gateway sends
what it routed by the body's model) those replies get OpenAI's shape: each of the connection
manager's own JSON replies (the QoS and no-upstream mappers) gets a twin in front of it that
puts its fields inside `error` (its message as `message`), and Envoy's plain-text replies get
one mapper per status with the text as `message`. The model router's own refusals (400, 404
model_not_found, 413) are OpenAI's already and are not touched (they match no mapper here).
One builder for both renderers (the translator's connection managers, Istio's EnvoyFilter).
"""

from __future__ import annotations

import copy
from typing import Any

Obj = dict[str, Any]

# RE2, matched whole against :path (the query included: it may follow).
OPENAI_PATHS = r"/(openai/)?v1/.*|/v2/models/[^/]+(/versions/[^/]+)?/openai/v1/.*"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded", 504: "timeout", 503: "unavailable"}
# Envoy's plain replies: (status, the filter that finds them besides the path)
_PLAIN: tuple[tuple[int, Obj], ...] = (
    (401, {"status_code_filter": {"comparison": {"op": "EQ", "value": {"default_value": 401, "runtime_key": "-"}}}}),
    (403, {"status_code_filter": {"comparison": {"op": "EQ", "value": {"default_value": 403, "runtime_key": "-"}}}}),
    (404, {"response_flag_filter": {"flags": ["NR"]}}),
    (504, {"response_flag_filter": {"flags": ["UT", "SI"]}}),
)  # fmt: skip


def path_filter() -> Obj:
    return {
        "header_filter": {
            "header": {
                "name": ":path",
                "string_match": {"safe_regex": {"regex": OPENAI_PATHS}},
            }
        }
    }


def error(status: int, message: str, fields: Obj | None = None) -> Obj:
    """The json_format of an OpenAI error object for `status` (`message` may be a command
    operator such as %LOCAL_REPLY_BODY%; `fields` go beside OpenAI's four)."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": None,
            "code": _CODES.get(status),
            **(fields or {}),
        }
    }


def status_of(mapper: Obj) -> int:
    """The status a mapper's replies have: the one it sets, else the one its filter picks,
    else 503 (the replies of the response flags meshfn maps: no upstream, overflow)."""
    if mapper.get("status_code"):
        return int(mapper["status_code"])
    comparison = mapper.get("filter", {}).get("status_code_filter", {}).get("comparison", {})
    value = comparison.get("value", {}).get("default_value")
    return int(value) if value else 503


def twin(mapper: Obj) -> Obj | None:
    """The OpenAI twin of one of the connection manager's JSON mappers (None if its body is not
    JSON with an `error` message): the same filter on OpenAI's paths, its fields in `error`."""
    body = mapper.get("body_format_override", {}).get("json_format")
    if not isinstance(body, dict) or "error" not in body:
        return None
    added = {h.get("header", {}).get("key") for h in mapper.get("headers_to_add", [])}
    if "grpc-status" in added:  # a gRPC reply: never on OpenAI's paths
        return None
    out = copy.deepcopy(mapper)
    fields = {k: v for k, v in body.items() if k != "error"}
    out["filter"] = {"and_filter": {"filters": [path_filter(), copy.deepcopy(mapper["filter"])]}}
    out["body_format_override"]["json_format"] = error(status_of(mapper), body["error"], fields)
    return out


def openai_replies(mappers: list[Obj]) -> list[Obj]:
    """A connection manager's mappers with OpenAI's in front: each JSON mapper's twin, then
    Envoy's plain replies, then the mappers as they were (first match wins)."""
    twins = [t for m in mappers if (t := twin(m)) is not None]
    return [*twins, *plain_replies(), *mappers]


def plain_replies() -> list[Obj]:
    """Envoy's plain-text replies on OpenAI's paths as OpenAI's error object."""
    return [
        {
            "filter": {"and_filter": {"filters": [path_filter(), copy.deepcopy(found)]}},
            "body_format_override": {
                "json_format": error(status, "%LOCAL_REPLY_BODY%"),
                "content_type": "application/json",
            },
        }
        for status, found in _PLAIN
    ]
