"""Distributed tracing vocabulary shared by the renderers, the inference backend and the
control plane's collector: W3C Trace Context (`traceparent`, `tracestate`), the span attribute
names meshfn adds, the headers an external gateway drops from untrusted clients, and the
backend's tracing settings (one schema, written by `meshfn up` and the operator from the Mesh
policy, read by the backend).

Parsing never raises: a malformed `traceparent` is None (the trace restarts), a malformed
`tracestate` is dropped, as W3C Trace Context says. A leaf: pydantic only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

TRACEPARENT = "traceparent"
# Where `meshfn up` collects an inference backend's spans (BackendTracing.pullToken).
SPANS_PATH = "/meshfn/spans"
# `SPANS_PATH?wait=S`: the backend answers as soon as a span waits, or empty after S seconds (a
# long poll: an idle backend costs its collector one request per S, not two a second).
SPANS_WAIT = "wait"
SPANS_MAX_WAIT_S = 60.0
TRACESTATE = "tracestate"

# What an external gateway with `clientContext: restart` removes from client requests before
# Envoy reads them (its early header mutation): the W3C context, and Envoy's own ways of forcing
# a sampling decision (x-client-trace-id, x-envoy-force-trace, and x-request-id, whose UUID
# carries Envoy's trace decision between proxies). Envoy then starts a new trace under the
# gateway's own sampling and makes a fresh request id.
CLIENT_CONTEXT_HEADERS = (
    TRACEPARENT,
    TRACESTATE,
    "x-client-trace-id",
    "x-envoy-force-trace",
    "x-request-id",
)

# A split gateway (every caller samples little) traces on an internal listener that only the
# requests it samples take; its own listener has no tracer, so its access logs read the trace
# id from this dynamic metadata (namespace, key), which the internal listener's answer sets,
# and, its own upstream being that listener, the cluster the request really went to.
SPLIT_TRACE_METADATA = ("meshfn.trace", "trace_id")
SPLIT_CLUSTER_METADATA = ("meshfn.trace", "upstream_cluster")
# and its response flags and upstream connection there (a request it shed or found no upstream
# for is answered by the internal listener itself: the gateway's own listener did reach one)
SPLIT_FLAGS_METADATA = ("meshfn.trace", "response_flags")
SPLIT_UPSTREAM_METADATA = ("meshfn.trace", "upstream_local_address")


def split_value(filter_metadata: Any, where: tuple[str, str]) -> str:
    """What a split gateway's access-log entry holds at `where` (SPLIT_TRACE_METADATA or
    SPLIT_CLUSTER_METADATA), "" where it holds nothing (`filter_metadata`: the entry's dynamic
    metadata by namespace, protobuf Structs)."""
    namespace, key = where
    found = filter_metadata.get(namespace)
    if found is None or key not in found.fields:
        return ""
    return str(found.fields[key].string_value)


def split_unanswered(filter_metadata: Any) -> bool:
    """A split gateway's sampled request that its internal listener answered itself, no
    upstream request made (shed, no healthy upstream): what the gateway's own listener leaves
    out of the drift breaker's stream (names.LATENCY_LOG_FILTER) for the others."""
    traced = split_value(filter_metadata, SPLIT_TRACE_METADATA)
    return bool(traced) and split_value(filter_metadata, SPLIT_UPSTREAM_METADATA) in ("", "-")


def split_upstream_cluster(filter_metadata: Any, logged: str) -> str:
    """The upstream cluster of a gateway's access-log entry (`logged`), or at a split gateway
    the one its internal listener sent a sampled request to."""
    return split_value(filter_metadata, SPLIT_CLUSTER_METADATA) or logged


# Span attributes meshfn adds (custom tags on Envoy's spans, attributes on the backend's).
# Never taken from a header a client sent: a verified JWT claim, the mTLS peer, route metadata.
TAG_TENANT = "meshfn.tenant"
TAG_MODEL = "meshfn.model"
TAG_ROUTE = "meshfn.route"
TAG_PRINCIPAL = "meshfn.principal"

ClientContext = Literal["restart", "honor"]
TagName = Literal["tenant", "model", "route", "principal"]
ALL_TAGS: tuple[TagName, ...] = ("tenant", "model", "route", "principal")

# version-trace_id-parent_id-flags, lowercase hex; a later version may append "-" and more.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_MAX_TRACESTATE = 512  # W3C: vendors should propagate at least 512 characters
_MAX_MEMBERS = 32


@dataclass(frozen=True, slots=True)
class SpanContext:
    """A parent's identity: trace id (32 lowercase hex), span id (16), sampled flag, and the
    vendor `tracestate` passed on unchanged (empty when absent or malformed)."""

    trace_id: str
    span_id: str
    sampled: bool
    state: str = ""

    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


def _text(value: str | bytes | None) -> str | None:
    """A header value as text, None when absent or not ASCII."""
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value


def parse_traceparent(value: str | bytes | None) -> SpanContext | None:
    """A W3C `traceparent` (version 00, or a later version read as 00 when its first four
    fields are well formed), or None for anything else: wrong lengths, upper case, non-hex,
    all-zero ids, version ff, trailing data on version 00."""
    text = _text(value)
    if text is None:
        return None
    match = _TRACEPARENT.fullmatch(text.strip(" \t"))
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (rest and version == "00") or trace_id == _ZERO_TRACE:
        return None
    if span_id == _ZERO_SPAN:
        return None
    return SpanContext(trace_id, span_id, bool(int(flags, 16) & 1))


def _member(member: str) -> bool:
    key, eq, val = member.partition("=")
    return (
        bool(eq and key and val)
        and len(key) <= 256
        and len(val) <= 256
        and "=" not in val
        and all(0x20 < ord(c) < 0x7F for c in key + val)
    )


def parse_tracestate(value: str | bytes | None) -> str:
    """`tracestate` passed on when it is well formed (list-members `key=value`, at most 32,
    printable, within 512 characters), else "" (W3C: discard a malformed one)."""
    text = _text(value)
    if not text or len(text) > _MAX_TRACESTATE:
        return ""
    members = [m for m in (m.strip(" \t") for m in text.split(",")) if m]
    if len(members) > _MAX_MEMBERS or not all(map(_member, members)):
        return ""
    return ",".join(members)


def new_trace_id() -> str:
    return os.urandom(16).hex()


def new_span_id() -> str:
    return os.urandom(8).hex()


Endpoint = Annotated[
    str,
    Field(pattern=r"^((grpc|http)://[A-Za-z0-9.:\[\]-]{1,300}(/[!-~]*)?|unix:///[!-~]{1,300})$"),
]


def endpoint_port(endpoint: str) -> int | None:
    """The TCP port of a grpc:// or http:// endpoint (OTLP's 4317 and 4318 where it names
    none), None for unix:///path."""
    parts = urlsplit(endpoint)
    if parts.scheme == "unix":
        return None
    return parts.port or (4317 if parts.scheme == "grpc" else 4318)


class BackendTracing(BaseModel):
    """The inference backend's tracing (its config's `tracing`): where its spans go and how it
    samples requests that arrive without a usable `traceparent` (a request with one follows the
    parent's sampled flag). `meshfn up` and the operator write it from Mesh.spec.tracing.

    Pushed to `endpoint`, or, with `pullToken` instead, held for `meshfn up` to collect
    (POST /meshfn/spans with that bearer token, on the backend's own private socket): under
    `meshfn up` the backend needs no outbound connection for its spans, so its egress sandbox
    stays closed (it refuses every unix socket connect, and TCP to anything the policy does not
    name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: Endpoint | None = Field(
        None,
        description="the OTLP collector: grpc://host:port, http://host:port/v1/traces, or"
        " unix:///path (OTLP/gRPC over a unix socket)",
    )
    pullToken: Annotated[str, Field(pattern=r"^[0-9a-f]{32,128}$")] | None = Field(
        None,
        description="no endpoint: the spans wait (bounded by `queue`) until POST /meshfn/spans"
        " with this bearer token takes them (meshfn up's embedded collector)",
    )
    sampling: Annotated[float, Field(ge=0, le=100)] = Field(
        1.0, description="percent of requests without a parent's decision that are traced"
    )
    serviceName: Annotated[str, Field(min_length=1, max_length=128)] = Field(
        "meshfn-inference", description="the service.name of the backend's spans"
    )
    timeout: Annotated[float, Field(gt=0, le=60)] = Field(
        1.0, description="seconds an export may take before its spans count as dropped"
    )
    queue: Annotated[int, Field(ge=16, le=1_000_000)] = Field(
        4096, description="spans held for export at most; more are dropped and counted"
    )

    @model_validator(mode="after")
    def _one_way(self) -> Self:
        if (self.endpoint is None) == (self.pullToken is None):
            raise ValueError("give an endpoint or a pullToken (exactly one)")
        return self
