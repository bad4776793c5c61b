"""The Envoy fragments both renderers build on (meshfn.xds.fragments): a route's pieces, and a
message written as the JSON an EnvoyFilter patch holds; and the two renderers' degraded twins
agreeing on them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from google.protobuf import json_format

from meshfn import ir
from meshfn.contracts.plugins import ROUTING_HEADER
from meshfn.policy import load_policies
from meshfn.testing.istio_cases import rendering, source
from meshfn.xds.fragments.messages import envoy_json, seconds
from meshfn.xds.fragments.routes import (
    degraded_clusters,
    degraded_match,
    retry_policy,
    route_match,
)
from meshfn.xds.names import ROUTE
from meshfn.xds.translate import translate

RETRY = ir.Retry(3, ("connect-failure", "5xx"), per_try_timeout=timedelta(milliseconds=1500))


def test_inverted_headers_also_match_requests_without_them() -> None:
    match = route_match(
        ir.RouteMatch(
            ir.PathMatch("regex", "/v[12]/.*"),
            headers=(
                ir.HeaderMatch("x-env", "exact", "prod", invert=True),
                ir.HeaderMatch("x-canary", "present", ""),
            ),
        )
    )
    assert match.safe_regex.regex == "/v[12]/.*"
    env, canary = match.headers
    assert env.invert_match and env.treat_missing_header_as_empty
    assert env.string_match.exact == "prod"
    assert canary.present_match and not canary.treat_missing_header_as_empty


def test_the_degraded_twin_matches_the_routing_header_too() -> None:
    route = ir.Route(
        "chat", "default", ("*",), (ir.RouteMatch(ir.PathMatch("prefix", "/chat")),), "d/llm"
    )
    match = degraded_match(route, 0)
    assert match.prefix == "/chat"
    assert [(h.name, h.string_match.exact) for h in match.headers] == [
        (ROUTING_HEADER, "default/chat")
    ]
    split = degraded_clusters("primary", "tail", 10)
    assert [(c.name, c.weight.value) for c in split.clusters] == [("primary", 10), ("tail", 90)]


def test_retries_skip_the_failed_host_and_with_localities_the_priority() -> None:
    plain = retry_policy(RETRY)
    assert plain.num_retries.value == 3 and plain.retry_on == "connect-failure,5xx"
    assert [p.name for p in plain.retry_host_predicate] == [
        "envoy.retry_host_predicates.previous_hosts"
    ]
    assert not plain.HasField("retry_priority")
    localities = retry_policy(RETRY, locality_failover=True)
    assert localities.retry_priority.name == "envoy.retry_priorities.previous_priorities"


def test_envoy_json_is_envoys_json_with_numbers_kept() -> None:
    action = rc.RouteAction(
        weighted_clusters=degraded_clusters("a", "b", 0),
        retry_policy=retry_policy(RETRY, locality_failover=True),
    )
    written = envoy_json(action)
    assert written == {
        "weighted_clusters": {
            "clusters": [{"name": "a", "weight": 0}, {"name": "b", "weight": 100}]
        },
        "retry_policy": {
            "retry_on": "connect-failure,5xx",
            "num_retries": 3,
            "per_try_timeout": "1.5s",
            "retry_priority": {
                "name": "envoy.retry_priorities.previous_priorities",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.priority."
                    "previous_priorities.v3.PreviousPrioritiesConfig",
                    "update_frequency": 1,
                },
            },
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host."
                        "previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 3,  # an int64: protobuf's JSON says "3"
        },
    }
    assert json_format.ParseDict(written, rc.RouteAction()) == action
    route = route_pb2.RouteConfiguration(name="r", request_headers_to_remove=["x"])
    assert json_format.ParseDict(envoy_json(route), route_pb2.RouteConfiguration()) == route


def test_seconds_are_the_shortest_duration() -> None:
    assert [seconds(timedelta(seconds=s)) for s in (15, 1.5, 0.0001, 0)] == [
        "15s",
        "1.5s",
        "0.0001s",
        "0s",
    ]


def _istio_twins(case: str) -> dict[str, dict[str, Any]]:
    return {
        patch["patch"]["value"]["name"]: patch["patch"]["value"]
        for f in rendering(case).objects["EnvoyFilter"]
        for patch in f["spec"]["configPatches"]
        if patch["patch"]["operation"] == "INSERT_BEFORE" and patch["applyTo"] == "HTTP_ROUTE"
    }


def test_both_renderers_build_the_degraded_twin_from_the_same_pieces() -> None:
    """The Istio renderer's inserted twin has the translator's match and retry policy."""
    twins = _istio_twins("fallback")
    assert twins
    model = load_policies(source("fallback"))
    translated = {}
    for workload in model.workloads:
        resources = translate(model, workload.node_cluster)
        assert resources is not None
        for config in resources.get(ROUTE, {}).values():
            assert isinstance(config, route_pb2.RouteConfiguration)
            translated |= {r.name: r for host in config.virtual_hosts for r in host.routes}
    for name, twin in twins.items():
        ours = translated[name]
        assert json_format.ParseDict(twin["match"], rc.RouteMatch()) == ours.match
        assert twin["match"] == envoy_json(ours.match)
        retry = rc.RetryPolicy()
        retry.CopyFrom(ours.route.retry_policy)
        # the one difference, as before the two shared these pieces: Istio's twin does not skip
        # the failed priority under locality failover
        retry.ClearField("retry_priority")
        assert twin["route"]["retry_policy"] == envoy_json(retry)
