"""Rollout: its checks across documents (compile/rollouts.py lowers it).

A Rollout names a Function of its namespace, the version in service (`stable`) and the one that
takes over (`candidate`). Everything that would make its steps mean something else than they
say is refused here, each error at its own line: a Function that does not exist or serves no
REST, versions that contradict the Function's own, a candidate the registry does not have
(when the caller can ask one), steps that do not grow, a second rollout of the same Function,
tenant pinning on a gateway that verifies no JWT, and what a rollout cannot be combined with
yet (a fallback chain behind the Function, QoS gateway shedding).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

from .errors import PolicyError
from .model import Function, Rollout
from .qos import Bindings
from .references import resolve_gateway
from .security import Security
from .validate import Loaded, where

# The published versions of a function in the registry, or None when the registry cannot be
# asked (Kubernetes mode: the backends' volume is not the control plane's).
Published = Callable[[str], Sequence[str] | None]


def check(items: list[Loaded], published: Published | None = None) -> list[PolicyError]:
    rollouts = [i for i in items if isinstance(i.obj, Rollout)]
    if not rollouts:
        return []
    functions = {f"{i.namespace}/{i.name}": i for i in items if isinstance(i.obj, Function)}
    errors: list[PolicyError] = []
    first: dict[str, Loaded] = {}
    for item in rollouts:  # as written: the first of two for one Function stands
        assert isinstance(item.obj, Rollout)
        errors += _steps(item)
        key = f"{item.namespace}/{item.obj.spec.function}"
        function = functions.get(key)
        if function is None:
            hint = difflib.get_close_matches(key, list(functions), n=1)
            more = f" (did you mean {hint[0]}?)" if hint else ""
            errors.append(item.error(("spec", "function"), f"unknown Function {key}{more}"))
            continue
        if key in first:
            other = first[key]
            errors.append(
                item.error(
                    ("spec", "function"),
                    f"Function {key} is already rolled out by {other.ref} "
                    f"({where(other, ('spec', 'function'))}): one Rollout per Function",
                )
            )
            continue
        first[key] = item
        errors += _versions(item, function, published)
        errors += _combinations(item, function, items)
    return errors


def _steps(item: Loaded) -> list[PolicyError]:
    """Canary weights grow; shadow-only checks need a shadow step; pinned tenants once."""
    assert isinstance(item.obj, Rollout)
    spec = item.obj.spec
    errors = []
    if spec.canary is not None:
        previous = 0
        for i, step in enumerate(spec.canary.steps):
            if step.weight <= previous:
                errors.append(
                    item.error(
                        ("spec", "canary", "steps", i, "weight"),
                        f"weight {step.weight} does not grow: the step before it sends "
                        f"{previous}% (each step sends the candidate more)",
                    )
                )
            previous = max(previous, step.weight)
    if spec.slo.agreement is not None and spec.shadow is None:
        errors.append(
            item.error(
                ("spec", "slo", "agreement"),
                "agreement compares the two versions' answers on shadow steps: add spec.shadow",
            )
        )
    pinning = spec.pinning
    if pinning is not None:
        both = sorted(set(pinning.stable) & set(pinning.candidate))
        if both:
            errors.append(
                item.error(
                    ("spec", "pinning", "candidate"),
                    f"pinned to both versions: {', '.join(both)}",
                )
            )
    return errors


def _versions(item: Loaded, function: Loaded, published: Published | None) -> list[PolicyError]:
    assert isinstance(item.obj, Rollout) and isinstance(function.obj, Function)
    spec, fn = item.obj.spec, function.obj.spec
    errors = []
    if spec.candidate == spec.stable:
        return [
            item.error(
                ("spec", "candidate"), f"the candidate is the stable version {spec.stable!r}"
            )
        ]
    own = fn.version or (fn.artifact.partition("@")[2] if fn.artifact else None)
    if own is not None and own != spec.stable:
        errors.append(
            item.error(
                ("spec", "stable"),
                f"Function {function.namespace}/{function.name} serves version {own!r} "
                f"({where(function, ('spec', 'version' if fn.version else 'artifact'))}): the "
                "stable version is the one in service",
            )
        )
    if not fn.protocols.rest:
        errors.append(
            item.error(
                ("spec", "function"),
                f"Function {function.namespace}/{function.name} serves no REST "
                f"({where(function, ('spec', 'protocols'))}): a rollout splits its REST requests",
            )
        )
    registry_name = fn.artifact.partition("@")[0] if fn.artifact else function.name
    versions = published(registry_name) if published is not None else None
    if versions is not None:
        have = ", ".join(versions) or "none"
        for field, version in (("stable", spec.stable), ("candidate", spec.candidate)):
            if version not in versions:
                errors.append(
                    item.error(
                        ("spec", field),
                        f"version {version!r} of {registry_name} is not published in the "
                        f"registry (published: {have}); build and publish it first "
                        "(meshfn fn build, meshfn fn publish)",
                    )
                )
    return errors


def _combinations(item: Loaded, function: Loaded, items: list[Loaded]) -> list[PolicyError]:
    """Pinning needs a verified claim at the gateway; QoS gateway shedding (which gives the
    Function's traffic clusters of its own, as a rollout does per version) is not combined
    with a rollout yet."""
    assert isinstance(item.obj, Rollout) and isinstance(function.obj, Function)
    errors = []
    gateways = {f"{i.namespace}/{i.name}": i for i in items if i.kind == "Gateway"}
    gateway = resolve_gateway(function, gateways)
    if isinstance(gateway, PolicyError):
        return []
    pinning = item.obj.spec.pinning
    pinned = pinning is not None and bool(pinning.stable or pinning.candidate)
    if pinned and not Security(items).jwt_rules("gateway", gateway.namespace, gateway.name):
        assert pinning is not None
        errors.append(
            item.error(
                ("spec", "pinning"),
                f"tenants are told apart by the verified JWT claim {pinning.claim!r}, but "
                f"Gateway {gateway.namespace}/{gateway.name} verifies no JWT: add a "
                "RequestAuthentication in its namespace that selects it",
            )
        )
    policy = Bindings(items).for_function(function)
    if policy is not None and getattr(policy.obj.spec, "gatewayShedding", None) is not None:
        errors.append(
            item.error(
                ("spec", "function"),
                f"{policy.ref} sheds its requests at the gateway "
                f"({where(policy, ('spec', 'gatewayShedding'))}): a rollout of a Function "
                "with gateway shedding is not supported yet",
            )
        )
    return errors
