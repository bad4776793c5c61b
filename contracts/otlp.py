"""OTLP trace messages (OpenTelemetry protocol v1): the inference backend writes them, the
control plane's collector reads them, Envoy's OpenTelemetry tracer sends them.

Our own definitions, in a descriptor pool of our own: xds-protos ships the `opentelemetry.proto`
package as a stale copy from before OTLP 0.15 (`instrumentation_library_spans`, no `scope_spans`:
it cannot read what Envoy 1.40 sends) and without gRPC stubs, and installing
`opentelemetry-proto` beside it overwrites its files. The wire format carries field numbers, not
names, so these messages (package `meshfn.otlp`, the upstream field numbers and types of
opentelemetry-proto 1.x) read and write the same bytes as upstream's; the private pool never
clashes with a copy another package registers. Messages are made by protobuf's own runtime
(upb), so parsing costs what generated code costs.

Only the trace signal and what it needs: common (AnyValue, KeyValue, InstrumentationScope),
resource, trace (Span with events, links, status, flags) and the collector's
ExportTraceServiceRequest/Response.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

PACKAGE = "meshfn.otlp"
# The gRPC method collectors serve (OTLP/gRPC) and the HTTP path (OTLP/HTTP, protobuf body).
GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
HTTP_PATH = "/v1/traces"
HTTP_CONTENT_TYPE = "application/x-protobuf"

# SpanKind and StatusCode (the enums' numbers)
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
KIND_NAMES = {
    0: "unspecified",
    1: "internal",
    2: "server",
    3: "client",
    4: "producer",
    5: "consumer",
}

_T = descriptor_pb2.FieldDescriptorProto
_REPEATED, _OPTIONAL = _T.LABEL_REPEATED, _T.LABEL_OPTIONAL

# message -> [(field name, number, type, label, message type or None, oneof index or None)]
_MESSAGES: dict[str, list[tuple[str, int, int, int, str | None, int | None]]] = {
    "AnyValue": [
        ("string_value", 1, _T.TYPE_STRING, _OPTIONAL, None, 0),
        ("bool_value", 2, _T.TYPE_BOOL, _OPTIONAL, None, 0),
        ("int_value", 3, _T.TYPE_INT64, _OPTIONAL, None, 0),
        ("double_value", 4, _T.TYPE_DOUBLE, _OPTIONAL, None, 0),
        ("array_value", 5, _T.TYPE_MESSAGE, _OPTIONAL, "ArrayValue", 0),
        ("kvlist_value", 6, _T.TYPE_MESSAGE, _OPTIONAL, "KeyValueList", 0),
        ("bytes_value", 7, _T.TYPE_BYTES, _OPTIONAL, None, 0),
    ],
    "ArrayValue": [("values", 1, _T.TYPE_MESSAGE, _REPEATED, "AnyValue", None)],
    "KeyValueList": [("values", 1, _T.TYPE_MESSAGE, _REPEATED, "KeyValue", None)],
    "KeyValue": [
        ("key", 1, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("value", 2, _T.TYPE_MESSAGE, _OPTIONAL, "AnyValue", None),
    ],
    "InstrumentationScope": [
        ("name", 1, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("version", 2, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("attributes", 3, _T.TYPE_MESSAGE, _REPEATED, "KeyValue", None),
        ("dropped_attributes_count", 4, _T.TYPE_UINT32, _OPTIONAL, None, None),
    ],
    "Resource": [
        ("attributes", 1, _T.TYPE_MESSAGE, _REPEATED, "KeyValue", None),
        ("dropped_attributes_count", 2, _T.TYPE_UINT32, _OPTIONAL, None, None),
    ],
    "Status": [
        ("message", 2, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("code", 3, _T.TYPE_INT32, _OPTIONAL, None, None),  # an enum on the wire: a varint
    ],
    "Event": [
        ("time_unix_nano", 1, _T.TYPE_FIXED64, _OPTIONAL, None, None),
        ("name", 2, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("attributes", 3, _T.TYPE_MESSAGE, _REPEATED, "KeyValue", None),
        ("dropped_attributes_count", 4, _T.TYPE_UINT32, _OPTIONAL, None, None),
    ],
    "Link": [
        ("trace_id", 1, _T.TYPE_BYTES, _OPTIONAL, None, None),
        ("span_id", 2, _T.TYPE_BYTES, _OPTIONAL, None, None),
        ("trace_state", 3, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("attributes", 4, _T.TYPE_MESSAGE, _REPEATED, "KeyValue", None),
        ("dropped_attributes_count", 5, _T.TYPE_UINT32, _OPTIONAL, None, None),
        ("flags", 6, _T.TYPE_FIXED32, _OPTIONAL, None, None),
    ],
    "Span": [
        ("trace_id", 1, _T.TYPE_BYTES, _OPTIONAL, None, None),
        ("span_id", 2, _T.TYPE_BYTES, _OPTIONAL, None, None),
        ("trace_state", 3, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("parent_span_id", 4, _T.TYPE_BYTES, _OPTIONAL, None, None),
        ("name", 5, _T.TYPE_STRING, _OPTIONAL, None, None),
        ("kind", 6, _T.TYPE_INT32, _OPTIONAL, None, None),  # an enum on the wire
        ("start_time_unix_nano", 7, _T.TYPE_FIXED64, _OPTIONAL, None, None),
        ("end_time_unix_nano", 8, _T.TYPE_FIXED64, _OPTIONAL, None, None),
        ("attributes", 9, _T.TYPE_MESSAGE, _REPEATED, "KeyValue", None),
        ("dropped_attributes_count", 10, _T.TYPE_UINT32, _OPTIONAL, None, None),
        ("events", 11, _T.TYPE_MESSAGE, _REPEATED, "Event", None),
        ("dropped_events_count", 12, _T.TYPE_UINT32, _OPTIONAL, None, None),
        ("links", 13, _T.TYPE_MESSAGE, _REPEATED, "Link", None),
        ("dropped_links_count", 14, _T.TYPE_UINT32, _OPTIONAL, None, None),
        ("status", 15, _T.TYPE_MESSAGE, _OPTIONAL, "Status", None),
        ("flags", 16, _T.TYPE_FIXED32, _OPTIONAL, None, None),
    ],
    "ScopeSpans": [
        ("scope", 1, _T.TYPE_MESSAGE, _OPTIONAL, "InstrumentationScope", None),
        ("spans", 2, _T.TYPE_MESSAGE, _REPEATED, "Span", None),
        ("schema_url", 3, _T.TYPE_STRING, _OPTIONAL, None, None),
    ],
    "ResourceSpans": [
        ("resource", 1, _T.TYPE_MESSAGE, _OPTIONAL, "Resource", None),
        ("scope_spans", 2, _T.TYPE_MESSAGE, _REPEATED, "ScopeSpans", None),
        ("schema_url", 3, _T.TYPE_STRING, _OPTIONAL, None, None),
    ],
    "ExportTraceServiceRequest": [
        ("resource_spans", 1, _T.TYPE_MESSAGE, _REPEATED, "ResourceSpans", None)
    ],
    "ExportTracePartialSuccess": [
        ("rejected_spans", 1, _T.TYPE_INT64, _OPTIONAL, None, None),
        ("error_message", 2, _T.TYPE_STRING, _OPTIONAL, None, None),
    ],
    "ExportTraceServiceResponse": [
        ("partial_success", 1, _T.TYPE_MESSAGE, _OPTIONAL, "ExportTracePartialSuccess", None)
    ],
}


def _file() -> descriptor_pb2.FileDescriptorProto:
    out = descriptor_pb2.FileDescriptorProto(
        name="meshfn/otlp.proto", package=PACKAGE, syntax="proto3"
    )
    for name, fields in _MESSAGES.items():
        message = out.message_type.add(name=name)
        if any(oneof is not None for *_, oneof in fields):
            message.oneof_decl.add(name="value")
        for field, number, kind, label, type_name, oneof in fields:
            entry = message.field.add(name=field, number=number, type=kind, label=label)
            if type_name is not None:
                entry.type_name = f".{PACKAGE}.{type_name}"
            if oneof is not None:
                entry.oneof_index = oneof
    return out


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


# Message classes (protobuf's own; typed as Any: they are made at run time, not generated).
ExportTraceServiceRequest: Any = _message("ExportTraceServiceRequest")
ExportTraceServiceResponse: Any = _message("ExportTraceServiceResponse")
ResourceSpans: Any = _message("ResourceSpans")
ScopeSpans: Any = _message("ScopeSpans")
Span: Any = _message("Span")
Event: Any = _message("Event")
Link: Any = _message("Link")
KeyValue: Any = _message("KeyValue")
AnyValue: Any = _message("AnyValue")


def any_value(value: object) -> Message:
    """An AnyValue for a str, bool, int, float, bytes or a list or tuple of them (anything
    else as its str)."""
    out = AnyValue()
    if isinstance(value, (list, tuple)):
        out.array_value.values.extend(any_value(v) for v in value)
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, bytes):
        out.bytes_value = value
    else:
        out.string_value = str(value)
    return out  # type: ignore[no-any-return]


def plain(value: Any) -> object:
    """An AnyValue as plain data (what the collector stores and shows)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [plain(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: plain(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return bytes(value.bytes_value).hex()
    return getattr(value, which)


def attributes(pairs: Any) -> dict[str, object]:
    """Repeated KeyValue as a dict (the last of a repeated key wins)."""
    return {kv.key: plain(kv.value) for kv in pairs}
