"""The CEL rules (`x-kubernetes-validations`) of Istio's CRDs, evaluated on objects as a
kube-apiserver v1.25+ evaluates them on create. meshfn's own apiserver (v1.20) and jsonschema
ignore them, so without this a rendered object that istiod's CRDs refuse (`timeout: 0s`) passes
every other check.

    checker = CelChecker.from_file(crd_path)
    for failure in checker.check(obj):      # [] when every rule holds
        print(failure)                      # spec.http[0].timeout: must be a valid duration ...

What the apiserver does, and so what this does:

- A rule runs at its schema node for every value present there (absent or null: not run), with
  `self` bound to that value typed by the schema: object properties the schema does not know are
  pruned and the known ones escaped (`__namespace__`, `__dash__` ...), `number` values are
  doubles, `additionalProperties` maps keep their keys.
- A rule that is false fails with its `message` (or `failed rule: RULE`); one that errors or
  yields no bool fails too, with the error.
- Transition rules (those naming `oldSelf`) only run on update: they are skipped here and
  counted (`CelChecker.transition_rules`).
- Kubernetes' CEL libraries are provided where the rules use them: Go's `time.ParseDuration`
  for `duration()`, the URL library (`url`, `isURL`, `getScheme`, `getHost`, `getHostname`,
  `getPort`, `getEscapedPath`, `getQuery`, after Go's `net/url`), the strings extension
  (`substring`, `charAt`, `indexOf`, `lastIndexOf`, `lowerAscii`, `upperAscii`, `replace`,
  `split`, `join`, `trim`), and `size()` counting a string's code points. A rule calling any
  other function is unsupported: `check` raises `UnsupportedRule` naming it (never a silent
  pass), and `CelChecker.unsupported` lists every such rule of the file.

The engine is `common-expression-language` (Rust's cel-interpreter; import `cel.cel`: its
top-level package `cel` is shared with xds-protos' `cel.expr`). Its own `duration()` and `size()`
deviate from cel-go (no `µs`, accepts `1e3ms`; string size in bytes) and cannot be overridden,
so every function of the Kubernetes library above is bound under a `k8s_` name and each rule's
calls are renamed to it before compiling (outside string literals). Durations reach CEL as
`timedelta`s truncated to the microsecond: comparisons with whole-microsecond limits such as
`duration('1ms')` stay exact.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from cel.cel import Context, Program
from cel.cel import compile as cel_compile

__all__ = [
    "CelChecker",
    "Failure",
    "Rule",
    "UnsupportedRule",
    "evaluate",
    "go_duration_ns",
    "go_parse_request_uri",
    "go_url_parse",
]

_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UnsupportedRule(Exception):
    """A rule calls a function this checker does not provide (the apiserver would run it)."""


# ---------------------------------------------------------------- the rules and their failures


@dataclass(frozen=True)
class Rule:
    schema_path: str  # where the rule sits: spec.http[].timeout
    rule: str  # as written in the CRD
    message: str  # the CRD's message, or the apiserver's default
    program: Program | None  # None for unsupported and transition rules
    transition: bool  # names oldSelf: runs on update only, skipped here
    unsupported: tuple[str, ...]  # functions the rule calls that are not provided
    compile_error: str | None = None


@dataclass(frozen=True)
class Failure:
    path: str  # the object's field: spec.http[0].timeout
    message: str
    rule: str
    error: str | None = None  # the evaluation error, when the rule did not yield a bool

    def __str__(self) -> str:
        why = f" (evaluation error: {self.error})" if self.error else ""
        return f"{self.path}: {self.message}{why} [rule: {self.rule}]"


@dataclass
class _Node:
    rules: list[Rule] = field(default_factory=list)
    type: str | None = None
    properties: dict[str, _Node] | None = None
    items: _Node | None = None
    additional: _Node | None = None
    preserve_unknown: bool = False


# Operators, macros' helpers and standard functions the engine evaluates as cel-go does
# (tests/istio/test_istio_cel.py holds them to it).
_STANDARD = frozenset(
    {
        "!_",
        "-_",
        "_&&_",
        "_||_",
        "_==_",
        "_!=_",
        "_<_",
        "_<=_",
        "_>_",
        "_>=_",
        "_+_",
        "_-_",
        "_*_",
        "_/_",
        "_%_",
        "_?_:_",
        "_[_]",
        "@in",
        "@not_strictly_false",
        "contains",
        "startsWith",
        "endsWith",
        "matches",
        "int",
        "uint",
        "double",
        "string",
        "dyn",
    }
)


class CelChecker:
    """Every CEL rule of a set of CRDs, compiled once; `check(obj)` runs those of its kind."""

    def __init__(self, crds: Iterable[Mapping[str, Any]]) -> None:
        self._context = Context(functions=dict(_LIBRARY_FUNCTIONS))
        self._compiled: dict[str, Rule] = {}
        self.kinds: dict[tuple[str, str], _Node] = {}
        self.rules: list[Rule] = []
        for crd in crds:
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                api = f"{spec['group']}/{version['name']}"
                schema = version["schema"]["openAPIV3Schema"]
                self.kinds[(api, spec["names"]["kind"])] = self._node(schema, "")

    @classmethod
    def from_file(cls, path: Path) -> CelChecker:
        docs = yaml.load_all(path.read_text(), Loader=_LOADER)  # a safe loader (C when built)
        return cls(d for d in docs if d and d.get("kind") == "CustomResourceDefinition")

    @property
    def transition_rules(self) -> list[Rule]:
        return [r for r in self.rules if r.transition]

    @property
    def unsupported(self) -> list[Rule]:
        return [r for r in self.rules if r.unsupported or r.compile_error]

    def check(self, obj: Mapping[str, Any]) -> list[Failure]:
        """The failures of every rule of obj's kind (apiVersion + kind) on obj."""
        key = (obj["apiVersion"], obj["kind"])
        if key not in self.kinds:
            raise KeyError(f"no CRD serves {key[0]} {key[1]}")
        failures: list[Failure] = []
        self._walk(self.kinds[key], obj, "", failures)
        return failures

    def evaluations(self, obj: Mapping[str, Any]) -> list[tuple[str, Rule]]:
        """(field path, rule) of every rule check() runs on obj (transition rules excluded)."""
        found: list[tuple[str, Rule]] = []
        self._walk(self.kinds[(obj["apiVersion"], obj["kind"])], obj, "", None, found)
        return found

    # ------------------------------------------------------------------------ internals

    def _node(self, schema: Mapping[str, Any], path: str) -> _Node:
        node = _Node(
            type=schema.get("type"),
            preserve_unknown=bool(schema.get("x-kubernetes-preserve-unknown-fields")),
        )
        for validation in schema.get("x-kubernetes-validations", []):
            rule = self._rule(path or "<root>", validation)
            node.rules.append(rule)
            self.rules.append(rule)
        if isinstance(schema.get("properties"), Mapping):
            node.properties = {
                name: self._node(sub, f"{path}.{name}" if path else name)
                for name, sub in schema["properties"].items()
            }
        if isinstance(schema.get("items"), Mapping):
            node.items = self._node(schema["items"], f"{path}[]")
        if isinstance(schema.get("additionalProperties"), Mapping):
            node.additional = self._node(schema["additionalProperties"], f"{path}{{}}")
        for combinator in ("allOf", "anyOf", "oneOf", "not"):
            if _has_rules(schema.get(combinator)):
                raise UnsupportedRule(f"{path}: x-kubernetes-validations inside {combinator}")
        return node

    def _rule(self, schema_path: str, validation: Mapping[str, Any]) -> Rule:
        text = validation["rule"]
        message = validation.get("message") or f"failed rule: {text}"
        if "messageExpression" in validation:
            raise UnsupportedRule(f"{schema_path}: messageExpression is not supported ({text})")
        cached = self._compiled.get(text)
        if cached is not None:
            return dataclasses.replace(cached, schema_path=schema_path, message=message)
        try:
            program = cel_compile(_bind_library(text))
        except Exception as e:  # the apiserver refuses such a CRD
            rule = Rule(schema_path, text, message, None, False, (), f"{type(e).__name__}: {e}")
            self._compiled[text] = rule
            return rule
        refs = program.references()
        transition = "oldSelf" in refs["variables"]
        unsupported = tuple(
            sorted(f for f in refs["functions"] if f not in _STANDARD and f not in _LIBRARY_NAMES)
        )
        usable = None if transition or unsupported else program
        rule = Rule(schema_path, text, message, usable, transition, unsupported)
        self._compiled[text] = rule
        return rule

    def _walk(
        self,
        node: _Node,
        value: Any,
        path: str,
        failures: list[Failure] | None,
        found: list[tuple[str, Rule]] | None = None,
    ) -> None:
        if value is None:
            return
        if node.rules:
            self._apply_rules(node, value, path or "<root>", failures, found)
        if isinstance(value, Mapping):
            if node.properties is not None:
                for name, sub in value.items():
                    if name in node.properties:
                        where = f"{path}.{name}" if path else name
                        self._walk(node.properties[name], sub, where, failures, found)
            elif node.additional is not None:
                for key, sub in value.items():
                    self._walk(node.additional, sub, f"{path}[{key}]", failures, found)
        elif isinstance(value, list) and node.items is not None:
            for i, sub in enumerate(value):
                self._walk(node.items, sub, f"{path}[{i}]", failures, found)

    def _apply_rules(
        self,
        node: _Node,
        value: Any,
        where: str,
        failures: list[Failure] | None,
        found: list[tuple[str, Rule]] | None,
    ) -> None:
        """The node's own rules (not the transition rules) on `value`: listed into `found`,
        evaluated into `failures`."""
        bound = _typed(node, value)
        for rule in node.rules:
            if rule.transition:
                continue
            if found is not None:
                found.append((where, rule))
            if failures is not None:
                failure = self._evaluate(rule, bound, where)
                if failure is not None:
                    failures.append(failure)

    def _evaluate(self, rule: Rule, bound: Any, path: str) -> Failure | None:
        if rule.program is None:
            why = rule.compile_error or "calls " + ", ".join(rule.unsupported)
            raise UnsupportedRule(
                f"{path}: rule {rule.rule!r} at {rule.schema_path} cannot be evaluated here "
                f"({why}); add the function to meshfn.testing.istio_cel"
            )
        self._context.add_variable("self", bound)
        try:
            result = rule.program.execute(self._context)
        except Exception as e:
            return Failure(path, rule.message, rule.rule, f"{type(e).__name__}: {e}")
        if result is True:
            return None
        if result is False:
            return Failure(path, rule.message, rule.rule)
        return Failure(path, rule.message, rule.rule, f"the rule yielded {result!r}, not a bool")


def evaluate(expression: str, value: Any) -> Any:
    """One CEL expression on `self` = value, with the Kubernetes library bound (for tests)."""
    context = Context({"self": value}, dict(_LIBRARY_FUNCTIONS))
    return cel_compile(_bind_library(expression)).execute(context)


def _has_rules(schema: Any) -> bool:
    if isinstance(schema, Mapping):
        return "x-kubernetes-validations" in schema or any(_has_rules(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_rules(v) for v in schema)
    return False


# ------------------------------------------------------------------ `self` as the apiserver types it

_RESERVED = frozenset(
    {
        *("true", "false", "null", "in", "as", "break", "const", "continue", "else", "for"),
        *("function", "if", "import", "let", "loop", "package", "namespace", "return", "var"),
        *("void", "while"),
    }
)
_ESCAPABLE = re.compile(r"[a-zA-Z_.\-/][a-zA-Z0-9_.\-/]*")


def _escape(name: str) -> str | None:
    """A property name as CEL sees it (k8s.io/apiserver/pkg/cel Escape), None if inaccessible."""
    if name in _RESERVED:
        return f"__{name}__"
    if not _ESCAPABLE.fullmatch(name):
        return None
    return (
        name.replace("__", "__underscores__")
        .replace(".", "__dot__")
        .replace("-", "__dash__")
        .replace("/", "__slash__")
    )


def _typed(node: _Node, value: Any) -> Any:
    if isinstance(value, Mapping):
        if node.properties is not None:
            out = {}
            for name, sub in value.items():
                escaped = _escape(name)
                if sub is None or escaped is None:
                    continue
                if name in node.properties:
                    out[escaped] = _typed(node.properties[name], sub)
                elif node.preserve_unknown:
                    out[escaped] = sub
            return out
        if node.additional is not None:
            return {k: _typed(node.additional, v) for k, v in value.items() if v is not None}
        return dict(value)
    if isinstance(value, list):
        return [_typed(node.items, v) if node.items else v for v in value]
    if node.type == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# ------------------------------------------------------------------ Go's time.ParseDuration

_UNITS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # µs, MICRO SIGN
    "\u03bcs": 1_000,  # μs, GREEK SMALL LETTER MU
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_MAX = 1 << 63


# Over the size budget on purpose: a port of Go's time.ParseDuration kept statement for statement,
# to be read side by side with Go's source (split up, the correspondence would be lost).
def go_duration_ns(s: str) -> int:  # noqa: C901, PLR0912, PLR0915 (a port of Go's, as above)
    """Nanoseconds of a Go duration string, as time.ParseDuration (ValueError where Go errs)."""
    orig, neg, d = s, False, 0
    if s[:1] in ("-", "+"):
        neg, s = s[0] == "-", s[1:]
    if s == "0":
        return 0
    if not s:
        raise ValueError(f"time: invalid duration {orig!r}")
    while s:
        if not (s[0] == "." or s[0] in string.digits):
            raise ValueError(f"time: invalid duration {orig!r}")
        i = 0
        while i < len(s) and s[i] in string.digits:
            i += 1
        pre, v, s = i > 0, int(s[:i] or "0"), s[i:]
        if v > _MAX:
            raise ValueError(f"time: invalid duration {orig!r}")
        f, scale, post = 0, 1.0, False
        if s[:1] == ".":
            s = s[1:]
            i, overflow = 0, False
            while i < len(s) and s[i] in string.digits:
                if not overflow:  # Go drops the digits it cannot hold
                    y = f * 10 + int(s[i])
                    if f > (_MAX - 1) // 10 or y > _MAX:
                        overflow = True
                    else:
                        f, scale = y, scale * 10
                i += 1
            post, s = i > 0, s[i:]
        if not pre and not post:
            raise ValueError(f"time: invalid duration {orig!r}")
        i = 0
        while i < len(s) and not (s[i] == "." or s[i] in string.digits):
            i += 1
        if i == 0:
            raise ValueError(f"time: missing unit in duration {orig!r}")
        unit_name, s = s[:i], s[i:]
        if unit_name not in _UNITS:
            raise ValueError(f"time: unknown unit {unit_name!r} in duration {orig!r}")
        unit = _UNITS[unit_name]
        if v > _MAX // unit:
            raise ValueError(f"time: invalid duration {orig!r}")
        v *= unit
        if f > 0:
            v += int(float(f) * (float(unit) / scale))
            if v > _MAX:
                raise ValueError(f"time: invalid duration {orig!r}")
        d += v
        if d > _MAX:
            raise ValueError(f"time: invalid duration {orig!r}")
    if neg:
        return -d
    if d > _MAX - 1:
        raise ValueError(f"time: invalid duration {orig!r}")
    return d


def _duration(value: Any) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if not isinstance(value, str):
        raise TypeError(f"no such overload: duration({type(value).__name__})")
    # floor to the microsecond: exact against whole-microsecond limits
    return timedelta(microseconds=go_duration_ns(value) // 1000)


# ------------------------------------------------------------------ Go's net/url, as Kubernetes uses it

_SCHEME_CHARS = frozenset(string.ascii_letters + string.digits + "+-.")
_HOST_OK = frozenset(string.ascii_letters + string.digits + "-_.~!$&'()*+,;=:[]<>\"")
_USERINFO_OK = frozenset(string.ascii_letters + string.digits + "-._:~!$&'()*+,;=%@")
_PATH_OK = frozenset(string.ascii_letters + string.digits + "-_.~$&+,/:;=@")
_VALID_ENCODED_PATH = _PATH_OK | frozenset("!'()*[]%")
_HEX = frozenset(string.hexdigits)


@dataclass(frozen=True)
class GoURL:
    scheme: str = ""
    opaque: str = ""
    user: str | None = None
    host: str = ""
    path: str = ""
    raw_path: str = ""  # the path as written, when it is a valid encoding of path
    raw_query: str = ""
    fragment: str = ""

    @property
    def hostname(self) -> str:
        host, _ = _split_host_port(self.host)
        return host

    @property
    def port(self) -> str:
        _, port = _split_host_port(self.host)
        return port

    @property
    def escaped_path(self) -> str:
        raw = self.raw_path
        if raw and _valid_encoded_path(raw) and _unescape(raw, "path") == self.path:
            return raw
        if self.path == "*":
            return "*"
        return _escape_path(self.path)

    def query(self) -> dict[str, list[str]]:
        """url.Values of the query: malformed pairs are dropped, as Go's Query() does."""
        out: dict[str, list[str]] = {}
        for part in self.raw_query.split("&"):
            if not part or ";" in part:
                continue
            key, _, val = part.partition("=")
            try:
                k, v = _unescape(key, "query"), _unescape(val, "query")
            except ValueError:
                continue
            out.setdefault(k, []).append(v)
        return out


def _split_host_port(host: str) -> tuple[str, str]:
    colon = host.rfind(":")
    port = ""
    if colon != -1 and _valid_optional_port(host[colon:]):
        host, port = host[:colon], host[colon + 1 :]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def _valid_optional_port(port: str) -> bool:
    return port == "" or (port[0] == ":" and all(c in string.digits for c in port[1:]))


def _unescape(s: str, mode: str) -> str:
    """net/url unescape: ValueError on a bad %-escape (or a bad host character)."""
    raw = s.encode()
    out = bytearray()
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == ord("%"):
            if i + 2 >= len(raw):
                raise ValueError(f"invalid URL escape {raw[i:].decode(errors='replace')!r}")
            a, b = chr(raw[i + 1]), chr(raw[i + 2])
            if a not in _HEX or b not in _HEX:
                raise ValueError(f"invalid URL escape {raw[i : i + 3].decode(errors='replace')!r}")
            if mode == "host" and int(a, 16) < 8 and raw[i : i + 3] != b"%25":
                raise ValueError(f"invalid URL escape {raw[i : i + 3].decode()!r}")
            out.append(int(a + b, 16))
            i += 3
            continue
        if mode == "host" and c < 0x80 and chr(c) not in _HOST_OK:
            raise ValueError(f"invalid character {chr(c)!r} in host name")
        out.append(ord(" ") if mode == "query" and c == ord("+") else c)
        i += 1
    return out.decode(errors="surrogateescape")


def _escape_path(path: str) -> str:
    return "".join(
        chr(b) if chr(b) in _PATH_OK else f"%{b:02X}" for b in path.encode(errors="surrogateescape")
    )


def _valid_encoded_path(s: str) -> bool:
    return all(c in _VALID_ENCODED_PATH or ord(c) >= 0x80 for c in s)


# Over the size budget on purpose: a port of Go's net/url parse, statement for statement.
def _go_parse(raw: str, via_request: bool) -> GoURL:  # noqa: C901, PLR0912 (a port of Go's)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in raw):
        raise ValueError("net/url: invalid control character in URL")
    if raw == "" and via_request:
        raise ValueError("empty url")
    if raw == "*":
        return GoURL(path="*")
    scheme, rest = "", raw
    for i, c in enumerate(raw):
        if c == ":":
            if i == 0:
                raise ValueError("missing protocol scheme")
            scheme, rest = raw[:i].lower(), raw[i + 1 :]
            break
        if c not in _SCHEME_CHARS or (i == 0 and c not in string.ascii_letters):
            break
    raw_query = ""
    if rest.endswith("?") and rest.count("?") == 1:
        rest = rest[:-1]
    else:
        rest, _, raw_query = rest.partition("?")
    if not rest.startswith("/"):
        if scheme:
            return GoURL(scheme=scheme, opaque=rest, raw_query=raw_query)
        if via_request:
            raise ValueError("invalid URI for request")
        if ":" in rest.partition("/")[0]:
            raise ValueError("first path segment in URL cannot contain colon")
    user, host = None, ""
    if (scheme or (not via_request and not rest.startswith("///"))) and rest.startswith("//"):
        authority, slash, tail = rest[2:].partition("/")
        rest = slash + tail
        at = authority.rfind("@")
        host = _parse_host(authority[at + 1 :])
        if at >= 0:
            user = authority[:at]
            if not all(c in _USERINFO_OK or ord(c) >= 0x80 for c in user):
                raise ValueError("net/url: invalid userinfo")
            _unescape(user, "userinfo")
    path = _unescape(rest, "path")
    raw_path = rest if _escape_path(path) != rest else ""
    return GoURL(scheme, "", user, host, path, raw_path, raw_query)


def _parse_host(host: str) -> str:
    if host.startswith("["):
        close = host.rfind("]")
        if close < 0:
            raise ValueError("missing ']' in host")
        if not _valid_optional_port(host[close + 1 :]):
            raise ValueError(f"invalid port {host[close + 1 :]!r} after host")
        zone = host.find("%25", 0, close)
        if zone >= 0:
            return (
                _unescape(host[:zone], "host")
                + _unescape(host[zone:close], "zone")
                + _unescape(host[close:], "host")
            )
    else:
        colon = host.rfind(":")
        if colon != -1 and not _valid_optional_port(host[colon:]):
            raise ValueError(f"invalid port {host[colon:]!r} after host")
    return _unescape(host, "host")


def go_parse_request_uri(raw: str) -> GoURL:
    """url.ParseRequestURI: an absolute URI or an absolute path, no fragment split."""
    return _go_parse(raw, via_request=True)


def go_url_parse(raw: str) -> GoURL:
    """url.Parse (fragment split off and checked)."""
    rest, hash_, frag = raw.partition("#")
    url = _go_parse(rest, via_request=False)
    if hash_:
        _unescape(frag, "fragment")
        url = dataclasses.replace(url, fragment=frag)
    return url


_URL_TAG = "@k8s.url"


def _url(value: Any) -> dict[str, Any]:
    """Kubernetes' url(): checked with ParseRequestURI, then parsed with Parse."""
    if not isinstance(value, str):
        raise TypeError(f"no such overload: url({type(value).__name__})")
    try:
        go_parse_request_uri(value)
        u = go_url_parse(value)
    except ValueError as e:
        raise ValueError(f"URL parse error during conversion from string: {e}") from None
    return {
        _URL_TAG: True,
        "scheme": u.scheme,
        "host": u.host,
        "hostname": u.hostname,
        "port": u.port,
        "escapedPath": u.escaped_path,
        "query": u.query(),
    }


def _is_url(value: Any) -> bool:
    if not isinstance(value, str):
        raise TypeError(f"no such overload: isURL({type(value).__name__})")
    try:
        go_parse_request_uri(value)
    except ValueError:
        return False
    return True


def _url_getter(name: str) -> Callable[[Any], Any]:
    def get(u: Any) -> Any:
        if not (isinstance(u, dict) and u.get(_URL_TAG) is True):
            raise TypeError(f"no such overload: {type(u).__name__}.get...() (not a URL)")
        return u[name]

    return get


# ------------------------------------------------------------------ strings extension, size()


def _str(value: Any, fn: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"no such overload: {fn} on {type(value).__name__}")
    return value


def _int(value: Any, fn: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"no such overload: {fn} with {type(value).__name__}")
    return value


def _substring(s: Any, start: Any, end: Any = None) -> str:
    text = _str(s, "substring")
    b = _int(start, "substring")
    e = len(text) if end is None else _int(end, "substring")
    if b < 0 or b > len(text):
        raise IndexError(f"index out of range: {b}")
    if e < 0 or e > len(text):
        raise IndexError(f"index out of range: {e}")
    if b > e:
        raise IndexError(f"invalid substring range. start: {b}, end: {e}")
    return text[b:e]


def _char_at(s: Any, i: Any) -> str:
    text, n = _str(s, "charAt"), _int(i, "charAt")
    if n < 0 or n > len(text):
        raise IndexError(f"index out of range: {n}")
    return text[n : n + 1]


def _index_of(s: Any, sub: Any, offset: Any = 0) -> int:
    text, needle, off = _str(s, "indexOf"), _str(sub, "indexOf"), _int(offset, "indexOf")
    if off < 0 or off > len(text):
        raise IndexError(f"index out of range: {off}")
    return text.find(needle, off)


def _last_index_of(s: Any, sub: Any, offset: Any = None) -> int:
    text, needle = _str(s, "lastIndexOf"), _str(sub, "lastIndexOf")
    off = len(text) if offset is None else _int(offset, "lastIndexOf")
    if off < 0 or off > len(text):
        raise IndexError(f"index out of range: {off}")
    return text.rfind(needle, 0, off + len(needle))


def _ascii_case(upper: bool) -> Callable[[Any], str]:
    def convert(s: Any) -> str:
        text = _str(s, "upperAscii" if upper else "lowerAscii")
        table = str.maketrans(
            string.ascii_lowercase + string.ascii_uppercase,
            string.ascii_uppercase * 2 if upper else string.ascii_lowercase * 2,
        )
        return text.translate(table)

    return convert


def _replace(s: Any, old: Any, new: Any, n: Any = -1) -> str:
    count = _int(n, "replace")
    return _str(s, "replace").replace(_str(old, "replace"), _str(new, "replace"), count)


def _split(s: Any, sep: Any, n: Any = -1) -> list[str]:
    text, separator, count = _str(s, "split"), _str(sep, "split"), _int(n, "split")
    if count == 0:
        return []
    if separator == "":
        chars = list(text)
        return (
            chars if count < 0 or count >= len(chars) else [*chars[: count - 1], text[count - 1 :]]
        )
    return text.split(separator, count - 1 if count > 0 else -1)


def _join(items: Any, sep: Any = "") -> str:
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise TypeError("no such overload: join on a non list(string)")
    return _str(sep, "join").join(items)


_TRIM = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())


def _trim(s: Any) -> str:
    return _str(s, "trim").strip(_TRIM)


def _size(value: Any) -> int:
    """size(): code points of a string (the engine's own counts bytes), bytes, list, map."""
    if isinstance(value, str | bytes | list | dict):
        return len(value)
    raise TypeError(f"no such overload: size({type(value).__name__})")


_LIBRARY: dict[str, Callable[..., Any]] = {
    "duration": _duration,
    "size": _size,
    "url": _url,
    "isURL": _is_url,
    "getScheme": _url_getter("scheme"),
    "getHost": _url_getter("host"),
    "getHostname": _url_getter("hostname"),
    "getPort": _url_getter("port"),
    "getEscapedPath": _url_getter("escapedPath"),
    "getQuery": _url_getter("query"),
    "substring": _substring,
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "lowerAscii": _ascii_case(upper=False),
    "upperAscii": _ascii_case(upper=True),
    "replace": _replace,
    "split": _split,
    "join": _join,
    "trim": _trim,
}
_PREFIX = "k8s_"
_LIBRARY_FUNCTIONS = {_PREFIX + name: fn for name, fn in _LIBRARY.items()}
_LIBRARY_NAMES = frozenset(_LIBRARY_FUNCTIONS)

# A string literal (kept as is) or a called identifier (renamed when the library provides it).
_TOKENS = re.compile(
    r"""(?P<string>[rRbB]{0,2}(?:'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"|'(?:\\.|[^\\'\n])*'|"(?:\\.|[^\\"\n])*"))"""
    r"""|(?P<call>(?<![\w])[A-Za-z_]\w*)(?=\s*\()""",
    re.DOTALL,
)


def _bind_library(rule: str) -> str:
    """The rule with its calls of library functions renamed to the k8s_ bindings."""

    def rename(m: re.Match[str]) -> str:
        name = m.group("call")
        return _PREFIX + name if name is not None and name in _LIBRARY else m.group(0)

    return _TOKENS.sub(rename, rule)
