"""Golden Istio renderings: tests/golden/istio/<case>/in.yaml -> out/<kind>.yaml (and the
policies/examples as case `examples`), regenerated with `pytest --update-golden`. Every golden
object is also validated with jsonschema against Istio 1.31's real CRDs (vendored in istio/crds/)."""

from __future__ import annotations

from functools import cache
from typing import Any

import jsonschema
import pytest
import yaml

from meshfn.istio.output import files
from meshfn.testing.istio_cases import CASES, CRDS, GOLDEN, rendering


@cache
def crd_schemas() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version."""
    out = {}
    for doc in yaml.safe_load_all(CRDS.read_text()):
        spec = doc["spec"]
        for version in spec["versions"]:
            api = f"{spec['group']}/{version['name']}"
            schema = version["schema"]["openAPIV3Schema"]
            # what every object has beside the CRD's own properties
            schema["properties"] |= {
                "apiVersion": {"const": api},
                "kind": {"const": spec["names"]["kind"]},
                "metadata": {"type": "object"},
            }
            out[(api, spec["names"]["kind"])] = schema
    return out


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 13


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str, request: pytest.FixtureRequest) -> None:
    actual = files(rendering(case))
    out = GOLDEN / case / "out"
    if request.config.getoption("--update-golden"):
        out.mkdir(parents=True, exist_ok=True)
        for stale in set(p.name for p in out.iterdir()) - set(actual):
            (out / stale).unlink()
        for name, text in actual.items():
            (out / name).write_text(text)
    assert out.is_dir(), f"run pytest --update-golden to create {out}"
    assert sorted(p.name for p in out.iterdir()) == sorted(actual)
    for name, text in actual.items():
        expected = (out / name).read_text()
        assert list(yaml.safe_load_all(text)) == list(yaml.safe_load_all(expected)), name
        assert text == expected, name


@pytest.mark.parametrize("case", CASES)
def test_rendering_is_deterministic(case: str) -> None:
    assert files(rendering(case)) == files(rendering(case))


@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_against_istio_crds(case: str) -> None:
    schemas = crd_schemas()
    for objects in rendering(case).objects.values():
        for obj in objects:
            schema = schemas[(obj["apiVersion"], obj["kind"])]
            # The CRDs are structural: unknown fields would be pruned silently, so refuse them.
            strict = _no_unknown_fields(schema)
            errors = sorted(
                jsonschema.Draft7Validator(strict).iter_errors(obj), key=lambda e: list(e.path)
            )
            assert not errors, f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(
                f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
            )


def _no_unknown_fields(schema: Any) -> Any:
    """additionalProperties: false wherever the CRD lists properties (but not for preserved
    unknown fields such as pluginConfig and patch values)."""
    if isinstance(schema, dict):
        out = {k: _no_unknown_fields(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_unknown_fields(v) for v in schema]
    return schema


def test_the_crd_check_catches_unknown_fields() -> None:
    """The strict CRD check above would fail on a typo (the apiserver would prune it)."""
    obj = rendering("basic").objects["DestinationRule"][0]
    bad = {**obj, "spec": {**obj["spec"], "trafficPolicyy": {}}}
    strict = _no_unknown_fields(crd_schemas()[(obj["apiVersion"], obj["kind"])])
    assert list(jsonschema.Draft7Validator(strict).iter_errors(bad))
