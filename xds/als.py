"""Envoy's gRPC access-log service (ALS), served next to ADS on the control plane's port.

Envoy streams per-request records here (duration, route, upstream cluster, response flags);
consumers such as the drift breaker subscribe by log name. Only proxies that hold an ADS stream
(authenticated with their bootstrap token) may report: a stream whose node is not connected is
refused, so a stray local process cannot feed fake latencies into the control loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import DecodeError

from .protocol import raw_service

log = logging.getLogger("meshfn.als")

SERVICE = "envoy.service.accesslog.v3.AccessLogService"
Sink = Callable[[str, accesslog_pb2.HTTPAccessLogEntry], None]


class AccessLogReceiver:
    def __init__(self, is_connected: Callable[[str], bool]) -> None:
        self.is_connected = is_connected
        self._sinks: dict[str, list[Sink]] = {}
        self.received = 0

    def subscribe(self, log_name: str, sink: Sink) -> None:
        self._sinks.setdefault(log_name, []).append(sink)

    def handler(self) -> grpc.GenericRpcHandler:
        return raw_service(
            SERVICE, "StreamAccessLogs", grpc.stream_unary_rpc_method_handler, self._stream
        )

    async def _stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> als_pb2.StreamAccessLogsResponse:
        node_id = ""
        sinks: list[Sink] = []
        async for raw in requests:
            try:
                message = als_pb2.StreamAccessLogsMessage.FromString(raw)
            except DecodeError:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "malformed access log message"
                )
                raise
            if not node_id:
                node_id = message.identifier.node.id
                if not node_id or not self.is_connected(node_id):
                    await context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        "access logs are accepted only from proxies connected over ADS",
                    )
                sinks = self._sinks.get(message.identifier.log_name, [])
            for entry in message.http_logs.log_entry:
                self.received += 1
                for sink in sinks:
                    sink(node_id, entry)
        return als_pb2.StreamAccessLogsResponse()
