"""Pass 9, assemble: the MeshModel from the last stage and the Mesh's own settings (ports,
identity, acceleration, sandbox, audit, drill)."""

from __future__ import annotations

import dataclasses

from meshfn import ir

from ..model import Audit, Drill
from .sidecars import Complete


def assemble(complete: Complete) -> ir.MeshModel:
    spec = complete.mesh.spec
    return ir.MeshModel(
        name=complete.mesh.metadata.name,
        trust_domain=spec.trustDomain,
        xds_port=spec.ports.xds,
        admin_port=spec.ports.admin,
        services=complete.services,
        workloads=complete.gateway_workloads + complete.sidecar_workloads,
        certificate_ttl=spec.identity.certificateTTL,
        functions=tuple(sorted(complete.functions, key=lambda f: (f.namespace, f.name))),
        acceleration=spec.acceleration,
        sandbox=ir.Sandbox(**spec.sandbox.model_dump()),
        audit=_audit(spec.audit),
        drill=_drill(spec.drill),
        policies=_with_guards(complete.written, complete.guard_objects),
        qos=complete.qos,
    )


def _drill(spec: Drill | None) -> ir.Drill | None:
    if spec is None:
        return None
    return ir.Drill(header=spec.header, request_principals=tuple(spec.requestPrincipals))


def _audit(spec: Audit | None) -> ir.Audit | None:
    if spec is None:
        return None
    return ir.Audit(
        proxies=spec.proxies,
        retention_days=spec.retentionDays,
        tenant_claim=spec.tenantClaim,
        body_hash=spec.bodyHash.enabled,
        body_hash_max_bytes=spec.bodyHash.maxBytes,
    )


def _with_guards(policies: ir.Policies, guards: tuple[ir.AuthzObject, ...]) -> ir.Policies:
    """The policies as written plus the repository guards meshfn writes itself, so the Istio
    renderer guards load/unload where the xDS translator does."""
    if not guards:
        return policies
    authz = sorted((*policies.authz, *guards), key=lambda p: (p.namespace, p.name))
    return dataclasses.replace(policies, authz=tuple(authz))
