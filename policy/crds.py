"""CustomResourceDefinitions for every meshfn kind, generated from the pydantic policy models.

One source of truth: the models that `meshfn validate` uses are turned into structural OpenAPI v3
schemas (no $ref, a type on every node, Optional as nullable), so the apiserver rejects malformed
objects with a 422 before meshfn sees them. What a schema cannot say (cross-field rules, RE2
syntax, references between objects) the policy source checks and reports in the object's status.

Every object keeps unknown fields (`x-kubernetes-preserve-unknown-fields`) instead of letting the
apiserver prune them: a misspelt field then reaches the strict model and comes back as
"unknown field 'mtsl' (did you mean 'mtls'?)" in the status, where pruning would drop it silently
and leave the default (maybe a weaker one) in force. Defaults stay in the models and are quoted
in the descriptions, so `kubectl explain` shows them and stored objects stay as the user wrote them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from meshfn.contracts.durations import format_duration
from meshfn.contracts.kube import BY_KIND, CATEGORY, GROUP, KINDS, VERSION, Kind

from .model import KINDS as MODELS

# Formats the apiserver knows (k8s.io/kube-openapi/pkg/validation/strfmt); others are dropped.
_KNOWN_FORMATS = {
    "int32", "int64", "float", "double", "byte", "binary", "date", "date-time", "password",
    "uri", "email", "hostname", "ipv4", "ipv6", "cidr", "mac", "uuid", "duration",
}  # fmt: skip
_DROPPED = {"title", "default", "propertyNames", "$schema", "$id", "examples"}
_ISO_DURATION = re.compile(r"^P(?:\d|T)")
_timedelta = TypeAdapter(timedelta)

# Extra `kubectl get` columns per kind (every kind also gets Accepted, Reason and Age).
_COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "Mesh": [("Trust Domain", "string", ".spec.trustDomain")],
    "Gateway": [],
    "Service": [("Port", "integer", ".spec.port"), ("Protocol", "string", ".spec.protocol")],
    "Route": [("Destination", "string", ".spec.destination.service")],
    "Function": [("Backend", "string", ".spec.backend"), ("Artifact", "string", ".spec.artifact")],
    "PeerAuthentication": [("Mode", "string", ".spec.mtls.mode")],
    "RequestAuthentication": [],
    "AuthorizationPolicy": [("Action", "string", ".spec.action")],
    "FallbackPolicy": [("Service", "string", ".spec.service")],
    "QoSPolicy": [("Default Class", "string", ".spec.defaultClass")],
}


class SchemaError(ValueError):
    """The model uses a construct a structural schema cannot express (fix the generator)."""


def _default_text(value: Any) -> str:
    if isinstance(value, str) and _ISO_DURATION.match(value):
        return format_duration(_timedelta.validate_python(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict) and not value:
        return "empty"
    if isinstance(value, list | dict):
        return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return str(value)


def structural(node: dict[str, Any], defs: dict[str, Any], path: str = "") -> dict[str, Any]:
    """One pydantic JSON Schema node -> a structural OpenAPI v3 node (recursively)."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs, path)
    if "anyOf" in node:
        return _nullable(node, defs, path)
    out: dict[str, Any] = {}
    description = _description(node)
    if description:
        out["description"] = " ".join(description.split())
    if "const" in node:
        out["enum"] = [node["const"]]
    for key, value in node.items():
        if key not in _DROPPED and key not in ("description", "const", "$defs"):
            out.update(_KEYWORDS.get(key, _as_is)(key, value, defs, path))
    if "type" not in out:
        if "enum" in out and all(isinstance(v, str) for v in out["enum"]):
            out["type"] = "string"
        else:
            raise SchemaError(f"{path or '.'}: no type (structural schemas need one on every node)")
    # type and description first: the files are read by people too
    return {
        "type": out.pop("type"),
        **({"description": out.pop("description")} if "description" in out else {}),
        **out,
    }


def _nullable(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    """`X | None` (pydantic's anyOf with null): X, nullable. Other unions have no structural
    schema."""
    options = [o for o in node["anyOf"] if o != {"type": "null"}]
    if len(options) != 1:
        raise SchemaError(f"{path or '.'}: a union of several types has no structural schema")
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    inner = structural({**options[0], **outer}, defs, path)
    if len(options) < len(node["anyOf"]):
        inner["nullable"] = True
    return inner


def _description(node: dict[str, Any]) -> str:
    """The field's description, with its default quoted (defaults stay in the models)."""
    description: str = node.get("description", "")
    if "default" in node and node["default"] is not None:
        default = f"Default: {_default_text(node['default'])}."
        description = f"{description.rstrip('.')}. {default}" if description else default
    return description


# One JSON Schema keyword -> what it becomes in a structural schema (the keywords not listed stay
# as they are): (keyword, value, defs, path) -> keywords of the structural node.
_Keyword = Callable[[str, Any, dict[str, Any], str], dict[str, Any]]


def _as_is(key: str, value: Any, defs: dict[str, Any], path: str) -> dict[str, Any]:
    return {key: value}


def _properties(key: str, value: Any, defs: dict[str, Any], path: str) -> dict[str, Any]:
    return {key: {name: structural(sub, defs, f"{path}.{name}") for name, sub in value.items()}}


def _items(key: str, value: Any, defs: dict[str, Any], path: str) -> dict[str, Any]:
    return {key: structural(value, defs, f"{path}[]")}


def _pattern_properties(key: str, value: Any, defs: dict[str, Any], path: str) -> dict[str, Any]:
    """Keys with a pattern (portLevelMtls ports): structural schemas have no patternProperties;
    the value schema stays, the model checks the keys."""
    (value_schema,) = value.values()
    return {"additionalProperties": structural(value_schema, defs, f"{path}{{}}")}


def _additional_properties(key: str, value: Any, defs: dict[str, Any], path: str) -> dict[str, Any]:
    """A map's value schema; `false` (a closed model) keeps unknown fields for the strict model
    to report (the module docstring says why)."""
    if value is False:
        return {"x-kubernetes-preserve-unknown-fields": True}
    if isinstance(value, dict):
        return {key: structural(value, defs, f"{path}{{}}")}
    return {}


def _exclusive_bound(key: str, value: Any, defs: dict[str, Any], path: str) -> dict[str, Any]:
    """JSON Schema's numeric exclusive bound -> OpenAPI v3.0's bound with a boolean flag."""
    return {"minimum" if key == "exclusiveMinimum" else "maximum": value, key: True}


def _format(key: str, value: Any, defs: dict[str, Any], path: str) -> dict[str, Any]:
    return {key: value} if value in _KNOWN_FORMATS else {}


_KEYWORDS: dict[str, _Keyword] = {
    "properties": _properties,
    "items": _items,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "exclusiveMinimum": _exclusive_bound,
    "exclusiveMaximum": _exclusive_bound,
    "format": _format,
}


def _status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string", "description": "Accepted or Invalid"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {
                "type": "string",
                "description": "the same lines `meshfn validate` prints: field: problem",
            },
            "observedGeneration": {"type": "integer"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
        },
    }
    resource = {
        "type": "object",
        "properties": {k: {"type": "string"} for k in ("apiVersion", "kind", "namespace", "name")},
    }
    return {
        "type": "object",
        "description": "Written by the meshfn controller (the leader replica) only.",
        "properties": {
            "observedGeneration": {
                "type": "integer",
                "description": "the metadata.generation the conditions describe",
            },
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "resources": {
                "type": "array",
                "description": "the Kubernetes objects rendered from this object (they carry an "
                "owner reference to it and are garbage-collected with it)",
                "items": resource,
            },
        },
    }


def object_schema(kind: str) -> dict[str, Any]:
    """The structural schema of one kind's custom resource (apiVersion, kind, metadata, spec,
    status)."""
    model = MODELS[kind]
    schema = model.model_json_schema(mode="validation", by_alias=True)
    defs = schema.get("$defs", {})
    spec = structural(schema["properties"]["spec"], defs, ".spec")
    return {
        "type": "object",
        "description": f"meshfn {kind} policy (the same document `meshfn validate` reads).",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": _status_schema(),
        },
    }


def crd(info: Kind) -> dict[str, Any]:
    columns = [
        {
            "name": "Accepted",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Accepted")].status',
        },
        {
            "name": "Reason",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Accepted")].reason',
        },
    ]
    columns += [{"name": n, "type": t, "jsonPath": p} for n, t, p in _COLUMNS[info.kind]]
    columns.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": info.crd_name,
            "labels": {"app.kubernetes.io/name": "meshfn", "app.kubernetes.io/part-of": "meshfn"},
        },
        "spec": {
            "group": GROUP,
            "scope": info.scope,
            "names": {
                "kind": info.kind,
                "listKind": f"{info.kind}List",
                "plural": info.plural,
                "singular": info.kind.lower(),
                "shortNames": [info.short],
                "categories": [CATEGORY],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": object_schema(info.kind)},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """No &anchors/*aliases for values the schema shares between fields: people read these."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


HEADER = "# Generated from meshfn's policy models by `meshfn kube crds`; do not edit.\n"


def rendered() -> dict[str, str]:
    """file name -> YAML text of every CRD, exactly as written to manifests/crds/."""
    missing = set(MODELS) ^ set(BY_KIND)
    if missing:
        raise SchemaError(f"policy kinds and CRD names disagree on: {', '.join(sorted(missing))}")
    return {
        f"{info.crd_name}.yaml": HEADER
        + yaml.dump(crd(info), Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
        for info in KINDS
    }


def export(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    files = rendered()
    for stale in directory.glob(f"*.{GROUP}.yaml"):
        if stale.name not in files:
            stale.unlink()
    written = []
    for name, text in files.items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
