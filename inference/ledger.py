"""The backend's side of the mesh's book of token budgets (contracts.token_book, kept by the
control plane's limit service: xds/ledger.py), so that every backend of a function and every
process of a backend spend the same budgets.

Two calls, JSON over gRPC on the control plane's port, proven as the limit service's callers are
(`x-meshfn-node` and the bearer token the control plane issued this backend): Reserve before a
generative request starts, Settle when it ends (sent behind the stream, retried a few times). A
ledger that cannot be reached refuses the request with 503 (budgets are a quota: a backend does
not hand out tokens it cannot count); a settle that never arrives leaves the request's hold in
the book until the window ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from meshfn.contracts.function import TokenLedgerAccess
from meshfn.contracts.qos import LIMIT_SERVICE_NODE_HEADER, TOKEN_LEDGER_SERVICE
from meshfn.contracts.token_book import Reservation, Shortfall

from .kserve import KServeError
from .metrics import Metrics

log = logging.getLogger("meshfn.inference.ledger")

TIMEOUT_S = 2.0
SETTLE_TRIES = 4


class LedgerUnavailable(KServeError):
    def __init__(self, why: str) -> None:
        super().__init__(503, f"the mesh's token budgets cannot be checked now: {why}")
        self.headers = ((b"retry-after", b"1"),)


def _encode(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload).encode()


class TokenLedger:
    def __init__(self, access: TokenLedgerAccess, metrics: Metrics) -> None:
        self.access = access
        self.metrics = metrics
        self.metadata = (
            (LIMIT_SERVICE_NODE_HEADER, access.node),
            ("authorization", access.authorization),
        )
        self._channel: grpc.aio.Channel | None = None
        self._pending: set[asyncio.Task[None]] = set()

    def _call(self, method: str) -> Any:
        if self._channel is None:  # made on the event loop that uses it
            self._channel = grpc.aio.insecure_channel(self.access.target)
        return self._channel.unary_unary(
            f"/{TOKEN_LEDGER_SERVICE}/{method}",
            request_serializer=_encode,
            response_deserializer=json.loads,
        )

    async def reserve(
        self, function: str, tenant: str, prompt: int, max_tokens: int
    ) -> Reservation | Shortfall | None:
        request = {"function": function, "tenant": tenant, "prompt": prompt,
                   "max_tokens": max_tokens}  # fmt: skip
        try:
            answer = await self._call("Reserve")(request, timeout=TIMEOUT_S, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            self.metrics.qos_ledger_errors.labels("reserve").inc()
            log.warning("token ledger: reserve failed", extra={"reason": exc.details()})
            raise LedgerUnavailable(f"{exc.code().name.lower()}: {exc.details()}") from None
        if "reservation" in answer:
            return Reservation.from_json(answer["reservation"])
        if "shortfall" in answer:
            return Shortfall.from_json(answer["shortfall"])
        return None

    def settle(
        self,
        function: str,
        tenant: str,
        held: Reservation,
        used: int,
        on_settled: Callable[[Mapping[str, int]], None],
    ) -> None:
        """Settle behind the request (its stream has ended); `on_settled` gets the tokens used
        so far per window."""
        request = {"function": function, "tenant": tenant, "reservation": held.to_json(),
                   "used": used}  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._settle(request, on_settled))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _settle(
        self, request: dict[str, Any], on_settled: Callable[[Mapping[str, int]], None]
    ) -> None:
        for attempt in range(SETTLE_TRIES):
            try:
                answer = await self._call("Settle")(
                    request, timeout=TIMEOUT_S, metadata=self.metadata
                )
            except grpc.aio.AioRpcError as exc:
                self.metrics.qos_ledger_errors.labels("settle").inc()
                retry = exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                if not retry or attempt == SETTLE_TRIES - 1:
                    log.warning("token ledger: settle lost", extra={"reason": exc.details()})
                    return
                await asyncio.sleep(0.2 * 2**attempt)
                continue
            on_settled({str(w): int(n) for w, n in answer.get("used", {}).items()})
            return

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=TIMEOUT_S)
        if self._channel is not None:
            await self._channel.close()
