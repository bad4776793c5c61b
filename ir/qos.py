"""IR -> the Envoy configuration of multi-tenant QoS that both renderers share, written as
Envoy's own JSON: the xDS translator parses it into messages, the Istio renderer puts it into
EnvoyFilter patches, so a policy limits the same way however it is deployed.

- `local_rate_limit`: one policy's per-tenant token buckets in Envoy's local rate limit filter.
  The descriptor is the tenant from jwt_authn's verified payload (dynamic metadata, never a
  header); each listed tenant has its own descriptor, every other tenant a bucket of its own
  from the wildcard descriptor (the default class), and requests without the claim (no
  descriptor) share the filter's own bucket: the anonymous tenant of the default class.
- `limited_replies`: the connection manager's local replies for those 429s (a JSON body naming
  the limit, policy, tenant and class) and for a limit service that did not answer.
- `limit_service_rate_limits`: the descriptors the control plane's rate-limit service reads
  (contracts.qos names their keys): shared rate limits and compute budgets, peeked before the
  request and charged when it ends with the guest CPU time the backend reported.
- `concurrency_settings`: the qos plugin's settings (per-tenant concurrency).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from meshfn import ir
from meshfn.contracts.naming import degraded_route_name, route_name
from meshfn.contracts.plugins import ConcurrencyPolicy, ConcurrencyTenant, QoSSettings
from meshfn.contracts.qos import (
    COST_HEADER,
    DESCRIPTOR_LIMIT,
    DESCRIPTOR_POLICY,
    DESCRIPTOR_TENANT,
    LIMIT_COMPUTE,
    LIMIT_COMPUTE_USED,
    LIMIT_HEADER,
    LIMIT_RATE,
)

Obj = dict[str, Any]

JWT_FILTER = "envoy.filters.http.jwt_authn"
JWT_PAYLOAD = "payload"  # the providers' payload_in_metadata (meshfn.ir.plugins.JWT_PAYLOAD)
LOCAL_RATE_LIMIT = "envoy.filters.http.local_ratelimit"
LOCAL_RATE_LIMIT_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
)
HEADER_TO_METADATA_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"
)
CEL_FILTER_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
UNLIMITED = 0xFFFFFFFF
ROUTE_METADATA = "meshfn"  # route metadata namespace; key QOS_KEY names the governing policy
QOS_KEY = "qos"
COST_METADATA = "meshfn.qos"  # dynamic metadata: the backend's reported cost (COST_KEY)
COST_KEY = "cpu_us"
# Tenants beyond the listed ones, each with its own bucket, kept per gateway (least recently
# used first out: an evicted tenant starts again with a full bucket).
DYNAMIC_DESCRIPTORS = 10_000
LOCAL_LIMITED = "local_rate_limited"  # Envoy's response code details for these 429s
LIMIT_SERVICE_ERROR = "rate_limiter_error"


def cel_string(text: str) -> str:
    """A CEL string literal. `%` and `)` are escaped too: the text sits inside %CEL(...)%."""
    out = []
    for char in text:
        if char in "\\'\"%)(":
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return "'" + "".join(out) + "'"


def tenant_cel(claim: str) -> str:
    """The verified tenant claim in CEL ('' without one)."""
    payload = f"metadata.filter_metadata[{cel_string(JWT_FILTER)}]"
    return (
        f"(({cel_string(JWT_FILTER)} in metadata.filter_metadata) && "
        f"({cel_string(claim)} in {payload}.{JWT_PAYLOAD})) ? "
        f"{payload}.{JWT_PAYLOAD}[{cel_string(claim)}] : ''"
    )


def _lookup_cel(claim: str, values: dict[str, str], default: str) -> str:
    """CEL: values[tenant] for a listed tenant, else `default`."""
    if not values:
        return cel_string(default)
    table = "{" + ", ".join(f"{cel_string(k)}: {cel_string(v)}" for k, v in values.items()) + "}"
    tenant = f"({tenant_cel(claim)})"
    return f"({tenant} in {table} ? {table}[{tenant}] : {cel_string(default)})"


def class_cel(policy: ir.QoSPolicy) -> str:
    """The tenant's class, in CEL."""
    listed = {t.name: t.tenant_class for t in policy.tenants if t.tenant_class != policy.default_class}
    return _lookup_cel(policy.claim, listed, policy.default_class)


def tenant_action(claim: str, skip_if_absent: bool) -> Obj:
    """The rate limit action reading the verified tenant from jwt_authn's dynamic metadata."""
    return {
        "metadata": {
            "descriptor_key": DESCRIPTOR_TENANT,
            "metadata_key": {
                "key": JWT_FILTER,
                "path": [{"key": JWT_PAYLOAD}, {"key": claim}],
            },
            "source": "DYNAMIC",
            "skip_if_absent": skip_if_absent,
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
    """Seconds until the bucket holds a token again (it refills continuously)."""
    if bucket is None:
        return 1
    return max(1, math.ceil(bucket.seconds / bucket.requests))


def _percent(key: str) -> Obj:
    return {"default_value": {"numerator": 100, "denominator": "HUNDRED"}, "runtime_key": key}


def _header(name: str, value: str) -> Obj:
    return {"header": {"key": name, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def local_rate_limit(policy: ir.QoSPolicy) -> Obj:
    """The policy's per-tenant rate limits, for one gateway (module docstring)."""
    default = policy.default.limits.rate
    descriptors = [
        {
            "entries": [{"key": DESCRIPTOR_TENANT, "value": tenant.name}],
            "token_bucket": _bucket(tenant.limits.rate),
        }
        for tenant in policy.tenants
    ]
    if default is not None:
        descriptors.append(
            {"entries": [{"key": DESCRIPTOR_TENANT, "value": ""}], "token_bucket": _bucket(default)}
        )
    seconds = {
        t.name: str(retry_after(t.limits.rate))
        for t in policy.tenants
        if t.limits.rate is not None and retry_after(t.limits.rate) != retry_after(default)
    }
    wait = (
        f"%CEL({_lookup_cel(policy.claim, seconds, str(retry_after(default)))})%"
        if seconds
        else str(retry_after(default))
    )
    out: Obj = {
        "@type": LOCAL_RATE_LIMIT_TYPE,
        "stat_prefix": "meshfn_qos",
        "token_bucket": _bucket(default),  # requests without the claim: the anonymous tenant
        "filter_enabled": _percent("meshfn_qos.enabled"),
        "filter_enforced": _percent("meshfn_qos.enforced"),
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        "rate_limits": [{"actions": [tenant_action(policy.claim, skip_if_absent=False)]}],
        "descriptors": descriptors,
        "response_headers_to_add": [_header("retry-after", wait), _header(LIMIT_HEADER, LIMIT_RATE)],
    }
    if default is not None:
        out["max_dynamic_descriptors"] = DYNAMIC_DESCRIPTORS
    return out


def local_rate_limited(policy: ir.QoSPolicy) -> bool:
    """The policy has rate limits a gateway keeps itself (not shared through the limit service)."""
    return policy.rate_limited and not policy.shared


def _policy_cel(policies: tuple[ir.QoSPolicy, ...], each: str) -> str:
    """CEL choosing `each`'s expression by the route's governing policy (route metadata)."""
    if len(policies) == 1:
        return getattr(policies[0], each) if each != "class" else class_cel(policies[0])
    key = f"xds.route_metadata.filter_metadata[{cel_string(ROUTE_METADATA)}][{cel_string(QOS_KEY)}]"
    expr = "''"
    for policy in reversed(policies):
        expr = f"({key} == {cel_string(policy.key)} ? {class_cel(policy)} : {expr})"
    return expr


def _cel_filter(expression: str) -> Obj:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": CEL_FILTER_TYPE, "expression": expression},
        }
    }


def limited_replies(policies: tuple[ir.QoSPolicy, ...]) -> list[Obj]:
    """Local reply mappers of a gateway listener whose routes `policies` govern: the JSON body
    of a local rate limit's 429, and the 503 of a limit service that did not answer where the
    policy fails closed. The policies of one gateway read one claim (policy checks)."""
    if not policies:
        return []
    claim = policies[0].claim
    tenant = f"%DYNAMIC_METADATA({JWT_FILTER}:{JWT_PAYLOAD}:{claim})%"
    policy = f"%METADATA(ROUTE:{ROUTE_METADATA}:{QOS_KEY})%"
    out = []
    if any(local_rate_limited(p) for p in policies):
        out.append(
            {
                "filter": _cel_filter(f"response.code_details == {cel_string(LOCAL_LIMITED)}"),
                "body_format_override": {
                    "json_format": {
                        "error": "rate limit exceeded",
                        "limit": LIMIT_RATE,
                        "scope": "gateway",
                        "policy": policy,
                        "tenant": tenant,
                        "class": f"%CEL({_policy_cel(policies, 'class')})%",
                    },
                    "content_type": "application/json",
                },
            }
        )
    if any(p.fail_closed and p.uses_limit_service for p in policies):
        out.append(
            {
                "filter": _cel_filter(
                    f"response.code_details == {cel_string(LIMIT_SERVICE_ERROR)}"
                ),
                "headers_to_add": [_header("retry-after", "1"), _header(LIMIT_HEADER, "limit-service")],
                "body_format_override": {
                    "json_format": {
                        "error": "the limit service did not answer and the policy fails closed",
                        "limit": "limit-service",
                        "policy": policy,
                        "tenant": tenant,
                    },
                    "content_type": "application/json",
                },
            }
        )
    return out


def _generic(key: str, value: str) -> Obj:
    return {"generic_key": {"descriptor_key": key, "descriptor_value": value}}


def limit_service_rate_limits(policy: ir.QoSPolicy) -> list[Obj]:
    """What a gateway asks the control plane's rate-limit service for `policy`'s requests: one
    call before the request (the shared rate limit, +1; the compute budget, peeked: +0) and one
    when it ends (the compute budget, charged with the backend's reported guest CPU time)."""
    out: list[Obj] = []
    head = [_generic(DESCRIPTOR_POLICY, policy.key)]
    tenant = tenant_action(policy.claim, skip_if_absent=True)  # none: the anonymous tenant
    if policy.shared and policy.rate_limited:
        out.append({"actions": [*head, _generic(DESCRIPTOR_LIMIT, LIMIT_RATE), tenant]})
    if policy.budgeted:
        out.append(
            {
                "actions": [*head, _generic(DESCRIPTOR_LIMIT, LIMIT_COMPUTE), tenant],
                "hits_addend": {"number": 0},
            }
        )
        out.append(
            {
                "actions": [*head, _generic(DESCRIPTOR_LIMIT, LIMIT_COMPUTE_USED), tenant],
                "hits_addend": {"format": f"%DYNAMIC_METADATA({COST_METADATA}:{COST_KEY})%"},
                "apply_on_stream_done": True,
            }
        )
    return out


def cost_to_metadata() -> Obj:
    """header_to_metadata: the backend's reported guest CPU time (COST_HEADER, microseconds) into
    dynamic metadata, where the charge at the end of the request reads it (0 when absent)."""
    rule = {"metadata_namespace": COST_METADATA, "key": COST_KEY, "type": "NUMBER"}
    return {
        "@type": HEADER_TO_METADATA_TYPE,
        "response_rules": [
            {
                "header": COST_HEADER,
                "on_header_present": rule,
                "on_header_missing": {**rule, "value": "0"},
                "remove": False,
            }
        ],
    }


def route_names(route: ir.Route) -> list[str]:
    """Every Envoy route name a meshfn route may have (its degraded twins included)."""
    return [
        name
        for i in range(len(route.matches))
        for name in (route_name(route.key, i), degraded_route_name(route.key, i))
    ]


def _concurrency_policy(policy: ir.QoSPolicy, routes: list[str]) -> ConcurrencyPolicy:
    default = policy.default.limits.concurrency or 0
    return ConcurrencyPolicy(
        name=policy.key,
        routes=routes,
        default_class=policy.default_class,
        default_limit=default,
        tenants=[
            ConcurrencyTenant(
                name=t.name, tenant_class=t.tenant_class, limit=t.limits.concurrency or 0
            )
            for t in policy.tenants
        ],
    )


def concurrency_settings(
    gateway: ir.QoSPolicy | None, routes: Iterable[ir.Route]
) -> QoSSettings | None:
    """The qos plugin's settings for a listener: the gateway's policy for every route without
    one of its own, and each route's own policy for its routes; None without any concurrency
    limit (a route whose own policy sets none is still named, so the gateway's does not apply)."""
    own: dict[str, tuple[ir.QoSPolicy, list[str]]] = {}
    for route in routes:
        if route.qos is not None:
            own.setdefault(route.qos.key, (route.qos, []))[1].extend(route_names(route))
    policies = [p for p, _ in own.values()] + ([gateway] if gateway is not None else [])
    if not any(p.concurrency_limited for p in policies):
        return None
    out = [_concurrency_policy(p, sorted(names)) for p, names in own.values()]
    if gateway is not None:
        out.append(_concurrency_policy(gateway, []))
    return QoSSettings(policies=out)
