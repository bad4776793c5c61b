"""Golden cases in two stages (layout: tests/golden/README.md; `pytest --update-golden` rewrites
both): policy -> IR (`in.yaml` -> `ir.yaml`), then IR -> xDS with the IR read back from
`ir.yaml` (-> `out.<type>.yaml`), so each stage is tested on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshfn import ir
from meshfn.ir.dump import dump_model, load_model
from meshfn.policy import load_policies
from meshfn.xds.dump import resources_to_plain, to_yaml
from meshfn.xds.names import SHORT_NAMES
from meshfn.xds.translate import translate

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "in.yaml").exists())


def render_ir(case: str) -> str:
    return to_yaml(dump_model(load_policies(GOLDEN / case / "in.yaml")))


def golden_ir(case: str) -> ir.MeshModel:
    return load_model(yaml.safe_load((GOLDEN / case / "ir.yaml").read_text()))


def render_xds(model: ir.MeshModel) -> dict[str, str]:
    """File name -> text: per resource type `out.<type>.yaml`, {workload: {type: [resources]}}
    for the types some workload has; together they are what `meshfn translate` prints."""
    plain = {}
    for workload in model.workloads:
        resources = translate(model, workload.node_cluster)
        assert resources is not None
        plain[workload.node_cluster] = resources_to_plain(resources)
    files = {}
    for kind in SHORT_NAMES.values():
        by_workload = {node: {kind: out[kind]} for node, out in plain.items() if kind in out}
        if by_workload:
            files[f"out.{kind}.yaml"] = to_yaml(by_workload)
    return files


def check(case: str, expected: dict[str, str], pattern: str, update: bool) -> None:
    """The case's files matching `pattern` are exactly `expected` (rewritten with `update`)."""
    directory = GOLDEN / case
    if update:
        for stale in set(p.name for p in directory.glob(pattern)) - set(expected):
            (directory / stale).unlink()
        for name, text in expected.items():
            (directory / name).write_text(text)
    found = {p.name: p.read_text() for p in directory.glob(pattern)}
    assert sorted(found) == sorted(expected), f"run pytest --update-golden for {directory}"
    for name, text in expected.items():
        # As data first for a readable diff, then byte for byte (key order is part of it).
        assert yaml.safe_load(text) == yaml.safe_load(found[name]), name
        assert text == found[name], name


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 8


@pytest.mark.parametrize("case", CASES)
def test_policy_to_ir(case: str, request: pytest.FixtureRequest) -> None:
    update = bool(request.config.getoption("--update-golden"))
    check(case, {"ir.yaml": render_ir(case)}, "ir.yaml", update)


@pytest.mark.parametrize("case", CASES)
def test_the_ir_golden_reads_back_as_the_model(case: str) -> None:
    """Stage two translates exactly what stage one produced: the dump loses nothing."""
    assert golden_ir(case) == load_policies(GOLDEN / case / "in.yaml")


@pytest.mark.parametrize("case", CASES)
def test_ir_to_xds(case: str, request: pytest.FixtureRequest) -> None:
    update = bool(request.config.getoption("--update-golden"))
    check(case, render_xds(golden_ir(case)), "out.*.yaml", update)


@pytest.mark.parametrize("case", CASES)
def test_translation_is_deterministic(case: str) -> None:
    assert render_ir(case) == render_ir(case)
    assert render_xds(golden_ir(case)) == render_xds(golden_ir(case))
