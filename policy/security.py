"""Zero-trust policies -> IR: who gets which mTLS mode, JWT rules and authorization policies.

Selection follows Istio: a policy with a selector applies to the named workload in its
namespace; without one, to every workload of its namespace. For mTLS the most specific setting
wins (port level > service > namespace > Mesh default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshfn import ir

from .model import (
    AuthorizationPolicy,
    JwtRule,
    Mesh,
    PeerAuthentication,
    RequestAuthentication,
    Rule,
    WorkloadSelector,
)
from .validate import Loaded


def spiffe_id(trust_domain: str, namespace: str, account: str) -> str:
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{account}"


def selects(selector: WorkloadSelector | None, kind: str, name: str) -> bool:
    if selector is None:
        return True
    return (selector.service if kind == "service" else selector.gateway) == name


class Security:
    """The zero-trust policies of one policy set, indexed for per-workload lookups."""

    def __init__(self, items: Sequence[Loaded]) -> None:
        mesh = next(i.obj for i in items if isinstance(i.obj, Mesh))
        assert isinstance(mesh, Mesh)
        self.trust_domain = mesh.spec.trustDomain
        self.mesh_mode: ir.MtlsMode = mesh.spec.mtls.mode
        self.peer = [i for i in items if isinstance(i.obj, PeerAuthentication)]
        self.request = [i for i in items if isinstance(i.obj, RequestAuthentication)]
        self.authz = sorted(
            (i for i in items if isinstance(i.obj, AuthorizationPolicy)),
            key=lambda i: (i.namespace, i.name),
        )

    def mtls(self, service: ir.Service, app_port: int) -> ir.MtlsMode:
        mode: ir.MtlsMode = self.mesh_mode
        namespace_wide = None
        selected = None
        for item in self.peer:
            obj = item.obj
            assert isinstance(obj, PeerAuthentication)
            if item.namespace != service.namespace:
                continue
            if obj.spec.selector is None:
                namespace_wide = obj.spec
            elif obj.spec.selector.service == service.name:
                selected = obj.spec
        for spec in (namespace_wide, selected):
            if spec is not None and spec.mtls is not None:
                mode = spec.mtls.mode
        if selected is not None and str(app_port) in selected.portLevelMtls:
            mode = selected.portLevelMtls[str(app_port)].mode
        return mode

    def jwt_rules(self, kind: str, namespace: str, name: str) -> tuple[ir.JwtRule, ...]:
        rules: list[ir.JwtRule] = []
        for item in sorted(self.request, key=lambda i: (i.namespace, i.name)):
            obj = item.obj
            assert isinstance(obj, RequestAuthentication)
            if item.namespace == namespace and selects(obj.spec.selector, kind, name):
                rules.extend(_jwt_rule(rule) for rule in obj.spec.jwtRules)
        return tuple(dict.fromkeys(rules))

    def policies(self, kind: str, namespace: str, name: str) -> tuple[ir.AuthzPolicy, ...]:
        out = []
        for item in self.authz:
            obj = item.obj
            assert isinstance(obj, AuthorizationPolicy)
            if item.namespace == namespace and selects(obj.spec.selector, kind, name):
                out.append(
                    ir.AuthzPolicy(
                        name=f"{item.namespace}/{item.name}",
                        action=obj.spec.action,
                        rules=tuple(_rule(r) for r in obj.spec.rules),
                    )
                )
        return tuple(out)

    def as_written(self) -> ir.Policies:
        """The policies as namespace-scoped objects with their selectors (ir.Policies)."""
        peer = []
        for item in sorted(self.peer, key=lambda i: (i.namespace, i.name)):
            obj = item.obj
            assert isinstance(obj, PeerAuthentication)
            spec = obj.spec
            peer.append(
                ir.PeerPolicy(
                    name=item.name,
                    namespace=item.namespace,
                    selector=_selector(spec.selector),
                    mtls=spec.mtls.mode if spec.mtls is not None else None,
                    port_mtls=tuple(
                        sorted((int(port), m.mode) for port, m in spec.portLevelMtls.items())
                    ),
                )
            )
        request = []
        for item in sorted(self.request, key=lambda i: (i.namespace, i.name)):
            assert isinstance(item.obj, RequestAuthentication)
            request.append(
                ir.RequestPolicy(
                    name=item.name,
                    namespace=item.namespace,
                    selector=_selector(item.obj.spec.selector),
                    rules=tuple(_jwt_rule(rule) for rule in item.obj.spec.jwtRules),
                )
            )
        authz = []
        for item in self.authz:
            assert isinstance(item.obj, AuthorizationPolicy)
            authz_spec = item.obj.spec
            authz.append(
                ir.AuthzObject(
                    name=item.name,
                    namespace=item.namespace,
                    selector=_selector(authz_spec.selector),
                    action=authz_spec.action,
                    rules=tuple(_rule(r) for r in authz_spec.rules),
                )
            )
        return ir.Policies(
            mtls=self.mesh_mode, peer=tuple(peer), request=tuple(request), authz=tuple(authz)
        )

    def secure_service(self, service: ir.Service, account: str) -> ir.Service:
        """The service with its identity and, per sidecar'd endpoint, the sidecar's mTLS mode."""
        endpoints = tuple(
            dataclasses.replace(e, mtls=self.mtls(service, e.port)) if e.sidecar_port else e
            for e in service.endpoints
        )
        return dataclasses.replace(
            service,
            endpoints=endpoints,
            identity=spiffe_id(self.trust_domain, service.namespace, account),
        )


def _selector(selector: WorkloadSelector | None) -> ir.Selector | None:
    if selector is None:
        return None
    if selector.service is not None:
        return ir.Selector("service", selector.service)
    assert selector.gateway is not None
    return ir.Selector("gateway", selector.gateway)


def _jwt_rule(rule: JwtRule) -> ir.JwtRule:
    return ir.JwtRule(
        issuer=rule.issuer,
        audiences=tuple(rule.audiences),
        jwks=rule.jwks,
        jwks_uri=rule.jwksUri,
        from_headers=tuple((h.name.lower(), h.prefix) for h in rule.fromHeaders),
        from_params=tuple(rule.fromParams),
        claim_to_headers=tuple((c.header.lower(), c.claim) for c in rule.outputClaimToHeaders),
        forward=rule.forwardOriginalToken,
        clock_skew_seconds=int(rule.clockSkew.total_seconds()),
        require_expiration=rule.requireExpiration,
        max_lifetime_seconds=(
            None if rule.maxLifetime is None else int(rule.maxLifetime.total_seconds())
        ),
    )


def _rule(rule: Rule) -> ir.AuthzRule:
    return ir.AuthzRule(
        sources=tuple(
            ir.SourceMatch(
                principals=tuple(f.source.principals),
                not_principals=tuple(f.source.notPrincipals),
                namespaces=tuple(f.source.namespaces),
                not_namespaces=tuple(f.source.notNamespaces),
                request_principals=tuple(f.source.requestPrincipals),
                not_request_principals=tuple(f.source.notRequestPrincipals),
            )
            for f in rule.from_
        ),
        operations=tuple(
            ir.OperationMatch(
                paths=tuple(t.operation.paths),
                not_paths=tuple(t.operation.notPaths),
                methods=tuple(t.operation.methods),
                not_methods=tuple(t.operation.notMethods),
            )
            for t in rule.to
        ),
        conditions=tuple(
            ir.ConditionMatch(key=c.key, values=tuple(c.values), not_values=tuple(c.notValues))
            for c in rule.when
        ),
    )
