"""The names of meshfn's generative-AI metrics and attributes, in ONE place.

They follow the OpenTelemetry semantic conventions for generative AI, v1.41 (from v1.42 they
live in `semantic-conventions-genai` under the same names, all still "Development"): the
conventions may still move, so every producer and reader (the backend's /metrics, `meshfn
status`, the console, the documentation's metrics reference) takes the names from here.

Prometheus cannot carry dots in names: each metric is exported under its OpenTelemetry name
with dots turned into underscores and the unit appended the way OpenTelemetry's Prometheus
exporter does (`_seconds`), and each attribute as a label with dots turned into underscores.
`gen_ai.client.token.usage` is a client metric in the conventions (there is no server
token-usage metric); the backend records it for its clients, from the usage it reports them.
The tenant is not a convention attribute: ours is named apart (`meshfn.tenant`).
"""

from __future__ import annotations

SEMCONV_VERSION = "1.41.0"

# metrics (OpenTelemetry names)
TOKEN_USAGE = "gen_ai.client.token.usage"  # histogram, {token}
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"  # histogram, s
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"  # histogram, s
REQUEST_DURATION = "gen_ai.server.request.duration"  # histogram, s

# attributes
OPERATION = "gen_ai.operation.name"  # chat | text_completion | embeddings
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
TOKEN_TYPE = "gen_ai.token.type"  # input | output
ERROR_TYPE = "error.type"
TENANT = "meshfn.tenant"  # not a convention attribute: the verified tenant (QoS)
# ... and on a generation's span (the backend's server span)
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"  # string[]: the client's (stop | length)
FINISH_REASON = "meshfn.finish_reason"  # not a convention attribute: why (budget, deadline...)

PROVIDER_NAME = "meshfn"
OPERATIONS = ("chat", "text_completion", "embeddings")
TOKEN_TYPES = ("input", "output")


def span_name(operation: str, model: str) -> str:
    """A generation's span name, as the conventions spell it: `{operation} {model}`."""
    return f"{operation} {model}"


def span_attributes(operation: str, model: str) -> dict[str, object]:
    """What the conventions put on every span of an operation, known before it runs."""
    return {OPERATION: operation, PROVIDER: PROVIDER_NAME, REQUEST_MODEL: model}


def prometheus_name(name: str, unit: str = "") -> str:
    """An OpenTelemetry metric name as Prometheus exposes it (dots to underscores, unit)."""
    base = name.replace(".", "_")
    return f"{base}_{unit}" if unit and not base.endswith(f"_{unit}") else base


def label(attribute: str) -> str:
    """An OpenTelemetry attribute as a Prometheus label."""
    return attribute.replace(".", "_")


# As exported in /metrics (prometheus_client adds _bucket, _sum, _count to each histogram).
PROM_TOKEN_USAGE = prometheus_name(TOKEN_USAGE)
PROM_TIME_TO_FIRST_TOKEN = prometheus_name(TIME_TO_FIRST_TOKEN, "seconds")
PROM_TIME_PER_OUTPUT_TOKEN = prometheus_name(TIME_PER_OUTPUT_TOKEN, "seconds")
PROM_REQUEST_DURATION = prometheus_name(REQUEST_DURATION, "seconds")
LABELS = tuple(label(a) for a in (OPERATION, PROVIDER, REQUEST_MODEL, TENANT))
TOKEN_LABELS = (*LABELS, label(TOKEN_TYPE))
DURATION_LABELS = (*LABELS, label(ERROR_TYPE))

# The usage record of one generation, from the backend to the proxies' access logs (audit) and
# the gateways' access-log stream (the drift breaker's inter-token latency): a response trailer
# after a streamed body, a response header on a whole one. One JSON object, ASCII; gateways
# remove it from what they answer clients. Keys: GENERATION_KEYS.
GENERATION_HEADER = "x-meshfn-generation"
GENERATION_KEYS = (
    "model",  # the function (its name)
    "operation",  # chat | text_completion | generate
    "prompt_tokens",
    "completion_tokens",
    "ttft_ms",  # the backend's: from the generation's start to its first token
    "finish_reason",  # stop | length | budget | deadline | cancelled | error
    "outcome",  # completed | cancelled | failed
    "note",  # why it ended early (token budget, deadline), else null
    "prompt_hmac",  # with generation.auditText hmac: HMAC-SHA256 of the prompt, else absent
    "completion_hmac",  # ... and of the completion
    "text_salt_id",  # which salt those are under
)
