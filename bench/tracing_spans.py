"""The backend's spans of one traced request, built two ways, for bench/tracing.py (`--sdk`):

  ours  meshfn.inference.tracing: the hot path reads clocks and appends tuples; the OTLP
        messages are built on the exporter thread, a batch at a time (`encode`)
  sdk   the OpenTelemetry SDK (opentelemetry-sdk, its W3C propagator and OTLP encoder): what the
        backend would run instead

Each side runs in its own interpreter (`python -P bench/tracing_spans.py ours|sdk N`): the SDK
lives in a virtual environment of its own, because xds-protos, which meshfn needs, ships a stale
copy of the `opentelemetry.proto` package that the SDK's exporter would overwrite (or be
overwritten by). Prints one JSON line: microseconds per request on the request's path (`hot`)
and in the exporter (`encode`), medians of 7 batches.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STEPS = ("admission", "queue", "guest call")  # the children of a warm, unbatched request
BATCH = 512


def ours(n: int) -> dict[str, float]:
    from meshfn.contracts.tracing import BackendTracing
    from meshfn.inference.tracing import RequestSpan, Tracer, encode

    tracer = Tracer(BackendTracing(endpoint="grpc://127.0.0.1:9", queue=16))
    done: list[RequestSpan] = []
    tracer.finish = lambda span, status: done.append(span)  # type: ignore[method-assign]

    def hot() -> None:
        span = tracer.begin("infer iris", PARENT)
        assert span is not None
        now = time.perf_counter_ns()
        for i, name in enumerate(STEPS):
            span.child(name, now + i, now + i + 1)
        span.attrs.update(
            {"meshfn.model": "iris", "meshfn.version": "1", "meshfn.protocol": "rest",
             "http.response.status_code": 200}
        )  # fmt: skip
        span.end = time.perf_counter_ns()
        tracer.finish(span, 200)

    result = _measure(hot, n)
    batch = done[:BATCH]
    encoded = _batches(lambda: encode(batch, "models.default inference"), 20) / len(batch)
    tracer.close(timeout=0.1)
    return {"hot": result, "encode": encoded}


def sdk(n: int) -> dict[str, float]:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    finished: list[ReadableSpan] = []

    class Keep(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            finished.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(
        resource=Resource.create({"service.name": "models.default inference"})
    )
    # as the SDK is deployed: a batch processor (its thread hands batches to the exporter)
    provider.add_span_processor(
        BatchSpanProcessor(Keep(), max_queue_size=1 << 16, schedule_delay_millis=1000)
    )
    tracer = provider.get_tracer("meshfn.inference")
    propagator = TraceContextTextMapPropagator()

    def hot() -> None:
        parent = propagator.extract({"traceparent": PARENT})
        with tracer.start_as_current_span(
            "infer iris", context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            now = time.time_ns()
            for i, name in enumerate(STEPS):
                child = tracer.start_span(name, start_time=now + i)
                child.end(end_time=now + i + 1)
            span.set_attributes(
                {"meshfn.model": "iris", "meshfn.version": "1", "meshfn.protocol": "rest",
                 "http.response.status_code": 200}
            )  # fmt: skip
        if len(finished) > 4 * BATCH:
            del finished[: 2 * BATCH]

    result = _measure(hot, n)
    spans = finished[: 4 * BATCH]
    per_request = len(STEPS) + 1
    encoded = _batches(lambda: encode_spans(spans).SerializeToString(), 20) / (
        len(spans) / per_request
    )
    return {"hot": result, "encode": encoded}


def _measure(call: Any, n: int) -> float:
    for _ in range(min(n, 2000)):
        call()
    return _batches(lambda: [call() for _ in range(n)], 7) / n


def _batches(call: Any, times: int) -> float:
    """Median microseconds of `call()` over `times` runs."""
    took = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        took.append((time.perf_counter() - started) * 1e6)
    return statistics.median(took)


if __name__ == "__main__":
    side, count = sys.argv[1], int(sys.argv[2])
    figures = ours(count) if side == "ours" else sdk(count)
    print(json.dumps({k: round(v, 2) for k, v in figures.items()}))
