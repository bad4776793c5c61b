"""Envoy's OpenTelemetry tracer on a connection manager (not a filter of the chain: the
connection manager's own `tracing`), and what it needs: the cluster to the collector and, on a
gateway that restarts client context, the early header mutation that drops the client's trace
headers before Envoy reads them. The sampling rules are meshfn.xds.fragments.tracing's (shared
with the Istio renderer); routes carry their own part (routes.py)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from functools import lru_cache

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import extension_pb2, grpc_service_pb2, http_service_pb2, http_uri_pb2
from envoy.config.trace.v3 import http_tracer_pb2, opentelemetry_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2,
)
from google.protobuf import duration_pb2

from meshfn import ir
from meshfn.contracts.tracing import CLIENT_CONTEXT_HEADERS

from ...fragments import tracing as fragments
from ...fragments.messages import duration, pack
from ...names import CLUSTER, TRACE_COLLECTOR_CLUSTER
from ..clusters import HTTP_PROTOCOL_OPTIONS, http2_options
from ..common import one_endpoint, pipe_endpoints
from ..host import ProxyHost
from ..resources import Resources
from .base import FilterContext, HttpFilter, TracingContext

OPENTELEMETRY = "envoy.tracers.opentelemetry"


class Tracing(HttpFilter[TracingContext]):
    def config(self, ctx: FilterContext) -> TracingContext | None:
        return ctx.tracing

    def connection_manager(
        self, ctx: FilterContext, config: TracingContext
    ) -> hcm.HttpConnectionManager:
        return hcm.HttpConnectionManager(tracing=connection_tracing(config))

    def early_header_mutations(
        self, ctx: FilterContext, config: TracingContext
    ) -> Iterable[extension_pb2.TypedExtensionConfig]:
        return (client_context_removal(),) if config.restarts else ()

    def resources(
        self, ctx: FilterContext, config: TracingContext, overlay: ir.Overlay
    ) -> Resources:
        cluster = collector_cluster(config.collector)
        return {CLUSTER: {cluster.name: cluster}}


@lru_cache(maxsize=1024)
def connection_tracing(config: TracingContext) -> hcm.HttpConnectionManager.Tracing:
    """The connection manager's tracing: the tracer, its percentages, its tags, span names."""
    settings = config.settings
    provider = opentelemetry_pb2.OpenTelemetryConfig(service_name=config.service)
    collector = config.collector
    if collector.protocol == "grpc":
        provider.grpc_service.CopyFrom(
            grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                    cluster_name=TRACE_COLLECTOR_CLUSTER
                ),
                timeout=duration(collector.timeout),
            )
        )
    else:
        provider.http_service.CopyFrom(
            http_service_pb2.HttpService(
                http_uri=http_uri_pb2.HttpUri(
                    uri=f"http://{collector.host}:{collector.port}{collector.path}",
                    cluster=TRACE_COLLECTOR_CLUSTER,
                    timeout=duration(collector.timeout),
                )
            )
        )
    if config.honors:
        provider.sampler.CopyFrom(fragments.sampler(settings.sampling))
    random = fragments.sampling(settings) if config.kind == "gateway" else settings.sampling
    out = hcm.HttpConnectionManager.Tracing(
        provider=http_tracer_pb2.Tracing.Http(name=OPENTELEMETRY, typed_config=pack(provider)),
        custom_tags=fragments.connection_tags(config.tracing, config.kind, config.verified_tokens),
        operation="%REQ(:METHOD)% %ROUTE_NAME%"
        if config.kind == "gateway"
        else f"%REQ(:METHOD)% {config.service}",
    )
    out.random_sampling.value = random
    out.client_sampling.value = 100.0 if config.honors else 0.0
    out.overall_sampling.value = 100.0
    return out


@lru_cache(maxsize=1)
def client_context_removal() -> extension_pb2.TypedExtensionConfig:
    """Drops a client's trace context before Envoy reads it (contracts.tracing)."""
    mutation = header_mutation_pb2.HeaderMutation(
        mutations=[mutation_rules_pb2.HeaderMutation(remove=h) for h in CLIENT_CONTEXT_HEADERS]
    )
    return extension_pb2.TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation", typed_config=pack(mutation)
    )


@lru_cache(maxsize=64)
def collector_cluster(collector: ir.TraceCollector) -> cluster_pb2.Cluster:
    """The collector: a unix socket (a pipe address) or an IP literal STATIC, a name
    STRICT_DNS; HTTP/2 for OTLP over gRPC."""
    host = collector.host.strip("[]")
    kind = cluster_pb2.Cluster.STATIC
    if collector.socket:
        endpoints = pipe_endpoints(TRACE_COLLECTOR_CLUSTER, [collector.socket])
    else:
        endpoints = one_endpoint(TRACE_COLLECTOR_CLUSTER, host, collector.port)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            kind = cluster_pb2.Cluster.STRICT_DNS
    cluster = cluster_pb2.Cluster(
        name=TRACE_COLLECTOR_CLUSTER,
        type=kind,
        connect_timeout=duration_pb2.Duration(seconds=1),
        load_assignment=endpoints,
    )
    if collector.protocol == "grpc":
        cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].Pack(http2_options())
    return cluster


def tracing_for(
    model: ir.MeshModel, workload: ir.Workload, host: ProxyHost
) -> TracingContext | None:
    """Tracing on a workload's connection managers, where the mesh traces and a collector is
    known (the policy's, else the run mode's own)."""
    tracing = model.tracing
    if tracing is None:
        return None
    collector = tracing.collector or host.collector
    if collector is None:
        return None
    settings = (
        tracing.gateway(workload.key)
        if workload.kind == "gateway"
        else ir.GatewayTracing(tracing.sampling, "restart")
    )
    return TracingContext(
        tracing,
        collector,
        workload.kind,
        f"{workload.name}.{workload.namespace}",
        settings,
        bool(workload.jwt_rules),
    )
