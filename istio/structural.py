"""An object checked against a CRD's structural schema as a Kubernetes apiserver checks it.

The semantics are the apiserver's (k8s.io/apiextensions-apiserver: OpenAPI v3.0 with Kubernetes'
extensions), with one difference: what an apiserver would *prune* silently is an error here. An
unknown field, or a null where the schema is not nullable, would be dropped on apply and the
object would not mean what meshfn rendered, so it is refused with its path.

- **Types.** `integer` takes whole numbers (3.0 too, as the apiserver's JSON decoding does),
  `number` takes integers; a boolean is never a number. `x-kubernetes-int-or-string` takes an
  integer or a string. `nullable: true` allows null; elsewhere null is refused.
- **Fields.** An object's fields are its `properties`, or any key with the `additionalProperties`
  schema (a map); others are unknown, unless `x-kubernetes-preserve-unknown-fields` keeps them
  (with no schema below: anything goes). `required` fields must be present.
- **Values.** `enum`; `minimum`/`maximum` (with OpenAPI v3.0's boolean `exclusiveMinimum`/
  `exclusiveMaximum`), `multipleOf`; `minLength`/`maxLength` in characters; `pattern` with RE2,
  the syntax and engine of Go's regexp, unanchored as there; `minItems`/`maxItems`,
  `minProperties`/`maxProperties`; `x-kubernetes-list-type` `set` and `map` (no duplicate item,
  no two items with the same `x-kubernetes-list-map-keys`); `allOf`, `anyOf`, `oneOf`, `not` as
  value validations (their schemas never prune, as in the apiserver).
- **Formats**, as the apiserver reads them: only on strings, only the formats it knows (`byte`
  is standard base64, `date-time` RFC 3339, `date`, `ipv4`, `ipv6`, `cidr`, `uuid` here; the
  others it knows, such as `email` or `uri`, appear in no schema meshfn checks). Numeric formats
  (`int32`, `int64`, `double`) are not checked, by the apiserver either: bounds are `minimum` and
  `maximum`. Unknown formats are ignored.
- **Not here**: `x-kubernetes-validations` (CEL rules). The tests evaluate those on every golden
  object (tests/istio/test_istio_cel.py, meshfn.testing.istio_cel).

Pure: no files, no state; `schema` is the openAPIV3Schema of one CRD version (or any node of it).
"""

from __future__ import annotations

import base64
import binascii
import difflib
import ipaddress
import json
import re
from collections.abc import Callable, Iterator
from datetime import date, datetime
from functools import cache
from typing import Any

import re2

Schema = dict[str, Any]
Path = tuple[str | int, ...]
Problem = tuple[Path, str]


def problems(
    schema: Schema, value: Any, path: Path = (), *, prune: bool = True
) -> Iterator[Problem]:
    """Each problem with `value` under `schema`: (path, what is wrong), a node before its
    children. `prune=False` for the schemas of allOf/anyOf/oneOf/not, which never prune."""
    if value is None:
        if not schema.get("nullable"):
            yield path, "must not be null (the schema is not nullable: an apiserver would drop it)"
        return
    wrong = _type_problem(schema, value)
    if wrong is not None:
        yield path, wrong
        return
    for check in _VALUE_CHECKS:
        problem = check(schema, value)
        if problem is not None:
            yield path, problem
    yield from _junctor_problems(schema, value, path)
    if isinstance(value, dict):
        yield from _field_problems(schema, value, path, prune)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from problems(schema["items"], item, (*path, i), prune=prune)


def matches(schema: Schema, value: Any) -> bool:
    """Whether `value` satisfies `schema` as a value validation (nothing pruned)."""
    return next(problems(schema, value, prune=False), None) is None


# ---------------------------------------------------------------- types


def _json_type(value: Any) -> str:
    """The JSON type of a value, as an apiserver names it."""
    if isinstance(value, bool):
        return "boolean"
    for kind, name in ((int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object" if isinstance(value, dict) else type(value).__name__


def _is_integer(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _has_type(value: Any, expected: str) -> bool:
    if expected == "integer":
        return _is_integer(value)
    if expected == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return _json_type(value) == expected


def _type_problem(schema: Schema, value: Any) -> str | None:
    if schema.get("x-kubernetes-int-or-string"):
        if _is_integer(value) or isinstance(value, str):
            return None
        return f"must be an integer or a string, got {_json_type(value)}"
    expected = schema.get("type")
    if expected is None or _has_type(value, expected):
        return None
    return f"must be of type {expected}, got {_json_type(value)}"


# ---------------------------------------------------------------- value validations


def _as_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _enum(schema: Schema, value: Any) -> str | None:
    allowed = schema.get("enum")
    if allowed is None or any(_as_json(value) == _as_json(a) for a in allowed):
        return None
    supported = ", ".join(_as_json(a) for a in allowed)
    return f"unsupported value {_as_json(value)}: supported values: {supported}"


def _bounds(schema: Schema, value: Any) -> str | None:
    if not _has_type(value, "number"):
        return None
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
        strictly = "" if schema.get("exclusiveMinimum") else " or equal to"
        return f"must be greater than{strictly} {low}, got {value}"
    if high is not None and (value >= high if schema.get("exclusiveMaximum") else value > high):
        strictly = "" if schema.get("exclusiveMaximum") else " or equal to"
        return f"must be less than{strictly} {high}, got {value}"
    step = schema.get("multipleOf")
    if step is not None and (value / step) % 1:
        return f"must be a multiple of {step}, got {value}"
    return None


def _counted(value: Any) -> tuple[int, str] | None:
    """How long a string, list or object is, and in what."""
    if isinstance(value, str):
        return len(value), "characters"  # code points: Go counts runes
    if isinstance(value, list):
        return len(value), "items"
    if isinstance(value, dict):
        return len(value), "properties"
    return None


# The length keywords of each JSON type (the same three checks, one wording).
_LENGTH_KEYWORDS = {
    "characters": ("minLength", "maxLength"),
    "items": ("minItems", "maxItems"),
    "properties": ("minProperties", "maxProperties"),
}


def _length(schema: Schema, value: Any) -> str | None:
    counted = _counted(value)
    if counted is None:
        return None
    size, unit = counted
    low_key, high_key = _LENGTH_KEYWORDS[unit]
    low, high = schema.get(low_key), schema.get(high_key)
    if low is not None and size < low:
        return f"must have at least {low} {unit}, has {size}"
    if high is not None and size > high:
        return f"must have at most {high} {unit}, has {size}"
    return None


@cache
def _regex(pattern: str) -> Any:
    return re2.compile(pattern)


def _pattern(schema: Schema, value: Any) -> str | None:
    pattern = schema.get("pattern")
    if pattern is None or not isinstance(value, str) or _regex(pattern).search(value):
        return None
    return f"must match the pattern {pattern!r}, got {value!r}"


_DATE_TIME = re.compile(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")
_UUID = re.compile(r"[0-9a-fA-F]{8}-?(?:[0-9a-fA-F]{4}-?){3}[0-9a-fA-F]{12}")


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except binascii.Error:
        return False
    return True


def _is_date_time(text: str) -> bool:
    if not _DATE_TIME.fullmatch(text):
        return False
    try:
        datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def _is_date(text: str) -> bool:
    try:
        return len(text) == 10 and bool(date.fromisoformat(text))
    except ValueError:
        return False


def _parses(parse: Callable[[str], object]) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            parse(text)
        except ValueError:
            return False
        return True

    return check


# The string formats checked (format -> whether a string is one).
_FORMATS: dict[str, Callable[[str], bool]] = {
    "byte": _is_base64,
    "date-time": _is_date_time,
    "date": _is_date,
    "ipv4": _parses(ipaddress.IPv4Address),
    "ipv6": _parses(ipaddress.IPv6Address),
    "cidr": _parses(lambda text: ipaddress.ip_network(text, strict=False)),
    "uuid": lambda text: bool(_UUID.fullmatch(text)),
}


def _format(schema: Schema, value: Any) -> str | None:
    check = _FORMATS.get(schema.get("format", ""))
    if check is None or not isinstance(value, str) or check(value):
        return None
    return f"must be a {schema['format']} string, got {value!r}"


def _list_type(schema: Schema, value: Any) -> str | None:
    """x-kubernetes-list-type set (unique items) and map (unique by the map keys)."""
    kind = schema.get("x-kubernetes-list-type")
    if kind not in ("set", "map") or not isinstance(value, list):
        return None
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen: set[str] = set()
    for item in value:
        identity = item if kind == "set" or not isinstance(item, dict) else _map_key(item, keys)
        text = _as_json(identity)
        if text in seen:
            return f"duplicate value: {text}"
        seen.add(text)
    return None


def _map_key(item: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    return {key: item.get(key) for key in keys}


_VALUE_CHECKS: tuple[Callable[[Schema, Any], str | None], ...] = (
    _enum,
    _bounds,
    _length,
    _pattern,
    _format,
    _list_type,
)


# ---------------------------------------------------------------- allOf, anyOf, oneOf, not


def _junctor_problems(schema: Schema, value: Any, path: Path) -> Iterator[Problem]:
    for sub in schema.get("allOf", ()):
        yield from problems(sub, value, path, prune=False)
    alternatives = schema.get("anyOf")
    if alternatives is not None and not any(matches(sub, value) for sub in alternatives):
        yield path, "must match at least one of the schemas in anyOf"
    alternatives = schema.get("oneOf")
    if alternatives is not None:
        matching = sum(matches(sub, value) for sub in alternatives)
        if matching != 1:
            yield path, _one_of_problem(alternatives, value, matching)
    if "not" in schema and matches(schema["not"], value):
        yield path, "must not match the schema in not"


def _one_of_problem(alternatives: list[Schema], value: Any, matching: int) -> str:
    """Protobuf oneofs become `oneOf: [{not: {anyOf: [required a, required b]}}, required a,
    required b]` in Istio's CRDs: name the fields."""
    fields = [
        sub["required"][0]
        for sub in alternatives
        if list(sub) == ["required"] and len(sub["required"]) == 1
    ]
    if fields and isinstance(value, dict):
        present = [f for f in fields if f in value]
        return f"may set only one of {', '.join(fields)}; sets {', '.join(present)}"
    return f"must match exactly one of the schemas in oneOf, matches {matching}"


# ---------------------------------------------------------------- fields


# Fields every embedded resource has beside its schema's (x-kubernetes-embedded-resource).
_RESOURCE_FIELDS = frozenset({"apiVersion", "kind", "metadata"})


def _field_problems(
    schema: Schema, value: dict[str, Any], path: Path, prune: bool
) -> Iterator[Problem]:
    for name in schema.get("required", ()):
        if name not in value:
            yield (*path, name), "required field is missing"
    known = schema.get("properties", {})
    each = schema.get("additionalProperties")
    keeps_unknown = (
        not prune or each is True or bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    )
    for key, item in value.items():
        sub = known.get(key, each if isinstance(each, dict) else None)
        if sub is not None:
            yield from problems(sub, item, (*path, key), prune=prune)
        elif not keeps_unknown and not (
            key in _RESOURCE_FIELDS and schema.get("x-kubernetes-embedded-resource")
        ):
            yield (*path, key), _unknown(key, known)


def _unknown(key: str, known: dict[str, Any]) -> str:
    hint = difflib.get_close_matches(key, list(known), n=1)
    if hint:
        return f"unknown field (did you mean {hint[0]!r}?): an apiserver would drop it"
    return "unknown field: an apiserver would drop it"
