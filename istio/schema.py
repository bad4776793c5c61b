"""Every rendered object is checked against Istio's own CRDs before anyone sees it.

The schemas are the openAPIV3Schema of each served version in Istio 1.31's CRDs, vendored once in
istio/crds/ (with their licence; package data of meshfn.istio, so an installed meshfn has them):
the same copy the tests install on a kube-apiserver and evaluate the CEL rules of. An object is
checked as an apiserver checks it against a structural schema, except that what the apiserver
would prune silently (an unknown field, a null the schema does not allow) is refused
(meshfn.istio.structural says what is checked). Its metadata is checked against Kubernetes'
ObjectMeta, which an apiserver prunes the same way.

The CRDs are read lazily, once per process: the first validation parses the YAML (libyaml's C
parser, ~0.25 s) into an index of the schemas without their descriptions and CEL rules. Nothing is
written anywhere: the renderer stays pure (a cached index on disk saved ~0.2 s per CLI run, not
worth a renderer that writes files).
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import yaml

from .core import Loc, Obj
from .structural import Schema, problems

ISTIO_VERSION = "1.31"
SCHEMA_SOURCE = f"Istio {ISTIO_VERSION} CRDs"
# The vendored bundle with its licence and version (istio/crds/README.md): the one copy, which
# the tests read too.
CRDS_DIR = files("meshfn.istio") / "crds"
CRDS = CRDS_DIR / "crd-all.gen.yaml"
Index = dict[str, dict[str, Schema]]  # kind -> apiVersion -> openAPIV3Schema


class SchemaError(ValueError):
    """A rendered object Istio would refuse: names the object and the schema path. A bug in the
    renderer, never the user's: nothing is written."""

    def __init__(self, obj: Obj, path: Loc, problem: str) -> None:
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        self.object = f"{obj.get('kind')} {meta.get('namespace', '')}/{meta.get('name')}"
        self.path = ".".join(str(p) for p in path)
        super().__init__(f"{self.object}: {self.path}: {problem} (schema: {SCHEMA_SOURCE})")


def validate(obj: Obj) -> None:
    """Raise SchemaError if Istio's CRDs refuse `obj`, or an apiserver would prune part of it
    (an unknown field included)."""
    schema = _object_schema(obj)
    for path, problem in problems(schema, obj):
        raise SchemaError(obj, path, problem)


def _object_schema(obj: Obj) -> Schema:
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    versions = index().get(kind) if isinstance(kind, str) else None
    if versions is None:
        raise SchemaError(obj, ("kind",), f"not a kind Istio's CRDs define: {kind!r}")
    if api_version not in versions:
        served = ", ".join(sorted(versions))
        raise SchemaError(
            obj, ("apiVersion",), f"{kind} is not served as {api_version!r} (served: {served})"
        )
    return _with_object_fields(kind, api_version)


@cache
def _with_object_fields(kind: str, api_version: str) -> Schema:
    """The CRD's schema with what every object has beside it: apiVersion, kind, metadata."""
    schema = index()[kind][api_version]
    fields = {
        "apiVersion": {"type": "string", "enum": [api_version]},
        "kind": {"type": "string", "enum": [kind]},
        "metadata": OBJECT_META,
    }
    return {**schema, "properties": {**schema.get("properties", {}), **fields}}


_STRING: Schema = {"type": "string"}
_STRING_MAP: Schema = {"type": "object", "additionalProperties": _STRING}
_INT64: Schema = {"type": "integer", "format": "int64"}
_TIMESTAMP: Schema = {"type": "string", "format": "date-time", "nullable": True}
# Kubernetes' ObjectMeta (k8s.io/apimachinery/pkg/apis/meta/v1) as a structural schema: a CRD's
# schema leaves metadata to the apiserver, which keeps only these fields.
OBJECT_META: Schema = {
    "type": "object",
    "properties": {
        "name": _STRING,
        "generateName": _STRING,
        "namespace": _STRING,
        "selfLink": _STRING,
        "uid": _STRING,
        "resourceVersion": _STRING,
        "generation": _INT64,
        "creationTimestamp": _TIMESTAMP,
        "deletionTimestamp": _TIMESTAMP,
        "deletionGracePeriodSeconds": _INT64,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "ownerReferences": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["apiVersion", "kind", "name", "uid"],
                "properties": {
                    "apiVersion": _STRING,
                    "kind": _STRING,
                    "name": _STRING,
                    "uid": _STRING,
                    "controller": {"type": "boolean"},
                    "blockOwnerDeletion": {"type": "boolean"},
                },
            },
        },
        "finalizers": {"type": "array", "items": _STRING},
        "managedFields": {
            "type": "array",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    },
}


# ---------------------------------------------------------------- the CRDs, read once


@cache
def index() -> Index:
    """Every served version's schema by kind and apiVersion, parsed from the vendored YAML."""
    return build_index(CRDS.read_bytes())


def build_index(text: bytes) -> Index:
    """The index of a CRD bundle: kind -> apiVersion -> openAPIV3Schema of each served version,
    pruned to what validation reads."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~8x the pure parser
    out: Index = {}
    for doc in yaml.load_all(text, Loader=loader):
        if not doc:
            continue
        spec = doc["spec"]
        versions = out.setdefault(spec["names"]["kind"], {})
        for version in spec["versions"]:
            if version.get("served", True):
                schema = version["schema"]["openAPIV3Schema"]
                versions[f"{spec['group']}/{version['name']}"] = _pruned(schema)
    return out


# Keywords validation never reads: documentation, and CEL rules (the tests evaluate those).
_UNREAD = frozenset({"description", "x-kubernetes-validations"})


def _pruned(node: Schema) -> Schema:
    out: Schema = {}
    for key, value in node.items():
        if key in _UNREAD:
            continue
        if key == "properties":
            out[key] = {name: _pruned(sub) for name, sub in value.items()}
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_pruned(sub) for sub in value]
        elif isinstance(value, dict) and key in ("items", "additionalProperties", "not"):
            out[key] = _pruned(value)
        else:
            out[key] = value
    return out
