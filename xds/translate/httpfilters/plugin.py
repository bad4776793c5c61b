"""The combined plugin: where a gateway listener both audits and degrades, the audit and degrade
filters run as ONE plugin (meshfn.wasm) in the audit filter's place, after jwt_authn and before
RBAC; Envoy's fixed cost per wasm filter and request is then paid once, not twice. Its
configuration arrives over ECDS, like the degrade filter's (degrade.py), so tripping a drift
breaker pushes only new plugin configuration. The audit unit keeps the access log (audit.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from meshfn import ir

from ...names import EXTENSION
from ..resources import Resources
from ..wasm import ecds_config, ecds_slot, meshfn_filter
from .base import AuditConfig, DegradeConfig, FilterContext, HttpFilter


@dataclass(frozen=True)
class PluginConfig:
    audit: AuditConfig
    degrade: DegradeConfig

    @property
    def name(self) -> str:
        """The filter's name and its ECDS resource's (Envoy pairs them by name)."""
        return f"meshfn.plugin.{self.degrade.listener}"


class Plugin(HttpFilter[PluginConfig]):
    def config(self, ctx: FilterContext) -> PluginConfig | None:
        if not ctx.combined:
            return None
        assert ctx.audit is not None and ctx.degrade is not None
        return PluginConfig(ctx.audit, ctx.degrade)

    def http_filters(self, ctx: FilterContext, config: PluginConfig) -> Iterable[hcm.HttpFilter]:
        return (ecds_slot(config.name),)

    def resources(self, ctx: FilterContext, config: PluginConfig, overlay: ir.Overlay) -> Resources:
        degrade = config.degrade.settings(overlay.degraded_routes)
        built = meshfn_filter(config.audit.settings, degrade, config.degrade.wasm_dir)
        return {EXTENSION: {config.name: ecds_config(config.name, built)}}
