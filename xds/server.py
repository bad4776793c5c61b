"""ADS server (grpc.aio): state-of-the-world and incremental (delta) aggregated discovery.

Protocol reference: https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol

The server is assembled from small parts, as go-control-plane's is:
- subscription.py: one stream's protocol state for one type (names, wildcard, nonces, versions
  sent and ACKed), where the protocol's subtleties are explained;
- sotw.py and delta.py: the two protocol variants, deciding what to send from that state;
- stream.py: a stream's reader/answer loop, shared by both;
- auth.py: which workload a stream is and whether its bootstrap token proves it;
- recording.py and status.py: metrics, logs and the per-proxy record behind `meshfn status`;
- protocol.py: the limits whose breach ends a stream.

Responses are pre-assembled bytes from the snapshot cache, written through a generic handler with
an identity serializer; requests arrive as bytes and are parsed by the handlers, so a malformed
message ends only its own stream, with INVALID_ARGUMENT. Make-before-break: within one push, types
go out in PUSH_ORDER (endpoints before clusters, routes before listeners), and newly subscribed
names are answered at once, so a warming cluster never waits for the initial-fetch timeout.

Memory per stream is kept small for fleets of 10,000: a Delta stream's record of what its client
holds is a reference to the shared snapshot (subscription.py), first responses to clients that
hold nothing are shared like diffs, and the large responses being written at once are bounded
(stream.WriteBudget), since grpc keeps a copy of each until the client's window takes it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from .auth import Authenticator, StreamAuth
from .cache import SnapshotCache
from .delta import DeltaHandler
from .recording import Recorder
from .sotw import SotwHandler
from .status import Metrics, ProxyStatus
from .stream import Context, Handler, Stream, WriteBudget

log = logging.getLogger("meshfn.xds")

SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"

__all__ = ["SERVICE", "AdsServer", "Authenticator"]


def _identity(data: bytes) -> bytes:
    return data


class AdsServer:
    """`authenticate(node_cluster, authorization_metadata)` decides whether a stream may have
    the configuration (and private keys) of the workload it claims to be; None trusts anyone
    (tests of the protocol alone). `budget` bounds the bytes of large responses in flight;
    `on_streams(count)` hears how many streams are open whenever that changes (the process's
    GC tuning scales with it)."""

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: Metrics | None = None,
        authenticate: Authenticator | None = None,
        budget: WriteBudget | None = None,
        on_streams: Callable[[int], None] | None = None,
    ) -> None:
        self.cache = cache
        self.metrics = metrics or Metrics()
        self.authenticate = authenticate
        recorder = Recorder(self.metrics)
        auth = StreamAuth(authenticate)
        budget = budget or WriteBudget()  # one for both protocols: it bounds the memory
        self._sotw = SotwHandler(cache, recorder, auth, budget)
        self._delta = DeltaHandler(cache, recorder, auth, budget)
        self._recorder = recorder
        self._extra_handlers: list[grpc.GenericRpcHandler] = []
        self._streams: dict[int, Stream] = {}
        self._on_streams = on_streams or (lambda count: None)
        self._server: grpc.aio.Server | None = None

    async def start(self, address: str = "127.0.0.1", port: int = 0) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                ("grpc.max_concurrent_streams", 100_000),
                # Large fleets reconnect at once after a restart: let calls wait for the
                # handler instead of being dropped by grpc-core (FACTS.md, fan-out ceiling).
                ("grpc.server_max_unrequested_time_in_server", 3600),
                # Calls waiting for the handler beyond these counts are refused at random
                # (grpc-core's early detection: clients see CANCELLED); a reconnect storm of
                # thousands of proxies exceeded the defaults (1000 soft, 3000 hard).
                ("grpc.server.max_pending_requests", 1_000_000),
                ("grpc.server.max_pending_requests_hard_limit", 1_000_000),
            ],
            maximum_concurrent_rpcs=None,
        )
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "StreamAggregatedResources": self._method(self._sotw),
                "DeltaAggregatedResources": self._method(self._delta),
            },
        )
        server.add_generic_rpc_handlers((handler, *self._extra_handlers))
        bound = server.add_insecure_port(f"{address}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind the ADS server to {address}:{port}")
        await server.start()
        self._server = server
        log.info("ADS listening", extra={"address": f"{address}:{bound}"})
        return bound

    def add_handler(self, handler: grpc.GenericRpcHandler) -> None:
        """Serve another gRPC service on the ADS port (call before start)."""
        self._extra_handlers.append(handler)

    def is_connected(self, node_id: str) -> bool:
        return any(s.status.node_id == node_id for s in self._streams.values())

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    def statuses(self) -> list[ProxyStatus]:
        """Every identified stream's record (sent, ACKed, NACKed per type), by workload."""
        return [
            s.status
            for s in sorted(self._streams.values(), key=lambda s: (s.group, s.status.node_id, s.id))
            if s.group
        ]

    def streams(self) -> list[Stream]:
        """The open streams, oldest first."""
        return sorted(self._streams.values(), key=lambda s: s.id)

    def acked(self, type_url: str) -> dict[str, list[str]]:
        """Per workload, the version of `type_url` each of its streams ACKed ("" for none yet):
        cheap enough to poll, unlike `proxies()`, which renders every stream's whole status."""
        out: dict[str, list[str]] = {}
        for stream in self._streams.values():
            if stream.group:
                status = stream.status.types.get(type_url)
                out.setdefault(stream.group, []).append(status.acked_version if status else "")
        return out

    def proxies(self) -> list[dict[str, Any]]:
        return [
            s.status.as_dict(known_group=self.cache.get(s.group) is not None)
            for s in sorted(self._streams.values(), key=lambda s: (s.group, s.status.node_id, s.id))
            if s.group
        ]

    def _method(self, handler: Handler) -> grpc.RpcMethodHandler[bytes, bytes]:
        async def serve(requests: AsyncIterator[bytes], context: Context) -> None:
            stream = Stream(handler.protocol, context)
            self._streams[stream.id] = stream
            self._recorder.opened(handler.protocol)
            self._on_streams(len(self._streams))
            try:
                await handler.serve(stream, requests)
            finally:
                self._streams.pop(stream.id, None)
                self._recorder.closed(handler.protocol)
                self._on_streams(len(self._streams))

        return grpc.stream_stream_rpc_method_handler(
            serve, request_deserializer=_identity, response_serializer=_identity
        )
