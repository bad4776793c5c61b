"""Pass 3, fallback: each Service's FallbackPolicy lowered onto it: its traffic policy (outlier
detection, circuit breakers and retry budget, health checks, locality failover), its fallback
chain flattened, and its drift breaker."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from meshfn import ir

from ..model import FallbackPolicy
from ..validate import Loaded
from .security import Secured


@dataclass(frozen=True)
class Chained(Secured):
    """`services` now with their FallbackPolicies (traffic, fallback, drift)."""


def chain(secured: Secured) -> Chained:
    services = tuple(_apply(service, secured.fallback) for service in secured.services)
    return Chained(**(vars(secured) | {"services": services}))


def _apply(service: ir.Service, policies: Mapping[str, Loaded]) -> ir.Service:
    item = policies.get(service.key)
    if item is None:
        return service
    assert isinstance(item.obj, FallbackPolicy)
    spec = item.obj.spec
    outlier = None
    if spec.outlierDetection is not None:
        o = spec.outlierDetection
        outlier = ir.Outlier(
            consecutive_5xx=o.consecutive5xxErrors,
            consecutive_gateway=o.consecutiveGatewayErrors,
            interval=o.interval,
            base_ejection_time=o.baseEjectionTime,
            max_ejection_percent=o.maxEjectionPercent,
        )
    breakers = None
    if spec.circuitBreakers is not None or spec.retryBudget is not None:
        cb = spec.circuitBreakers
        budget = spec.retryBudget
        breakers = ir.CircuitBreakers(
            max_connections=cb.maxConnections if cb else None,
            max_pending_requests=cb.maxPendingRequests if cb else None,
            max_requests=cb.maxRequests if cb else None,
            max_retries=cb.maxRetries if cb else None,
            retry_budget_percent=budget.percent if budget else None,
            retry_budget_min_concurrency=budget.minRetryConcurrency if budget else None,
        )
    health = None
    if spec.healthCheck is not None:
        h = spec.healthCheck
        health = ir.HealthCheck(
            h.path, h.interval, h.timeout, h.unhealthyThreshold, h.healthyThreshold
        )
    locality = spec.locality
    drift = None
    if spec.driftBreaker is not None:
        d = spec.driftBreaker
        drift = ir.Drift(
            threshold_percent=d.threshold,
            min_increase=d.minIncrease,
            min_samples=d.minSamples,
            window=d.window,
            baseline_window=d.baselineWindow,
            cold_start_baseline=d.coldStartBaseline,
            recover_after=d.recoverAfter,
            probe_percent=d.probePercent,
            streams=d.streams,
        )
    return dataclasses.replace(
        service,
        traffic=ir.TrafficPolicy(
            locality_failover=locality is not None and locality.enabled,
            failover_regions=tuple((f.from_, f.to) for f in locality.failover) if locality else (),
            outlier=outlier,
            breakers=breakers,
            health_check=health,
            policy=item.name,
        ),
        fallback=tuple(_chain_of(service.key, policies)[: spec.maxFallbackDepth]),
        drift=drift,
    )


def _chain_of(key: str, policies: Mapping[str, Loaded]) -> list[str]:
    """Depth-first expansion of fallback chains (a fallback's own chain follows it), without
    repeats. Cycles are rejected by the reference checks before this runs."""
    out: list[str] = []

    def visit(service: str) -> None:
        item = policies.get(service)
        if item is None:
            return
        assert isinstance(item.obj, FallbackPolicy)
        for name in item.obj.spec.chain:
            child = f"{item.namespace}/{name}"
            if child != key and child not in out:
                out.append(child)
                visit(child)

    visit(key)
    return out
