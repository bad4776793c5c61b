"""The MeshModel as plain data (ready for YAML or JSON) and back.

For golden files of the translator's two stages (policy -> IR, IR -> xDS) and for reading an IR
without its policies. Deterministic: dataclass field order, every field (defaults too, so a
changed default shows in a diff), tuples as lists, timedelta as a Go duration string ("1h0m0s",
"1.5s", "100ms") as Envoy Gateway's IR dumps write them. `load_model` is strict about what it
is given (an unknown field, a wrong type or a value outside a Literal is an error naming its
path) and fills in defaults for fields left out, so a hand-written IR can stay short.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from datetime import timedelta
from fractions import Fraction
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ValidationError

from . import MeshModel


def dump_model(model: MeshModel) -> dict[str, Any]:
    out = _dump(model)
    assert isinstance(out, dict)
    return out


def load_model(data: Any) -> MeshModel:
    """The MeshModel `dump_model` wrote (ValueError naming the field path if it is not one)."""
    model = _load(MeshModel, data, "")
    assert isinstance(model, MeshModel)
    return model


def _dump(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _dump(getattr(value, f.name)) for f in _fields(type(value))}
    if isinstance(value, tuple):
        return [_dump(v) for v in value]
    if isinstance(value, BaseModel):  # a shared contract (meshfn.contracts), in its own format
        return value.model_dump(mode="json")
    if isinstance(value, timedelta):
        return go_duration(value)
    if value is None or isinstance(value, str | int | float):  # bool is an int
        return value
    raise TypeError(f"no plain form for {type(value).__name__}")


@cache
def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """The fields a constructor takes (a MeshModel's indexes are derived, not data)."""
    return tuple(f for f in dataclasses.fields(cls) if f.init)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _load(kind: Any, value: Any, path: str) -> Any:
    """`value` as an IR value of type `kind`: one step per kind of type."""
    origin = get_origin(kind)
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        return _load_dataclass(kind, value, path)
    if origin is tuple:
        return _load_tuple(get_args(kind), value, path)
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return _load_contract(kind, value, path)
    if origin in (Union, types.UnionType):
        return _load_optional(kind, value, path)
    if origin is Literal:
        return _load_literal(kind, value, path)
    return _load_scalar(kind, value, path)


def _load_contract(kind: type[BaseModel], value: Any, path: str) -> BaseModel:
    """A shared contract (meshfn.contracts), validated by its own model."""
    try:
        return kind.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(
            f"{path}.{where}: {first['msg']}" if where else f"{path}: {first['msg']}"
        ) from None


def _load_optional(kind: Any, value: Any, path: str) -> Any:
    """`X | None`, the only union the IR uses."""
    arms = [arm for arm in get_args(kind) if arm is not type(None)]
    if value is None and len(arms) < len(get_args(kind)):
        return None
    if len(arms) != 1:
        raise TypeError(f"{path}: unions other than X | None are not IR types")
    return _load(arms[0], value, path)


def _load_literal(kind: Any, value: Any, path: str) -> Any:
    if value not in get_args(kind):
        raise ValueError(f"{path}: {value!r} is not one of {list(get_args(kind))}")
    return value


def _load_scalar(kind: Any, value: Any, path: str) -> Any:
    """A duration (a Go duration string), or a str, int, float or bool as itself (an int is
    a float too; a bool is never an int)."""
    if kind is timedelta:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a duration string, got {value!r}")
        try:
            return parse_go_duration(value)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (str, int, float, bool) and type(value) is kind:
        return value
    raise ValueError(f"{path}: expected {getattr(kind, '__name__', kind)}, got {value!r}")


def _load_dataclass(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, Mapping):
        raise ValueError(f"{path or '.'}: expected a mapping for {cls.__name__}, got {value!r}")
    fields = {f.name: f for f in _fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{path or '.'}: {cls.__name__} has no field {', '.join(unknown)}")
    hints = _hints(cls)
    kwargs = {
        name: _load(hints[name], item, f"{path}.{name}" if path else name)
        for name, item in value.items()
    }
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{path or '.'}: {cls.__name__} needs {', '.join(missing)}")
    return cls(**kwargs)


def _load_tuple(args: tuple[Any, ...], value: Any, path: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a list, got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_load(args[0], item, f"{path}[{i}]") for i, item in enumerate(value))
    if len(value) != len(args):
        raise ValueError(f"{path}: expected {len(args)} items, got {len(value)}")
    pairs = enumerate(zip(args, value, strict=True))
    return tuple(_load(arg, item, f"{path}[{i}]") for i, (arg, item) in pairs)


# ---------------------------------------------------------------- Go durations

_US = timedelta(microseconds=1)
_UNIT_NS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # U+00B5, what Go writes
    "μs": 1_000,  # U+03BC, which Go reads too
    "ms": 1_000_000,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
}
_PART = r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
_DURATION = re.compile(rf"([-+]?)((?:{_PART})+)")


def go_duration(value: timedelta) -> str:
    """What Go's time.Duration.String() writes for `value` (timedelta's resolution is 1 us)."""
    us = value // _US
    sign, us = ("-" if us < 0 else ""), abs(us)
    if us == 0:
        return "0s"
    if us < 1_000:
        return f"{sign}{us}µs"
    if us < 1_000_000:
        return f"{sign}{_decimal(us, 1_000)}ms"
    minutes, seconds = divmod(us, 60_000_000)
    hours, minutes = divmod(minutes, 60)
    text = f"{_decimal(seconds, 1_000_000)}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def _decimal(count: int, per_unit: int) -> str:
    """`count` / `per_unit` (a power of ten) in decimal, without trailing zeros."""
    whole, rest = divmod(count, per_unit)
    if not rest:
        return str(whole)
    digits = len(str(per_unit)) - 1
    return f"{whole}.{rest:0{digits}d}".rstrip("0")


def parse_go_duration(text: str) -> timedelta:
    """What Go's time.ParseDuration reads ("1h30m", "1.5s", "-300ms", "0"), down to 1 us."""
    if text in ("0", "+0", "-0"):
        return timedelta(0)
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration like 1h0m0s, 1.5s or 300ms")
    sign, parts = match.group(1), match.group(2)
    ns = sum(Fraction(n) * _UNIT_NS[unit] for n, unit in re.findall(_PART, parts))
    if ns.denominator != 1 or ns % 1_000:
        raise ValueError(f"{text!r} is finer than a microsecond")
    us = int(ns) // 1_000
    return timedelta(microseconds=-us if sign == "-" else us)
