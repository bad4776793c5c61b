"""RBAC: AuthorizationPolicies as two Envoy RBAC filters, DENY then ALLOW.

Istio's semantics: DENY policies are checked first; once any ALLOW policy selects a workload,
requests no ALLOW rule matches are denied (403). Claims come from jwt_authn's verified payload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache

from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.type.matcher.v3 import metadata_pb2, path_pb2, regex_pb2, string_pb2, value_pb2

from meshfn import ir

from ...fragments.messages import pack
from ...fragments.plugins import JWT_PAYLOAD
from .base import FilterContext, HttpFilter
from .jwt_authn import JWT_FILTER


class Rbac(HttpFilter[tuple[ir.AuthzPolicy, ...]]):
    def config(self, ctx: FilterContext) -> tuple[ir.AuthzPolicy, ...] | None:
        return ctx.authz or None

    def http_filters(
        self, ctx: FilterContext, config: tuple[ir.AuthzPolicy, ...]
    ) -> Iterable[hcm.HttpFilter]:
        return rbac_filters(config)


def _regex(value: str) -> string_pb2.StringMatcher:
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=value))


def _principal_string(pattern: str) -> string_pb2.StringMatcher:
    """Istio principal pattern ("td/ns/x/sa/y", "*", "prefix*", "*suffix") -> SPIFFE matcher."""
    if pattern == "*":
        return _regex(".+")
    if pattern.endswith("*"):
        return string_pb2.StringMatcher(prefix="spiffe://" + pattern[:-1])
    if pattern.startswith("*"):
        return string_pb2.StringMatcher(suffix=pattern[1:])
    return string_pb2.StringMatcher(exact="spiffe://" + pattern)


def _namespace_string(pattern: str) -> string_pb2.StringMatcher:
    if pattern == "*":
        return _regex("spiffe://[^/]+/ns/[^/]+/sa/[^/]+")
    if pattern.endswith("*"):
        return _regex(f"spiffe://[^/]+/ns/{pattern[:-1]}[^/]*/sa/[^/]+")
    return _regex(f"spiffe://[^/]+/ns/{pattern}/sa/[^/]+")


def _peer(matcher: string_pb2.StringMatcher) -> rbac_pb2.Principal:
    return rbac_pb2.Principal(
        authenticated=rbac_pb2.Principal.Authenticated(principal_name=matcher)
    )


def _claim(claim: str, value: string_pb2.StringMatcher | None) -> rbac_pb2.Principal:
    """A JWT claim (string or list of strings) from jwt_authn's metadata."""
    path = [
        metadata_pb2.MetadataMatcher.PathSegment(key=JWT_PAYLOAD),
        metadata_pb2.MetadataMatcher.PathSegment(key=claim),
    ]

    def meta(matcher: value_pb2.ValueMatcher) -> rbac_pb2.Principal:
        # sourced_metadata (dynamic metadata by default): Principal.metadata is deprecated, and
        # Envoy 1.40 warns once per RBAC filter it loads with it
        return rbac_pb2.Principal(
            sourced_metadata=rbac_pb2.SourcedMetadata(
                metadata_matcher=metadata_pb2.MetadataMatcher(
                    filter=JWT_FILTER, path=path, value=matcher
                )
            )
        )

    if value is None:
        return meta(value_pb2.ValueMatcher(present_match=True))
    string = value_pb2.ValueMatcher(string_match=value)
    return _or_principals(
        [
            meta(string),
            meta(value_pb2.ValueMatcher(list_match=value_pb2.ListMatcher(one_of=string))),
        ]
    )


def _value_string(pattern: str) -> string_pb2.StringMatcher:
    if pattern == "*":
        return _regex(".*")
    if pattern.endswith("*"):
        return string_pb2.StringMatcher(prefix=pattern[:-1])
    if pattern.startswith("*"):
        return string_pb2.StringMatcher(suffix=pattern[1:])
    return string_pb2.StringMatcher(exact=pattern)


def _request_principal(pattern: str) -> rbac_pb2.Principal:
    """ "iss/sub" (split at the last "/", issuers are URLs), "iss/*" or "*"."""
    if pattern == "*":
        return _claim("iss", None)
    issuer, _, subject = pattern.rpartition("/")
    return _and_principals(
        [
            _claim("iss", string_pb2.StringMatcher(exact=issuer)),
            _claim("sub", None if subject == "*" else string_pb2.StringMatcher(exact=subject)),
        ]
    )


def _or_principals(ids: list[rbac_pb2.Principal]) -> rbac_pb2.Principal:
    return ids[0] if len(ids) == 1 else rbac_pb2.Principal(or_ids=rbac_pb2.Principal.Set(ids=ids))


def _and_principals(ids: list[rbac_pb2.Principal]) -> rbac_pb2.Principal:
    if not ids:
        return rbac_pb2.Principal(any=True)
    return ids[0] if len(ids) == 1 else rbac_pb2.Principal(and_ids=rbac_pb2.Principal.Set(ids=ids))


def _not_principal(inner: rbac_pb2.Principal) -> rbac_pb2.Principal:
    return rbac_pb2.Principal(not_id=inner)


def _or_permissions(rules: list[rbac_pb2.Permission]) -> rbac_pb2.Permission:
    return (
        rules[0]
        if len(rules) == 1
        else rbac_pb2.Permission(or_rules=rbac_pb2.Permission.Set(rules=rules))
    )


def _and_permissions(rules: list[rbac_pb2.Permission]) -> rbac_pb2.Permission:
    if not rules:
        return rbac_pb2.Permission(any=True)
    return (
        rules[0]
        if len(rules) == 1
        else rbac_pb2.Permission(and_rules=rbac_pb2.Permission.Set(rules=rules))
    )


def _principal_field(
    positive: tuple[str, ...], negative: tuple[str, ...], one: Callable[[str], rbac_pb2.Principal]
) -> list[rbac_pb2.Principal]:
    """Values within a field are OR'ed; `not*` fields negate their OR."""
    out = []
    if positive:
        out.append(_or_principals([one(p) for p in positive]))
    if negative:
        out.append(_not_principal(_or_principals([one(p) for p in negative])))
    return out


def _permission_field(
    positive: tuple[str, ...], negative: tuple[str, ...], one: Callable[[str], rbac_pb2.Permission]
) -> list[rbac_pb2.Permission]:
    out = []
    if positive:
        out.append(_or_permissions([one(p) for p in positive]))
    if negative:
        out.append(rbac_pb2.Permission(not_rule=_or_permissions([one(p) for p in negative])))
    return out


def _source(source: ir.SourceMatch) -> rbac_pb2.Principal:
    """Fields of one source are AND'ed."""
    return _and_principals(
        _principal_field(
            source.principals, source.not_principals, lambda p: _peer(_principal_string(p))
        )
        + _principal_field(
            source.namespaces, source.not_namespaces, lambda p: _peer(_namespace_string(p))
        )
        + _principal_field(
            source.request_principals, source.not_request_principals, _request_principal
        )
    )


def _path(pattern: str) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=_value_string(pattern)))


def _method(method: str) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(
        header=rc.HeaderMatcher(name=":method", string_match=string_pb2.StringMatcher(exact=method))
    )


def _operation(operation: ir.OperationMatch) -> rbac_pb2.Permission:
    return _and_permissions(
        _permission_field(operation.paths, operation.not_paths, _path)
        + _permission_field(operation.methods, operation.not_methods, _method)
    )


def _condition(condition: ir.ConditionMatch) -> rbac_pb2.Principal:
    key = condition.key

    def one(value: str) -> rbac_pb2.Principal:
        if key.startswith("request.auth.claims["):
            return _claim(key[len("request.auth.claims[") : -1], _value_string(value))
        if key == "request.auth.audiences":
            return _claim("aud", _value_string(value))
        if key == "request.auth.principal":
            return _request_principal(value)
        if key == "source.principal":
            return _peer(_principal_string(value))
        if key == "source.namespace":
            return _peer(_namespace_string(value))
        assert key.startswith("request.headers[")
        return rbac_pb2.Principal(
            header=rc.HeaderMatcher(
                name=key[len("request.headers[") : -1].lower(), string_match=_value_string(value)
            )
        )

    return _and_principals(_principal_field(condition.values, condition.not_values, one))


def _policy(rule: ir.AuthzRule) -> rbac_pb2.Policy:
    principals = []
    if rule.sources:
        principals.append(_or_principals([_source(s) for s in rule.sources]))
    principals += [_condition(c) for c in rule.conditions]
    permission = (
        _or_permissions([_operation(o) for o in rule.operations])
        if rule.operations
        else rbac_pb2.Permission(any=True)
    )
    return rbac_pb2.Policy(permissions=[permission], principals=[_and_principals(principals)])


@lru_cache(maxsize=1024)
def rbac_filters(policies: tuple[ir.AuthzPolicy, ...]) -> tuple[hcm.HttpFilter, ...]:
    """DENY first, then ALLOW (omitted when no ALLOW policy selects the workload)."""
    out = []
    for action in ("DENY", "ALLOW"):
        selected = [p for p in policies if p.action == action]
        if not selected:
            continue
        rules = rbac_pb2.RBAC(
            action=rbac_pb2.RBAC.DENY if action == "DENY" else rbac_pb2.RBAC.ALLOW,
            policies={
                f"{p.name}[{i}]": _policy(rule) for p in selected for i, rule in enumerate(p.rules)
            },
        )
        config = rbac_filter.RBAC(rules=rules, rules_stat_prefix=f"meshfn_{action.lower()}_")
        out.append(hcm.HttpFilter(name=f"meshfn.authz.{action.lower()}", typed_config=pack(config)))
    return tuple(out)
