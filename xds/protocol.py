"""What ends an ADS stream: the protocol error type and the limits on hostile requests.

Any request that breaks a rule here ends only its own stream, with a gRPC status that says why;
every other stream and the server carry on (docs/operations/faults.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import grpc

from .names import PUSH_ORDER, SHORT_NAMES

SUPPORTED_TYPES = frozenset(PUSH_ORDER)
# A proxy needs a few thousand names; a million is an attack on our memory and CPU.
MAX_NAMES_PER_REQUEST = 100_000
MAX_NAME_BYTES = 4096
# Our nonces are a hex counter (cache.next_nonce): anything longer was never sent by us.
MAX_NONCE_CHARS = 32


class ProtocolError(Exception):
    """A request that ends its stream: `code` goes to the client, `reason` labels the metric."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


def check_type(type_url: str) -> None:
    if type_url not in SUPPORTED_TYPES:
        raise ProtocolError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"unsupported type_url {type_url[:200]!r}; served: "
            + ", ".join(SHORT_NAMES[t] for t in PUSH_ORDER),
            "bad_type",
        )


def check_names(names: Collection[str]) -> None:
    if len(names) > MAX_NAMES_PER_REQUEST:
        raise ProtocolError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(names)} resource names in one request (limit {MAX_NAMES_PER_REQUEST})",
            "too_many_names",
        )
    if max(map(len, names), default=0) > MAX_NAME_BYTES:
        raise ProtocolError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"resource name longer than {MAX_NAME_BYTES} bytes",
            "bad_name",
        )


def raw_service(
    service: str, method: str, kind: Callable[..., grpc.RpcMethodHandler[Any, Any]], behaviour: Any
) -> grpc.GenericRpcHandler:
    """One method of a service served next to ADS (`kind`: grpc.unary_unary_rpc_method_handler
    or another), taking the request bytes as they came so that the handler parses them itself
    and answers a malformed message with its own gRPC status."""
    return grpc.method_handlers_generic_handler(
        service,
        {
            method: kind(
                behaviour,
                request_deserializer=lambda data: data,
                response_serializer=lambda message: message.SerializeToString(),
            )
        },
    )
