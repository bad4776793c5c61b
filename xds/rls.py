"""Envoy's rate-limit service (RLS, `envoy.service.ratelimit.v3`), served next to ADS on the
control plane's port: the global rates of QoSPolicies whose `global` asks for one count across
every gateway they bind.

A request's domain is the policy (namespace/name); its one descriptor names the policy again and
the verified tenant (fragments.qos.global_rate_limit), or no tenant: the anonymous tenant. Each
(policy, tenant) has one token bucket for all gateways, refilled continuously at the tenant's
rate and holding at most its burst, like the local limit's. Requests the service cannot answer
(an unknown domain, a malformed descriptor) get a gRPC error, which the gateway treats as the
limit service failing: the policy's `onLimitServiceError`.

Every call must prove which gateway asks, as an ADS stream proves its workload: metadata
`x-meshfn-node` (contracts.qos.LIMIT_SERVICE_NODE_HEADER, the gateway's node cluster) and
`authorization: Bearer <token>` that `authenticate` accepts for that node (the control plane's
limit-service token, rendered into that gateway's ratelimit filter only). A call without them, or
whose token is another node's, is UNAUTHENTICATED before its request is even parsed; a proven
gateway that the policy does not bind is PERMISSION_DENIED. Either way no bucket is touched, and
the refusal is counted in meshfn_qos_global_errors_total{reason}.

Buckets live in this process's memory and, with `state`, in a SQLite file in the control plane's
state directory: written behind the decisions (at most every SAVE_INTERVAL seconds, off the
event loop, and on stop), read back at start with each bucket's wall-clock age, so a restart
resumes every tenant's bucket where it was instead of handing out a fresh burst. A crash
(SIGKILL) forgets at most the last SAVE_INTERVAL of spending; an unreadable file is logged,
counted (reason "state") and replaced: the buckets start full, as without a file. Several
control-plane processes would each count their own callers (meshfn runs one limit service per
mesh).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter

from meshfn import ir
from meshfn.contracts.qos import (
    DESCRIPTOR_POLICY,
    DESCRIPTOR_TENANT,
    LIMIT_HEADER,
    LIMIT_RATE,
    LIMIT_SERVICE_NODE_HEADER,
)

from .auth import MAX_GROUP_CHARS, Authenticator, authorization, metadata
from .protocol import raw_service

log = logging.getLogger("meshfn.rls")

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
# (policy, tenant) buckets kept in all, least recently used first out (an evicted tenant starts
# again with a full bucket, as with each gateway's local limit).
MAX_BUCKETS = 10_000
SAVE_INTERVAL = 1.0  # seconds between writes of the buckets to the state file, at most
_UNITS = {1: "SECOND", 60: "MINUTE", 3600: "HOUR", 86400: "DAY"}
Code = rls_pb2.RateLimitResponse.Code


@dataclass(frozen=True, slots=True)
class GlobalPolicy:
    """A QoSPolicy with a global rate and the node clusters of the gateways it binds (the only
    callers that may spend its buckets)."""

    policy: ir.QoSPolicy
    gateways: frozenset[str]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RequestError(ValueError):
    """A request the service cannot answer: the gRPC status and why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RateLimitService:
    """`policies()`: the current global policies by key (the last good MeshModel's);
    `authenticate(node_cluster, authorization)`: whether a call's token proves its node."""

    def __init__(
        self,
        policies: Callable[[], Mapping[str, GlobalPolicy]],
        authenticate: Authenticator,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        state: Path | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.policies = policies
        self.authenticate = authenticate
        self.clock = clock
        self.wall = wall
        self.state = state
        self._buckets: OrderedDict[tuple[str, str], _Bucket] = OrderedDict()
        self._saved_at = -math.inf
        self._saving: asyncio.Task[None] | None = None
        self._dirty = False
        # (policy, tenant label) -> [allowed, over limit]: `meshfn status`.
        self._counts: dict[tuple[str, str], list[int]] = {}
        self.registry = registry = registry or CollectorRegistry()
        self.decisions = Counter(
            "meshfn_qos_global_requests",
            "Global rate limit decisions of the control plane's limit service (tenant: a listed "
            "tenant, '' the anonymous one, '*' any other)",
            ["policy", "tenant", "outcome"],
            registry=registry,
        )
        self.errors = Counter(
            "meshfn_qos_global_errors",
            "Limit service requests refused with a gRPC error",
            ["reason"],
            registry=registry,
        )
        if state is not None:
            self._load(state)

    def handler(self) -> grpc.GenericRpcHandler:
        return raw_service(
            SERVICE, "ShouldRateLimit", grpc.unary_unary_rpc_method_handler, self._should_rate_limit
        )

    async def _should_rate_limit(
        self, raw: bytes, context: grpc.aio.ServicerContext[bytes, rls_pb2.RateLimitResponse]
    ) -> rls_pb2.RateLimitResponse:
        try:
            caller = self.caller(
                metadata(context, LIMIT_SERVICE_NODE_HEADER), authorization(context)
            )
            request = rls_pb2.RateLimitRequest.FromString(raw)
            response = self.decide(request, caller)
            self._save_behind()
            return response
        except DecodeError:
            self.errors.labels("malformed").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed RateLimitRequest")
            raise
        except RequestError as exc:
            self.errors.labels(exc.code.name.lower()).inc()
            log.warning("limit service request refused", extra={"reason": str(exc)})
            await context.abort(exc.code, str(exc))
            raise

    def caller(self, node: str | None, token: str | None) -> str:
        """The gateway (node cluster) a call's metadata proves, or the error that refuses it."""
        if not node or len(node) > MAX_GROUP_CHARS or not self.authenticate(node, token):
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the limit service needs {LIMIT_SERVICE_NODE_HEADER} and a valid limit-service"
                " token for that gateway",
            )
        return node

    def decide(self, request: rls_pb2.RateLimitRequest, caller: str) -> rls_pb2.RateLimitResponse:
        """Count the request of gateway `caller` (proven) against each descriptor's bucket; over
        any, it is over the limit."""
        bound = self.policies().get(request.domain)
        if bound is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"no QoSPolicy with a global rate is {request.domain!r}"
            )
        if caller not in bound.gateways:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"QoSPolicy {request.domain!r} does not bind gateway {caller[:100]!r}",
            )
        policy = bound.policy
        if not request.descriptors:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no descriptors")
        hits = request.hits_addend or 1
        response = rls_pb2.RateLimitResponse(overall_code=Code.OK)
        waits: list[float] = []
        for descriptor in request.descriptors:
            tenant = _tenant(policy, descriptor.entries)
            own = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else 0
            status, wait = self._take(policy, tenant, own or hits)
            response.statuses.append(status)
            if status.code == Code.OVER_LIMIT:
                response.overall_code = Code.OVER_LIMIT
                waits.append(wait)
        if waits:
            for key, value in (
                ("retry-after", str(max(1, math.ceil(max(waits))))),
                (LIMIT_HEADER, LIMIT_RATE),
            ):
                response.response_headers_to_add.append(base_pb2.HeaderValue(key=key, value=value))
        return response

    def _take(
        self, policy: ir.QoSPolicy, tenant: str, hits: int
    ) -> tuple[rls_pb2.RateLimitResponse.DescriptorStatus, float]:
        rate = policy.limits_of(tenant)[1].rate
        label = tenant if tenant == "" or any(t.name == tenant for t in policy.tenants) else "*"
        if rate is None:
            self._count(policy.key, label, True)
            return rls_pb2.RateLimitResponse.DescriptorStatus(code=Code.OK), 0.0
        now = self.clock()
        key = (policy.key, tenant)
        bucket = self._buckets.get(key)
        per_second = rate.requests / rate.seconds
        if bucket is None:
            bucket = _Bucket(float(rate.burst), now)
            self._buckets[key] = bucket
            while len(self._buckets) > MAX_BUCKETS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            bucket.tokens = min(float(rate.burst), bucket.tokens + (now - bucket.at) * per_second)
            bucket.at = now
        allowed = bucket.tokens >= hits
        if allowed:
            bucket.tokens -= hits
        self._dirty = True
        wait = max(0.0, (hits - bucket.tokens) / per_second)
        # Until the bucket is full again (the x-ratelimit-reset header).
        full = (rate.burst - bucket.tokens) / per_second
        status = rls_pb2.RateLimitResponse.DescriptorStatus(
            code=Code.OK if allowed else Code.OVER_LIMIT,
            limit_remaining=int(bucket.tokens),
            duration_until_reset=_duration(full),
        )
        unit = _UNITS.get(rate.seconds)
        if unit is not None:
            status.current_limit.requests_per_unit = rate.requests
            status.current_limit.unit = rls_pb2.RateLimitResponse.RateLimit.Unit.Value(unit)
        self._count(policy.key, label, allowed)
        return status, wait

    # ------------------------------------------------------------ the state file

    def _rows(self) -> list[tuple[str, str, float, float]]:
        """(policy, tenant, tokens, wall-clock time the tokens were counted) per bucket."""
        now, wall = self.clock(), self.wall()
        return [(k[0], k[1], b.tokens, wall - (now - b.at)) for k, b in self._buckets.items()]

    def _save_behind(self) -> None:
        """After a decision: write the buckets in a worker thread unless written (or being
        written) within SAVE_INTERVAL; a later decision writes what this one skipped."""
        if self.state is None or not self._dirty or self._saving is not None:
            return
        if self.clock() - self._saved_at < SAVE_INTERVAL:
            return
        self._saved_at, self._dirty = self.clock(), False
        self._saving = asyncio.get_running_loop().create_task(self._save_async(self._rows()))

    async def _save_async(self, rows: list[tuple[str, str, float, float]]) -> None:
        try:
            await asyncio.to_thread(self._write, rows)
        finally:
            self._saving = None

    async def flush(self) -> None:
        """Write the buckets now (stop: nothing spent is forgotten)."""
        if self._saving is not None:
            await self._saving
        if self.state is not None and self._dirty:
            self._dirty = False
            await asyncio.to_thread(self._write, self._rows())

    def _write(self, rows: list[tuple[str, str, float, float]]) -> None:
        assert self.state is not None
        try:
            with contextlib.closing(_connect(self.state)) as db, db:
                db.execute("DELETE FROM buckets")
                db.executemany("INSERT INTO buckets VALUES (?, ?, ?, ?)", rows)
        except sqlite3.Error as exc:
            self.errors.labels("state").inc()
            log.warning("cannot write the limit service's buckets: %s", exc)

    def _load(self, path: Path) -> None:
        if not path.exists():
            return
        try:
            with contextlib.closing(_connect(path)) as db:
                rows = db.execute(
                    "SELECT policy, tenant, tokens, at FROM buckets ORDER BY at"
                ).fetchall()
        except sqlite3.Error as exc:
            self.errors.labels("state").inc()
            log.warning("the limit service's buckets are unreadable (%s): starting full", exc)
            path.unlink(missing_ok=True)
            return
        now, wall = self.clock(), self.wall()
        for policy, tenant, tokens, at in rows[-MAX_BUCKETS:]:
            # Refilled for the time since, up to the burst, at the next decision (_take).
            self._buckets[(policy, tenant)] = _Bucket(float(tokens), now - max(0.0, wall - at))

    def _count(self, policy: str, label: str, allowed: bool) -> None:
        self.decisions.labels(policy, label, "allowed" if allowed else "over_limit").inc()
        counts = self._counts.setdefault((policy, label), [0, 0])
        counts[0 if allowed else 1] += 1

    def summary(self) -> list[dict[str, object]]:
        """Per policy and tenant (listed, "" anonymous, "*" any other): the decisions so far."""
        return [
            {"policy": policy, "tenant": tenant, "allowed": counts[0], "over_limit": counts[1]}
            for (policy, tenant), counts in sorted(self._counts.items())
        ]


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=5)
    db.execute(
        "CREATE TABLE IF NOT EXISTS buckets (policy TEXT, tenant TEXT, tokens REAL, at REAL,"
        " PRIMARY KEY (policy, tenant))"
    )
    return db


def _tenant(policy: ir.QoSPolicy, entries: Iterable[Any]) -> str:
    """The descriptor's tenant ("" without one), checking it names this policy."""
    found: dict[str, str] = {}
    for entry in entries:
        if entry.key not in (DESCRIPTOR_POLICY, DESCRIPTOR_TENANT) or entry.key in found:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"unexpected descriptor entry {entry.key!r}"
            )
        found[entry.key] = entry.value
    if found.get(DESCRIPTOR_POLICY) != policy.key:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the descriptor must name the policy {policy.key!r} as {DESCRIPTOR_POLICY}",
        )
    tenant = found.get(DESCRIPTOR_TENANT, "")
    if len(tenant) > 128 or any(ord(c) < 0x20 or ord(c) == 0x7F for c in tenant):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "the tenant is not a claim value")
    return tenant


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


def global_policies(model: ir.MeshModel) -> dict[str, GlobalPolicy]:
    """Each QoSPolicy with a global rate, with the gateways bound to it (global rates bind
    whole gateways only)."""
    return {
        p.key: GlobalPolicy(
            p,
            frozenset(
                w.node_cluster
                for w in model.workloads
                if w.kind == "gateway" and w.qos is not None and w.qos.key == p.key
            ),
        )
        for p in model.qos
        if p.global_rate is not None
    }
