"""Pass 6, rollouts: each Rollout lowered, and its Function told which two versions its backend
serves (both, until the Rollout is removed) and how the backend compares shadow answers.

The reference checks (policy.rollout) have passed: every Rollout names a Function, at most one
per Function, with versions that exist. Where the rollout's traffic is now is not policy: the
rollout controller keeps it in the overlay (ir.Split).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshfn import ir
from meshfn.contracts.rollout import FunctionRollout

from ..model import Rollout, RolloutSpec
from .functions import Served


@dataclass(frozen=True)
class Rolled(Served):
    """`rollouts`: in (namespace, name) order; `functions` now with their rollout."""

    rollouts: tuple[ir.Rollout, ...]


def roll(served: Served) -> Rolled:
    rollouts = sorted(
        (lower(i.obj, i.namespace) for i in served.items if isinstance(i.obj, Rollout)),
        key=lambda r: (r.namespace, r.name),
    )
    by_function = {r.function: r for r in rollouts}
    functions = tuple(
        dataclasses.replace(f, rollout=_function_rollout(by_function[f.key]))
        if f.key in by_function
        else f
        for f in served.functions
    )
    return Rolled(**(vars(served) | {"functions": functions}), rollouts=tuple(rollouts))


def _function_rollout(rollout: ir.Rollout) -> FunctionRollout:
    return FunctionRollout(
        stable=rollout.stable, candidate=rollout.candidate, tolerance=rollout.slo.tolerance
    )


def lower(obj: Rollout, namespace: str) -> ir.Rollout:
    spec = obj.spec
    return ir.Rollout(
        name=obj.metadata.name,
        namespace=namespace,
        function=f"{namespace}/{spec.function}",
        stable=spec.stable,
        candidate=spec.candidate,
        steps=_steps(spec),
        slo=_slo(spec),
        on_breach=spec.onBreach,
        interval=spec.interval,
        window=spec.window,
        no_data_timeout=spec.noDataTimeout,
        pinning=ir.Pinning(
            spec.pinning.claim, tuple(spec.pinning.stable), tuple(spec.pinning.candidate)
        )
        if spec.pinning is not None
        else None,
    )


def _steps(spec: RolloutSpec) -> tuple[ir.RolloutStep, ...]:
    steps = []
    if spec.shadow is not None:
        shadow = spec.shadow
        steps.append(ir.RolloutStep("shadow", shadow.percent, shadow.minRequests, shadow.minTime))
    if spec.canary is not None:
        canary = spec.canary
        steps += [
            ir.RolloutStep(
                "canary",
                step.weight,
                step.minRequests if step.minRequests is not None else canary.minRequests,
                step.minTime if step.minTime is not None else canary.minTime,
            )
            for step in canary.steps
        ]
    return tuple(steps)


def _slo(spec: RolloutSpec) -> ir.RolloutSlo:
    slo = spec.slo
    return ir.RolloutSlo(
        max_error_ratio=slo.errorRatio.max,
        max_error_increase=slo.errorRatio.maxIncrease,
        latency=tuple(
            ir.LatencyCheck(check.percentile, check.max, check.maxRatio, check.minIncrease)
            for check in slo.latency
        ),
        min_agreement=slo.agreement.minRatio if slo.agreement is not None else None,
        tolerance=slo.agreement.tolerance if slo.agreement is not None else 0.0,
        min_samples=slo.minSamples,
    )
