"""A route's pieces, for the translator's route tables and the Istio renderer's inserted routes
(the drift breaker's degraded twin): the match, the twin's match and its split between the
primary and the chain's tail, and the retry policy."""

from __future__ import annotations

from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2
from google.protobuf import wrappers_pb2

from meshfn import ir
from meshfn.contracts.plugins import ROUTING_HEADER

from .messages import duration, pack


def _string_match(kind: str, value: str) -> string_pb2.StringMatcher:
    if kind == "exact":
        return string_pb2.StringMatcher(exact=value)
    if kind == "prefix":
        return string_pb2.StringMatcher(prefix=value)
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=value))


def route_match(match: ir.RouteMatch) -> rc.RouteMatch:
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
            # "x-env is not prod" holds for a request without x-env, as Istio's withoutHeaders
            # reads it (Envoy alone would not match an absent header, inverted or not)
            matcher.treat_missing_header_as_empty = header.invert
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


def path_rewrite(rewrite: ir.PathRewrite) -> regex_pb2.RegexMatchAndSubstitute:
    """A route's rewrite of the path it sends upstream (Envoy's regex_rewrite)."""
    return regex_pb2.RegexMatchAndSubstitute(
        pattern=regex_pb2.RegexMatcher(regex=rewrite.pattern), substitution=rewrite.substitution
    )


def degraded_match(route: ir.Route, index: int) -> rc.RouteMatch:
    """The match of a drift-guarded route's degraded twin: the route's, plus the internal
    routing header the degrade filter sets once the breaker trips (the listener strips it from
    client requests before routing)."""
    out = route_match(route.matches[index])
    out.headers.append(
        rc.HeaderMatcher(
            name=ROUTING_HEADER, string_match=string_pb2.StringMatcher(exact=route.key)
        )
    )
    return out


def degraded_clusters(primary: str, tail: str, probe_percent: int) -> rc.WeightedCluster:
    """Where a degraded twin sends its requests: most down the chain (`tail`), a probe share to
    the primary so the breaker can see it recover."""
    return rc.WeightedCluster(
        clusters=[
            rc.WeightedCluster.ClusterWeight(
                name=primary, weight=wrappers_pb2.UInt32Value(value=probe_percent)
            ),
            rc.WeightedCluster.ClusterWeight(
                name=tail, weight=wrappers_pb2.UInt32Value(value=100 - probe_percent)
            ),
        ]
    )


def retry_policy(retries: ir.Retry, locality_failover: bool = False) -> rc.RetryPolicy:
    """A retry never picks the host that just failed, nor (with locality failover, where the
    localities are Envoy priorities) the priority."""
    out = rc.RetryPolicy(
        retry_on=",".join(retries.retry_on),
        num_retries=wrappers_pb2.UInt32Value(value=retries.attempts),
        retry_host_predicate=[
            rc.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=3,
    )
    if locality_failover:
        out.retry_priority.CopyFrom(
            rc.RetryPolicy.RetryPriority(
                name="envoy.retry_priorities.previous_priorities",
                typed_config=pack(
                    previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=1)
                ),
            )
        )
    if retries.per_try_timeout is not None:
        out.per_try_timeout.CopyFrom(duration(retries.per_try_timeout))
    return out
