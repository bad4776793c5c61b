"""IR -> the Envoy configuration of multi-tenant QoS at a gateway, written as Envoy's own JSON
(the translator parses it into messages), so the one builder decides how a policy limits.

- `local_rate_limit`: one policy's per-tenant token buckets in Envoy's local rate limit filter.
  The descriptor is the tenant from jwt_authn's verified payload (dynamic metadata, never a
  header); each listed tenant has its own descriptor, every other tenant a bucket of its own
  from the wildcard descriptor (the default class), and requests without the claim (no
  descriptor) share the filter's own bucket: the anonymous tenant of the default class.
- `global_rate_limit`: a policy with `global` rates asks the control plane's rate-limit service
  (Envoy's RLS protocol) instead: domain the policy (namespace/name), one descriptor with the
  verified tenant as above (none: the anonymous tenant), its failure mode and a timeout.
- `limited_reply`: the connection manager's local reply for those 429s: a JSON body naming the
  limit, the policy and the tenant.
"""

from __future__ import annotations

from typing import Any

from meshfn import ir
from meshfn.contracts.plugins import ROUTE_METADATA
from meshfn.contracts.qos import (
    DESCRIPTOR_POLICY,
    DESCRIPTOR_TENANT,
    LIMIT_HEADER,
    LIMIT_RATE,
    LIMIT_SHED,
    TENANT_HEADER,
)

from .plugins import JWT_PAYLOAD  # where the translator's jwt_authn writes the verified payload

Obj = dict[str, Any]

JWT_FILTER = "envoy.filters.http.jwt_authn"
LOCAL_RATE_LIMIT = "envoy.filters.http.local_ratelimit"
LOCAL_RATE_LIMIT_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
)
UNLIMITED = 0xFFFFFFFF
QOS_KEY = "qos"  # in the route metadata (ROUTE_METADATA): the governing policy
QOS_SCOPE_KEY = "qos_scope"  # beside it: where its rate is counted (`scope` of the 429 body)
# At a gateway that sheds by priority: the classes a route carries and its Envoy priority.
QOS_CLASS_KEY = "qos_class"
QOS_PRIORITY_KEY = "qos_priority"


def scope(policy: ir.QoSPolicy) -> str:
    """Where a policy's rate is counted: across gateways (the limit service), or by each."""
    return "global" if policy.global_rate is not None else "gateway"


STAT_PREFIX = "meshfn_qos"
# Tenants beyond the listed ones, each with its own bucket, kept per gateway (least recently
# used first out: an evicted tenant starts again with a full bucket).
DYNAMIC_DESCRIPTORS = 10_000


def tenant_action(claim: str, header: bool = False) -> Obj:
    """The rate limit action reading the verified tenant from jwt_authn's dynamic metadata, or
    with `header` from TENANT_HEADER (Istio: its jwt_authn keeps the payload under the issuer's
    name; the header is as trustworthy, as jwt_authn writes it after the listener removed any a
    client sent). No claim: no descriptor, so the filter's own bucket (the anonymous tenant)
    applies."""
    if header:
        return {
            "request_headers": {
                "header_name": TENANT_HEADER,
                "descriptor_key": DESCRIPTOR_TENANT,
                "skip_if_absent": True,
            }
        }
    return {
        "metadata": {
            "descriptor_key": DESCRIPTOR_TENANT,
            "metadata_key": {"key": JWT_FILTER, "path": [{"key": JWT_PAYLOAD}, {"key": claim}]},
            "source": "DYNAMIC",
            "skip_if_absent": True,
        }
    }


def _bucket(bucket: ir.Bucket | None) -> Obj:
    if bucket is None:
        return {"max_tokens": UNLIMITED, "tokens_per_fill": UNLIMITED, "fill_interval": "1s"}
    return {
        "max_tokens": bucket.burst,
        "tokens_per_fill": bucket.requests,
        "fill_interval": f"{bucket.seconds}s",
    }


def retry_after(bucket: ir.Bucket | None) -> int:
    """Whole seconds until a drained bucket holds a token again (Envoy refills it in steps of
    `requests` every `seconds`)."""
    return 1 if bucket is None else max(1, bucket.seconds)


def _percent(key: str) -> Obj:
    return {"default_value": {"numerator": 100, "denominator": "HUNDRED"}, "runtime_key": key}


def _header(name: str, value: str) -> Obj:
    return {"header": {"key": name, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def claim_of(workload: ir.Workload) -> str | None:
    """The verified tenant claim a proxy writes as TENANT_HEADER: a gateway's policies' (one
    claim per gateway), a sidecar's in front of a backend with QoS."""
    if workload.inbound is not None:
        return workload.inbound.tenant_claim if workload.jwt_rules else None
    policies = [p for p in governing(workload) if p is not None]
    return policies[0].claim if policies else None


def governing(workload: ir.Workload) -> list[ir.QoSPolicy]:
    """A gateway's QoSPolicies: its own first, then its routes' (each once)."""
    found = [workload.qos] if workload.qos is not None else []
    for listener in workload.listeners:
        for route in listener.routes:
            if route.qos is not None and route.qos not in found:
                found.append(route.qos)
    return found


def disabled() -> Obj:
    """The filter where no policy of this gateway limits the rate (routes may enable it)."""
    return {"@type": LOCAL_RATE_LIMIT_TYPE, "stat_prefix": STAT_PREFIX}


def local_rate_limit(policy: ir.QoSPolicy, header: bool = False) -> Obj:
    """The policy's per-tenant rate limits, for one gateway (module docstring; `header`: see
    tenant_action)."""
    if not policy.rate_limited:
        return disabled()
    default = policy.default.limits.rate
    descriptors = [
        {
            "entries": [{"key": DESCRIPTOR_TENANT, "value": tenant.name}],
            "token_bucket": _bucket(tenant.limits.rate),
        }
        for tenant in policy.tenants
    ]
    # Every unlisted tenant: a bucket of its own (an empty value is Envoy's wildcard).
    descriptors.append(
        {"entries": [{"key": DESCRIPTOR_TENANT, "value": ""}], "token_bucket": _bucket(default)}
    )
    waits = {retry_after(t.limits.rate) for t in policy.tenants} | {retry_after(default)}
    return {
        "@type": LOCAL_RATE_LIMIT_TYPE,
        "stat_prefix": STAT_PREFIX,
        "token_bucket": _bucket(default),  # requests without the claim: the anonymous tenant
        "filter_enabled": _percent(f"{STAT_PREFIX}.enabled"),
        "filter_enforced": _percent(f"{STAT_PREFIX}.enforced"),
        "always_consume_default_token_bucket": False,
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        "rate_limited_as_resource_exhausted": True,  # gRPC clients: not UNAVAILABLE
        "rate_limits": [{"actions": [tenant_action(policy.claim, header)]}],
        "descriptors": descriptors,
        "max_dynamic_descriptors": DYNAMIC_DESCRIPTORS,
        "response_headers_to_add": [
            _header("retry-after", str(max(waits))),
            _header(LIMIT_HEADER, LIMIT_RATE),
        ],
    }


GLOBAL_RATE_LIMIT = "envoy.filters.http.ratelimit"
GLOBAL_RATE_LIMIT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit"
# What a gateway answers when a fail-closed policy's limit service cannot answer in time.
LIMIT_SERVICE_ERROR_STATUS = "ServiceUnavailable"


def global_rate_limit(
    policy: ir.QoSPolicy,
    cluster: str,
    header: bool = False,
    metadata: tuple[tuple[str, str], ...] = (),
) -> Obj:
    """The policy's rates asked of the limit service behind `cluster` (module docstring), each
    call carrying `metadata` (the gateway's node and limit-service token; none offline)."""
    assert policy.global_rate is not None
    grpc_service: Obj = {
        "envoy_grpc": {"cluster_name": cluster},
        "timeout": f"{policy.global_rate.timeout_ms / 1000:.3f}s",
    }
    if metadata:
        grpc_service["initial_metadata"] = [{"key": k, "value": v} for k, v in metadata]
    return {
        "@type": GLOBAL_RATE_LIMIT_TYPE,
        "domain": policy.key,
        "stage": 0,
        "request_type": "external",
        "timeout": f"{policy.global_rate.timeout_ms / 1000:.3f}s",
        "failure_mode_deny": policy.global_rate.deny,
        "status_on_error": {"code": LIMIT_SERVICE_ERROR_STATUS},
        "stat_prefix": STAT_PREFIX,
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        "rate_limited_as_resource_exhausted": True,
        "rate_limit_service": {
            "grpc_service": grpc_service,
            "transport_api_version": "V3",
        },
        "rate_limits": [
            {
                "actions": [
                    {
                        "generic_key": {
                            "descriptor_key": DESCRIPTOR_POLICY,
                            "descriptor_value": policy.key,
                        }
                    },
                    tenant_action(policy.claim, header),
                ]
            }
        ],
    }


def limit_service_error_reply() -> Obj:
    """The local reply mapper for a fail-closed global rate whose limit service did not answer
    (Envoy's response flag RLSE): a JSON body saying so, beside the 503."""
    return {
        "filter": {"response_flag_filter": {"flags": ["RLSE"]}},
        "body_format_override": {
            "json_format": {
                "error": "rate limit service unavailable",
                "limit": LIMIT_RATE,
                "scope": "global",
                "policy": f"%METADATA(ROUTE:{ROUTE_METADATA}:{QOS_KEY})%",
                "onLimitServiceError": "deny",
            },
            "content_type": "application/json",
        },
    }


def _tenant_field(claim: str, header: bool) -> str:
    """The verified tenant in a local reply's body: jwt_authn's payload, or (Istio, which keys
    the payload by issuer) the header written from the verified claim."""
    return (
        f"%REQ({TENANT_HEADER})%"
        if header
        else f"%DYNAMIC_METADATA({JWT_FILTER}:{JWT_PAYLOAD}:{claim})%"
    )


def limited_reply(claim: str, header: bool = False) -> Obj:
    """The local reply mapper for the rate limit's 429s: a JSON body naming the limit, the
    policy (route metadata) and the verified tenant. Mappers see only Envoy's own replies, and at
    a gateway only this filter answers 429 itself (a backend's 429 passes through as it is)."""
    return {
        "filter": {
            "status_code_filter": {
                "comparison": {"op": "EQ", "value": {"default_value": 429, "runtime_key": "-"}}
            }
        },
        "body_format_override": {
            "json_format": {
                "error": "rate limit exceeded",
                "limit": LIMIT_RATE,
                "scope": f"%METADATA(ROUTE:{ROUTE_METADATA}:{QOS_SCOPE_KEY})%",
                "policy": f"%METADATA(ROUTE:{ROUTE_METADATA}:{QOS_KEY})%",
                "tenant": _tenant_field(claim, header),
            },
            "content_type": "application/json",
        },
    }


def tenant_matcher(claim: str, tenants: tuple[str, ...]) -> Obj:
    """A route's dynamic-metadata matcher: the verified claim (jwt_authn's payload, which only
    jwt_authn writes) is one of `tenants`."""
    values = [{"string_match": {"exact": t}} for t in tenants]
    return {
        "filter": JWT_FILTER,
        "path": [{"key": JWT_PAYLOAD}, {"key": claim}],
        # Envoy's OrMatcher wants two or more.
        "value": {"or_match": {"value_matchers": values}} if len(values) > 1 else values[0],
    }


GRPC_RESOURCE_EXHAUSTED = "8"


def shed_replies(claim: str, header: bool = False) -> list[Obj]:
    """The local reply mappers for a request shed at the gateway: its priority's circuit
    breaker overflowed (response flag UO: no upstream request was made), answered like the
    backend's shed: 429, a JSON body naming the limit, policy, tenant and class, Retry-After and
    x-meshfn-qos-limit; a gRPC request first, with grpc-status RESOURCE_EXHAUSTED (Envoy keeps
    a grpc-status a mapper set; it would say UNAVAILABLE) and the body as its message."""
    route = f"%METADATA(ROUTE:{ROUTE_METADATA}:{{}})%"
    overflow = {"response_flag_filter": {"flags": ["UO"]}}
    grpc = {
        "header_filter": {
            "header": {"name": "content-type", "string_match": {"prefix": "application/grpc"}}
        }
    }
    headers = [_header("retry-after", "1"), _header(LIMIT_HEADER, LIMIT_SHED)]
    body = {
        "json_format": {
            "error": "the backend is saturated: the lower priorities are shed first, at the "
            "gateway",
            "limit": LIMIT_SHED,
            "scope": "gateway",
            "policy": route.format(QOS_KEY),
            "tenant": _tenant_field(claim, header),
            "class": route.format(QOS_CLASS_KEY),
            "priority": route.format(QOS_PRIORITY_KEY),
        },
        "content_type": "application/json",
    }
    return [
        {
            "filter": {"and_filter": {"filters": [overflow, grpc]}},
            "status_code": 429,
            "headers_to_add": [*headers, _header("grpc-status", GRPC_RESOURCE_EXHAUSTED)],
            "body_format_override": body,
        },
        {
            "filter": overflow,
            "status_code": 429,
            "headers_to_add": headers,
            "body_format_override": body,
        },
    ]
