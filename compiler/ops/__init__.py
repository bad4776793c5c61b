"""The operator registry: each module below registers its units with `@register`.

Adding an operator: a module here (or a class in a family's module) and, for a new module, one
line in `_MODULES`."""

from __future__ import annotations

import importlib

from .base import REGISTRY, Emitter, Op, register, schema_version, supported_list

_MODULES = (
    "elementwise",
    "shape",
    "linalg",
    "conv",
    "norm",
    "reduce",
    "ml",
    "trees",
    "svm",
    "index",
    "quant",
    "resize",
    "recurrent",
)

for _name in _MODULES:
    importlib.import_module(f"{__name__}.{_name}")


def table() -> str:
    """The supported operators as a Markdown table, generated from the registry (for the docs):
    domain, operator, the oldest opset version implemented, and what the unit refuses."""
    rows = ["| domain | operator | from version | notes |", "|---|---|---|---|"]
    for (domain, op), cls in sorted(REGISTRY.items()):
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        note = (
            " ".join((cls.NOTES or doc).split()) if cls.NOTES or cls.__doc__ != Op.__doc__ else ""
        )
        rows.append(f"| {domain or 'ai.onnx'} | {op} | {cls.SINCE} | {note} |")
    return "\n".join(rows) + "\n"


__all__ = ["REGISTRY", "Emitter", "Op", "register", "schema_version", "supported_list", "table"]
