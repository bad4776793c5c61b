"""The combined plugin: where a gateway listener both audits and degrades, or routes OpenAI
requests by the model their body names (the model router: only in this plugin), the parts run
as ONE plugin (meshfn.wasm) in the audit filter's place, after jwt_authn and before RBAC;
Envoy's fixed cost per wasm filter and request is then paid once. Its configuration arrives
over ECDS, like the degrade filter's (degrade.py), so tripping a drift breaker pushes only new
plugin configuration. The audit unit keeps the access log (audit.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from meshfn import ir

from ...names import EXTENSION
from ..resources import Resources
from ..wasm import ecds_config, ecds_slot, meshfn_filter
from .base import AuditConfig, DegradeConfig, FilterContext, HttpFilter, RouteConfig


@dataclass(frozen=True)
class PluginConfig:
    audit: AuditConfig | None
    degrade: DegradeConfig | None
    route: RouteConfig | None

    @property
    def listener(self) -> str:
        part = self.degrade or self.route
        assert part is not None
        return part.listener

    @property
    def name(self) -> str:
        """The filter's name and its ECDS resource's (Envoy pairs them by name)."""
        return f"meshfn.plugin.{self.listener}"

    @property
    def wasm_dir(self) -> Path:
        part = self.degrade or self.route or self.audit
        assert part is not None
        return part.wasm_dir


class Plugin(HttpFilter[PluginConfig]):
    def config(self, ctx: FilterContext) -> PluginConfig | None:
        if not ctx.combined:
            return None
        return PluginConfig(ctx.audit, ctx.degrade, ctx.route)

    def http_filters(self, ctx: FilterContext, config: PluginConfig) -> Iterable[hcm.HttpFilter]:
        return (ecds_slot(config.name),)

    def resources(self, ctx: FilterContext, config: PluginConfig, overlay: ir.Overlay) -> Resources:
        degrade = config.degrade.settings(overlay.degraded_routes) if config.degrade else None
        built = meshfn_filter(
            config.audit.settings if config.audit is not None else None,
            degrade,
            config.wasm_dir,
            config.route.settings() if config.route is not None else None,
        )
        return {EXTENSION: {config.name: ecds_config(config.name, built)}}
