"""A cheap first look at DiscoveryRequests.

SotW ACKs repeat every subscribed name (50 KB for a thousand clusters). Parsing that into Python
strings on every ACK dominated a push to a thousand proxies, so requests are first parsed as
`RequestHead`: the same wire format with `resource_names` left out (protobuf skips unknown fields
as raw bytes) and `node`/`error_detail` kept as bytes. The names are parsed only when the
subscription may have changed, which `names_key` detects by comparing raw bytes.
"""

from __future__ import annotations

from typing import Any

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from . import wire

_FIELDS = discovery_pb2.DiscoveryRequest.DESCRIPTOR.fields_by_name


def _head_class() -> Any:
    proto = descriptor_pb2.FileDescriptorProto(
        name="meshfn/xds/request_head.proto", package="meshfn.xds", syntax="proto3"
    )
    message = proto.message_type.add(name="RequestHead")
    string, raw = (
        descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    )
    for name, kind in (
        ("version_info", string),
        ("node", raw),
        ("type_url", string),
        ("response_nonce", string),
        ("error_detail", raw),
    ):
        message.field.add(
            name=name,
            number=_FIELDS[name].number,
            type=kind,
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("meshfn.xds.RequestHead"))


RequestHead = _head_class()
_LEADING = (_FIELDS["version_info"].number, _FIELDS["node"].number)
_TRAILING = (
    _FIELDS["type_url"].number,
    _FIELDS["response_nonce"].number,
    _FIELDS["error_detail"].number,
)


def names_key(raw: bytes, head: Any) -> bytes:
    """The bytes between the leading fields (version, node) and the trailing ones (type, nonce,
    error) of a canonically serialised request: its resource names. For a non-canonical sender
    the slice also holds other fields, so it changes every time; callers then compare the
    parsed names, which stays correct, only slower."""
    lead = sum(
        len(wire.field(n, v.encode() if isinstance(v, str) else v))
        for n, v in zip(_LEADING, (head.version_info, head.node), strict=True)
        if v
    )
    trail = sum(
        len(wire.field(n, v.encode() if isinstance(v, str) else v))
        for n, v in zip(
            _TRAILING, (head.type_url, head.response_nonce, head.error_detail), strict=True
        )
        if v
    )
    return raw[lead : len(raw) - trail]
