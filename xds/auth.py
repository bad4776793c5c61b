"""Which workload a stream is, and whether it may be told: checked on its first request, before
anything (private keys included) is sent.

The workload (snapshot group) is what the node claims in its first request; `authenticate` (the
control plane's bootstrap-token check, control_plane/identity/bootstrap_token.py) decides whether
the stream's `authorization` metadata proves that claim. The ADS server never knows how tokens
are made: it gets a function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2

from .protocol import ProtocolError

# (workload, authorization metadata or None) -> may this stream have that workload's config?
Authenticator = Callable[[str, str | None], bool]

METADATA_KEY = "authorization"
MAX_GROUP_CHARS = 256
MAX_NODE_ID_CHARS = 1024


def metadata(context: grpc.aio.ServicerContext[Any, Any], key: str) -> str | None:
    """A call's first `key` in its initial metadata (None: none sent)."""
    return next((str(v) for k, v in context.invocation_metadata() or () if k == key), None)


def authorization(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The stream's bearer token as sent in its initial metadata (None: none sent)."""
    return metadata(context, METADATA_KEY)


class StreamAuth:
    """`authenticate` None trusts every claim (tests of the protocol alone)."""

    def __init__(self, authenticate: Authenticator | None) -> None:
        self.authenticate = authenticate

    def identify(self, node: base_pb2.Node, present: bool, token: str | None) -> tuple[str, str]:
        """(workload, node id) of a stream's first request, or the error that ends it."""
        if not present or not (node.id or node.cluster):
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first request on a stream must carry node (id and cluster)",
                "no_node",
            )
        # Envoy's node.cluster names the workload; bare clients may send only "workload~n".
        group = node.cluster or node.id.split("~", 1)[0]
        if len(group) > MAX_GROUP_CHARS or len(node.id) > MAX_NODE_ID_CHARS:
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT, "node id or cluster too long", "bad_node"
            )
        if self.authenticate is not None and not self.authenticate(group, token):
            raise ProtocolError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"no valid bootstrap token for workload {group[:100]!r}",
                "unauthenticated",
            )
        return group, node.id or group
