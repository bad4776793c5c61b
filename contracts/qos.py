"""Multi-tenant QoS: tenant classes, their limits and priorities. ONE schema for the `QoSPolicy`
kind and the inference backend's configuration (which carries the classes of the policy that
binds each of its functions, to shed by priority and keep per-tenant limits); the IR holds the
policy resolved (each tenant's effective limits) for the renderers.

A tenant is the value of a JWT claim that Envoy verified (jwt_authn), never a header a client
sent; a request without the claim belongs to the default class as the anonymous tenant "".
Limits on a class apply to EACH of its tenants (every tenant has its own buckets); a tenant entry
puts a tenant in a class and may replace some of that class's limits for that tenant alone.
A leaf: pydantic only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .durations import Duration

# A claim value: printable, no control characters (it becomes a descriptor value, a CEL string
# literal, a label value and a JSON string).
TENANT = r"^[^\x00-\x1f\x7f]{1,128}$"
Tenant = Annotated[str, Field(pattern=TENANT, max_length=128)]
# A claim name: also a key in %DYNAMIC_METADATA(ns:payload:claim)%, so no ':', '(', ')', '%'.
CLAIM = r"^[A-Za-z0-9_.-]{1,128}$"
Claim = Annotated[str, Field(pattern=CLAIM)]
CLASS_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ClassName = Annotated[str, Field(pattern=CLASS_NAME, min_length=1, max_length=63)]

# How a gateway picks a service's endpoint (Service.spec.loadBalancer; the IR carries it as is).
LoadBalancer = Literal["round-robin", "least-request", "weighted-round-robin"]
# What services that serve Functions use unless they say: bench/qos.py compares the two with one
# slow endpoint beside a fast one (docs/benchmarks.md: wrr_p99_ratio). Measured (2026-12-02, quiet machine):
# weighted round robin sends the slow endpoint 0.5-0.75% of requests once its weights have
# settled (~3.5 s), least-request 25-27.5% (Envoy's power of two choices draws the same one of
# two endpoints a quarter of the time); p99 20.1-20.8 vs 22.5-31.2 ms, ratio 0.89.
FUNCTION_BACKEND_BALANCER: LoadBalancer = "weighted-round-robin"

# ORCA's per-response load report (Envoy reads it for client_side_weighted_round_robin).
ORCA_HEADER = "endpoint-load-metrics"
# Both of ORCA's response headers: a gateway removes them from what it answers its clients (a
# backend's load is the mesh's business, and a timing hint to an attacker) after its router has
# read them (Envoy parses the report before it finalises the response headers).
ORCA_HEADERS = (ORCA_HEADER, f"{ORCA_HEADER}-bin")


def orca_text(inflight: int, capacity: int, rps: float) -> str:
    """An ORCA load report in its TEXT form: utilisation (requests in flight per unit of
    capacity, e.g. worker threads; above 1 when requests queue), requests per second, and the
    in-flight count as a named metric."""
    utilization = min(inflight / max(capacity, 1), 10.0)
    return (
        f"TEXT application_utilization={utilization:.3f}, cpu_utilization="
        f"{min(utilization, 1.0):.3f}, rps_fractional={rps:.1f}, named_metrics.inflight={inflight}"
    )


# Priority shedding in the inference backend (inference/qos.py): a function with maxConcurrency N
# admits its highest priority up to N requests in flight and each lower one a smaller share, the
# lowest SHED_FLOOR of N. Gateways that shed (GatewayShedding) derive their thresholds from it.
SHED_FLOOR = 0.5


def shed_threshold(rank: int, count: int, limit: int) -> int:
    """In-flight requests at which the backend sheds the priority of `rank` (0: the highest)
    of `count` distinct priorities on a function admitting `limit` at once."""
    if rank == 0 or count < 2:
        return limit
    return max(1, math.floor(limit * (1 - (1 - SHED_FLOOR) * rank / (count - 1))))


@dataclass(frozen=True, slots=True)
class PrioritySplit:
    """Who routes with Envoy's HIGH priority at a gateway that sheds (GatewayShedding): the
    classes of the top priority. `listed` tenants route with priority HIGH when `listed_high`,
    else DEFAULT; every other request (unlisted tenants, no claim) with the other one."""

    high: tuple[str, ...]  # class names
    low: tuple[str, ...]
    listed: tuple[str, ...]
    listed_high: bool


def split_priorities(
    classes: Iterable[tuple[str, int]], default_class: str, tenants: Iterable[tuple[str, str]]
) -> PrioritySplit:
    """`classes`: (name, priority); `tenants`: (name, class). A route can name only listed
    tenants (the others are the default class's), so the listed tenants on the side the
    default class is NOT on get a route of their own. The policy's checks and the renderers
    both ask this, so they cannot disagree about who is listed."""
    ranked = list(classes)
    top = max(priority for _, priority in ranked)
    high = tuple(name for name, priority in ranked if priority == top)
    low = tuple(name for name, priority in ranked if priority != top)
    default_high = default_class in high
    listed = tuple(name for name, cls in tenants if (cls in high) != default_high)
    return PrioritySplit(high, low, listed, not default_high)


Window = Literal["second", "minute", "hour", "day", "month"]
WINDOWS: tuple[Window, ...] = ("second", "minute", "hour", "day", "month")
_FIXED = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}

# Where the proxy in front of the inference backend writes the verified tenant (jwt_authn
# claim_to_headers) after removing any copy a client sent; the backend reads it (priority,
# attribution).
TENANT_HEADER = "x-meshfn-tenant"
# On every QoS refusal, naming which limit: "rate" (gateway), "concurrency", "compute", "tokens"
# or "shed" (backend).
LIMIT_HEADER = "x-meshfn-qos-limit"
LIMIT_RATE = "rate"
LIMIT_CONCURRENCY = "concurrency"
LIMIT_COMPUTE = "compute"
LIMIT_TOKENS = "tokens"
LIMIT_SHED = "shed"
# The rate limit descriptor entry that holds the verified tenant.
DESCRIPTOR_TENANT = "meshfn_tenant"
# A global rate limit's descriptor also names the policy (namespace/name), as its domain does.
DESCRIPTOR_POLICY = "meshfn_policy"
# A gateway's calls to the control plane's limit service (xds/rls.py) say which workload (node
# cluster) is asking in this metadata, beside `authorization: Bearer <its limit-service token>`
# (control_plane/identity/bootstrap_token.py, purpose "rls"): only a proven gateway that the
# policy binds may spend the policy's buckets.
LIMIT_SERVICE_NODE_HEADER = "x-meshfn-node"
# The mesh's book of token budgets, served beside the limit service (xds/ledger.py): JSON in,
# JSON out, the caller proven as there (a backend: node "backend:<service key>").
TOKEN_LEDGER_SERVICE = "meshfn.qos.v1.TokenLedger"
TOKEN_LEDGER_PURPOSE = "ledger"  # the bootstrap token's purpose (control_plane.identity)


def has_token_budgets(qos: FunctionQoS | None) -> bool:
    """Whether a Function's QoS gives any tenant a token budget."""
    return qos is not None and any(e.tokens for e in [*qos.classes, *qos.tenants])


def ledger_node(service_key: str) -> str:
    """A backend's identity towards the token ledger: the service it serves."""
    return f"backend:{service_key}"


class _Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        populate_by_name=False,
        validate_default=False,
        serialize_by_alias=True,  # `class`, as written, in the backend's config too
    )


def window_bounds(window: Window, now: float) -> tuple[float, float]:
    """[start, end) in UNIX seconds of the UTC calendar window holding `now`: a second, minute,
    hour or day aligned to the epoch, or the calendar month."""
    if window != "month":
        size = _FIXED[window]
        start = now - (now % size)
        return start, start + size
    moment = datetime.fromtimestamp(now, UTC)
    first = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    following = (
        first.replace(year=first.year + 1, month=1)
        if first.month == 12
        else first.replace(month=first.month + 1)
    )
    return first.timestamp(), following.timestamp()


def window_seconds(window: Window) -> int:
    """The longest the window can be (a month: 31 days), to order windows."""
    return _FIXED.get(window, 31 * 86400)


class RateLimit(_Strict):
    """A token bucket: `requests` per `per`, refilled continuously, holding at most `burst`."""

    requests: Annotated[int, Field(ge=1, le=1_000_000_000)] = Field(
        description="requests admitted per `per`"
    )
    per: Duration = Field(timedelta(seconds=1), description="the period (1s to 24h)")
    burst: Annotated[int, Field(ge=1, le=1_000_000_000)] | None = Field(
        None, description="most requests admitted at once after a quiet spell; default: requests"
    )

    @model_validator(mode="after")
    def _sane(self) -> Self:
        if not timedelta(seconds=1) <= self.per <= timedelta(days=1):
            raise ValueError("per must be between 1s and 24h")
        if self.per.total_seconds() != int(self.per.total_seconds()):
            raise ValueError("per must be a whole number of seconds")
        if self.burst is not None and self.burst < self.requests:
            raise ValueError(
                f"burst ({self.burst}) is below requests ({self.requests}): the bucket could "
                "never hold one period's requests, so the rate could never be reached"
            )
        return self

    @property
    def bucket(self) -> int:
        return self.burst if self.burst is not None else self.requests

    @property
    def seconds(self) -> int:
        return int(self.per.total_seconds())


class ComputeBudget(_Strict):
    """Guest CPU time (the wasm guest's own CPU, as the inference backend measures it) a tenant
    may use per calendar window (UTC)."""

    cpuMs: Annotated[int, Field(ge=1, le=4_000_000_000)] = Field(
        description="guest CPU milliseconds per window"
    )
    per: Window = Field(description="second, minute, hour, day or month (calendar, UTC)")


class TokenBudget(_Strict):
    """Tokens (prompt + completion, as the model counts them) a tenant's generative requests
    may use per calendar window (UTC)."""

    tokens: Annotated[int, Field(ge=1, le=10**15)] = Field(
        description="prompt + completion tokens per window"
    )
    per: Window = Field(description="second, minute, hour, day or month (calendar, UTC)")


def _ordered(name: str, budgets: list[tuple[Window, int]], unit: str) -> None:
    """One budget per window, and a longer window never smaller than a shorter one."""
    ordered = sorted(budgets, key=lambda b: window_seconds(b[0]))
    for (short, small), (long, large) in pairwise(ordered):
        if short == long:
            raise ValueError(f"{name}: two budgets per {short}")
        if large < small:
            raise ValueError(
                f"{name}: {large} {unit} per {long} is less than {small} {unit} per {short}: "
                f"the per-{short} budget could never be used up"
            )


class Limits(_Strict):
    rate: RateLimit | None = Field(None, description="request rate with burst")
    concurrency: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        None, description="requests in flight at once, per gateway"
    )
    compute: Annotated[list[ComputeBudget], Field(max_length=5)] = Field(
        default_factory=list, description="guest CPU budgets, at most one per window"
    )
    tokens: Annotated[list[TokenBudget], Field(max_length=5)] = Field(
        default_factory=list,
        description="token budgets of generative Functions (prompt + completion tokens), at "
        "most one per window",
    )

    @model_validator(mode="after")
    def _budgets(self) -> Self:
        _ordered("compute", [(b.per, b.cpuMs) for b in self.compute], "ms")
        _ordered("tokens", [(b.per, b.tokens) for b in self.tokens], "tokens")
        return self

    @property
    def empty(self) -> bool:
        return (
            self.rate is None and self.concurrency is None and not self.compute and not self.tokens
        )


class TenantClass(Limits):
    """A class of tenants: its limits apply to each of its tenants, its priority to their
    requests when a backend saturates (lower priorities shed first)."""

    name: ClassName = Field(
        description="The class's name (a DNS label), referred to by defaultClass and tenants."
    )
    priority: Annotated[int, Field(ge=0, le=1000)] = Field(
        0, description="higher keeps its latency when a backend saturates; lower sheds first"
    )


class TenantEntry(Limits):
    """One tenant: its class (default: the default class) and limits that replace the class's
    for this tenant (each given field replaces the class's; the others stay)."""

    name: Tenant = Field(description="the verified claim's value")
    class_: ClassName | None = Field(
        None,
        alias="class",
        description="The tenant's class; default: defaultClass. Written `class`.",
    )


class TenantClasses(_Strict):
    """Who is in which class and what each class may do (a QoSPolicy's tenant model)."""

    tenantClaim: Claim | None = Field(
        None,
        description="the verified JWT claim naming the tenant; default: Mesh.spec.audit."
        "tenantClaim, else `tenant`",
    )
    defaultClass: ClassName = Field(
        description="the class of tenants not listed, and of requests without the claim"
    )
    classes: Annotated[list[TenantClass], Field(min_length=1, max_length=64)] = Field(
        description="The tenant classes (1-64), each with its priority and limits."
    )
    tenants: Annotated[list[TenantEntry], Field(max_length=10_000)] = Field(
        default_factory=list,
        description=(
            "Tenants named one by one (at most 10,000): their class, and limits of their own."
        ),
    )
    tokenReservation: Literal["full", "partial"] = Field(
        "full",
        description="how a generative request meets its tenant's token budgets: full, it is "
        "admitted only if its prompt plus max_tokens fits what is left of every budget (else "
        "429), reserved then, and reconciled with the tokens it used when it ends; partial, it "
        "is admitted while its prompt and one completion token fit, generates at most what is "
        "left, and stops with finish_reason length when the budget runs out (its audit record "
        "notes budget)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for loc, message in self.problems():
            where = ".".join(str(p) for p in loc)
            raise ValueError(f"{where}: {message}")
        return self

    def problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        """What contradicts itself, with where (a policy reports each at its own line)."""
        out: list[tuple[tuple[str | int, ...], str]] = []
        names = [c.name for c in self.classes]
        for i, name in enumerate(names):
            if name in names[:i]:
                out.append((("classes", i, "name"), f"class {name!r} is defined twice"))
        if self.defaultClass not in names:
            out.append(
                (
                    ("defaultClass",),
                    f"{self.defaultClass!r} is not one of the classes ({', '.join(names)})",
                )
            )
        seen: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            if tenant.name in seen:
                out.append(
                    (("tenants", i, "name"), f"{tenant.name!r} is listed twice (one entry each)")
                )
            seen.add(tenant.name)
            if tenant.class_ is not None and tenant.class_ not in names:
                out.append(
                    (
                        ("tenants", i, "class"),
                        f"class {tenant.class_!r} is not defined ({', '.join(names)})",
                    )
                )
            if tenant.class_ is None and tenant.empty:
                out.append((("tenants", i), f"{tenant.name!r} sets neither a class nor a limit"))
        if (
            all(c.empty for c in self.classes)
            and all(t.empty for t in self.tenants)
            and len({c.priority for c in self.classes}) < 2
        ):
            out.append((("classes",), "no limit and one priority: it would change nothing"))
        return out

    @property
    def counts_requests(self) -> bool:
        """Whether some tenant has a rate or concurrency limit: the gateways count those per
        HTTP request, so one gRPC stream of many inferences would count as one."""
        return any(c.rate or c.concurrency for c in [*self.classes, *self.tenants])

    def class_of(self, tenant: str) -> TenantClass:
        """The class of a tenant ("" is the anonymous tenant: the default class)."""
        entry = self.entry(tenant)
        wanted = entry.class_ if entry is not None and entry.class_ else self.defaultClass
        return next(c for c in self.classes if c.name == wanted)

    def entry(self, tenant: str) -> TenantEntry | None:
        return next((t for t in self.tenants if t.name == tenant), None)

    def limits_of(self, tenant: str) -> Limits:
        """A listed tenant's effective limits: its class's, with the fields it sets replaced."""
        base = self.class_of(tenant)
        entry = self.entry(tenant)
        if entry is None:
            return Limits(
                rate=base.rate,
                concurrency=base.concurrency,
                compute=base.compute,
                tokens=base.tokens,
            )
        return Limits(
            rate=entry.rate or base.rate,
            concurrency=entry.concurrency or base.concurrency,
            compute=entry.compute or base.compute,
            tokens=entry.tokens or base.tokens,
        )


class FunctionQoS(TenantClasses):
    """What the inference backend serves a function with: the classes of the QoSPolicy that
    binds it (`policy`, namespace/name), to order queued guest calls by priority, shed the lowest
    first at saturation and count per tenant. The tenant comes from `TENANT_HEADER`, written by
    the proxy in front of the backend from the JWT it verified."""

    policy: Annotated[str, Field(pattern=r"^[a-z0-9-]{1,63}/[a-z0-9-]{1,63}$")]
    tenantClaim: Claim | None = Field("tenant", description="the claim the proxy verified")


class GatewayShedding(_Strict):
    """Shed the lower priorities at each gateway, before a request costs the backend's sidecar
    and the backend anything: the top-priority class (or classes) routes as Envoy's HIGH
    priority, the others as DEFAULT, and the gateway's cluster of each bound backend admits at
    most the backend's own shedding threshold of DEFAULT requests at once (its functions'
    maxConcurrency shares, divided among the gateways that reach it); beyond that a DEFAULT
    request gets the backend's 429 (`limit: shed`) from the gateway itself."""

    gateways: Annotated[int, Field(ge=1, le=1000)] | None = Field(
        None,
        description="how many gateway proxies share each backend's capacity; default: the "
        "number of Gateways whose routes reach it",
    )
