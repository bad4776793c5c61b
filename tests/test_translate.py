"""Translator properties beyond the golden files: memoisation on IR objects, scoping, ordering."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshfn import ir
from meshfn.control_plane.policy import load_policies
from meshfn.xds.names import CLUSTER, ENDPOINT, LISTENER, ROUTE
from meshfn.xds.translate import translate

EXAMPLES = Path(__file__).resolve().parents[1] / "policies" / "examples"


def test_unknown_workload_gets_nothing() -> None:
    assert translate(load_policies(EXAMPLES), "nobody.default") is None


def test_unchanged_ir_yields_identical_messages() -> None:
    model = load_policies(EXAMPLES)
    first = translate(model, "edge.ingress")
    second = translate(load_policies(EXAMPLES), "edge.ingress")
    assert first is not None and second is not None
    for type_url in (LISTENER, ROUTE, CLUSTER, ENDPOINT):
        for name, message in first[type_url].items():
            assert second[type_url][name] is message  # memoised on the (equal) IR object


def test_a_changed_endpoint_changes_only_its_assignment() -> None:
    model = load_policies(EXAMPLES)
    first = translate(model, "edge.ingress")
    service = model.service("default/echo")
    moved = dataclasses.replace(
        service, endpoints=(dataclasses.replace(service.endpoints[0], sidecar_port=15299),)
    )
    changed = dataclasses.replace(
        model, services=tuple(moved if s.key == service.key else s for s in model.services)
    )
    second = translate(changed, "edge.ingress")
    assert first is not None and second is not None
    assert second[ENDPOINT]["echo.default"] is not first[ENDPOINT]["echo.default"]
    assert second[ENDPOINT]["models-lite.default"] is first[ENDPOINT]["models-lite.default"]
    assert second[CLUSTER]["echo.default"] is first[CLUSTER]["echo.default"]
    port = second[ENDPOINT]["echo.default"].endpoints[0].lb_endpoints[0].endpoint.address
    assert port.socket_address.port_value == 15299  # reached through its sidecar


def test_methods_become_one_header_matcher() -> None:
    from meshfn.xds.translate.routes import _match

    one = _match(ir.RouteMatch(ir.PathMatch("prefix", "/"), methods=("POST",)))
    assert one.headers[0].name == ":method" and one.headers[0].string_match.exact == "POST"
    two = _match(ir.RouteMatch(ir.PathMatch("prefix", "/"), methods=("GET", "POST")))
    assert two.headers[0].string_match.safe_regex.regex == "GET|POST"
