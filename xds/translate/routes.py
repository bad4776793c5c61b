"""Listener routes -> RouteConfiguration: one virtual host per host name, routes by precedence."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2
from google.protobuf import wrappers_pb2

from meshfn.control_plane import ir

from .common import duration

_PATH_RANK = {"exact": 0, "regex": 1, "prefix": 2}


def precedence(route: ir.Route, index: int) -> tuple[int, int, int, int, str, int]:
    """Gateway API-style order, since Envoy takes the first match: exact paths, then regexes,
    then longer prefixes; then matches with methods; then more header matches; then by name."""
    match = route.matches[index]
    return (
        _PATH_RANK[match.path.kind],
        -len(match.path.value),
        0 if match.methods else 1,
        -len(match.headers),
        route.key,
        index,
    )


def _string_match(kind: str, value: str) -> string_pb2.StringMatcher:
    if kind == "exact":
        return string_pb2.StringMatcher(exact=value)
    if kind == "prefix":
        return string_pb2.StringMatcher(prefix=value)
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=value))


def _match(match: ir.RouteMatch) -> rc.RouteMatch:
    path = match.path
    out = rc.RouteMatch()
    if path.kind == "exact":
        out.path = path.value
    elif path.kind == "prefix":
        out.prefix = path.value
    else:
        out.safe_regex.regex = path.value
    for header in match.headers:
        matcher = rc.HeaderMatcher(name=header.name, invert_match=header.invert)
        if header.kind == "present":
            matcher.present_match = True
        else:
            matcher.string_match.CopyFrom(_string_match(header.kind, header.value))
        out.headers.append(matcher)
    if match.methods:
        methods = match.methods
        out.headers.append(
            rc.HeaderMatcher(
                name=":method",
                string_match=_string_match("exact", methods[0])
                if len(methods) == 1
                else _string_match("regex", "|".join(methods)),
            )
        )
    return out


def _action(route: ir.Route) -> rc.RouteAction:
    action = rc.RouteAction(cluster=route.cluster)
    if route.timeout is not None:
        action.timeout.CopyFrom(duration(route.timeout))
    if route.retries is not None:
        retry = rc.RetryPolicy(
            retry_on=",".join(route.retries.retry_on),
            num_retries=wrappers_pb2.UInt32Value(value=route.retries.attempts),
        )
        if route.retries.per_try_timeout is not None:
            retry.per_try_timeout.CopyFrom(duration(route.retries.per_try_timeout))
        action.retry_policy.CopyFrom(retry)
    return action


def route_config_name(listener: ir.Listener) -> str:
    return listener.name


@lru_cache(maxsize=4096)
def route_configuration(listener: ir.Listener) -> route_pb2.RouteConfiguration:
    by_host: dict[str, list[tuple[ir.Route, int]]] = {}
    for route in listener.routes:
        for host in route.hosts:
            by_host.setdefault(host, []).extend((route, i) for i in range(len(route.matches)))
    virtual_hosts = []
    # Specific hosts first only for readability: Envoy picks virtual hosts by best domain match.
    for host in sorted(by_host, key=lambda h: (h == "*", h)):
        entries = sorted(by_host[host], key=lambda pair: precedence(*pair))
        virtual_hosts.append(
            rc.VirtualHost(
                name=host,
                domains=[host],
                routes=[
                    rc.Route(
                        name=f"{route.key}/{index}",
                        match=_match(route.matches[index]),
                        route=_action(route),
                    )
                    for route, index in entries
                ],
            )
        )
    return route_pb2.RouteConfiguration(
        name=route_config_name(listener),
        virtual_hosts=virtual_hosts,
        validate_clusters=wrappers_pb2.BoolValue(value=False),
    )
