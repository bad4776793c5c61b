"""Golden translation cases: tests/golden/<case>/in.yaml -> out.yaml (`pytest --update-golden`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshfn.control_plane.policy import load_policies
from meshfn.xds.dump import resources_to_plain, to_yaml
from meshfn.xds.translate import translate

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "in.yaml").exists())


def render(case: str) -> str:
    model = load_policies(GOLDEN / case / "in.yaml")
    out = {}
    for workload in model.workloads:
        resources = translate(model, workload.node_cluster)
        assert resources is not None
        out[workload.node_cluster] = resources_to_plain(resources)
    return to_yaml(out)


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 8


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str, request: pytest.FixtureRequest) -> None:
    actual = render(case)
    expected_path = GOLDEN / case / "out.listeners.yaml"
    if request.config.getoption("--update-golden"):
        expected_path.write_text(actual)
    assert expected_path.exists(), f"run pytest --update-golden to create {expected_path}"
    expected = expected_path.read_text()
    # Compare as data first for a readable diff, then byte for byte (key order is part of it).
    assert yaml.safe_load(actual) == yaml.safe_load(expected)
    assert actual == expected


@pytest.mark.parametrize("case", CASES)
def test_translation_is_deterministic(case: str) -> None:
    assert render(case) == render(case)
