"""The audit filter, on the proxies `Mesh.spec.audit` names.

It sits after jwt_authn (it reads the verified payload, or in jwt_headers mode the claim headers
jwt_authn writes: see internal_headers) and before RBAC (so denied requests carry their subject
too), and Envoy's file access log writes each request as one journal line the control plane's
collector stores. Proxies without jwt rules keep jwt_authn mode (no verified token, no
subject). Where the listener also runs the degrade filter, the combined plugin (plugin.py) runs
both in this filter's place, and this unit adds the access log only.
"""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from meshfn import ir

from ...fragments.plugins import audit_settings
from ..host import ProxyHost
from ..wasm import access_log, audit_filter
from .base import AuditConfig, FilterContext, HttpFilter


class Audit(HttpFilter[AuditConfig]):
    def config(self, ctx: FilterContext) -> AuditConfig | None:
        return ctx.audit

    def http_filters(self, ctx: FilterContext, config: AuditConfig) -> Iterable[hcm.HttpFilter]:
        return () if ctx.combined else (audit_filter(config.settings, config.wasm_dir),)

    def access_logs(
        self, ctx: FilterContext, config: AuditConfig
    ) -> Iterable[accesslog_pb2.AccessLog]:
        split = ctx.tracing is not None and ctx.tracing.split and ctx.tracing.kind == "gateway"
        return (access_log(config.journal, config.settings, config.trusted_gateways, split),)


def audit_for(model: ir.MeshModel, workload: ir.Workload, host: ProxyHost) -> AuditConfig | None:
    """The workload's audit filter, where `Mesh.spec.audit` names its kind of proxy."""
    audit = model.audit
    if audit is None or not audit.records(workload.kind):
        return None
    return AuditConfig(
        audit_settings(audit, host.salt, bool(workload.jwt_rules)),
        host.journal(workload.node_cluster),
        host.wasm_dir,
        None if workload.kind == "gateway" else gateway_identities(model),
    )


def gateway_identities(model: ir.MeshModel) -> tuple[str, ...]:
    """The mTLS identities a sidecar believes the mesh-route header from: the gateways'."""
    return tuple(
        sorted({w.identity for w in model.workloads if w.kind == "gateway" and w.identity})
    )
