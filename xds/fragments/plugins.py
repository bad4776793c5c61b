"""IR -> the plugin settings of meshfn's proxy-wasm filters (meshfn.contracts.plugins models).

ONE builder for every renderer: the xDS translator sends these settings over ECDS, the Istio
renderer puts the same JSON into WasmPlugin `pluginConfig`, so a filter behaves the same whichever
way it was deployed. Also the audit journal's access-log fields, which the collector reads
whichever proxy wrote them. Pure: IR and contracts in, pydantic models and plain data out.
"""

from __future__ import annotations

from functools import lru_cache

from meshfn import ir
from meshfn.contracts.genai import GENERATION_HEADER
from meshfn.contracts.naming import priority_route_name, route_name
from meshfn.contracts.plugins import (
    AUDIT_FILTER_STATE,
    MESH_ROUTE_HEADER,
    MESH_ROUTE_KEY,
    MODEL_ROUTED_PATHS,
    ROUTE_METADATA,
    AuditSettings,
    BodyHash,
    DegradeRule,
    DegradeSettings,
    GrpcRouteSettings,
    RouteSettings,
    SubjectSalt,
    Trigger,
    bare_filter_state,
)
from meshfn.contracts.qos import LIMIT_HEADER
from meshfn.contracts.rollout import MODEL_VERSION_HEADER
from meshfn.contracts.tracing import (
    SPLIT_CLUSTER_METADATA,
    SPLIT_FLAGS_METADATA,
    SPLIT_TRACE_METADATA,
)

# The jwt_authn metadata key the translator's providers write the verified payload under.
JWT_PAYLOAD = "payload"


@lru_cache(maxsize=64)
def audit_settings(audit: ir.Audit, salt: SubjectSalt, jwt_headers: bool) -> AuditSettings:
    """jwt_headers mode where jwt_authn runs (the proxy has jwt rules), else jwt_authn mode."""
    return AuditSettings(
        subject_salt=salt.hex,
        salt_id=salt.id,
        subject_source="jwt_headers" if jwt_headers else "jwt_authn",
        jwt_metadata_key=JWT_PAYLOAD,
        tenant_claim=audit.tenant_claim,
        body_hash=BodyHash(enabled=audit.body_hash, max_bytes=audit.body_hash_max_bytes),
    )


def route_settings(model: ir.MeshModel, listener: ir.Listener) -> RouteSettings | None:
    """The model router of a gateway listener whose routes include model routes: the models
    its OpenAI routes serve, those its KServe gRPC routes serve by the name in the message (at
    a gateway that sheds by priority: policy.kserve.grpc_route), and the largest request body
    of their functions (None: no such route)."""
    openai = sorted({r.model for r in listener.routes if r.model and not r.grpc})
    grpc = sorted({r.model for r in listener.routes if r.model and r.grpc})
    if not openai and not grpc:
        return None
    limits = {f.name: f.settings.limits.maxRequestBytes for f in model.functions}
    largest = max(limits.get(name, 1 << 20) for name in (*openai, *grpc))
    return RouteSettings(
        paths=list(MODEL_ROUTED_PATHS) if openai else [],
        models=openai,
        max_body_bytes=largest,
        grpc=GrpcRouteSettings(models=grpc) if grpc else None,
    )


def drill_trigger(drill: ir.Drill | None) -> Trigger | None:
    """The degrade filter's trigger for the callers Mesh.spec.drill names."""
    if drill is None:
        return None
    return Trigger(header=drill.header, request_principals=list(drill.request_principals))


GuardedRoutes = tuple[tuple[str, tuple[str, ...]], ...]  # (route key, its Envoy route names)


def guarded_routes(
    listener: ir.Listener, drift_routes: frozenset[str], gateway_qos: ir.QoSPolicy | None = None
) -> GuardedRoutes:
    """The listener's drift-guarded routes (keys in `drift_routes`) with their route names (and
    their priority twins where the governing QoSPolicy sheds at the gateway)."""
    out = []
    for route in listener.routes:
        if route.key not in drift_routes:
            continue
        names = [route_name(route.key, i) for i in range(len(route.matches))]
        policy = route.qos or gateway_qos
        if policy is not None and policy.gateway_shed:
            names += [priority_route_name(n, p) for n in names for p in ("high", "default")]
        out.append((route.key, tuple(names)))
    return tuple(out)


def degrade_rules(
    routes: GuardedRoutes, degraded: frozenset[str], trigger: Trigger | None
) -> DegradeSettings:
    """One rule per drift-guarded route: depth 1 (reroute to the route's degraded twin) once the
    breaker has tripped it, else 0 (pass through). The listener strips the routing header from
    client requests (early header mutation), so the filter does not look for a spoofed one."""
    rules = [
        DegradeRule(
            name=key,
            routes=list(names),
            mode="reroute",
            fallbacks=[key],
            depth=1 if key in degraded else 0,
        )
        for key, names in routes
    ]
    return DegradeSettings(rules=rules, listener_strips_routing_header=True, trigger=trigger)


def degrade_settings(
    listener: ir.Listener,
    drift_routes: frozenset[str],
    degraded: frozenset[str],
    drill: ir.Drill | None = None,
) -> DegradeSettings:
    """The degrade filter's settings for a listener (see degrade_rules)."""
    return degrade_rules(guarded_routes(listener, drift_routes), degraded, drill_trigger(drill))


def claim_header_pairs(
    audit: AuditSettings | None, trigger: Trigger | None
) -> tuple[tuple[str, str], ...]:
    """(header, claim) pairs every jwt_authn provider of a proxy must write: the audit filter's
    subject in jwt_headers mode (and its tenant unless the access log reads it), and iss/sub
    where a drill trigger names request principals."""
    pairs: list[tuple[str, str]] = []
    if audit is not None and audit.subject_source == "jwt_headers":
        pairs.append((audit.sub_header, "sub"))
        if audit.tenant_claim and not bare_filter_state(audit):
            pairs.append((audit.tenant_header, audit.tenant_claim))
    if trigger is not None and trigger.request_principals:
        pairs += [(trigger.issuer_header, "iss"), (trigger.subject_header, "sub")]
    return tuple(dict.fromkeys(pairs))


# One JSON object per line; `record.from_log_line` reads exactly these keys (plus those of
# `access_log_format(settings)` for a bare filter state).
ACCESS_LOG_FORMAT: dict[str, str] = {
    "id": "%REQ(X-REQUEST-ID)%",
    "time": "%START_TIME(%Y-%m-%dT%H:%M:%S.%6fZ)%",
    "method": "%REQ(:METHOD)%",
    "authority": "%REQ(:AUTHORITY)%",
    "path": "%PATH(NQ)%",  # never the query string: tokens travel there
    "status": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS(NUMBER)%",  # a gRPC refusal's HTTP status is 200
    "duration_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
    "duration_ms": "%DURATION%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "route": "%ROUTE_NAME%",
    "principal": "%DOWNSTREAM_PEER_URI_SAN%",
    "flags": "%RESPONSE_FLAGS%",
    "qos_limit": f"%RESP({LIMIT_HEADER}):16%",  # which QoS limit refused the request
    # The trace the proxy's tracer put the request in (empty without tracing); the headers
    # stand in where tracing is off (a traceparent a client or a proxy in front sent)
    "trace_id": "%TRACE_ID%",
    # the Function version that answered (the backend names it; a rollout has two)
    "model_version": f"%RESP({MODEL_VERSION_HEADER}):64%",
    "traceparent": "%REQ(TRACEPARENT):128%",
    "b3_trace_id": "%REQ(X-B3-TRACEID):64%",
    "audit": f"%FILTER_STATE({AUDIT_FILTER_STATE}:PLAIN)%",
    # a generation's usage record (contracts.genai): the trailer after a stream, the header of
    # a whole response; and the time to the first upstream byte (a stream's first token)
    "generation": f"%TRAILER({GENERATION_HEADER.upper()}):1024%",
    "generation_whole": f"%RESP({GENERATION_HEADER.upper()}):1024%",
    "upstream_first_byte_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",
}

AUDIT_STATE_VERSION = "1"


def _literal(text: str) -> str:
    """`text` verbatim in an Envoy format string."""
    return text.replace("%", "%%")


def mesh_route_fields(trusted_gateways: tuple[str, ...] | None) -> dict[str, str]:
    """How the access log names the mesh route (audit/record.py: mesh_route reads
    it). A gateway (`trusted_gateways` None) names it from its own route metadata; a sidecar
    copies the gateway's `x-meshfn-route` header and the SPIFFE IDs of the gateways it may
    believe, and the record names the route only when the request's verified mTLS peer is one of
    them (a client's header is kept apart as `route_claimed`)."""
    if trusted_gateways is None:
        return {
            "mesh_route": f"%METADATA(ROUTE:{ROUTE_METADATA}:{MESH_ROUTE_KEY})%",
            "mesh_route_by": "proxy",
        }
    return {
        "mesh_route": f"%REQ({MESH_ROUTE_HEADER.upper()}):256%",
        "mesh_route_from": _literal(" ".join(trusted_gateways)),
    }


def access_log_format(
    settings: AuditSettings,
    trusted_gateways: tuple[str, ...] | None = (),
    split_trace: bool = False,
) -> dict[str, str]:
    """ACCESS_LOG_FORMAT with the mesh route (`mesh_route_fields`), the trace id from metadata
    at a split gateway (`split_trace`: its own listener has no tracer, contracts.tracing
    SPLIT_TRACE_METADATA), and for a bare filter state
    (`bare_filter_state`) what the filter no longer publishes: the audit record version, salt_id
    and subject_source (constants of this configuration) and the tenant from jwt_authn's verified
    payload (uncapped: Envoy cuts bytes, record.from_log_line caps it at 128 characters and flags
    `truncated`)."""
    fields = dict(ACCESS_LOG_FORMAT) | mesh_route_fields(trusted_gateways)
    if split_trace:
        fields["trace_id"] = "%DYNAMIC_METADATA({}:{})%".format(*SPLIT_TRACE_METADATA)
        fields["traced_cluster"] = "%DYNAMIC_METADATA({}:{})%".format(*SPLIT_CLUSTER_METADATA)
        fields["traced_flags"] = "%DYNAMIC_METADATA({}:{})%".format(*SPLIT_FLAGS_METADATA)
    if bare_filter_state(settings):
        fields["audit_v"] = AUDIT_STATE_VERSION
        fields["salt_id"] = _literal(settings.salt_id)
        fields["subject_source"] = settings.subject_source
        if settings.tenant_claim:
            fields["tenant"] = (
                "%DYNAMIC_METADATA(envoy.filters.http.jwt_authn:"
                f"{settings.jwt_metadata_key}:{settings.tenant_claim})%"
            )
    return fields
