"""Envoy's OpenTelemetry tracer for both renderers: the connection manager's tracing, the
route's, the sampler and the custom tags (the translator uses the messages, the Istio renderer
writes the route's in EnvoyFilter patches with messages.envoy_json).

How a sampling decision travels (measured with Envoy 1.40, tests/xds/test_tracing_envoy.py):
Envoy decides per request from `random_sampling` (the route's `tracing` replaces the connection
manager's three percentages when it is set) unless the x-request-id it reads already carries a
decision, which Envoy packs into the UUID it forwards. A span continued from a `traceparent` is
sampled when the parent was AND Envoy's decision says traced; a span without a parent is
sampled by the decision. So:

- a sidecar samples at the mesh's rate what arrives without a parent, and otherwise follows its
  gateway: the x-request-id the gateway forwards says it traced the request, the parent's flag
  says the same;
- a gateway that restarts client context drops the client's trace headers first (the early
  header mutation: contracts.tracing.CLIENT_CONTEXT_HEADERS, x-request-id included) and never
  honours x-client-trace-id (`client_sampling` 0), so every trace it starts is its own random
  decision at its sampling rate;
- a gateway that honors client context decides with a parent-based sampler (a parent's flag is
  kept, a request without one is sampled by its trace id at the gateway's rate) and lets
  Envoy's own decision trace everything (random 100%), since a span is sampled only when both
  agree.

Custom tags come from verified data only: the tenant from jwt_authn's verified payload, the
caller's SPIFFE ID from the mTLS handshake, the route and model from the route table.
"""

from __future__ import annotations

from envoy.config.core.v3 import extension_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.tracers.opentelemetry.samplers.v3 import (
    parent_based_sampler_pb2,
    trace_id_ratio_based_sampler_pb2,
)
from envoy.type.tracing.v3 import custom_tag_pb2
from envoy.type.v3 import percent_pb2

from meshfn import ir
from meshfn.contracts.tracing import TAG_MODEL, TAG_PRINCIPAL, TAG_ROUTE, TAG_TENANT

from .messages import pack
from .plugins import JWT_PAYLOAD

JWT_NAMESPACE = "envoy.filters.http.jwt_authn"
PARENT_BASED = "envoy.tracers.opentelemetry.samplers.parent_based"
RATIO = "envoy.tracers.opentelemetry.samplers.trace_id_ratio_based"
# The caller's SPIFFE ID, from the certificate it presented (a sidecar's mTLS handshake).
PEER_PRINCIPAL = "%DOWNSTREAM_PEER_URI_SAN%"


def fraction(value: float) -> percent_pb2.FractionalPercent:
    """A percent as Envoy's FractionalPercent, per ten thousand (0.01% steps). Not per
    million: Envoy draws a route's sampling from the request id modulo 10,000 and compares it
    with the numerator modulo the denominator, so any share of a million above 1% sampled every
    request (measured with Envoy 1.40: 20% per million traced 300 of 300)."""
    return percent_pb2.FractionalPercent(
        numerator=round(value * 100), denominator=percent_pb2.FractionalPercent.TEN_THOUSAND
    )


def tenant_value(claim: str) -> str:
    """The verified tenant claim, as a substitution format (empty: no verified token)."""
    return f"%DYNAMIC_METADATA({JWT_NAMESPACE}:{JWT_PAYLOAD}:{claim})%"


def connection_tags(
    tracing: ir.Tracing, kind: str, verified_tokens: bool
) -> list[custom_tag_pb2.CustomTag]:
    """The connection manager's tags: the tenant where jwt_authn runs, the caller's SPIFFE ID
    at a sidecar."""
    tags = []
    if "tenant" in tracing.tags and verified_tokens:
        tags.append(
            custom_tag_pb2.CustomTag(tag=TAG_TENANT, value=tenant_value(tracing.tenant_claim))
        )
    if "principal" in tracing.tags and kind == "sidecar":
        tags.append(custom_tag_pb2.CustomTag(tag=TAG_PRINCIPAL, value=PEER_PRINCIPAL))
    return tags


def route_tags(tracing: ir.Tracing, route: ir.Route) -> list[custom_tag_pb2.CustomTag]:
    """A gateway route's tags: the mesh route and the model it serves."""
    tags = []
    if "route" in tracing.tags:
        tags.append(_literal(TAG_ROUTE, route.key))
    if "model" in tracing.tags and route.function:
        tags.append(_literal(TAG_MODEL, route.function))
    return tags


def _literal(tag: str, value: str) -> custom_tag_pb2.CustomTag:
    return custom_tag_pb2.CustomTag(tag=tag, literal=custom_tag_pb2.CustomTag.Literal(value=value))


def sampling(
    gateway: ir.GatewayTracing, route_override: float | None = None, sampler: bool = True
) -> float:
    """Envoy's random sampling percent on a gateway route: 100 where the parent-based sampler
    decides (a gateway that honors client context, when `sampler`: raw Envoy; Istio's provider
    has no sampler to set), else the route's override or the gateway's rate."""
    if gateway.client_context == "honor" and sampler:
        return 100.0
    return gateway.sampling if route_override is None else route_override


def route_tracing(
    tracing: ir.Tracing, gateway: ir.GatewayTracing, route: ir.Route, sampler: bool = True
) -> rc.Tracing:
    """A gateway route's tracing. Set on every route (its tags), it replaces the connection
    manager's three percentages, so it repeats them: the route's sampling, no client forcing
    where client context restarts, everything past the first two."""
    restart = gateway.client_context == "restart"
    return rc.Tracing(
        random_sampling=fraction(sampling(gateway, tracing.route_sampling(route.key), sampler)),
        client_sampling=fraction(0.0 if restart else 100.0),
        overall_sampling=fraction(100.0),
        custom_tags=route_tags(tracing, route),
    )


def sampler(percent: float) -> extension_pb2.TypedExtensionConfig:
    """The tracer's sampler where a gateway honors client context: a parent's flag, else the
    trace id at `percent`."""
    ratio = trace_id_ratio_based_sampler_pb2.TraceIdRatioBasedSamplerConfig(
        sampling_percentage=fraction(percent)
    )
    config = parent_based_sampler_pb2.ParentBasedSamplerConfig(
        wrapped_sampler=extension_pb2.TypedExtensionConfig(name=RATIO, typed_config=pack(ratio))
    )
    return extension_pb2.TypedExtensionConfig(name=PARENT_BASED, typed_config=pack(config))
