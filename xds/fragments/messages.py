"""Protobuf helpers for Envoy configuration: an Any, a Duration, and a message as the JSON an
EnvoyFilter patch holds."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from google.protobuf import any_pb2, descriptor_pool, duration_pb2, json_format, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def pack(message: Message) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(message, deterministic=True)
    return out


def duration(value: timedelta) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromTimedelta(value)
    return out


def seconds(value: timedelta) -> str:
    """A Duration as Envoy's JSON writes it ("1.5s"), from a timedelta."""
    total = value.total_seconds()
    text = f"{total:.9f}".rstrip("0").rstrip(".")
    return f"{text or '0'}s"


_WRAPPERS = {
    f"google.protobuf.{kind}Value"
    for kind in ("Bool", "Int32", "Int64", "UInt32", "UInt64", "Float", "Double", "String", "Bytes")
}
_STRUCTS = {"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"}


def envoy_json(message: Message) -> Any:
    """`message` as Envoy's JSON, the way an EnvoyFilter patch holds it: fields by their .proto
    names, in field-number order; wrappers as bare values; Durations in seconds ("1.5s"); an Any
    as its message with its "@type"; enums by name. Unlike protobuf's own JSON, 64-bit integers
    stay numbers."""
    name = message.DESCRIPTOR.full_name
    if name in _WRAPPERS:
        (field,) = message.DESCRIPTOR.fields
        return getattr(message, field.name)
    if isinstance(message, duration_pb2.Duration):
        return seconds(message.ToTimedelta())
    if isinstance(message, any_pb2.Any):
        kind = descriptor_pool.Default().FindMessageTypeByName(message.TypeName())
        inner = message_factory.GetMessageClass(kind)()
        message.Unpack(inner)
        return {"@type": message.type_url, **envoy_json(inner)}
    if name in _STRUCTS:
        return json_format.MessageToDict(message)
    out = {}
    for field, value in message.ListFields():
        if not field.is_repeated:
            out[field.name] = _value(field, value)
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            out[field.name] = {key: _value(entry, item) for key, item in value.items()}
        else:
            out[field.name] = [_value(field, item) for item in value]
    return out


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None:
        return envoy_json(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    return value
