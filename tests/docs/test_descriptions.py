"""Every field and class of the policy model (and of the types it uses from meshfn.contracts)
says what it means to a user: the reference, the JSON Schema, the CRDs (`kubectl explain`) and
editors all show these descriptions.

UNDESCRIBED is an allow-list that may only shrink: a name in it must still lack its description
(else remove it), and nothing outside it may. It started at what issue 33 found undescribed and is
empty now."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from meshfn.policy.model import KINDS
from meshfn.testing.docs import reference_generator

UNDESCRIBED: frozenset[str] = frozenset()


def _models() -> list[type[BaseModel]]:
    models: list[type[BaseModel]] = reference_generator().reachable(KINDS.values())
    return models


def _missing() -> set[str]:
    missing: set[str] = set()
    for model in _models():
        if not (model.__dict__.get("__doc__") or "").strip():
            missing.add(model.__name__)
        for name, info in model.model_fields.items():
            if not (info.description or "").strip():
                missing.add(f"{model.__name__}.{name}")
    return missing


def test_every_policy_field_and_class_is_described() -> None:
    new = sorted(_missing() - UNDESCRIBED)
    assert not new, f"describe these (Field(description=...) or a docstring): {', '.join(new)}"


def test_the_allow_list_only_shrinks() -> None:
    described = sorted(UNDESCRIBED - _missing())
    assert not described, f"described now: remove from UNDESCRIBED: {', '.join(described)}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_crd_explains_every_field(kind: str) -> None:
    """What `kubectl explain` reads: every property of the generated CRD has a description."""
    from meshfn.policy import crds

    def walk(node: dict[str, Any], path: str) -> list[str]:
        missing = [] if node.get("description") else [path]
        for name, sub in (node.get("properties") or {}).items():
            missing += walk(sub, f"{path}.{name}")
        items = node.get("items")
        if isinstance(items, dict) and items.get("properties"):
            missing += walk(items, f"{path}[]")
        return missing

    spec = crds.object_schema(kind)["properties"]["spec"]
    assert not walk(spec, "spec")
