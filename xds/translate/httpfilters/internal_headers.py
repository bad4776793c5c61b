"""Headers only Envoy may set: the degrade filter's routing header and the claim headers
jwt_authn writes for the wasm filters (the audit filter's subject and tenant in jwt_headers mode,
a drill trigger's iss and sub; on a gateway of a mesh that audits, the mesh-route header its
routes set for the sidecars' records). Which headers those are is the filters' contract
(`contracts.plugins.internal_headers`, shared with the Istio renderer), so this one unit applies
it for every plugin on the listener, first in the chain: the HTTP connection manager removes
them from client requests before it matches a route or runs a filter (so only jwt_authn, or the
degrade filter, can have set them), and the route configuration removes the claim headers
before a request goes upstream (the backend never sees the raw subject).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from meshfn.contracts.plugins import (
    MESH_ROUTE_HEADER,
    AuditSettings,
    DegradeSettings,
    RouteSettings,
    internal_headers,
)
from meshfn.contracts.qos import TENANT_HEADER

from ...fragments.plugins import claim_header_pairs
from .base import FilterContext, HttpFilter


class Plugins(NamedTuple):
    """The settings of the listener's plugins that decide its internal headers, and whether it
    writes the verified QoS tenant."""

    degrade: DegradeSettings | None
    audit: AuditSettings | None
    mesh_route: bool = False
    tenant: bool = False
    route: RouteSettings | None = None


class InternalHeaders(HttpFilter[Plugins]):
    def config(self, ctx: FilterContext) -> Plugins | None:
        degrade = ctx.degrade
        plugins = Plugins(
            DegradeSettings(rules=[], trigger=degrade.trigger) if degrade is not None else None,
            ctx.audit.settings if ctx.audit is not None else None,
            ctx.mesh_route,
            ctx.qos is not None,
            ctx.route.settings() if ctx.route is not None else None,
        )
        return plugins if internal_headers(*plugins) else None

    def early_headers_to_remove(self, ctx: FilterContext, config: Plugins) -> Iterable[str]:
        return internal_headers(*config)

    def request_headers_to_remove(self, ctx: FilterContext, config: Plugins) -> Iterable[str]:
        # The claim headers only: they carry the caller's subject, the backend must not see it.
        # (The routing header is the router's; the mesh-route header goes on to the sidecar;
        # the QoS tenant too: the inference backend sheds and meters by it.)
        keep = {MESH_ROUTE_HEADER, TENANT_HEADER}
        if config.degrade is not None:
            keep.add(config.degrade.routing_header)
        return [name for name in internal_headers(*config) if name not in keep]


def claim_headers(ctx: FilterContext) -> tuple[tuple[str, str], ...]:
    """(header, claim) pairs every jwt_authn provider of the listener must write: the audit
    filter's (jwt_headers mode) and, where drills name request principals, iss and sub."""
    audit = ctx.audit.settings if ctx.audit is not None else None
    pairs = claim_header_pairs(audit, ctx.degrade.trigger if ctx.degrade is not None else None)
    if ctx.qos is not None:
        pairs += ((TENANT_HEADER, ctx.qos.claim),)
    return pairs
