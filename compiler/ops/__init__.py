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
)

for _name in _MODULES:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["REGISTRY", "Emitter", "Op", "register", "schema_version", "supported_list"]
