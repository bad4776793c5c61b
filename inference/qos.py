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
from meshfn.contracts.token_book import Reservation, Shortfall, TokenBook

from .kserve import KServeError
from .ledger import TokenLedger
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
class TenantState:
    tenant_class: str
    priority: int
    limits: Limits
    inflight: int = 0
    usage: dict[str, _Usage] = field(default_factory=dict)  # window -> this window's use
    outcomes: dict[str, int] = field(default_factory=dict)  # admitted / limited / shed
    cpu_ns: int = 0  # guest CPU time so far
    tokens_used: int = 0  # tokens so far (this process's requests)
    tokens_window: dict[str, int] = field(default_factory=dict)  # window -> used, as last settled


@dataclass(frozen=True, slots=True)
class TokenGrant:
    """A generative request's share of its tenant's token budgets (the book's reservation,
    settled when the request ends); `completion`, the most completion tokens they allow (None:
    no budget limits it); the x-ratelimit-* headers in tokens its response carries (remaining
    after this reservation)."""

    reservation: Reservation
    headers: tuple[tuple[bytes, bytes], ...]

    @property
    def completion(self) -> int | None:
        return self.reservation.completion

    @staticmethod
    def of(reservation: Reservation) -> TokenGrant:
        limit = str(reservation.limit).encode()
        remaining = str(reservation.remaining).encode()
        reset = str(reservation.reset).encode()
        return TokenGrant(
            reservation,
            (
                (b"x-ratelimit-limit-tokens", limit),
                (b"x-ratelimit-remaining-tokens", remaining),
                (b"x-ratelimit-reset-tokens", reset),
                (b"x-ratelimit-limit", limit),
                (b"x-ratelimit-remaining", remaining),
                (b"x-ratelimit-reset", reset),
            ),
        )


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

    def __init__(
        self,
        function: str,
        qos: FunctionQoS,
        max_concurrency: int,
        metrics: Metrics,
        name: str | None = None,
        ledger: TokenLedger | None = None,
    ) -> None:
        self.function = function  # its label (name@version)
        self.name = name or function  # its name: the key of its token budgets
        self.ledger = ledger  # the mesh's token budgets (None: this process keeps its own)
        self.book = TokenBook()
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

    async def reserve(
        self, ticket: Ticket, prompt: int, max_tokens: int, now: float | None = None
    ) -> TokenGrant | None:
        """Hold a generative request's tokens against its tenant's token budgets: its prompt
        plus max_tokens (`tokenReservation: full`: refused with 429 unless every budget has
        that much left), or with `partial` as much of it as is left (the prompt and at least
        one completion token must fit; the stream then stops at what is left). In the mesh's
        book when the backend has the control plane's ledger, else in this process's. None: no
        token budget applies."""
        state = ticket.state
        budgets = state.limits.tokens
        if not budgets:
            return None
        if self.ledger is not None:
            result = await self.ledger.reserve(self.name, ticket.tenant, prompt, max_tokens)
        else:
            result = self.book.reserve(
                (self.name, ticket.tenant),
                budgets,
                prompt,
                max_tokens,
                self.qos.tokenReservation,
                time.time() if now is None else now,
            )
        if isinstance(result, Shortfall):
            raise self._refuse(
                ticket.tenant, state, self._token_refusal(ticket.tenant, state, result)
            )
        return TokenGrant.of(result) if result is not None else None

    def _token_refusal(self, tenant: str, state: TenantState, short: Shortfall) -> Refusal:
        body = {
            "function": self.function,
            "policy": self.qos.policy,
            "tenant": tenant,
            "class": state.tenant_class,
            "window": short.window,
            "tokens_left": short.left,
            "tokens_needed": short.need,
        }
        what = "its prompt plus max_tokens" if self.qos.tokenReservation == "full" else "its prompt"
        return Refusal(
            LIMIT_TOKENS,
            f"tenant {tenant or '(anonymous)'} has {short.left} of its {short.quota} tokens per "
            f"{short.window} left; this request needs {short.need} ({what})",
            short.reset,
            short.quota,
            body,
        )

    def settle(self, ticket: Ticket, grant: TokenGrant, used: int) -> None:
        """A generative request ended having used `used` tokens (prompt + completion, the
        backend's own count; a cut stream: what it generated): its reservation is released and
        its use charged (in the mesh's book: sent behind, the stream has ended)."""
        state = ticket.state
        state.tokens_used += used
        held = grant.reservation
        if self.ledger is not None:
            self.ledger.settle(
                self.name, ticket.tenant, held, used, lambda w: self._used(ticket, w)
            )
        else:
            key = (self.name, ticket.tenant)
            self._used(ticket, self.book.settle(key, held.windows, held.reserved, used))

    def _used(self, ticket: Ticket, windows: Mapping[str, int]) -> None:
        state = ticket.state
        for window, used in windows.items():
            state.tokens_window[window] = used
            self.metrics.qos_tokens.labels(
                self.function, ticket.tenant, state.tenant_class, window
            ).set(used)

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
        """Per tenant: class, outcomes, guest CPU, budget use (the status endpoint). Token
        budgets: this process's book, or with the mesh's ledger what it last said was used
        (what running requests hold is the ledger's to show)."""
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
                **self._token_use(tenant, s),
            }
            for tenant, s in sorted(self.tenants.items())
        ]

    def _token_use(self, tenant: str, state: TenantState) -> dict[str, object]:
        if self.ledger is not None:
            return {"token_budget_used": dict(state.tokens_window), "tokens_reserved": None}
        usage = self.book.usage((self.name, tenant))
        return {
            "token_budget_used": {w: used for w, (used, _) in usage.items()},
            "tokens_reserved": {w: held for w, (_, held) in usage.items()},
        }


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
