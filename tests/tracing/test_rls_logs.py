"""The control plane's rate-limit service answers calls that Envoy makes for a traced request:
its log lines for such a call carry the request's trace_id and span_id."""

from __future__ import annotations

import io
import json
import logging

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from prometheus_client import CollectorRegistry

from meshfn.common.logs import JsonFormatter
from meshfn.contracts.qos import LIMIT_SERVICE_NODE_HEADER
from meshfn.xds.rls import RateLimitService

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize("traced", [True, False])
async def test_a_refused_calls_log_line_names_its_trace(traced: bool) -> None:
    service = RateLimitService(lambda: {}, lambda node, header: False, CollectorRegistry())
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("meshfn.rls")
    logger.addHandler(handler)
    metadata = [(LIMIT_SERVICE_NODE_HEADER, "edge.default"), ("authorization", "Bearer nope")]
    if traced:
        metadata.append(("traceparent", f"00-{TRACE}-{SPAN}-01"))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ShouldRateLimit(rls_pb2.RateLimitRequest(), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        logger.removeHandler(handler)
        await server.stop(0)
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines() if "refused" in x]
    if traced:
        assert (line["trace_id"], line["span_id"]) == (TRACE, SPAN)
    else:
        assert "trace_id" not in line
