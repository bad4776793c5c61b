"""The router: the chain's last filter (terminal), forwarding along the route Envoy picked."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from ...fragments.messages import pack
from .base import FilterContext, HttpFilter

ROUTER = "envoy.filters.http.router"
ROUTER_FILTER = hcm.HttpFilter(name=ROUTER, typed_config=pack(router_pb2.Router()))


class Router(HttpFilter[FilterContext]):
    def config(self, ctx: FilterContext) -> FilterContext:
        return ctx  # everywhere

    def http_filters(self, ctx: FilterContext, config: FilterContext) -> Iterable[hcm.HttpFilter]:
        return (ROUTER_FILTER,)
