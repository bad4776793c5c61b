"""Go/Istio-style durations ("250ms", "1m30s"): what users of Envoy and Istio type, in policies
and in the inference backend's configuration alike."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|ms|m|s|us|ns))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|ns)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
MAX_DURATION = timedelta(days=365)


def parse_duration(value: object) -> timedelta:
    """Go/Istio-style durations ("250ms", "1m30s"): what users of Envoy and Istio type."""
    if isinstance(value, timedelta):
        return value
    if not isinstance(value, str):
        raise ValueError('a duration is a string such as "1s", "250ms" or "1m30s"')
    if not _DURATION.match(value):
        raise ValueError(f'invalid duration {value!r}: use e.g. "1s", "250ms" or "1m30s"')
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    # Bounded before timedelta sees it: a long run of digits overflows timedelta's C int.
    if seconds > MAX_DURATION.total_seconds():
        raise ValueError(f"duration {value!r} is longer than 365 days")
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    micros = round(value.total_seconds() * 1e6)
    if micros % 1_000_000 == 0:
        return f"{micros // 1_000_000}s"
    if micros % 1000 == 0:
        return f"{micros // 1000}ms"
    return f"{micros}us"


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({"type": "string", "pattern": _DURATION.pattern}),
]
