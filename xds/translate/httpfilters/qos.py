"""Multi-tenant QoS at a gateway: Envoy's local rate limit with one token bucket per verified
tenant (meshfn.xds.fragments.qos builds its configuration, shared with the Istio renderer), and
the JSON body of its 429s. A route bound to a QoSPolicy of its own carries that policy's configuration
per route (routes.py); the listener's filter carries the gateway's policy, or none."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from google.protobuf import json_format

from meshfn import ir

from ...fragments import qos as envoy_qos
from ...fragments.messages import pack
from ...names import CONTROL_PLANE_CLUSTER
from .base import FilterContext, HttpFilter, QoSContext


def rate_limit_config(policy: ir.QoSPolicy | None) -> local_rate_limit_pb2.LocalRateLimit:
    """The filter's configuration for `policy` (None, or a global rate: disabled)."""
    local = policy is not None and policy.global_rate is None
    raw = dict(envoy_qos.local_rate_limit(policy) if policy and local else envoy_qos.disabled())
    raw.pop("@type")
    message = local_rate_limit_pb2.LocalRateLimit()
    json_format.ParseDict(raw, message)
    return message


def global_rate_limit_config(
    policy: ir.QoSPolicy, metadata: tuple[tuple[str, str], ...] = ()
) -> rate_limit_pb2.RateLimit:
    """The gateway's global rate: asked of the control plane's limit service (xds/rls.py),
    served on the ADS port, with `metadata` proving which gateway asks."""
    raw = dict(envoy_qos.global_rate_limit(policy, CONTROL_PLANE_CLUSTER, metadata=metadata))
    raw.pop("@type")
    message = rate_limit_pb2.RateLimit()
    json_format.ParseDict(raw, message)
    return message


class QoS(HttpFilter[QoSContext]):
    def config(self, ctx: FilterContext) -> QoSContext | None:
        qos = ctx.qos
        return qos if qos is not None and (qos.rate_limited or qos.shed) else None

    def http_filters(self, ctx: FilterContext, config: QoSContext) -> Iterable[hcm.HttpFilter]:
        if not config.rate_limited:
            return
        yield hcm.HttpFilter(
            name=envoy_qos.LOCAL_RATE_LIMIT, typed_config=pack(rate_limit_config(config.gateway))
        )
        if config.gateway is not None and config.gateway.global_rate is not None:
            yield hcm.HttpFilter(
                name=envoy_qos.GLOBAL_RATE_LIMIT,
                typed_config=pack(
                    global_rate_limit_config(config.gateway, config.limit_service_metadata)
                ),
            )

    def local_reply_mappers(
        self, ctx: FilterContext, config: QoSContext, header: bool = False
    ) -> Iterable[hcm.ResponseMapper]:
        if config.shed:  # before the 429 mapper: Envoy applies the first that matches
            for raw in envoy_qos.shed_replies(config.claim, header):
                yield json_format.ParseDict(raw, hcm.ResponseMapper())
        if not config.rate_limited:
            return
        yield json_format.ParseDict(
            envoy_qos.limited_reply(config.claim, header), hcm.ResponseMapper()
        )
        gateway = config.gateway
        if gateway is not None and gateway.global_rate is not None and gateway.global_rate.deny:
            yield json_format.ParseDict(envoy_qos.limit_service_error_reply(), hcm.ResponseMapper())
