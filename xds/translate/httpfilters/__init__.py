"""meshfn's HTTP filter chain: one unit per filter, one list that orders them.

Modelled on Envoy Gateway's internal/xds/translator/httpfilters.go: each unit (base.HttpFilter)
says whether it applies to a connection manager (`config`) and what it adds there (filter
entries, access logs, early header mutations), to the route configuration (headers to remove)
and to the resources (JWKS clusters, ECDS configurations). Gateways and sidecars build their
connection managers and route configurations through the functions below, so a listener is
assembled in one pass, never patched afterwards. Unlike Envoy Gateway there is no separate
order number: the position in HTTP_FILTERS is the order, for the chain and for every other
contribution. A new filter is a module with its unit and one line here.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from google.protobuf import json_format

from meshfn import ir

from ...fragments.headers import early_header_removal
from ...fragments.openai import openai_replies
from ..resources import Resources, merge
from .audit import Audit
from .base import FilterContext, HttpFilter, QoSContext, TracingContext
from .degrade import Degrade
from .internal_headers import InternalHeaders
from .jwt_authn import JwtAuthn
from .plugin import Plugin
from .qos import QoS
from .rbac import Rbac
from .router import ROUTER_FILTER, Router
from .tracing import Tracing
from .whole_bodies import WholeSmallBodies

# A request is cleared of headers only Envoy may set, read whole if its body is small (so a
# refusal keeps the connection), authenticated, recorded (the audit filter
# reads jwt_authn's verified claims), judged (a denied request is recorded with its subject
# too), rate limited per verified tenant (only what authorization let through spends tokens),
# degraded if its route's breaker has tripped, and routed. Where a listener both audits and
# degrades, the combined plugin records and degrades in the audit filter's place. Tracing is no
# filter of the chain but the connection manager's own (its tracer, and the early removal of an
# untrusted client's trace headers), listed first.
HTTP_FILTERS: tuple[HttpFilter[Any], ...] = (
    Tracing(),
    InternalHeaders(),
    WholeSmallBodies(),
    JwtAuthn(),
    Audit(),
    Plugin(),
    Rbac(),
    QoS(),
    Degrade(),
    Router(),
)


def _applied(ctx: FilterContext) -> list[tuple[HttpFilter[Any], Any]]:
    return [(unit, config) for unit in HTTP_FILTERS if (config := unit.config(ctx)) is not None]


def build_connection_manager(manager: hcm.HttpConnectionManager, ctx: FilterContext) -> None:
    """Add the chain to `manager`, which the caller is building (listener-specific settings,
    access logs and local replies are its own and come first)."""
    early: list[str] = []
    for unit, config in _applied(ctx):
        own = unit.connection_manager(ctx, config)
        if own is not None:
            manager.MergeFrom(own)
        manager.http_filters.extend(unit.http_filters(ctx, config))
        manager.access_log.extend(unit.access_logs(ctx, config))
        early.extend(unit.early_headers_to_remove(ctx, config))
    if early:
        manager.early_header_mutation_extensions.append(early_header_removal(dict.fromkeys(early)))
    replies = local_replies(ctx, manager.local_reply_config.mappers)
    if replies.mappers:  # the caller's other local-reply settings stay
        del manager.local_reply_config.mappers[:]
        manager.local_reply_config.mappers.extend(replies.mappers)


def local_replies(
    ctx: FilterContext, first: Iterable[hcm.ResponseMapper] = (), header: bool = False
) -> hcm.LocalReplyConfig:
    """The local replies of a connection manager with `ctx`'s chain: `first`, then each
    filter's mappers (`header`: read a verified claim from the header jwt_authn wrote, as
    base.HttpFilter.local_reply_mappers says). Where OpenAI's API passes (`ctx.openai`),
    Envoy's own replies on its paths become OpenAI's error objects (fragments.openai), in front
    of the others."""
    mappers = [
        *first,
        *(
            m
            for unit, config in _applied(ctx)
            for m in unit.local_reply_mappers(ctx, config, header)
        ),
    ]
    if ctx.openai:
        current = [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in mappers]
        mappers = [json_format.ParseDict(m, hcm.ResponseMapper()) for m in openai_replies(current)]
    return hcm.LocalReplyConfig(mappers=mappers)


@lru_cache(maxsize=4096)
def request_headers_to_remove(ctx: FilterContext) -> tuple[str, ...]:
    """For the route configuration of a connection manager with `ctx`'s chain."""
    return tuple(
        dict.fromkeys(
            name
            for unit, config in _applied(ctx)
            for name in unit.request_headers_to_remove(ctx, config)
        )
    )


@lru_cache(maxsize=4096)
def resources(ctx: FilterContext, overlay: ir.Overlay) -> Resources:
    """What the chain refers to. Memoised: only read it (resources.merge)."""
    out: Resources = {}
    for unit, config in _applied(ctx):
        merge(out, unit.resources(ctx, config, overlay))
    return out


__all__ = [
    "HTTP_FILTERS",
    "ROUTER_FILTER",
    "FilterContext",
    "HttpFilter",
    "QoSContext",
    "TracingContext",
    "build_connection_manager",
    "local_replies",
    "request_headers_to_remove",
    "resources",
]
