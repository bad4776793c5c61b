"""Gateway listener -> Listener with an HTTP connection manager that takes routes over RDS."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import config_source_pb2, grpc_service_pb2, substitution_format_string_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2 as grpc_als_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.request_id.uuid.v3 import uuid_pb2
from google.protobuf import duration_pb2, struct_pb2, wrappers_pb2

from meshfn import ir
from meshfn.contracts.genai import GENERATION_HEADER
from meshfn.contracts.tracing import TRACEPARENT

from ..fragments.messages import pack
from ..names import CONTROL_PLANE_CLUSTER, LATENCY_LOG, LATENCY_LOG_FILTER, traced_gateway_name
from .common import ads_source, socket_address
from .httpfilters import (
    ROUTER_FILTER,
    FilterContext,
    TracingContext,
    build_connection_manager,
    local_replies,
)
from .httpfilters.tracing import carried_tags, traced_inbound_tracing
from .routes import route_config_name
from .security import with_request_hygiene

HCM = "envoy.filters.network.http_connection_manager"


def _latency_log() -> accesslog_pb2.AccessLog:
    """Per-request timings streamed to the control plane (gRPC access-log service on the ADS
    cluster): the drift breaker's input."""
    config = grpc_als_pb2.HttpGrpcAccessLogConfig(
        # a generation's usage record: the drift breaker's inter-token latency needs its tokens
        additional_response_trailers_to_log=[GENERATION_HEADER],
        additional_response_headers_to_log=[GENERATION_HEADER],
        common_config=grpc_als_pb2.CommonGrpcAccessLogConfig(
            log_name=LATENCY_LOG,
            grpc_service=grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                    cluster_name=CONTROL_PLANE_CLUSTER
                )
            ),
            transport_api_version=config_source_pb2.ApiVersion.V3,
            buffer_flush_interval=duration_pb2.Duration(nanos=100_000_000),
            buffer_size_bytes=wrappers_pb2.UInt32Value(value=16384),
        ),
        # the trace the gateway's tracer sent the request in: a trip names slow traces
        additional_request_headers_to_log=[TRACEPARENT],
    )
    reached_upstream = accesslog_pb2.AccessLogFilter(
        extension_filter=accesslog_pb2.ExtensionFilter(
            name="envoy.access_loggers.extension_filters.cel",
            typed_config=pack(cel_pb2.ExpressionFilter(expression=LATENCY_LOG_FILTER)),
        )
    )
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc", filter=reached_upstream, typed_config=pack(config)
    )


def _no_upstream_reply() -> hcm.LocalReplyConfig:
    """Say which route and which fallback chain ran out, as JSON, instead of Envoy's bare
    "no healthy upstream"."""
    body = struct_pb2.Struct()
    body.update(
        {
            "error": "no healthy upstream",
            "route": "%ROUTE_NAME%",
            "exhausted_chain": "%METADATA(ROUTE:meshfn:chain)%",
            "response_flags": "%RESPONSE_FLAGS%",
        }
    )
    return hcm.LocalReplyConfig(
        mappers=[
            hcm.ResponseMapper(
                filter=accesslog_pb2.AccessLogFilter(
                    response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=["UH", "UF", "URX"])
                ),
                status_code=wrappers_pb2.UInt32Value(value=503),
                body_format_override=substitution_format_string_pb2.SubstitutionFormatString(
                    json_format=body, content_type="application/json"
                ),
            )
        ]
    )


@lru_cache(maxsize=4096)
def listener(
    listener: ir.Listener, filters: FilterContext, latency_log: bool = False
) -> listener_pb2.Listener:
    """The gateway listener: routes over RDS, `filters`' chain, with `latency_log` the drift
    breaker's timings."""
    manager = with_request_hygiene(
        hcm.HttpConnectionManager(
            stat_prefix=listener.name,
            codec_type=hcm.HttpConnectionManager.AUTO,
            rds=hcm.Rds(config_source=ads_source(), route_config_name=route_config_name(listener)),
            strip_any_host_port=True,
            use_remote_address=wrappers_pb2.BoolValue(value=True),
            local_reply_config=_no_upstream_reply(),
            access_log=[_latency_log()] if latency_log else [],
        )
    )
    build_connection_manager(manager, filters)
    return listener_pb2.Listener(
        name=listener.name,
        address=socket_address(listener.address, listener.port),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[listener_components_pb2.Filter(name=HCM, typed_config=pack(manager))]
            )
        ],
    )


@lru_cache(maxsize=1024)
def traced_listener(
    listener: ir.Listener, config: TracingContext | None, filters: FilterContext
) -> listener_pb2.Listener:
    """The internal listener where a split gateway listener (with `filters`' chain) traces the
    requests it sampled (httpfilters.tracing.split_gateway_routes), on the same routes: the
    tracer (none while the gateway is not split, `config` None), the span's tags out of their
    headers, and the router, replying as the gateway's listener does to a request shed there
    or with no upstream left (a verified claim read from the header jwt_authn wrote it into,
    which the request carries there). Its request id stays, without the trace decision Envoy
    would pack into it, so the sidecar's records name the request as the gateway's do."""
    name = traced_gateway_name(listener.name)
    manager = hcm.HttpConnectionManager(
        stat_prefix=f"gateway_traced_{listener.name}",
        codec_type=hcm.HttpConnectionManager.AUTO,
        rds=hcm.Rds(config_source=ads_source(), route_config_name=route_config_name(listener)),
        preserve_external_request_id=True,
        local_reply_config=local_replies(filters, _no_upstream_reply().mappers, header=True),
    )
    manager.request_id_extension.typed_config.Pack(
        uuid_pb2.UuidRequestIdConfig(pack_trace_reason=wrappers_pb2.BoolValue(value=False))
    )
    manager.http_protocol_options.enable_trailers = True  # a stream's usage record
    return traced_internal_listener(name, manager, config)


def traced_internal_listener(
    name: str, manager: hcm.HttpConnectionManager, config: TracingContext | None
) -> listener_pb2.Listener:
    """A split proxy's internal listener `name` (no socket) around `manager`: the tracer
    (none while the proxy is not split, `config` None), the span's tags out of their headers
    (httpfilters.tracing.carried_tags), the router."""
    manager.http_filters.extend(
        [*(carried_tags(config) if config is not None else ()), ROUTER_FILTER]
    )
    if config is not None:
        manager.tracing.CopyFrom(traced_inbound_tracing(config))
    return listener_pb2.Listener(
        name=name,
        internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[listener_components_pb2.Filter(name=HCM, typed_config=pack(manager))]
            )
        ],
    )
