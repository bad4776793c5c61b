"""Hand-assembled protobuf wire format for discovery responses.

A DiscoveryResponse is a handful of length-delimited fields; the expensive part is the resources.
Encoding each resource once per version and concatenating those bytes per response costs a few
microseconds instead of building and serialising a message tree per stream (FACTS.md, "ADS
fan-out ceiling": 1.4-2.3x less CPU). Field numbers come from the descriptors at import time, so a
protocol change breaks loudly here instead of silently on the wire.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

_SOTW = discovery_pb2.DiscoveryResponse.DESCRIPTOR.fields_by_name
_DELTA = discovery_pb2.DeltaDiscoveryResponse.DESCRIPTOR.fields_by_name
_RESOURCE = discovery_pb2.Resource.DESCRIPTOR.fields_by_name


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def text(number: int, value: str) -> bytes:
    return field(number, value.encode()) if value else b""


CONTROL_PLANE = base_pb2.ControlPlane(identifier="meshfn").SerializeToString()


class Sotw:
    VERSION = _SOTW["version_info"].number
    RESOURCES = _SOTW["resources"].number
    TYPE_URL = _SOTW["type_url"].number
    NONCE = _SOTW["nonce"].number
    CONTROL_PLANE = _SOTW["control_plane"].number


class Delta:
    SYSTEM_VERSION = _DELTA["system_version_info"].number
    RESOURCES = _DELTA["resources"].number
    TYPE_URL = _DELTA["type_url"].number
    REMOVED = _DELTA["removed_resources"].number
    NONCE = _DELTA["nonce"].number
    CONTROL_PLANE = _DELTA["control_plane"].number


class ResourceField:
    NAME = _RESOURCE["name"].number
    VERSION = _RESOURCE["version"].number
    RESOURCE = _RESOURCE["resource"].number


def sotw_response(version: str, entries: bytes, type_url: str, nonce: str) -> bytes:
    """`entries` is the concatenation of pre-encoded `resources` fields."""
    return b"".join(
        (
            text(Sotw.VERSION, version),
            entries,
            text(Sotw.TYPE_URL, type_url),
            text(Sotw.NONCE, nonce),
            field(Sotw.CONTROL_PLANE, CONTROL_PLANE),
        )
    )


def delta_response(
    system_version: str, entries: bytes, type_url: str, removed: list[str], nonce: str
) -> bytes:
    return b"".join(
        (
            text(Delta.SYSTEM_VERSION, system_version),
            entries,
            text(Delta.TYPE_URL, type_url),
            b"".join(field(Delta.REMOVED, name.encode()) for name in removed),
            text(Delta.NONCE, nonce),
            field(Delta.CONTROL_PLANE, CONTROL_PLANE),
        )
    )
