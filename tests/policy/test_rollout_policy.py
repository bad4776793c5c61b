"""The Rollout kind's bad input, each a file:line error at the field that is wrong: a candidate
that does not exist or is not published, steps that do not grow, weights over 100, two rollouts
of one Function, versions that contradict the Function, checks without their step, pinning
without a verified claim, and what a rollout does not combine with (gateway shedding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshfn.policy import PolicyErrors, PolicyLoader, load_policies
from meshfn.testing.policies import (
    API_VERSION,
    ISSUER,
    doc,
    documents,
    gateway,
    jwt_authentication,
    mesh,
    service,
)

CANARY = {"steps": [{"weight": 5}, {"weight": 50}, {"weight": 100}]}


def _policies(tmp_path: Path, *rollouts: str, function: dict[str, object] | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = documents(
        mesh("m", "m.local"),
        gateway(None, 10000),
        service("models", 9101),
        doc("Function", "digits", {"backend": "models", **(function or {})}),
    )
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "rollout.yaml").write_text(documents(*rollouts))
    return tmp_path


def _rollout(name: str = "digits-v2", **spec: object) -> str:
    """A Rollout in block style, so each field has a line of its own."""
    fields = {"function": "digits", "stable": "1", "candidate": "2", "canary": CANARY, **spec}
    document = {"apiVersion": API_VERSION, "kind": "Rollout", "metadata": {"name": name}}
    return yaml.safe_dump({**document, "spec": fields}, sort_keys=False)


def _errors(path: Path, published: dict[str, list[str]] | None = None) -> list[str]:
    registry = None if published is None else lambda name: published.get(name, [])
    loader = PolicyLoader(path, registry)
    with pytest.raises(PolicyErrors) as caught:
        loader.load()
    return [str(e).split(str(path) + "/", 1)[-1] for e in caught.value.errors]


def test_a_valid_rollout_loads(tmp_path: Path) -> None:
    model = load_policies(_policies(tmp_path, _rollout()))
    (rollout,) = model.rollouts
    assert [s.percent for s in rollout.steps] == [5, 50, 100]
    (function,) = model.functions
    assert function.rollout is not None and function.rollout.candidate == "2"
    assert [v.version for v in function.served_versions()] == ["1", "2"]


def test_a_candidate_that_does_not_exist_or_is_not_published(tmp_path: Path) -> None:
    assert _errors(_policies(tmp_path / "a", _rollout(function="digit"))) == [
        "rollout.yaml:6: spec.function: unknown Function default/digit (did you mean "
        "default/digits?)"
    ]
    published = {"digits": ["1", "3"]}
    assert _errors(_policies(tmp_path / "b", _rollout()), published) == [
        "rollout.yaml:8: spec.candidate: version '2' of digits is not published in the registry "
        "(published: 1, 3); build and publish it first (meshfn fn build, meshfn fn publish)"
    ]
    assert _errors(_policies(tmp_path / "c", _rollout()), {}) == [
        "rollout.yaml:7: spec.stable: version '1' of digits is not published in the registry "
        "(published: none); build and publish it first (meshfn fn build, meshfn fn publish)",
        "rollout.yaml:8: spec.candidate: version '2' of digits is not published in the registry "
        "(published: none); build and publish it first (meshfn fn build, meshfn fn publish)",
    ]


def test_steps_that_do_not_grow_and_weights_over_100(tmp_path: Path) -> None:
    shrinking = {"steps": [{"weight": 5}, {"weight": 50}, {"weight": 50}, {"weight": 25}]}
    assert _errors(_policies(tmp_path / "a", _rollout(canary=shrinking))) == [
        "rollout.yaml:13: spec.canary.steps[2].weight: weight 50 does not grow: the step before "
        "it sends 50% (each step sends the candidate more)",
        "rollout.yaml:14: spec.canary.steps[3].weight: weight 25 does not grow: the step before "
        "it sends 50% (each step sends the candidate more)",
    ]
    over = {"steps": [{"weight": 5}, {"weight": 150}]}
    shadow = {"percent": 101}
    assert _errors(_policies(tmp_path / "b", _rollout(canary=over, shadow=shadow))) == [
        "rollout.yaml:12: spec.canary.steps[1].weight: 150 is over 100: a weight is a percentage "
        "of the requests",
        "rollout.yaml:14: spec.shadow.percent: 101 is over 100: a weight is a percentage of the "
        "requests",
    ]


def test_two_rollouts_of_one_function_are_refused(tmp_path: Path) -> None:
    path = _policies(tmp_path, _rollout(), _rollout("digits-again", candidate="3"))
    assert _errors(path) == [
        "rollout.yaml:20: spec.function: Function default/digits is already rolled out by "
        f"Rollout default/digits-v2 ({path}/rollout.yaml:6): one Rollout per Function"
    ]


def test_versions_must_agree_with_the_function(tmp_path: Path) -> None:
    assert _errors(_policies(tmp_path / "a", _rollout(candidate="1"))) == [
        "rollout.yaml:8: spec.candidate: the candidate is the stable version '1'"
    ]
    path = _policies(tmp_path / "b", _rollout(), function={"version": "7"})
    assert _errors(path) == [
        f"rollout.yaml:7: spec.stable: Function default/digits serves version '7' ({path}/"
        "base.yaml:19): the stable version is the one in service"
    ]
    path = _policies(tmp_path / "c", _rollout(), function={"protocols": {"rest": False}})
    assert _errors(path) == [
        f"rollout.yaml:6: spec.function: Function default/digits serves no REST ({path}/"
        "base.yaml:19): a rollout splits its REST requests"
    ]


def test_strategy_checks_and_pinning(tmp_path: Path) -> None:
    neither = _rollout(canary=None)
    assert _errors(_policies(tmp_path / "a", neither)) == [
        "rollout.yaml:5: spec: set shadow, canary or both (shadow runs first)"
    ]
    agreement = {"agreement": {"minRatio": 0.99}}
    assert _errors(_policies(tmp_path / "b", _rollout(slo=agreement))) == [
        "rollout.yaml:15: spec.slo.agreement: agreement compares the two versions' answers on "
        "shadow steps: add spec.shadow"
    ]
    both = {"latency": [{"percentile": 95, "max": "10ms", "maxRatio": 2}]}
    assert _errors(_policies(tmp_path / "c", _rollout(slo=both))) == [
        "rollout.yaml:16: spec.slo.latency[0]: set exactly one of: max, maxRatio (got max, maxRatio)"
    ]
    pinned = {"stable": ["acme"], "candidate": ["acme", "qa"]}
    assert _errors(_policies(tmp_path / "d", _rollout(pinning=pinned))) == [
        "rollout.yaml:14: spec.pinning: tenants are told apart by the verified JWT claim "
        "'tenant', but Gateway default/edge verifies no JWT: add a RequestAuthentication in its "
        "namespace that selects it",
        "rollout.yaml:17: spec.pinning.candidate: pinned to both versions: acme",
    ]
    verified = jwt_authentication("edge-jwt", {"gateway": "edge"}, ISSUER, jwksUri="https://x/j")
    path = _policies(tmp_path / "e", _rollout(pinning={"stable": ["acme"]}), verified)
    model = load_policies(path)
    assert model.rollouts[0].pinning is not None
    assert model.rollouts[0].pinning.stable == ("acme",)


def test_gateway_shedding_is_refused(tmp_path: Path) -> None:
    shedding = doc(
        "QoSPolicy",
        "tenants",
        {
            "targetRefs": [{"kind": "Function", "name": "digits"}],
            "defaultClass": "batch",
            "classes": [{"name": "gold", "priority": 1}, {"name": "batch", "priority": 0}],
            "tenants": [{"name": "acme", "class": "gold"}],
            "gatewayShedding": {},
        },
    )
    verified = jwt_authentication("edge-jwt", {"gateway": "edge"}, ISSUER, jwksUri="https://x/j")
    errors = _errors(_policies(tmp_path, _rollout(), shedding, verified))
    assert errors == [
        f"rollout.yaml:6: spec.function: QoSPolicy default/tenants sheds its requests at the "
        f"gateway ({tmp_path}/rollout.yaml:18): a rollout of a Function with gateway shedding "
        "is not supported yet"
    ]
