"""Pass 2, security: each Service's identity and its sidecars' mTLS modes, what every gateway
and service workload enforces (its JWT rules and authorization policies, selected as
policy.security says), and the zero-trust policies as written (for the Istio renderer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshfn import ir

from ..model import Gateway, Service
from ..security import Security, spiffe_id
from .resolve import Resolved


@dataclass(frozen=True)
class Access:
    """Who one workload's proxies are (SPIFFE ID), the JWTs they verify, the policies they
    apply."""

    identity: str
    jwt_rules: tuple[ir.JwtRule, ...]
    authz: tuple[ir.AuthzPolicy, ...]


@dataclass(frozen=True)
class Secured(Resolved):
    """`services`: every Service's IR with its identity and sidecar mTLS modes, in
    (namespace, name) order; `access`: per ("gateway" | "service", namespace/name) what its
    workloads enforce; `written`: the zero-trust policies as namespace-scoped objects."""

    services: tuple[ir.Service, ...]
    access: Mapping[tuple[str, str], Access]
    written: ir.Policies


def secure(resolved: Resolved) -> Secured:
    security = Security(resolved.items)
    services = []
    access = {}
    for key, gateway in resolved.gateways.items():
        assert isinstance(gateway.obj, Gateway)
        account = gateway.obj.spec.serviceAccount or gateway.name
        access[("gateway", key)] = Access(
            spiffe_id(security.trust_domain, gateway.namespace, account),
            security.jwt_rules("gateway", gateway.namespace, gateway.name),
            security.policies("gateway", gateway.namespace, gateway.name),
        )
    for item in resolved.service_items:
        assert isinstance(item.obj, Service) and isinstance(item.lowered, ir.Service)
        service = security.secure_service(item.lowered, item.obj.spec.serviceAccount or item.name)
        services.append(service)
        access[("service", service.key)] = Access(
            service.identity,
            security.jwt_rules("service", service.namespace, service.name),
            security.policies("service", service.namespace, service.name),
        )
    return Secured(
        **vars(resolved),
        services=tuple(services),
        access=access,
        written=security.as_written(),
    )
