"""Every rendered object is checked against Istio's schemas before anyone sees it.

The schemas come from PyPI's `cloudcoil-models-istio` (Apache-2.0): typed pydantic models
generated from Istio's CRDs. Its 1.31 release needs Python >= 3.14, so meshfn (3.11) uses 1.24.2.1:
objects valid there are valid on every Istio since 1.24. The models accept unknown fields (a
Kubernetes apiserver would silently prune them), so an object is also compared with what the
model kept: anything dropped is an unknown field, an error. Fields Istio added after 1.24 that
meshfn renders are checked by the small models below (Istio's API docs, version noted); the
tests check every golden object against the real Istio 1.31 CRDs too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import cache
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .core import Loc, Obj, object_id

SCHEMA_SOURCE = "cloudcoil-models-istio 1.24.2.1"


class SchemaError(ValueError):
    """A rendered object Istio would refuse: names the object and the schema path. A bug in the
    renderer, never the user's: nothing is written."""

    def __init__(self, obj: Obj, path: Loc, problem: str) -> None:
        kind, namespace, name = object_id(obj)
        self.object = f"{kind} {namespace}/{name}"
        self.path = ".".join(str(p) for p in path)
        super().__init__(f"{self.object}: {self.path}: {problem} (schema: {SCHEMA_SOURCE})")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RetryBudget(_Strict):
    """DestinationRule trafficPolicy.retryBudget (Istio 1.27)."""

    percent: Annotated[float, Field(ge=0, le=100)] | None = None
    minRetryConcurrency: Annotated[int, Field(ge=0, le=0xFFFFFFFF)] | None = None
    budgetInterval: str | None = None


class FormatterTag(_Strict):
    """Telemetry tracing customTags.<tag>.formatter (newer than 1.24; in Istio 1.31's CRD): an
    access-log substitution format."""

    value: Annotated[str, Field(min_length=1)]


# (kind, path) -> model, for fields newer than the packaged schemas. (The principal tag is the
# one meshfn renders with a formatter, in the one tracing entry of a sidecar's Telemetry.)
NEWER_FIELDS: dict[tuple[str, Loc], type[BaseModel]] = {
    ("DestinationRule", ("spec", "trafficPolicy", "retryBudget")): RetryBudget,
    (
        "Telemetry",
        ("spec", "tracing", 0, "customTags", "meshfn.principal", "formatter"),
    ): FormatterTag,
}


@cache
def _models() -> dict[str, type[BaseModel]]:
    from cloudcoil.models.istio.extensions import v1alpha1 as extensions
    from cloudcoil.models.istio.networking import v1 as networking
    from cloudcoil.models.istio.networking import v1alpha3 as networking_alpha
    from cloudcoil.models.istio.security import v1 as security
    from cloudcoil.models.istio.telemetry import v1 as telemetry

    return {
        "PeerAuthentication": security.PeerAuthentication,
        "RequestAuthentication": security.RequestAuthentication,
        "AuthorizationPolicy": security.AuthorizationPolicy,
        "DestinationRule": networking.DestinationRule,
        "ServiceEntry": networking.ServiceEntry,
        "WorkloadEntry": networking.WorkloadEntry,
        "Gateway": networking.Gateway,
        "VirtualService": networking.VirtualService,
        "EnvoyFilter": networking_alpha.EnvoyFilter,
        "WasmPlugin": extensions.WasmPlugin,
        "Telemetry": telemetry.Telemetry,
    }


def _pop(obj: Obj, path: Loc) -> Any:
    node: Any = obj
    for part in path[:-1]:
        if isinstance(node, list) and isinstance(part, int):
            node = node[part] if part < len(node) else None
        else:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None
    return node.pop(path[-1], None) if isinstance(node, dict) else None


def _dropped(given: Any, kept: Any, path: Loc) -> Iterator[Loc]:
    """Paths in `given` that the model's dump lacks (fields it does not know)."""
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return
        for key, value in given.items():
            if key not in kept:
                yield (*path, key)
            else:
                yield from _dropped(value, kept[key], (*path, key))
    elif isinstance(given, list) and isinstance(kept, list):
        for i, (a, b) in enumerate(zip(given, kept, strict=False)):
            yield from _dropped(a, b, (*path, i))


def validate(obj: Obj) -> None:
    """Raise SchemaError if Istio's schema refuses `obj` (an unknown field included)."""
    model = _models().get(obj.get("kind", ""))
    if model is None:
        raise SchemaError(obj, ("kind",), f"not a kind meshfn renders: {obj.get('kind')!r}")
    rest = copy.deepcopy(obj)
    for (kind, path), newer in NEWER_FIELDS.items():
        value = _pop(rest, path) if kind == obj["kind"] else None
        if value is not None:
            try:
                newer.model_validate(value)
            except ValidationError as exc:
                first = exc.errors(include_url=False)[0]
                raise SchemaError(obj, (*path, *first["loc"]), first["msg"]) from None
    try:
        parsed = model.model_validate(rest)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise SchemaError(obj, tuple(first["loc"]), first["msg"]) from None
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    for path in _dropped(rest, kept, ()):
        raise SchemaError(obj, path, "unknown field")
