"""MeshModel -> Envoy resources for one workload. Pure and deterministic; golden-tested.

Translation runs on every reload, for every workload: builders are memoised (lru_cache) on IR
objects and on the hashable httpfilters.FilterContext, so an unchanged piece of policy yields the
identical message, whose serialised bytes the snapshot cache then reuses.
"""

from __future__ import annotations

from meshfn import ir

from ..names import SECRET
from .gateway import gateway_resources
from .host import OFFLINE_HOST, AppSockets, ProxyHost
from .httpfilters import FilterContext, QoSContext
from .httpfilters.audit import audit_for
from .httpfilters.tracing import tracing_for
from .resources import Resources
from .security import Credentials, secrets
from .sidecar import sidecar_resources

NO_OVERLAY = ir.Overlay()


def translate(
    model: ir.MeshModel,
    node_cluster: str,
    credentials: Credentials | None = None,
    overlay: ir.Overlay = NO_OVERLAY,
    host: ProxyHost = OFFLINE_HOST,
    limit_service_token: str | None = None,
) -> Resources | None:
    """Everything an Envoy of workload `node_cluster` needs, or None for an unknown workload.

    `credentials` (certificate, key, trust bundle) become the SDS secrets; without them the
    secrets are left out (offline rendering, golden files). `overlay` carries runtime state such
    as routes the drift breaker has tripped. `host` says where the built wasm filters and audit
    journals are and holds the subject salt. `limit_service_token`: the `authorization` value a
    gateway shows the control plane's limit service (xds/rls.py); None offline.
    """
    workload = model.workload(node_cluster)
    if workload is None:
        return None
    audit = audit_for(model, workload, host)
    if workload.kind == "sidecar":
        claim = workload.inbound.tenant_claim if workload.inbound is not None else None
        filters = FilterContext(
            workload.jwt_rules,
            workload.authz,
            audit,
            qos=QoSContext(claim) if claim is not None and workload.jwt_rules else None,
            tracing=tracing_for(model, workload, host),
            openai=workload.inbound is not None and workload.inbound.functions,
        )
        out = sidecar_resources(workload, filters, overlay, host)
    else:
        out = gateway_resources(model, workload, overlay, host, audit, limit_service_token)
    if credentials is not None:
        out[SECRET] = dict(secrets(credentials))
    return out


__all__ = ["OFFLINE_HOST", "AppSockets", "Credentials", "ProxyHost", "Resources", "translate"]
