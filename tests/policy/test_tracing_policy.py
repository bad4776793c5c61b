"""Mesh.spec.tracing and its overrides, through the loader to the IR (meshfn.policy.compile.tracing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshfn import ir
from meshfn.policy.errors import PolicyErrors
from meshfn.policy.loader import load_policies
from meshfn.testing.policies import documents, gateway, mesh, route, service

COLLECTOR = {"host": "127.0.0.1", "port": 4317}


def _load(tmp_path: Path, *docs: str) -> ir.MeshModel:
    (tmp_path / "p.yaml").write_text(documents(*docs))
    return load_policies(tmp_path)


def _errors(tmp_path: Path, *docs: str) -> str:
    with pytest.raises(PolicyErrors) as caught:
        _load(tmp_path, *docs)
    return str(caught.value)


def test_without_tracing_the_model_has_none(tmp_path: Path) -> None:
    model = _load(tmp_path, mesh("m", "m.local"), gateway(None, 10000), service("s", 9000))
    assert model.tracing is None


def test_defaults_and_overrides_resolve_per_gateway_and_route(tmp_path: Path) -> None:
    model = _load(
        tmp_path,
        mesh("m", "m.local", tracing={"collector": COLLECTOR}),
        gateway(None, 10000),
        gateway(None, 10100, name="partner", tracing={"clientContext": "honor"}),
        gateway(None, 10200, name="quiet", tracing={"sampling": 0}),
        service("s", 9000),
        route("r", "s", gateway="edge", tracing={"sampling": 50}),
        route("p", "s", gateway="partner"),
    )
    tracing = model.tracing
    assert tracing is not None
    assert (tracing.sampling, tracing.client_context, tracing.tenant_claim) == (
        1.0,
        "restart",
        "tenant",
    )
    assert tracing.tags == ("tenant", "model", "route", "principal")
    assert tracing.collector == ir.TraceCollector("grpc", "127.0.0.1", 4317)
    assert tracing.gateway("default/edge") == ir.GatewayTracing(1.0, "restart")
    assert tracing.gateway("default/partner") == ir.GatewayTracing(1.0, "honor")
    assert tracing.gateway("default/quiet") == ir.GatewayTracing(0.0, "restart")
    # only the gateways that differ are listed
    assert [key for key, _ in tracing.gateways] == ["default/partner", "default/quiet"]
    assert tracing.route_sampling("default/r") == 50.0
    assert tracing.route_sampling("default/p") is None


def test_an_override_without_mesh_tracing_is_an_error(tmp_path: Path) -> None:
    message = _errors(
        tmp_path,
        mesh("m", "m.local"),
        gateway(None, 10000, tracing={"sampling": 5}),
        service("s", 9000),
        route("r", "s", tracing={"sampling": 50}),
    )
    assert message.count("the Mesh has no tracing") == 2


def test_a_route_sampling_on_a_gateway_that_honors_client_context_is_refused(
    tmp_path: Path,
) -> None:
    message = _errors(
        tmp_path,
        mesh("m", "m.local", tracing={"collector": COLLECTOR, "clientContext": "honor"}),
        gateway(None, 10000),
        service("s", 9000),
        route("r", "s", tracing={"sampling": 50}),
    )
    assert "honors client trace context" in message and "spec.tracing.sampling" in message


@pytest.mark.parametrize(
    ("tracing", "problem"),
    [
        ({"sampling": 101}, "less than or equal to 100"),
        ({"sampling": -1}, "greater than or equal to 0"),
        ({"tags": ["tenant", "tenant"]}, "must not repeat"),
        ({"tags": ["x-tenant-header"]}, "tags"),
        ({"clientContext": "trust"}, "clientContext"),
        ({"collector": {"host": "bad host", "port": 4317}}, "host"),
        ({"collector": {"host": "c", "port": 4317, "timeout": "1ms"}}, "between 10ms and 60s"),
        ({"collector": {"host": "c", "port": 4317, "protocol": "udp"}}, "protocol"),
    ],
)
def test_bad_tracing_settings_are_errors(
    tmp_path: Path, tracing: dict[str, object], problem: str
) -> None:
    message = _errors(tmp_path, mesh("m", "m.local", tracing=tracing), gateway(None, 10000))
    assert problem in message, message
