"""One YAML document -> one typed policy object, or errors that name file, line and field."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from meshfn.contracts.principals import REQUEST_PRINCIPAL

from .errors import PolicyError, object_ref
from .model import KINDS, PolicyObject
from .source import Document, Loc

if TYPE_CHECKING:
    from meshfn import ir

from .types import (
    API_VERSION,
    CONDITION_KEY,
    DNS_LABEL,
    HEADER_NAME,
    HOST,
    HTTP_PATH,
    NAMESPACE_MATCH,
    OBJECT_REF,
    PATH_PATTERN,
    PRINCIPAL,
    TRUST_DOMAIN,
)

PATTERN_HELP = {
    DNS_LABEL: "must be a lowercase DNS label (a-z, 0-9, '-'; alphanumeric at both ends)",
    TRUST_DOMAIN: "must be a trust domain (lowercase letters, digits, '-', '.', '_')",
    HOST: 'must be a host name such as "api.example.com", "*.example.com" or "*"',
    HEADER_NAME: "must be an HTTP header name",
    HTTP_PATH: "must start with '/'",
    OBJECT_REF: 'must be "name" or "namespace/name"',
    PRINCIPAL: 'must be a principal such as "td.local/ns/default/sa/web", "*", or one with a '
    "leading or trailing *",
    NAMESPACE_MATCH: 'must be a namespace, "*", or a prefix ending in *',
    REQUEST_PRINCIPAL: 'must be "<issuer>/<subject>", "<issuer>/*" or "*"',
    PATH_PATTERN: 'must be "/exact", "/prefix*", "*suffix" or "*"',
    CONDITION_KEY: "must be request.auth.claims[NAME], request.auth.principal, "
    "request.auth.audiences, source.principal, source.namespace or request.headers[NAME]",
}


@dataclass(frozen=True)
class Loaded:
    """A valid policy object and the document it came from (for error lines later on).

    `lowered` is the object's own piece of IR (a Service or a Route), computed once when its
    file is loaded, so reloads after a one-file change do not rebuild the rest of the mesh."""

    doc: Document
    obj: PolicyObject
    lowered: ir.Service | ir.Route | ir.Function | None = field(
        default=None, compare=False, repr=False
    )
    # Plain copies of the identity: read on every reload for every object, where pydantic
    # attribute access adds up.
    kind: str = field(init=False, compare=False)
    namespace: str = field(init=False, compare=False)
    name: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", self.obj.kind)
        object.__setattr__(self, "namespace", getattr(self.obj.metadata, "namespace", ""))
        object.__setattr__(self, "name", self.obj.metadata.name)

    @property
    def ref(self) -> str:
        return object_ref(self.kind, self.namespace, self.name)

    def error(self, loc: Loc, message: str) -> PolicyError:
        return self.doc.error(loc, message)


def where(item: Loaded, loc: Loc = ()) -> str:
    """`file:line` of `loc` in the item's document (or of its closest ancestor), for messages
    that point at a counterpart."""
    line = item.doc.line_of(loc)
    return f"{item.doc.file}:{line}" if line > 0 else item.doc.file  # custom resources: no line


def validate_document(doc: Document) -> Loaded | list[PolicyError]:
    data = doc.data
    if not isinstance(data, dict):
        return [
            doc.error((), "a policy document is a mapping with apiVersion, kind, metadata, spec")
        ]
    errors: list[PolicyError] = []
    api = data.get("apiVersion")
    if api is None:
        errors.append(doc.error(("apiVersion",), f"required field is missing ({API_VERSION})"))
    elif api != API_VERSION:
        errors.append(
            doc.error(
                ("apiVersion",), f"unsupported apiVersion {api!r}; meshfn reads {API_VERSION}"
            )
        )
    kind = data.get("kind")
    model = KINDS.get(kind) if isinstance(kind, str) else None
    if kind is None:
        errors.append(doc.error(("kind",), "required field is missing"))
    elif model is None:
        known = ", ".join(sorted(KINDS))
        errors.append(doc.error(("kind",), f"unknown kind {kind!r}; known kinds: {known}"))
    if errors or model is None:
        return errors
    try:
        obj = model.model_validate(data)
    except ValidationError as exc:
        return [_to_policy_error(doc, model, err) for err in exc.errors(include_url=False)]
    return Loaded(doc=doc, obj=obj)


def _to_policy_error(doc: Document, model: type[BaseModel], err: Any) -> PolicyError:
    loc: Loc = tuple(p for p in err["loc"] if isinstance(p, int) or not _is_tag(p))
    kind = err["type"]
    message: str = err["msg"]
    if kind == "extra_forbidden":
        # the unknown key is the last part of the location, whatever it looks like (a key such
        # as "spec:[x" must not be taken for a pydantic tag: fuzz finding policy-key-like-a-tag)
        parents = tuple(p for p in err["loc"][:-1] if isinstance(p, int) or not _is_tag(p))
        loc = (*parents, err["loc"][-1])
        field = str(loc[-1])
        allowed = _fields_at(model, loc[:-1])
        hint = difflib.get_close_matches(field, allowed, n=1)
        message = f"unknown field {field!r}"
        if hint:
            message += f" (did you mean {hint[0]!r}?)"
        elif allowed:
            message += f"; allowed: {', '.join(sorted(allowed))}"
    elif kind == "string_pattern_mismatch":
        described = PATTERN_HELP.get(err.get("ctx", {}).get("pattern", ""))
        if described:
            message = f"{described}, got {err['input']!r}"
    elif kind == "missing":
        message = "required field is missing"
    elif message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    elif "input" in err and kind.endswith("_type"):
        message = f"{message}, got {_describe(err['input'])}"
    return doc.error(loc, message)


def _is_tag(part: str) -> bool:
    """Pydantic puts union/validator tags such as 'function-after[...]' or 'list[...]' in locs."""
    return "[" in part or part in ("str", "int", "bool", "float", "none", "literal")


# How an error message names the value it got, by type: the first that matches (bool before int).
_VALUE_NAMES: tuple[tuple[type | types.UnionType, str], ...] = (
    (type(None), "null"),
    (bool, "a boolean"),
    (int | float, "the number {value}"),
    (str, "the string {value!r}"),
    (list, "a list"),
    (dict, "a mapping"),
)


def _describe(value: object) -> str:
    for kind, name in _VALUE_NAMES:
        if isinstance(value, kind):
            return name.format(value=value)
    return type(value).__name__


def _fields_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The field names a model accepts at `loc`, to suggest a fix for a misspelt field."""
    annotation: Any = model
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(part, int):
            args = typing.get_args(annotation)
            annotation = args[0] if args else Any
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            info = annotation.model_fields.get(part)
            if info is None:
                return []
            annotation = info.annotation
        else:
            return []
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(options) != 1:
                return annotation
            annotation = options[0]
        else:
            return annotation
