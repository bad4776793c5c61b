"""The mesh's book of token budgets (QoSPolicy `tokens` on Functions), served beside the limit
service on the control plane's port: every backend of a function, and every process of each,
reserves and settles in this one book (contracts.token_book), so a tenant's budget is the
mesh's and not each process's.

`meshfn.qos.v1.TokenLedger`, two unary methods, JSON in and out:
- Reserve {function, tenant, prompt, max_tokens} -> {reservation} | {shortfall} | {} (no budget);
- Settle {function, tenant, reservation, used} -> {used: {window: tokens used so far}}.
The caller proves itself as the limit service's callers do (`x-meshfn-node`, here a backend's
`backend:<service key>`, and the bearer token the control plane issued it for purpose
"ledger"); it may spend only the budgets of functions its service serves. The budgets, the
windows and the reservation mode come from the control plane's current model, never from the
caller. A bad call gets a gRPC error, as the limit service's.

The book's settled use is written behind to a JSON file in the state directory (at most every
SAVE_INTERVAL, atomically) and read back at start: a restart keeps a tenant's month. What
running requests hold is not kept: their settles after a restart charge what they used.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from meshfn import ir
from meshfn.common import peerjson
from meshfn.contracts.qos import (
    LIMIT_SERVICE_NODE_HEADER,
    TENANT,
    TOKEN_LEDGER_SERVICE,
    FunctionQoS,
    has_token_budgets,
    ledger_node,
)
from meshfn.contracts.token_book import Reservation, Shortfall, TokenBook

from .auth import MAX_GROUP_CHARS, Authenticator, authorization, metadata

log = logging.getLogger("meshfn.ledger")

SAVE_INTERVAL = 1.0
MAX_REQUEST_BYTES = 4096
MAX_TOKENS = 10**9  # a request's prompt or max_tokens beyond this is malformed
_TENANT_OK = re.compile(TENANT)


@dataclass(frozen=True, slots=True)
class Budgeted:
    """A function with token budgets: its tenant classes and the backend that may spend them."""

    qos: FunctionQoS
    caller: str  # ledger_node(its backend service)


def budgeted_functions(model: ir.MeshModel) -> dict[str, Budgeted]:
    """Functions whose QoSPolicy gives some tenant a token budget, by name."""
    return {
        f.name: Budgeted(f.qos, ledger_node(f.backend))
        for f in model.functions
        if f.qos is not None and has_token_budgets(f.qos)
    }


class BadCall(ValueError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKENS:
        raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be a token count")
    return value


class TokenLedgerService:
    def __init__(
        self,
        functions: Callable[[], Mapping[str, Budgeted]],
        authenticate: Authenticator,
        registry: CollectorRegistry | None = None,
        state: Path | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.functions = functions
        self.authenticate = authenticate
        self.wall = wall
        self.state = state
        self.book = TokenBook()
        self._saved_at = 0.0
        self._dirty = False
        registry = registry or CollectorRegistry()
        self.calls = Counter(
            "meshfn_qos_ledger_calls",
            "Calls to the mesh's token ledger (outcome: reserved, short, none, settled, refused)",
            ["call", "outcome"],
            registry=registry,
        )
        if state is not None:
            self._load(state)

    def handler(self) -> grpc.GenericRpcHandler:
        def method(behaviour: Any) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                behaviour,
                request_deserializer=lambda data: data,
                response_serializer=lambda answer: json.dumps(answer).encode(),
            )

        return grpc.method_handlers_generic_handler(
            TOKEN_LEDGER_SERVICE, {"Reserve": method(self._reserve), "Settle": method(self._settle)}
        )

    async def _reserve(self, raw: bytes, context: Any) -> dict[str, Any]:
        return await self._answer("reserve", raw, context, self.reserve)

    async def _settle(self, raw: bytes, context: Any) -> dict[str, Any]:
        return await self._answer("settle", raw, context, self.settle)

    async def _answer(
        self,
        call: str,
        raw: bytes,
        context: Any,
        behaviour: Callable[[str, dict[str, Any]], dict[str, Any]],
    ) -> dict[str, Any]:
        try:
            node = metadata(context, LIMIT_SERVICE_NODE_HEADER)
            if (
                not node
                or len(node) > MAX_GROUP_CHARS
                or not self.authenticate(node, authorization(context))
            ):
                raise BadCall(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the token ledger needs {LIMIT_SERVICE_NODE_HEADER} and a valid ledger token "
                    "for that backend",
                )
            answer = behaviour(node, _parse(raw))
        except BadCall as exc:
            self.calls.labels(call, "refused").inc()
            log.warning("token ledger call refused", extra={"reason": str(exc)})
            await context.abort(exc.code, str(exc))
            raise
        self._save_behind()
        return answer

    def _function(self, caller: str, request: Mapping[str, Any]) -> tuple[str, str, Budgeted]:
        name, tenant = request.get("function"), request.get("tenant")
        if not isinstance(name, str) or not isinstance(tenant, str):
            raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, "function and tenant are strings")
        if tenant and not _TENANT_OK.match(tenant):
            raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, "the tenant is not a claim value")
        found = self.functions().get(name)
        if found is None:
            raise BadCall(
                grpc.StatusCode.NOT_FOUND, f"no function {name[:100]!r} has token budgets"
            )
        if found.caller != caller:
            raise BadCall(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{caller[:100]!r} does not serve {name!r}: it may not spend its budgets",
            )
        return name, tenant, found

    def reserve(self, caller: str, request: dict[str, Any]) -> dict[str, Any]:
        name, tenant, found = self._function(caller, request)
        prompt = _count(request.get("prompt"), "prompt")
        max_tokens = _count(request.get("max_tokens"), "max_tokens")
        budgets = found.qos.limits_of(tenant).tokens
        result = self.book.reserve(
            (name, tenant), budgets, prompt, max_tokens, found.qos.tokenReservation, self.wall()
        )
        if isinstance(result, Reservation):
            self.calls.labels("reserve", "reserved").inc()
            return {"reservation": result.to_json()}
        if isinstance(result, Shortfall):
            self.calls.labels("reserve", "short").inc()
            return {"shortfall": result.to_json()}
        self.calls.labels("reserve", "none").inc()
        return {}

    def settle(self, caller: str, request: dict[str, Any]) -> dict[str, Any]:
        name, tenant, _ = self._function(caller, request)
        used = _count(request.get("used"), "used")
        try:
            held = Reservation.from_json(request["reservation"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, "a malformed reservation") from exc
        _count(held.reserved, "reservation.reserved")
        per_window = self.book.settle((name, tenant), held.windows, held.reserved, used)
        self._dirty = True
        self.calls.labels("settle", "settled").inc()
        return {"used": per_window}

    def usage(self) -> list[dict[str, object]]:
        """Per function and tenant: the tokens used and held per window (`meshfn status`)."""
        out: list[dict[str, object]] = []
        for function, tenant, window, _, used in sorted(self.book.rows()):
            held = self.book.usage((function, tenant)).get(window, (used, 0))[1]
            out.append({"function": function, "tenant": tenant, "window": window,
                        "used": used, "reserved": held})  # fmt: skip
        return out

    # ------------------------------------------------------------ the state file

    def _save_behind(self) -> None:
        now = time.monotonic()
        if self.state is None or not self._dirty or now - self._saved_at < SAVE_INTERVAL:
            return
        self.flush()
        self._saved_at = now

    def flush(self) -> None:
        """Write the book's settled use now (and at stop)."""
        if self.state is None or not self._dirty:
            return
        temporary = self.state.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps(self.book.rows()))
            os.replace(temporary, self.state)
            self._dirty = False
        except OSError as exc:
            log.warning("cannot write the token ledger: %s", exc)

    def _load(self, path: Path) -> None:
        if not path.exists():
            return
        try:
            self.book.load(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            log.warning("the token ledger %s is unreadable (%s): starting empty", path, exc)


def _parse(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_REQUEST_BYTES:
        raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, "the request is too large")
    try:
        request = peerjson.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, "the request is not JSON") from exc
    if not isinstance(request, dict):
        raise BadCall(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a JSON object")
    return request
