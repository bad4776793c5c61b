"""PeerAuthentication, RequestAuthentication, AuthorizationPolicy: one to one from the policies
as written (ir.Policies), with meshfn's meaning kept where Istio's defaults differ.

- The Mesh's mTLS default (STRICT unless it says otherwise; Istio's is PERMISSIVE) becomes an
  explicit mesh-wide PeerAuthentication in the root namespace.
- Claim headers the filters rely on (the audit subject, drill callers' iss/sub) are added to the
  jwt rules of every RequestAuthentication that selects such a workload, as the translator adds
  them to jwt_authn; the EnvoyFilters strip them from client requests.
"""

from __future__ import annotations

from ipaddress import ip_address
from urllib.parse import urlsplit

from meshfn import ir
from meshfn.contracts.plugins import AuditSettings

from .core import Context, Obj, Source, mesh_source, resource, selector
from .plugins import claim_headers_for

SECURITY = "security.istio.io/v1"


def _selector(ctx: Context, sel: ir.Selector | None) -> Obj:
    return {} if sel is None else {"selector": selector(ctx.options, sel.name)}


def peer_authentications(ctx: Context) -> None:
    model = ctx.model
    ctx.emit(
        resource(
            SECURITY,
            "PeerAuthentication",
            f"meshfn-{model.name}",
            ctx.options.root_namespace,
            {"mtls": {"mode": model.policies.mtls}},
        ),
        mesh_source(model),
    )
    for policy in model.policies.peer:
        spec: Obj = _selector(ctx, policy.selector)
        if policy.mtls is not None:
            spec["mtls"] = {"mode": policy.mtls}
        if policy.port_mtls:
            spec["portLevelMtls"] = {str(port): {"mode": mode} for port, mode in policy.port_mtls}
        ctx.emit(
            resource(SECURITY, "PeerAuthentication", policy.name, policy.namespace, spec),
            Source("PeerAuthentication", policy.namespace, policy.name),
        )


def _selected(model: ir.MeshModel, policy: ir.RequestPolicy) -> list[ir.Workload]:
    sel = policy.selector
    return [
        w
        for w in model.workloads
        if w.namespace == policy.namespace
        and (
            sel is None
            or (sel.kind == "gateway" and w.kind == "gateway" and w.name == sel.name)
            or (sel.kind == "service" and w.kind == "sidecar" and w.name == sel.name)
        )
    ]


def _loopback(uri: str) -> bool:
    host = urlsplit(uri).hostname or ""
    try:
        return host == "localhost" or ip_address(host).is_loopback
    except ValueError:
        return False


def request_authentications(ctx: Context) -> None:
    for policy in ctx.model.policies.request:
        source = Source("RequestAuthentication", policy.namespace, policy.name)
        extra: dict[str, str] = {}
        for workload in _selected(ctx.model, policy):
            extra.update(claim_headers_for(ctx, workload))
        rules = []
        for index, rule in enumerate(policy.rules):
            rules.append(_jwt_rule(rule, extra))
            path = ("spec", "jwtRules", index)
            if rule.clock_skew_seconds != 60:
                ctx.warn(
                    "jwt-clock-skew",
                    source,
                    (*path, "clockSkew"),
                    f"Istio's RequestAuthentication has no clock skew: Envoy's default 60s "
                    f"applies, not {rule.clock_skew_seconds}s",
                )
            if rule.require_expiration:
                ctx.warn(
                    "jwt-expiration-not-required",
                    source,
                    (*path, "requireExpiration"),
                    "Istio's RequestAuthentication cannot refuse tokens without `exp` (and its"
                    " claim matching sees no numeric claims): in Istio mode they are accepted;"
                    " set requireExpiration: false to say that is intended",
                )
            if rule.max_lifetime_seconds is not None:
                ctx.warn(
                    "jwt-max-lifetime",
                    source,
                    (*path, "maxLifetime"),
                    "Istio's RequestAuthentication has no token lifetime bound: tokens with a"
                    f" longer exp - iat than {rule.max_lifetime_seconds}s are accepted",
                )
            if rule.jwks_uri is not None and _loopback(rule.jwks_uri):
                ctx.warn(
                    "jwks-uri-loopback",
                    source,
                    (*path, "jwksUri"),
                    f"{rule.jwks_uri} is a loopback address: istiod (which fetches the keys) and "
                    "the proxies cannot reach meshfn's local issuer there",
                )
        spec = {**_selector(ctx, policy.selector), "jwtRules": rules}
        ctx.emit(
            resource(SECURITY, "RequestAuthentication", policy.name, policy.namespace, spec), source
        )


def _jwt_rule(rule: ir.JwtRule, extra: dict[str, str]) -> Obj:
    """`extra`: header -> claim pairs the filters need; they win over a rule's own entry for
    the same header (as in the translator)."""
    out: Obj = {"issuer": rule.issuer}
    if rule.audiences:
        out["audiences"] = list(rule.audiences)
    if rule.jwks is not None:
        out["jwks"] = rule.jwks
    else:
        out["jwksUri"] = rule.jwks_uri
    out["fromHeaders"] = [{"name": n, "prefix": p} for n, p in rule.from_headers]
    if rule.from_params:
        out["fromParams"] = list(rule.from_params)
    claims = [(h, c) for h, c in rule.claim_to_headers if h not in extra] + sorted(extra.items())
    if claims:
        out["outputClaimToHeaders"] = [{"header": h, "claim": c} for h, c in claims]
    out["forwardOriginalToken"] = rule.forward
    return out


# ---------------------------------------------------------------- authorization


def _fields(pairs: tuple[tuple[str, tuple[str, ...]], ...]) -> Obj:
    return {name: list(values) for name, values in pairs if values}


def _rule(rule: ir.AuthzRule) -> Obj:
    out: Obj = {}
    if rule.sources:
        out["from"] = [
            {
                "source": _fields(
                    (
                        ("principals", s.principals),
                        ("notPrincipals", s.not_principals),
                        ("namespaces", s.namespaces),
                        ("notNamespaces", s.not_namespaces),
                        ("requestPrincipals", s.request_principals),
                        ("notRequestPrincipals", s.not_request_principals),
                    )
                )
            }
            for s in rule.sources
        ]
    if rule.operations:
        out["to"] = [
            {
                "operation": _fields(
                    (
                        ("paths", o.paths),
                        ("notPaths", o.not_paths),
                        ("methods", o.methods),
                        ("notMethods", o.not_methods),
                    )
                )
            }
            for o in rule.operations
        ]
    if rule.conditions:
        out["when"] = [
            {"key": c.key, **_fields((("values", c.values), ("notValues", c.not_values)))}
            for c in rule.conditions
        ]
    return out


def ambiguous_principal(pattern: str, issuers: set[str]) -> str | None:
    """meshfn splits `iss/sub` at the last `/` and compares both; Istio compares the joined
    string, so another trusted issuer that is a `/`-prefix (or extension) of this one could
    match too. Returns that issuer, or None when the meanings agree."""
    if pattern == "*":
        return None
    issuer, _, subject = pattern.rpartition("/")
    for other in sorted(issuers - {issuer}):
        if subject == "*" and other.startswith(issuer + "/"):
            return other
        if subject != "*" and (issuer + "/").startswith(other + "/"):
            return other
    return None


def authorization_policies(ctx: Context) -> None:
    issuers = {r.issuer for p in ctx.model.policies.request for r in p.rules}
    for policy in ctx.model.policies.authz:
        sources = [Source(*origin) for origin in policy.derived_from] or [
            Source("AuthorizationPolicy", policy.namespace, policy.name)
        ]
        source = sources[0]
        spec: Obj = {**_selector(ctx, policy.selector), "action": policy.action}
        spec["rules"] = [_rule(r) for r in policy.rules]
        for i, rule in enumerate(policy.rules):
            for j, src in enumerate(rule.sources):
                for name, values in (
                    ("requestPrincipals", src.request_principals),
                    ("notRequestPrincipals", src.not_request_principals),
                ):
                    for k, value in enumerate(values):
                        _check_principal(
                            ctx,
                            source,
                            ("spec", "rules", i, "from", j, "source", name, k),
                            value,
                            issuers,
                        )
            for j, cond in enumerate(rule.conditions):
                if cond.key == "request.auth.principal":
                    for name, values in (("values", cond.values), ("notValues", cond.not_values)):
                        for k, value in enumerate(values):
                            _check_principal(
                                ctx,
                                source,
                                ("spec", "rules", i, "when", j, name, k),
                                value,
                                issuers,
                            )
        ctx.emit(
            resource(SECURITY, "AuthorizationPolicy", policy.name, policy.namespace, spec), *sources
        )


def _check_principal(
    ctx: Context, source: Source, path: tuple[str | int, ...], value: str, issuers: set[str]
) -> None:
    other = ambiguous_principal(value, issuers)
    if other is not None:
        ctx.warn(
            "request-principal-split",
            source,
            path,
            f"{value!r}: Istio matches the joined '<iss>/<sub>', so tokens of issuer {other!r} "
            "whose subject contains '/' can match too (meshfn splits at the last '/')",
        )


__all__ = [
    "AuditSettings",
    "authorization_policies",
    "peer_authentications",
    "request_authentications",
]
