"""The degrade filter, on a gateway listener whose routes have a drift breaker.

Its configuration arrives over ECDS, not inside the listener: tripping or resetting the breaker
then pushes only new plugin configuration; the listener, its connections and the route table
stay as they are (a listener update would drain keep-alive connections slowly and leave them on
the old configuration meanwhile). It runs after RBAC; where the listener also audits, both run
as one plugin in the audit filter's place (see audit.py), and this unit builds that plugin's
configuration too. Each guarded route has a degraded twin matching the routing header (routes.py)
that the connection manager strips from client requests (internal_headers.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from envoy.config.core.v3 import config_source_pb2, extension_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from meshfn import ir
from meshfn.contracts.plugins import DegradeSettings

from ...fragments.plugins import degrade_rules, guarded_routes
from ...names import EXTENSION
from ..common import ads_source
from ..resources import Resources
from ..wasm import degrade_filter, meshfn_filter
from .base import DegradeConfig, FilterContext, HttpFilter

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


class Degrade(HttpFilter[DegradeConfig]):
    def config(self, ctx: FilterContext) -> DegradeConfig | None:
        return ctx.degrade

    def http_filters(self, ctx: FilterContext, config: DegradeConfig) -> Iterable[hcm.HttpFilter]:
        # With audit, the combined plugin sits in the audit filter's place (audit.py).
        return (ecds_slot(ctx, config),) if ctx.audit is None else ()

    def resources(
        self, ctx: FilterContext, config: DegradeConfig, overlay: ir.Overlay
    ) -> Resources:
        name = ecds_name(ctx, config)
        settings = degrade_settings(config, overlay.degraded_routes)
        if ctx.audit is not None:
            built = meshfn_filter(ctx.audit.settings, settings, config.wasm_dir)
        else:
            built = degrade_filter(settings, config.wasm_dir)
        return {
            EXTENSION: {
                name: extension_pb2.TypedExtensionConfig(name=name, typed_config=built.typed_config)
            }
        }


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


def ecds_name(ctx: FilterContext, config: DegradeConfig) -> str:
    """The HTTP filter's name and its ECDS resource name (Envoy pairs them by name): the
    degrade filter, or the combined plugin where the listener audits too."""
    return f"meshfn.{'plugin' if ctx.audit is not None else 'degrade'}.{config.listener}"


def ecds_slot(ctx: FilterContext, config: DegradeConfig) -> hcm.HttpFilter:
    """The filter's place in the chain: Envoy fetches its configuration over ADS and, while it
    has none, keeps the listener warming (never serves without it)."""
    return hcm.HttpFilter(
        name=ecds_name(ctx, config),
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=ads_source(), type_urls=[WASM_FILTER_TYPE]
        ),
    )


def degrade_settings(config: DegradeConfig, degraded: frozenset[str]) -> DegradeSettings:
    """The filter's plugin settings (fragments.plugins.degrade_rules, shared with Istio)."""
    return degrade_rules(config.routes, degraded, config.trigger)
