"""W3C Trace Context parsing (meshfn.contracts.tracing) and the OTLP messages (contracts.otlp):
what the backend and the collector read from the wire; the backend's tracing settings (push or
pulled) and the one TCP port its Landlock rules open for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from meshfn.contracts import otlp
from meshfn.contracts.function import BackendConfig
from meshfn.contracts.tracing import (
    BackendTracing,
    SpanContext,
    parse_traceparent,
    parse_tracestate,
)
from meshfn.inference import sandbox

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_a_well_formed_traceparent_is_read() -> None:
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-01") == SpanContext(TRACE, SPAN, True)
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-00".encode()) == SpanContext(TRACE, SPAN, False)
    # other flag bits do not matter; the sampled bit does
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-03") == SpanContext(TRACE, SPAN, True)
    # a later version: its first four fields, whatever follows a dash
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01-future") == SpanContext(TRACE, SPAN, True)
    assert SpanContext(TRACE, SPAN, True).traceparent() == f"00-{TRACE}-{SPAN}-01"


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        f"00-{TRACE.upper()}-{SPAN}-01",  # upper case
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero span id
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has nothing after the flags
        f"00-{TRACE}-{SPAN}-0g",
        f"00-{TRACE[:-1]}x-{SPAN}-01",
        f"00_{TRACE}_{SPAN}_01",
        f"01-{TRACE}-{SPAN}-01x",  # a later version's extra fields start with a dash
        b"\xff\xfe" * 40,  # not ASCII
        "00-" + TRACE + "-" + SPAN + "-01" + "\x00",
    ],
)
def test_a_malformed_traceparent_is_none(value: str | bytes | None) -> None:
    assert parse_traceparent(value) is None


def test_tracestate_is_kept_when_well_formed_and_dropped_otherwise() -> None:
    assert parse_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7") == (
        "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    )
    assert parse_tracestate(None) == ""
    assert parse_tracestate("novalue") == ""
    assert parse_tracestate("a=b=c") == ""
    assert parse_tracestate("a=b c") == ""
    assert parse_tracestate("x" * 600) == ""
    assert parse_tracestate(",".join(f"k{i}=v" for i in range(33))) == ""
    assert parse_tracestate(b"\xff=1") == ""


def test_otlp_messages_round_trip_with_every_field_a_span_carries() -> None:
    request = otlp.ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.add(key="service.name", value=otlp.any_value("edge"))
    span = resource.scope_spans.add().spans.add(
        trace_id=bytes.fromhex(TRACE),
        span_id=bytes.fromhex(SPAN),
        name="GET /x",
        kind=otlp.KIND_SERVER,
        start_time_unix_nano=1,
        end_time_unix_nano=2,
        flags=0x101,
    )
    span.attributes.add(key="n", value=otlp.any_value(3))
    span.attributes.add(key="b", value=otlp.any_value(True))
    span.attributes.add(key="f", value=otlp.any_value(0.5))
    span.attributes.add(key="r", value=otlp.any_value(b"\x01"))
    span.links.add(trace_id=bytes.fromhex(TRACE), span_id=bytes.fromhex(SPAN))
    span.events.add(time_unix_nano=2, name="first token")
    span.status.code = otlp.STATUS_ERROR
    data = request.SerializeToString()
    back = otlp.ExportTraceServiceRequest.FromString(data)
    (got,) = back.resource_spans[0].scope_spans[0].spans
    assert otlp.attributes(got.attributes) == {"n": 3, "b": True, "f": 0.5, "r": "01"}
    assert got.links[0].span_id.hex() == SPAN and got.events[0].name == "first token"
    assert got.status.code == otlp.STATUS_ERROR and got.flags == 0x101
    assert otlp.attributes(back.resource_spans[0].resource.attributes) == {"service.name": "edge"}


def test_otlp_wire_numbers_match_upstream() -> None:
    """Field numbers decide the wire format: spot-check the ones Envoy and every collector
    use (opentelemetry-proto 1.x: Span.name 5, start 7 fixed64, attributes 9, status 15,
    ResourceSpans.scope_spans 2)."""
    span = otlp.Span(name="x", start_time_unix_nano=1)
    assert span.SerializeToString() == b"\x2a\x01x" + b"\x39" + (1).to_bytes(8, "little")
    scope = otlp.ResourceSpans()
    scope.scope_spans.add()
    assert scope.SerializeToString() == b"\x12\x00"


@pytest.mark.parametrize(
    ("tracing", "ports"),
    [
        ({"endpoint": "grpc://10.0.0.9:4317"}, (4317, 15201)),
        ({"endpoint": "http://collector.observability:14318/v1/traces"}, (14318, 15201)),
        ({"endpoint": "http://collector.observability/v1/traces"}, (4318, 15201)),
        ({"endpoint": "unix:///run/otel/otlp.sock"}, (15201,)),
        ({"pullToken": "ab" * 16}, (15201,)),  # meshfn up collects: no connection at all
        (None, (15201,)),
    ],
)
def test_landlock_lets_a_backend_reach_the_collector_it_pushes_to_and_nothing_more(
    tmp_path: Path, tracing: dict[str, str] | None, ports: tuple[int, ...]
) -> None:
    (tmp_path / "registry").mkdir()
    config = BackendConfig.model_validate(
        {
            "registry": str(tmp_path / "registry"),
            "trustedKeys": [],
            "sandbox": {"connect": [{"address": "127.0.0.1", "port": 15201}]},
            **({"tracing": tracing} if tracing else {}),
        }
    )
    assert sandbox.Sandbox(config).rules().connect_ports == tuple(sorted(ports))


@pytest.mark.parametrize(
    "given", [{}, {"endpoint": "grpc://a:1", "pullToken": "ab" * 16}, {"pullToken": "short"}]
)
def test_backend_tracing_pushes_or_is_pulled_never_both_nor_neither(given: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        BackendTracing.model_validate(given)
