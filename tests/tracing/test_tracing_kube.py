"""Tracing on Kubernetes: the Helm value tracing.collector reaches the operator's configuration,
the Istio rendering (the meshfn-otlp provider) and the inference backends' configuration; a
Mesh that traces with no collector anywhere renders no tracing and says why; a new sampling
reaches the backends through their ConfigMap without rolling their pods."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from meshfn import ir
from meshfn.contracts.function import BackendConfig
from meshfn.ir import MeshModel, Overlay
from meshfn.istio import RenderOptions
from meshfn.istio.core import Context
from meshfn.istio.telemetry import mesh_config, telemetries
from meshfn.kube.controller import OperatorConfig
from meshfn.kube.workloads import WATCH_CONFIG_S, BackendSettings, render_backends
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


def _backend_objects(
    tmp: Path, tracing: str, collector: str = "http://otel.observability.svc:4318/v1/traces"
) -> dict[tuple[str, str], dict[str, Any]]:
    """The examples' backend objects by (kind, name), with the Mesh's `tracing` lines replaced
    by `tracing`."""
    shutil.copytree(EXAMPLES, tmp)
    mesh = tmp / "mesh.yaml"
    shipped = "  tracing:\n    sampling: 10\n"
    assert shipped in mesh.read_text()
    mesh.write_text(mesh.read_text().replace(shipped, tracing))
    rendered = render_backends(
        load_policies(tmp),
        BackendSettings(),
        keda=False,
        collector=ir.TraceCollector.parse(collector),
    )
    return {(r.obj["kind"], r.obj["metadata"]["name"]): r.obj for r in rendered}


def test_a_new_sampling_reaches_the_backends_without_rolling_their_pods(tmp_path: Path) -> None:
    """The pod template's config hash leaves the sampling out: the backends watch their
    ConfigMap (--watch-config) and reload it in place. Turning tracing on or off, or another
    collector, changes the hash: the sandbox fixes where a backend may send spans at start."""
    at10 = _backend_objects(tmp_path / "10", "  tracing:\n    sampling: 10\n")
    at1 = _backend_objects(tmp_path / "1", "  tracing:\n    sampling: 1\n")
    off = _backend_objects(tmp_path / "off", "")
    elsewhere = _backend_objects(
        tmp_path / "elsewhere", "  tracing:\n    sampling: 10\n", "grpc://tempo.tracing.svc:4317"
    )
    deployments = [key for key in at10 if key[0] == "Deployment"]
    assert deployments and set(at10) == set(at1) == set(off) == set(elsewhere)
    for key in deployments:
        name = key[1]
        configs = [
            BackendConfig.model_validate(yaml.safe_load(o[("ConfigMap", f"{name}-backend")]["data"]["backend.yaml"]))
            for o in (at10, at1)
        ]  # fmt: skip
        assert [c.tracing.sampling for c in configs if c.tracing is not None] == [10.0, 1.0]
        assert at1[key] == at10[key], name  # the same pods
        (container,) = at10[key]["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert args[args.index("--watch-config") + 1] == str(WATCH_CONFIG_S)

        def digest(
            objects: dict[tuple[str, str], dict[str, Any]], key: tuple[str, str] = key
        ) -> str:
            return str(
                objects[key]["spec"]["template"]["metadata"]["annotations"]["meshfn.io/config-hash"]
            )

        assert len({digest(at10), digest(off), digest(elsewhere)}) == 3, name
