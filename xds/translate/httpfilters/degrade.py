"""The degrade filter, on a gateway listener whose routes have a drift breaker.

Its configuration arrives over ECDS, not inside the listener: tripping or resetting the breaker
then pushes only new plugin configuration; the listener, its connections and the route table
stay as they are (a listener update would drain keep-alive connections slowly and leave them on
the old configuration meanwhile). It runs after RBAC. Where the listener also audits, the
combined plugin (plugin.py) runs both in the audit filter's place, and this unit adds nothing.
Each guarded route has a degraded twin matching the routing header (routes.py) that the
connection manager strips from client requests (internal_headers.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from meshfn import ir

from ...fragments.plugins import guarded_routes
from ...names import EXTENSION
from ..resources import Resources
from ..wasm import degrade_filter, ecds_config, ecds_slot
from .base import DegradeConfig, FilterContext, HttpFilter


class Degrade(HttpFilter[DegradeConfig]):
    def config(self, ctx: FilterContext) -> DegradeConfig | None:
        return None if ctx.combined else ctx.degrade

    def http_filters(self, ctx: FilterContext, config: DegradeConfig) -> Iterable[hcm.HttpFilter]:
        return (ecds_slot(_name(config)),)

    def resources(
        self, ctx: FilterContext, config: DegradeConfig, overlay: ir.Overlay
    ) -> Resources:
        built = degrade_filter(config.settings(overlay.degraded_routes), config.wasm_dir)
        return {EXTENSION: {_name(config): ecds_config(_name(config), built)}}


def _name(config: DegradeConfig) -> str:
    """The filter's name and its ECDS resource's (Envoy pairs them by name)."""
    return f"meshfn.degrade.{config.listener}"


def degrade_for(
    listener: ir.Listener,
    guarded: frozenset[str],
    drill: ir.Drill | None,
    wasm_dir: Path,
    gateway_qos: ir.QoSPolicy | None = None,
) -> DegradeConfig | None:
    """The listener's degrade filter, if any of its routes (keys in `guarded`) has a drift
    breaker that can send it down a fallback chain."""
    routes = guarded_routes(listener, guarded, gateway_qos)
    return DegradeConfig(listener.name, routes, drill, wasm_dir) if routes else None
