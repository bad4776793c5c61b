"""Multi-tenant QoS inside the backend: per-tenant concurrency, compute budgets metered in
guest CPU time, and priority shedding as a function saturates (contracts.qos: the schema of the
QoSPolicy that binds the function).

The tenant is `TENANT_HEADER`, which the proxy in front of the backend wrote from the JWT claim
it verified after removing any copy a client sent; without it a request is the anonymous tenant
"" of the default class. Shedding: a function with maxConcurrency N admits its highest-priority
class up to N requests in flight and each lower priority up to a smaller share (the lowest at
SHED_FLOOR of N), so as in-flight work grows the lowest class is refused first and the highest
keeps capacity. Guest CPU time is the worker thread's CPU time during the guest call; a batched
call's time is split among its requests by rows. Event-loop only.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshfn.contracts.qos import (
    LIMIT_COMPUTE,
    LIMIT_CONCURRENCY,
    LIMIT_HEADER,
    LIMIT_SHED,
    LIMIT_TOKENS,
    ORCA_HEADER,
    SHED_FLOOR,
    TENANT,
    FunctionQoS,
    Limits,
    orca_text,
    shed_threshold,
    window_bounds,
)

from .kserve import KServeError
from .metrics import Metrics

__all__ = ["SHED_FLOOR", "Admission", "Load", "Refusal", "Ticket", "TokenGrant", "tenant_of"]
_TENANT_OK = re.compile(TENANT)


class Refusal(KServeError):
    """A QoS 429: a JSON body naming the limit, Retry-After and x-ratelimit-* headers."""

    def __init__(
        self, limit: str, message: str, retry: int, quota: int, body: Mapping[str, object]
    ) -> None:
        super().__init__(429, message)
        self.limit = limit
        self.payload = {"error": message, "limit": limit, "scope": "backend", **body}
        self.headers = (
            (b"retry-after", str(retry).encode()),
            (b"x-ratelimit-limit", str(quota).encode()),
            (b"x-ratelimit-remaining", b"0"),
            (b"x-ratelimit-reset", str(retry).encode()),
            (LIMIT_HEADER.encode(), limit.encode()),
        )

    def body(self) -> bytes:
        return json.dumps(self.payload).encode()


@dataclass(slots=True)
class _Usage:
    window_start: float = 0.0
    used_us: int = 0


@dataclass(slots=True)
class _TokenUsage:
    window_start: float = 0.0
    used: int = 0  # tokens generative requests used in this window (settled)
    reserved: int = 0  # tokens held by requests still running


@dataclass(slots=True)
class TenantState:
    tenant_class: str
    priority: int
    limits: Limits
    inflight: int = 0
    usage: dict[str, _Usage] = field(default_factory=dict)  # window -> this window's use
    outcomes: dict[str, int] = field(default_factory=dict)  # admitted / limited / shed
    cpu_ns: int = 0  # guest CPU time so far
    tokens: dict[str, _TokenUsage] = field(default_factory=dict)  # window -> token use
    tokens_used: int = 0  # tokens so far


@dataclass(frozen=True, slots=True)
class TokenGrant:
    """A generative request's share of its tenant's token budgets: `reserved` tokens held in
    each window (window -> its start) until the request ends and settles what it used;
    `completion`, the most completion tokens they allow (None: no budget limits it); and the
    x-ratelimit-* headers in tokens its response carries (remaining after this reservation)."""

    reserved: int
    windows: tuple[tuple[str, float], ...]
    completion: int | None
    headers: tuple[tuple[bytes, bytes], ...]


@dataclass(slots=True)
class Ticket:
    """An admitted request; `done` charges its guest CPU time."""

    state: TenantState
    admission: Admission
    tenant: str

    def done(self, guest_cpu_ns: int) -> None:
        self.admission.release(self, guest_cpu_ns)


def tenant_of(value: bytes | str | None) -> str:
    """The verified tenant from the header value ('' when absent or not a claim value)."""
    if value is None:
        return ""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return text if _TENANT_OK.match(text) else ""


class Admission:
    """One function's QoS: who may start a request now, and what each tenant used."""

    def __init__(self, function: str, qos: FunctionQoS, max_concurrency: int, metrics: Metrics):
        self.function = function
        self.qos = qos
        self.max = max_concurrency
        self.metrics = metrics
        self.inflight = 0
        self.tenants: dict[str, TenantState] = {}
        ranks = sorted({c.priority for c in qos.classes}, reverse=True)
        self.thresholds = {
            p: shed_threshold(i, len(ranks), max_concurrency) for i, p in enumerate(ranks)
        }

    def state(self, tenant: str) -> TenantState:
        state = self.tenants.get(tenant)
        if state is None:
            cls = self.qos.class_of(tenant)
            state = self.tenants[tenant] = TenantState(
                cls.name, cls.priority, self.qos.limits_of(tenant)
            )
        return state

    def _count(self, tenant: str, state: TenantState, outcome: str) -> None:
        state.outcomes[outcome] = state.outcomes.get(outcome, 0) + 1
        self.metrics.qos_requests.labels(self.function, tenant, state.tenant_class, outcome).inc()

    def _refuse(self, tenant: str, state: TenantState, refusal: Refusal) -> Refusal:
        self._count(tenant, state, "shed" if refusal.limit == LIMIT_SHED else "limited")
        return refusal

    def admit(self, tenant: str, now: float | None = None) -> Ticket:
        state = self.state(tenant)
        body: dict[str, object] = {
            "function": self.function,
            "policy": self.qos.policy,
            "tenant": tenant,
            "class": state.tenant_class,
        }
        limits = state.limits
        if limits.concurrency is not None and state.inflight >= limits.concurrency:
            raise self._refuse(
                tenant,
                state,
                Refusal(
                    LIMIT_CONCURRENCY,
                    f"tenant {tenant or '(anonymous)'} has {limits.concurrency} requests in flight "
                    f"on {self.function}, its concurrency limit",
                    1,
                    limits.concurrency,
                    body,
                ),
            )
        wall = time.time() if now is None else now
        for budget in limits.compute:
            start, end = window_bounds(budget.per, wall)
            usage = state.usage.setdefault(budget.per, _Usage(start))
            if usage.window_start != start:
                usage.window_start, usage.used_us = start, 0
            if usage.used_us >= budget.cpuMs * 1000:
                raise self._refuse(
                    tenant,
                    state,
                    Refusal(
                        LIMIT_COMPUTE,
                        f"tenant {tenant or '(anonymous)'} used its compute budget of "
                        f"{budget.cpuMs} guest CPU ms per {budget.per}",
                        max(1, math.ceil(end - wall)),
                        budget.cpuMs,
                        {**body, "window": budget.per, "used_ms": usage.used_us // 1000},
                    ),
                )
        threshold = self.thresholds.get(state.priority, self.max)
        if self.inflight >= threshold:
            raise self._refuse(
                tenant,
                state,
                Refusal(
                    LIMIT_SHED,
                    f"{self.function} is saturated ({self.inflight} requests in flight): class "
                    f"{state.tenant_class} (priority {state.priority}) is shed first",
                    1,
                    threshold,
                    body,
                ),
            )
        state.inflight += 1
        self.inflight += 1
        self._count(tenant, state, "admitted")
        return Ticket(state, self, tenant)

    def reserve(
        self, ticket: Ticket, prompt: int, max_tokens: int, now: float | None = None
    ) -> TokenGrant | None:
        """Hold a generative request's tokens against its tenant's token budgets: its prompt
        plus max_tokens (`tokenReservation: full`: refused with 429 unless every budget has
        that much left), or with `partial` as much of it as is left (the prompt and at least
        one completion token must fit; the stream then stops at what is left). None: no token
        budget applies."""
        state = ticket.state
        budgets = state.limits.tokens
        if not budgets:
            return None
        wall = time.time() if now is None else now
        lefts = []
        for budget in budgets:
            start, end = window_bounds(budget.per, wall)
            usage = state.tokens.setdefault(budget.per, _TokenUsage(start))
            if usage.window_start != start:  # a new window: what is held now counts in it
                usage.window_start, usage.used = start, 0
            lefts.append((budget.tokens - usage.used - usage.reserved, budget, end))
        want = prompt + max_tokens
        need = want if self.qos.tokenReservation == "full" else prompt + 1
        for left, budget, end in lefts:
            if left < need:
                raise self._refuse(ticket.tenant, state, self._token_refusal(
                    ticket.tenant, state, budget.tokens, budget.per, left, need, wall, end
                ))  # fmt: skip
        room = min(left for left, _, _ in lefts)
        reserved = min(want, room)
        for budget in budgets:
            state.tokens[budget.per].reserved += reserved
        tightest = min(lefts, key=lambda item: item[0])
        left, budget, end = tightest
        reset = str(max(1, math.ceil(end - wall))).encode()
        remaining = str(max(0, left - reserved)).encode()
        limit = str(budget.tokens).encode()
        headers = (
            (b"x-ratelimit-limit-tokens", limit),
            (b"x-ratelimit-remaining-tokens", remaining),
            (b"x-ratelimit-reset-tokens", reset),
            (b"x-ratelimit-limit", limit),
            (b"x-ratelimit-remaining", remaining),
            (b"x-ratelimit-reset", reset),
        )
        completion = None if reserved >= want else reserved - prompt
        windows = tuple((b.per, state.tokens[b.per].window_start) for b in budgets)
        return TokenGrant(reserved, windows, completion, headers)

    def _token_refusal(
        self,
        tenant: str,
        state: TenantState,
        quota: int,
        window: str,
        left: int,
        need: int,
        wall: float,
        end: float,
    ) -> Refusal:
        body = {
            "function": self.function,
            "policy": self.qos.policy,
            "tenant": tenant,
            "class": state.tenant_class,
            "window": window,
            "tokens_left": max(0, left),
            "tokens_needed": need,
        }
        what = "its prompt plus max_tokens" if self.qos.tokenReservation == "full" else "its prompt"
        return Refusal(
            LIMIT_TOKENS,
            f"tenant {tenant or '(anonymous)'} has {max(0, left)} of its {quota} tokens per "
            f"{window} left; this request needs {need} ({what})",
            max(1, math.ceil(end - wall)),
            quota,
            body,
        )

    def settle(self, ticket: Ticket, grant: TokenGrant, used: int) -> None:
        """A generative request ended having used `used` tokens (prompt + completion, the
        backend's own count; a cut stream: what it generated): its reservation is released and
        its use charged."""
        state = ticket.state
        state.tokens_used += used
        for window, start in grant.windows:
            usage = state.tokens.get(window)
            if usage is None:
                continue
            if usage.window_start == start:
                usage.reserved = max(0, usage.reserved - grant.reserved)
            usage.used += used
            self.metrics.qos_tokens.labels(
                self.function, ticket.tenant, state.tenant_class, window
            ).set(usage.used)

    def release(self, ticket: Ticket, guest_cpu_ns: int) -> None:
        state = ticket.state
        state.inflight -= 1
        self.inflight -= 1
        used_us = guest_cpu_ns // 1000
        state.cpu_ns += guest_cpu_ns
        self.metrics.qos_cpu.labels(self.function, ticket.tenant, state.tenant_class).inc(
            guest_cpu_ns / 1e9
        )
        for window, usage in state.usage.items():
            usage.used_us += used_us
            self.metrics.qos_budget.labels(
                self.function, ticket.tenant, state.tenant_class, window
            ).set(usage.used_us / 1000)

    def snapshot(self) -> list[dict[str, object]]:
        """Per tenant: class, outcomes, guest CPU, budget use (the status endpoint)."""
        return [
            {
                "tenant": tenant,
                "class": s.tenant_class,
                "priority": s.priority,
                "inflight": s.inflight,
                **{o: s.outcomes.get(o, 0) for o in ("admitted", "limited", "shed")},
                "guest_cpu_ms": s.cpu_ns // 1_000_000,
                "budget_used_ms": {w: u.used_us // 1000 for w, u in s.usage.items()},
                "tokens_used": s.tokens_used,
                "token_budget_used": {w: u.used for w, u in s.tokens.items()},
                "tokens_reserved": {w: u.reserved for w, u in s.tokens.items()},
            }
            for tenant, s in sorted(self.tenants.items())
        ]


class Load:
    """The backend's load as ORCA's `endpoint-load-metrics` (contracts.qos.orca_text, per
    worker thread), so Envoy's client_side_weighted_round_robin sends a busy endpoint less."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.recent: deque[float] = deque()
        # (inflight, responses in the last second) -> the header: one text formatting per
        # distinct pair instead of per response (bounded: cleared when full)
        self._headers: dict[tuple[int, int], tuple[bytes, bytes]] = {}

    def header(self, inflight: int, now: float | None = None) -> tuple[bytes, bytes]:
        """The report for a response, counting it among the last second's."""
        moment = time.monotonic() if now is None else now
        recent = self.recent
        recent.append(moment)
        while recent[0] < moment - 1.0:
            recent.popleft()
        key = (inflight, len(recent))
        header = self._headers.get(key)
        if header is None:
            if len(self._headers) >= _ORCA_CACHE:
                self._headers.clear()
            text = orca_text(inflight, self.workers, key[1]).encode()
            header = self._headers[key] = (_ORCA_NAME, text)
        return header


_ORCA_NAME = ORCA_HEADER.encode()
_ORCA_CACHE = 4096
