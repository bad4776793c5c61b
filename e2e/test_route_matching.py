"""Route matches as real Envoy applies the translator's matchers: an inverted header value holds
for a request without the header ("x-env is not prod"), as Istio's withoutHeaders reads it, so
both run modes route the same requests the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format
from meshfn_e2e import http

from meshfn import ir
from meshfn.testing import envoy
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Processes, wait_for
from meshfn.xds.fragments.routes import route_match

ROUTES = {
    "not-prod": ir.RouteMatch(
        ir.PathMatch("prefix", "/"), headers=(ir.HeaderMatch("x-env", "exact", "prod", True),)
    ),
    "not-v1": ir.RouteMatch(
        ir.PathMatch("prefix", "/"), headers=(ir.HeaderMatch("x-ver", "regex", "v1.*", True),)
    ),
    "fallthrough": ir.RouteMatch(ir.PathMatch("prefix", "/")),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("route-matching")
    port, admin = free_ports(2)
    routes = [
        {
            "match": json_format.MessageToDict(
                route_match(match), preserving_proto_field_name=True
            ),
            "direct_response": {"status": 200, "body": {"inline_string": name}},
        }
        for name, match in ROUTES.items()
    ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "test",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "http",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ]
        },
    }
    path = Path(tmp / "envoy.json")
    path.write_text(json.dumps(config))
    procs = Processes(tmp)
    try:
        proc = procs.start("envoy", envoy.argv(path))
        wait_for("envoy live", lambda: envoy.live(admin), timeout=30, proc=proc)
        yield f"http://127.0.0.1:{port}/"
    finally:
        procs.stop_all()


@pytest.mark.parametrize(
    ("headers", "route"),
    [
        ({}, "not-prod"),  # no x-env at all: it is not prod
        ({"x-env": "dev"}, "not-prod"),
        ({"x-env": "prod"}, "not-v1"),  # and no x-ver: not v1 either
        ({"x-env": "prod", "x-ver": "v2"}, "not-v1"),
        ({"x-env": "prod", "x-ver": "v1.3"}, "fallthrough"),
    ],
)
def test_an_inverted_header_value_matches_a_request_without_the_header(
    gateway: str, headers: dict[str, str], route: str
) -> None:
    reply = http(gateway, headers=headers)
    assert (reply.status, reply.body.decode()) == (200, route)
