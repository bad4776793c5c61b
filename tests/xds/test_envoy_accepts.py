"""Real Envoy (`--mode validate`) accepts our bootstrap and every golden translation.

Validate mode checks the static parts of a config offline (types, fields, regexes, references
between listeners/routes/clusters). xDS wiring is not checked there, so each golden case is
rewritten as a static config: RDS inlined into the listener, EDS clusters made STATIC with their
ClusterLoadAssignment.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from meshfn.control_plane.runtime.bootstrap import (
    ProxyIdentity,
    bootstrap_json,
    internal_listeners,
)
from meshfn.policy import load_policies
from meshfn.testing.envoy import validate
from meshfn.testing.filters import wasm_dir
from meshfn.xds.translate import OFFLINE_HOST

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def test_bootstrap_validates(tmp_path: Path) -> None:
    model = load_policies(ROOT / "policies" / "examples")
    identity = ProxyIdentity.for_workload(model.workloads[0], "Bearer test-token")
    result = validate(bootstrap_json(identity, "127.0.0.1", 18000, tmp_path / "admin.sock"))
    assert result.returncode == 0, result.stdout + result.stderr


def _static_secrets(node: Any) -> Any:
    """SDS references keep their names but lose their (ADS) source: they then resolve to the
    static secrets below, as validate mode cannot run ADS."""
    if isinstance(node, dict):
        node.pop("sdsConfig", None)
        for value in node.values():
            _static_secrets(value)
    elif isinstance(node, list):
        for value in node:
            _static_secrets(value)
    return node


def static_test_secrets() -> list[dict[str, Any]]:
    import datetime as dt
    import tempfile

    from meshfn.control_plane.identity.ca import CertificateAuthority
    from meshfn.control_plane.identity.spiffe import SpiffeId

    ca = CertificateAuthority(Path(tempfile.mkdtemp()) / "ca", "golden.local")
    cert = ca.issue(SpiffeId("golden.local", "default", "edge"), dt.timedelta(hours=1))
    return [
        {
            "name": "default",
            "tlsCertificate": {
                "certificateChain": {"inlineString": cert.certificate_pem},
                "privateKey": {"inlineString": cert.private_key_pem},
            },
        },
        {
            "name": "ROOTCA",
            "validationContext": {"trustedCa": {"inlineString": ca.trust_bundle_pem()}},
        },
    ]


def _localize(node: Any, tmp_path: Path) -> Any:
    """Offline renderings point at /var/lib/meshfn and carry a redacted salt: point them at the
    built filters, a journal directory that exists, and a valid salt, so Envoy really loads the
    wasm plugins and opens the access logs."""
    if isinstance(node, dict):
        return {k: _localize(v, tmp_path) for k, v in node.items()}
    if isinstance(node, list):
        return [_localize(v, tmp_path) for v in node]
    if isinstance(node, str):
        if node.startswith(f"{OFFLINE_HOST.wasm_dir}/"):
            return str(wasm_dir() / Path(node).name)
        if node.startswith(f"{OFFLINE_HOST.state_dir}/"):
            local = tmp_path / Path(node).relative_to(OFFLINE_HOST.state_dir)
            local.parent.mkdir(parents=True, exist_ok=True)
            return str(local)
        return node.replace('"subject_salt":"[redacted]"', f'"subject_salt":"{"ab" * 32}"')
    return node


def _inline_extensions(listener: Any, extensions: dict[str, Any]) -> None:
    """Validate mode cannot run ECDS: put each filter's discovered config in place."""
    for chain in listener.get("filterChains", []):
        for f in chain["filters"]:
            for http_filter in f["typedConfig"].get("httpFilters", []):
                if "configDiscovery" in http_filter:
                    http_filter.pop("configDiscovery")
                    http_filter["typedConfig"] = extensions[http_filter["name"]]["typedConfig"]


def static_config(resources: dict[str, Any], tmp_path: Path | None = None) -> dict[str, Any]:
    if tmp_path is not None:
        resources = _localize(resources, tmp_path)
    extensions = {e["name"]: e for e in resources.get("extension_configs", [])}
    routes = {r["name"]: r for r in resources.get("routes", [])}
    endpoints = {e["clusterName"]: e for e in resources.get("endpoints", [])}
    listeners = []
    for listener in copy.deepcopy(resources.get("listeners", [])):
        chains = listener.get("filterChains", []) + (
            [listener["defaultFilterChain"]] if "defaultFilterChain" in listener else []
        )
        for chain in chains:
            for f in chain["filters"]:
                config = f["typedConfig"]
                assert config["@type"] == HCM
                if "rds" in config:
                    config["routeConfig"] = routes[config.pop("rds")["routeConfigName"]]
        _inline_extensions(listener, extensions)
        listeners.append(listener)
    clusters = []
    for cluster in copy.deepcopy(resources.get("clusters", [])):
        if cluster.get("type") == "EDS":
            eds = cluster.pop("edsClusterConfig")
            cluster["type"] = "STATIC"
            assignment = copy.deepcopy(endpoints[eds.get("serviceName", cluster["name"])])
            cluster["loadAssignment"] = {**assignment, "clusterName": cluster["name"]}
        clusters.append(cluster)
    return _static_secrets(
        {
            "node": {"id": "validate", "cluster": "validate"},
            # as every Envoy meshfn starts has them (a split sidecar's tracing)
            "bootstrapExtensions": [json_format.MessageToDict(internal_listeners())],
            "admin": {"address": {"socketAddress": {"address": "127.0.0.1", "portValue": 0}}},
            "staticResources": {
                "listeners": listeners,
                "clusters": clusters,
                "secrets": static_test_secrets(),
            },
        }
    )


def golden_output(case: str) -> dict[str, dict[str, Any]]:
    """workload -> {resource type: [resources]}, joined from the case's out.<type>.yaml files."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((GOLDEN / case).glob("out.*.yaml")):
        for workload, resources in yaml.safe_load(path.read_text()).items():
            out.setdefault(workload, {}).update(resources)
    return out


@pytest.mark.parametrize(
    "case", sorted(p.name for p in GOLDEN.iterdir() if (p / "out.listeners.yaml").exists())
)
def test_golden_output_is_accepted_by_envoy(case: str, tmp_path: Path) -> None:
    for workload, resources in golden_output(case).items():
        result = validate(static_config(resources, tmp_path))
        assert result.returncode == 0, f"{case}/{workload}:\n{result.stdout}{result.stderr}"


def test_envoy_validate_catches_what_we_would_miss() -> None:
    """The harness itself must be able to fail: a regex over Envoy's program-size limit."""
    resources = golden_output("basic")["edge.default"]
    match = resources["routes"][0]["virtualHosts"][0]["routes"][0]["match"]
    match.pop("prefix")
    match["safeRegex"] = {"regex": "^/(" + "|".join(f"m{i}[a-z]+" for i in range(40)) + ")$"}
    result = validate(static_config(resources))
    assert result.returncode != 0
    assert "program size" in (result.stdout + result.stderr).lower()
