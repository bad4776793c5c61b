"""JSON Schema of the policy kinds, generated from the pydantic models (never written by hand).

Editors use it for completion (`# yaml-language-server: $schema=...`); the Kubernetes CRDs will be
generated from the same models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .model import KINDS
from .types import API_VERSION

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def kind_schema(kind: str) -> dict[str, Any]:
    schema = KINDS[kind].model_json_schema(mode="validation")
    schema["$schema"] = SCHEMA_DIALECT
    schema["$id"] = f"https://meshfn.io/schema/{API_VERSION}/{kind.lower()}.json"
    schema["title"] = f"{kind} ({API_VERSION})"
    return schema


def document_schema() -> dict[str, Any]:
    """One schema accepting any meshfn document, chosen by `kind`."""
    return {
        "$schema": SCHEMA_DIALECT,
        "$id": f"https://meshfn.io/schema/{API_VERSION}/all.json",
        "title": f"meshfn policy document ({API_VERSION})",
        "oneOf": [{"$ref": f"{kind.lower()}.json"} for kind in sorted(KINDS)],
    }


def rendered() -> dict[str, str]:
    """file name -> JSON text, exactly as exported."""
    files = {f"{kind.lower()}.json": kind_schema(kind) for kind in sorted(KINDS)}
    files["all.json"] = document_schema()
    return {name: json.dumps(body, indent=2, sort_keys=True) + "\n" for name, body in files.items()}


def export(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
