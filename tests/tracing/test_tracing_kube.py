"""Tracing on Kubernetes: the Helm value tracing.collector reaches the operator's configuration,
the Istio rendering (the meshfn-otlp provider) and the inference backends' configuration; a
Mesh that traces with no collector anywhere renders no tracing and says why."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from meshfn.contracts.function import BackendConfig
from meshfn.ir import MeshModel, Overlay
from meshfn.istio import RenderOptions
from meshfn.istio.core import Context
from meshfn.istio.telemetry import mesh_config, telemetries
from meshfn.kube.controller import OperatorConfig
from meshfn.kube.workloads import BackendSettings, render_backends
from meshfn.policy.loader import load_policies

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "policies" / "examples"
sys.path.insert(0, str(REPO / "tests" / "kube"))
from test_kube_units import chart  # noqa: E402


def test_the_helm_value_names_the_collector_for_proxies_and_backends() -> None:
    documents = chart(
        "--set",
        "tracing.collector.host=otel.observability.svc,tracing.collector.port=4318,"
        "tracing.collector.protocol=http",
    )
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    config = OperatorConfig.model_validate(yaml.safe_load(config_map["data"]["operator.yaml"]))
    assert config.collector is not None and config.collector.host == "otel.observability.svc"
    options = config.render_options(None)
    model = load_policies(EXAMPLES)  # traces 10%, names no collector
    mesh_config, _ = _mesh_config(model, options)
    (provider,) = [p for p in mesh_config["extensionProviders"] if p["name"] == "meshfn-otlp"]
    assert provider["opentelemetry"] == {
        "service": "otel.observability.svc",
        "port": 4318,
        "http": {"path": "/v1/traces", "timeout": "1s"},
    }
    rendered = render_backends(
        model, BackendSettings(), keda=False, collector=config.collector.ir()
    )
    backend_map = next(r.obj for r in rendered if r.obj["kind"] == "ConfigMap")
    backend = BackendConfig.model_validate(yaml.safe_load(backend_map["data"]["backend.yaml"]))
    assert backend.tracing is not None
    assert backend.tracing.endpoint == "http://otel.observability.svc:4318/v1/traces"
    assert backend.tracing.sampling == 10.0


def test_without_a_collector_the_chart_renders_none() -> None:
    documents = chart()
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    config = OperatorConfig.model_validate(yaml.safe_load(config_map["data"]["operator.yaml"]))
    assert config.collector is None
    model = load_policies(EXAMPLES)
    mesh_config, warnings = _mesh_config(model, config.render_options(None))
    assert "meshfn-otlp" not in {p["name"] for p in mesh_config["extensionProviders"]}
    assert "tracing-no-collector" in warnings
    rendered = render_backends(model, BackendSettings(), keda=False)
    backend_map = next(r.obj for r in rendered if r.obj["kind"] == "ConfigMap")
    assert "tracing" not in yaml.safe_load(backend_map["data"]["backend.yaml"])


def _mesh_config(
    model: MeshModel, options: RenderOptions
) -> tuple[dict[str, list[dict[str, object]]], set[str]]:
    """The meshConfig snippet and the tracing warnings (the Telemetry renderer alone: the
    wasm digests a full rendering needs are not built here)."""
    ctx = Context(model, options, {}, Overlay())
    telemetries(ctx)
    snippet: dict[str, dict[str, list[dict[str, object]]]] = mesh_config(ctx)
    return snippet["meshConfig"], {w.code for w in ctx.warnings}
