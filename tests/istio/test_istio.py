"""The Istio renderer beyond its goldens: the same plugin JSON as the translator, EnvoyFilter
patches proven with json_format and real Envoy, the drift breaker's trip, meshfn's meaning where
Istio's defaults differ, and bad input through the CLI."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import extension_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as _aggregate  # noqa: F401
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as _wasm  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (  # noqa: F401
    header_mutation_pb2 as _mutation,
)
from envoy.extensions.retry.host.previous_hosts.v3 import (  # noqa: F401
    previous_hosts_pb2 as _previous_hosts,
)
from google.protobuf import json_format
from typer.testing import CliRunner

from meshfn import ir
from meshfn.control_plane.cli import app
from meshfn.control_plane.runtime.envoy import envoy_binary
from meshfn.ir.routing import precedence
from meshfn.istio import SchemaError, render
from meshfn.istio.schema import validate
from meshfn.istio.security import ambiguous_principal
from meshfn.policy import load_policies
from meshfn.testing.istio_cases import CASES, DIGESTS, GOLDEN, rendering, source
from meshfn.xds.dump import resources_to_plain
from meshfn.xds.translate import translate

XDS_GOLDEN = Path(__file__).resolve().parents[1] / "golden"
XDS_CASES = sorted(p.name for p in XDS_GOLDEN.iterdir() if (p / "in.yaml").exists())


# ---------------------------------------------------------------- one builder, same JSON


def _wasm_configurations(node: Any) -> set[str]:
    """Every proxy-wasm plugin configuration string in translated resources."""
    found: set[str] = set()
    if isinstance(node, dict):
        config = node.get("configuration")
        if isinstance(config, dict) and "StringValue" in str(config.get("@type", "")):
            found.add(config["value"])
        for value in node.values():
            found |= _wasm_configurations(value)
    elif isinstance(node, list):
        for value in node:
            found |= _wasm_configurations(value)
    return found


def _parts(config: str) -> set[str]:
    """A plugin configuration as its parts' JSON: the combined plugin's audit, degrade and
    route each, or a single filter's configuration whole."""
    data = json.loads(config)
    if data and set(data) <= {"audit", "degrade", "route"}:
        return {json.dumps(v, separators=(",", ":")) for v in data.values()}
    return {config}


def _routers(case: str) -> list[dict[str, Any]]:
    """The model routers' extension configs (EnvoyFilter EXTENSION_CONFIG)."""
    return [
        p["patch"]["value"]
        for f in rendering(case).objects["EnvoyFilter"]
        for p in f["spec"]["configPatches"]
        if p["applyTo"] == "EXTENSION_CONFIG"
    ]


@pytest.mark.parametrize("case", [c for c in CASES if c in XDS_CASES or c == "examples"])
def test_plugin_config_is_the_translators_json(case: str) -> None:
    """Each WasmPlugin's pluginConfig, and each model router's, serialises to configurations the
    translator sends (ECDS or inline) for the same proxies, byte for byte, part by part (Istio
    runs the model router apart: it cannot be a WasmPlugin)."""
    model = load_policies(source(case))
    sent: set[str] = set()
    for workload in model.workloads:
        resources = translate(model, workload.node_cluster)
        assert resources is not None
        for config in _wasm_configurations(resources_to_plain(resources, redact=False)):
            sent |= _parts(config)
    for plugin in rendering(case).objects["WasmPlugin"]:
        config = json.dumps(plugin["spec"]["pluginConfig"], separators=(",", ":"))
        assert _parts(config) <= sent, plugin["metadata"]["name"]
    for router in _routers(case):
        wasm = router["typed_config"]["config"]
        assert wasm["allow_on_headers_stop_iteration"] is True
        parts = _parts(wasm["configuration"]["value"])
        assert len(parts) == 1 and parts <= sent, router["name"]


def test_the_model_router_runs_first_on_its_gateway_listener() -> None:
    routers = _routers("functions")
    assert routers
    for f in rendering("functions").objects["EnvoyFilter"]:
        patches = f["spec"]["configPatches"]
        inserted = [p for p in patches if p["applyTo"] == "HTTP_FILTER"
                    and "config_discovery" in p["patch"]["value"]]  # fmt: skip
        for patch in inserted:
            assert patch["patch"]["operation"] == "INSERT_FIRST"
            assert patch["patch"]["value"]["name"] in {r["name"] for r in routers}


# ---------------------------------------------------------------- EnvoyFilter proofs

APPLY_TO = {
    "CLUSTER": cluster_pb2.Cluster,
    "NETWORK_FILTER": listener_components_pb2.Filter,
    "HTTP_FILTER": hcm_pb2.HttpFilter,
    "HTTP_ROUTE": route_components_pb2.Route,
    "ROUTE_CONFIGURATION": route_pb2.RouteConfiguration,
    "EXTENSION_CONFIG": extension_pb2.TypedExtensionConfig,
}


def _patches(case: str) -> list[dict[str, Any]]:
    return [p for f in rendering(case).objects["EnvoyFilter"] for p in f["spec"]["configPatches"]]


@pytest.mark.parametrize("case", CASES)
def test_envoyfilters_follow_istios_analyzer(case: str) -> None:
    """Non-zero priority (IST0151 for relative operations), explicit context and match on every
    patch, ADD never on routes (IST0152), REMOVE/REPLACE unused."""
    for f in rendering(case).objects["EnvoyFilter"]:
        assert f["spec"]["priority"] > 0
        for patch in f["spec"]["configPatches"]:
            assert patch["match"]["context"] in ("GATEWAY", "SIDECAR_INBOUND")
            op = patch["patch"]["operation"]
            assert op in ("ADD", "MERGE", "INSERT_BEFORE", "INSERT_FIRST")
            if op == "ADD":
                assert patch["applyTo"] in ("CLUSTER", "EXTENSION_CONFIG")


@pytest.mark.parametrize("case", CASES)
def test_patch_values_parse_as_their_envoy_type(case: str) -> None:
    for patch in _patches(case):
        message = APPLY_TO[patch["applyTo"]]()
        json_format.ParseDict(patch["patch"]["value"], message)  # @type resolved, strict fields
        if patch["applyTo"] == "NETWORK_FILTER":
            manager = hcm_pb2.HttpConnectionManager()
            assert message.typed_config.Unpack(manager)


def _smallest_config(case: str) -> dict[str, Any]:
    """The pieces the patches add or merge, in the smallest config Envoy validates: istiod's
    clusters the aggregates name (static), a listener whose HCM gets every NETWORK_FILTER merge,
    a route per patched route name merged (or inserted) as Istio would."""
    patches = _patches(case)
    clusters: dict[str, Any] = {}
    route_table = route_pb2.RouteConfiguration(name="http.10000")
    vhost = route_table.virtual_hosts.add(name="any", domains=["*"])
    manager = hcm_pb2.HttpConnectionManager(stat_prefix="gateway")
    manager.http_filters.add(name="envoy.filters.http.router").typed_config.Pack(
        __import__(
            "envoy.extensions.filters.http.router.v3.router_pb2", fromlist=["Router"]
        ).Router()
    )
    extensions = {p["patch"]["value"]["name"]: p["patch"]["value"] for p in patches
                  if p["applyTo"] == "EXTENSION_CONFIG"}  # fmt: skip
    if extensions:  # what the routers' remote code names (istio-agent fetches it)
        clusters["meshfn-wasm"] = {"name": "meshfn-wasm", "type": "STATIC", "connect_timeout": "1s"}
    for patch in patches:
        value = patch["patch"]["value"]
        if patch["applyTo"] == "EXTENSION_CONFIG":
            continue
        if "config_discovery" in value:  # what ECDS delivers: the extension config, inline
            value = extensions[value["name"]]
        if patch["applyTo"] == "CLUSTER":
            clusters[value["name"]] = value
            for member in value["cluster_type"]["typed_config"]["clusters"]:
                clusters.setdefault(
                    member,
                    {
                        "name": member,
                        "type": "STATIC",
                        "connect_timeout": "1s",
                        "load_assignment": {"cluster_name": member, "endpoints": []},
                    },
                )
        elif patch["applyTo"] == "NETWORK_FILTER":
            typed = {k: v for k, v in value["typed_config"].items() if k != "@type"}
            manager.MergeFrom(json_format.ParseDict(typed, hcm_pb2.HttpConnectionManager()))
        elif patch["applyTo"] == "HTTP_FILTER":  # INSERT_BEFORE the router, or INSERT_FIRST
            operation = patch["patch"]["operation"]
            assert operation in ("INSERT_BEFORE", "INSERT_FIRST")
            entry = json_format.ParseDict(value, hcm_pb2.HttpFilter())
            if operation == "INSERT_BEFORE":
                manager.http_filters.insert(len(manager.http_filters) - 1, entry)
            elif entry.name not in [f.name for f in manager.http_filters]:  # one per context
                manager.http_filters.insert(0, entry)
        elif patch["applyTo"] == "ROUTE_CONFIGURATION":
            route_table.MergeFrom(json_format.ParseDict(value, route_pb2.RouteConfiguration()))
        else:
            route = json_format.ParseDict(value, route_components_pb2.Route())
            if patch["patch"]["operation"] == "MERGE":
                # what the VirtualService made: a match and istiod's cluster
                base = route_components_pb2.Route(
                    name=patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
                )
                base.match.prefix = "/"
                base.route.cluster = "istio-default"
                base.MergeFrom(route)
                route = base
            vhost.routes.append(route)
    clusters["istio-default"] = {"name": "istio-default", "type": "STATIC", "connect_timeout": "1s"}
    for r in vhost.routes:
        for name in [r.route.cluster, *(c.name for c in r.route.weighted_clusters.clusters)]:
            if name:
                clusters.setdefault(name, {"name": name, "type": "STATIC", "connect_timeout": "1s"})
    if not vhost.routes:
        vhost.routes.add(name="default").route.cluster = "istio-default"
        vhost.routes[0].match.prefix = "/"
    manager.route_config.CopyFrom(route_table)
    listener = {
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/" + manager.DESCRIPTOR.full_name,
                            **json_format.MessageToDict(manager),
                        },
                    }
                ]
            }
        ],
    }
    return {"static_resources": {"listeners": [listener], "clusters": list(clusters.values())}}


@pytest.mark.parametrize(
    "case", ["examples", "fallback", "audit_drift", "drill", "jwt-authz", "qos"]
)
def test_envoy_accepts_the_patched_pieces(case: str, tmp_path: Path) -> None:
    config = _smallest_config(case)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- drift breaker in Istio mode


@pytest.mark.parametrize("case", ["examples", "fallback", "audit_drift"])
def test_a_trip_changes_only_the_degrade_plugin_config(case: str) -> None:
    model = load_policies(source(case))
    guarded = sorted(
        r.key
        for w in model.workloads
        for lst in w.listeners
        for r in lst.routes
        if model.service(r.service).drift is not None
    )
    assert guarded
    healthy = render(model, DIGESTS)
    tripped = render(model, DIGESTS, overlay=ir.Overlay(frozenset(guarded[:1])))
    changed = []
    for kind, objects in healthy.objects.items():
        for before, after in zip(objects, tripped.objects[kind], strict=True):
            if before == after:
                continue
            assert kind == "WasmPlugin"
            rest_before, rest_after = copy.deepcopy(before), copy.deepcopy(after)
            assert rest_before["spec"].pop("pluginConfig") != rest_after["spec"].pop("pluginConfig")
            assert yaml.safe_dump(rest_before) == yaml.safe_dump(rest_after)  # byte-identical rest
            changed.append(before["metadata"]["name"])
    assert len(changed) == 1
    assert healthy.mesh_config == tripped.mesh_config


# ---------------------------------------------------------------- meshfn's meaning on Istio


def _one(case: str, kind: str, name: str) -> dict[str, Any]:
    return next(o for o in rendering(case).objects[kind] if o["metadata"]["name"] == name)


def test_mesh_mtls_default_is_explicit_strict() -> None:
    """Istio's default is PERMISSIVE; meshfn's STRICT is written out mesh-wide."""
    pa = _one("basic", "PeerAuthentication", "meshfn-golden")
    assert pa["metadata"]["namespace"] == "istio-system"
    assert pa["spec"] == {"mtls": {"mode": "STRICT"}}


def test_route_defaults_are_meshfns() -> None:
    """No retries unless asked (Istio retries twice), Envoy's 15s route timeout (Istio has
    none), the service's connect timeout (Istio 10s)."""
    vs = rendering("basic").objects["VirtualService"][0]
    http = vs["spec"]["http"][0]
    assert http["retries"] == {"attempts": 0}
    assert http["timeout"] == "15s"
    dr = rendering("basic").objects["DestinationRule"][0]
    assert dr["spec"]["trafficPolicy"]["connectionPool"]["tcp"]["connectTimeout"] == "1s"


def test_routes_keep_meshfns_precedence_in_one_virtual_service() -> None:
    model = load_policies(source("precedence"))
    listener = next(w for w in model.workloads if w.kind == "gateway").listeners[0]
    expected = [
        f"{r.key}/{i}"
        for r, i in sorted(
            ((r, i) for r in listener.routes for i in range(len(r.matches))),
            key=lambda pair: precedence(*pair),
        )
    ]
    (vs,) = rendering("precedence").objects["VirtualService"]
    assert [h["name"] for h in vs["spec"]["http"]] == expected


def test_weighted_round_robin_becomes_least_request() -> None:
    """Istio has no ORCA-weighted balancer: LEAST_REQUEST stands in, with a warning where the
    user chose weighted round robin (jobs), silently where it is meshfn's default (models
    serves a Function)."""
    result = rendering("qos")
    simple = {
        dr["metadata"]["name"]: dr["spec"]["trafficPolicy"]["loadBalancer"]["simple"]
        for dr in result.objects["DestinationRule"]
    }
    assert simple == {"jobs": "LEAST_REQUEST", "models": "LEAST_REQUEST"}
    warned = [w for w in result.warnings if w.code == "load-balancer-wrr"]
    assert [(w.source.name, w.path) for w in warned] == [("jobs", ("spec", "loadBalancer"))]


def test_what_istiod_would_refuse_is_not_rendered() -> None:
    """istiod's validation (and the CRDs' CEL rules, which jsonschema does not run) refuse a
    VirtualService with `timeout: 0s`, a retry policy beside `attempts: 0`, and durations finer
    than a millisecond, and with it every route it holds: a 0s timeout is left out (Istio's
    default is none, as meshfn's 0s means), attempts 0 stands alone, and finer durations are
    rounded up to whole milliseconds with a warning naming the field."""
    result = rendering("retries-timeouts")
    (vs,) = result.objects["VirtualService"]
    routes = {h["name"]: h for h in vs["spec"]["http"]}
    assert "timeout" not in routes["default/stream/0"]
    assert routes["default/stream/0"]["retries"] == {"attempts": 0}
    fast = routes["default/fast/0"]
    assert (fast["timeout"], fast["retries"]["perTryTimeout"]) == ("0.003s", "0.002s")
    rounded = sorted(
        (w.source.name, w.path) for w in result.warnings if w.code == "duration-rounded"
    )
    assert rounded == [
        ("fast", ("spec", "retries", "perTryTimeout")),
        ("fast", ("spec", "timeout")),
    ]


@pytest.mark.parametrize("case", CASES)
def test_istio_durations_are_whole_milliseconds(case: str) -> None:
    for obj in (o for objs in rendering(case).objects.values() for o in objs):
        for text in _durations(obj):
            total = float(text.removesuffix("s"))
            assert total >= 0.001 and round(total * 1000, 6).is_integer(), (text, obj)


def _durations(node: Any) -> list[str]:
    """Istio API durations in an object (Envoy JSON inside EnvoyFilter patches aside)."""
    if isinstance(node, dict):
        if node.get("kind") == "EnvoyFilter":
            return []
        return [
            v
            for k, v in node.items()
            if k in {"timeout", "perTryTimeout", "connectTimeout", "interval", "baseEjectionTime"}
            and isinstance(v, str)
        ] + [d for v in node.values() for d in _durations(v)]
    if isinstance(node, list):
        return [d for v in node for d in _durations(v)]
    return []


def test_request_principals_split_is_warned_only_when_ambiguous() -> None:
    issuers = {"https://a.example", "https://a.example/tenants"}
    assert ambiguous_principal("https://a.example/tenants/alice", issuers) == "https://a.example"
    assert ambiguous_principal("https://a.example/*", issuers) == "https://a.example/tenants"
    assert ambiguous_principal("https://a.example/alice", {"https://a.example"}) is None
    assert ambiguous_principal("*", issuers) is None


def test_full_builds_and_fail_close() -> None:
    """istiod leaves vm_id empty: one VM per module per proxy, which a -lean build would refuse
    to share between configurations."""
    for plugin in rendering("audit_drift").objects["WasmPlugin"]:
        spec = plugin["spec"]
        assert spec["failStrategy"] == "FAIL_CLOSE"
        assert spec["url"].endswith(f"{spec['sha256']}.wasm")
        assert spec["sha256"] in {DIGESTS[b] for b in ("audit", "degrade", "meshfn")}
        assert spec["phase"] in ("AUTHZ", "STATS")


def test_clients_cannot_pick_the_degraded_route() -> None:
    (f,) = [
        f
        for f in rendering("examples").objects["EnvoyFilter"]
        if f["metadata"]["namespace"] == "ingress"
    ]
    hcm = next(p for p in f["spec"]["configPatches"] if p["applyTo"] == "NETWORK_FILTER")
    mutations = hcm["patch"]["value"]["typed_config"]["early_header_mutation_extensions"]
    removed = [m["remove"] for m in mutations[0]["typed_config"]["mutations"]]
    assert "x-meshfn-degrade-route" in removed


def test_audit_tenant_travels_in_a_claim_header() -> None:
    (ra,) = rendering("examples").objects["RequestAuthentication"]
    claims = {c["header"]: c["claim"] for c in ra["spec"]["jwtRules"][0]["outputClaimToHeaders"]}
    assert claims["x-meshfn-jwt-sub"] == "sub" and claims["x-meshfn-jwt-tenant"] == "tenant"
    assert claims["x-tenant"] == "tenant"  # the rule's own entry stays


@pytest.mark.parametrize("case", CASES)
def test_no_route_removes_a_header_the_access_log_reads(case: str) -> None:
    """A route's request_headers_to_remove edits the header map the access log reads after it
    (Envoy 1.40 then logs the header as null): the bare audit's tenant, which Istio's audit
    provider reads from jwt_authn's claim header, must survive every route."""
    result = rendering(case)
    providers = result.mesh_config["meshConfig"]["extensionProviders"]
    logged = {
        match.lower()
        for p in providers
        if "envoyFileAccessLog" in p
        for value in p["envoyFileAccessLog"]["logFormat"]["labels"].values()
        for match in re.findall(r"%REQ\(([^)]+)\)%", value)
    }
    removed = {
        name
        for ef in result.objects.get("EnvoyFilter", [])
        for patch in ef["spec"]["configPatches"]
        if patch["applyTo"] == "ROUTE_CONFIGURATION"
        for name in patch["patch"]["value"].get("request_headers_to_remove", [])
    }
    assert not logged & removed
    if case in ("examples", "audit_bare"):
        assert "x-meshfn-jwt-tenant" in logged and "x-meshfn-jwt-sub" in removed


@pytest.mark.parametrize("case", CASES)
def test_sidecars_audit_only_what_they_serve(case: str) -> None:
    """Without a match Istio runs a WasmPlugin and an access log on a sidecar's outbound
    listeners too: the workload's own calls would become its audit records. Sidecars' run on
    SERVER traffic, gateways' on their listener's port."""
    result = rendering(case)
    model = load_policies(source(case))
    gateway_labels = [{"app": w.name} for w in model.workloads if w.kind == "gateway"]
    for plugin in result.objects.get("WasmPlugin", []):
        (match,) = plugin["spec"]["match"]
        on_gateway = plugin["spec"]["selector"]["matchLabels"] in gateway_labels
        assert match["mode"] == ("CLIENT" if on_gateway else "SERVER"), plugin["metadata"]
    for telemetry in result.objects.get("Telemetry", []):
        selector = telemetry["spec"].get("selector")  # none: the mesh-wide tracing default
        if selector is not None and selector["matchLabels"] not in gateway_labels:
            spec = telemetry["spec"]
            for entry in spec.get("accessLogging", []) + spec.get("tracing", []):
                assert entry["match"] == {"mode": "SERVER"}, telemetry["metadata"]


def test_a_routes_own_rate_limit_holds_on_its_degraded_twin() -> None:
    """While the drift breaker has tripped, the twin serves the route's requests: it carries the
    route's own limit (as the translator's twin does), not the gateway's (here: none)."""
    limited = {
        patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
        for ef in rendering("qos-drift").objects["EnvoyFilter"]
        for patch in ef["spec"]["configPatches"]
        if patch["applyTo"] == "HTTP_ROUTE" and "typed_per_filter_config" in patch["patch"]["value"]
    }
    assert limited == {"default/batch/0", "default/batch/0/degraded"}


# ---------------------------------------------------------------- bad input

runner = CliRunner()


def test_schema_refusal_names_object_and_path() -> None:
    obj = copy.deepcopy(rendering("basic").objects["DestinationRule"][0])
    obj["spec"]["trafficPolicy"]["connectionPool"]["tcp"]["maxConnectionz"] = 3
    with pytest.raises(
        SchemaError,
        match=r"DestinationRule default/echo: spec.trafficPolicy.connectionPool.tcp.maxConnectionz: unknown field",
    ):
        validate(obj)
    obj = copy.deepcopy(rendering("basic").objects["PeerAuthentication"][0])
    obj["spec"]["mtls"]["mode"] = "SOMETIMES"
    with pytest.raises(
        SchemaError, match=r"PeerAuthentication istio-system/meshfn-golden: spec.mtls.mode"
    ):
        validate(obj)


def test_cli_writes_nothing_when_an_object_is_invalid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshfn.istio import traffic

    monkeypatch.setattr(traffic, "ENVOY_ROUTE_TIMEOUT", {"seconds": 15})
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["render", "istio", "-p", str(GOLDEN / "basic" / "in.yaml"), "-o", str(out)]
    )
    assert result.exit_code == 1
    assert "VirtualService ingress" in result.output or "VirtualService default" in result.output
    assert "spec.http" in result.output
    assert not out.exists()


def test_cli_warns_with_file_line_and_strict_fails(tmp_path: Path) -> None:
    policy = GOLDEN / "external" / "in.yaml"
    out = tmp_path / "out"
    result = runner.invoke(app, ["render", "istio", "-p", str(policy), "-o", str(out)])
    assert result.exit_code == 0, result.output
    line = next(
        i for i, text in enumerate(policy.read_text().splitlines(), 1) if "clockSkew" in text
    )
    assert f"{policy}:{line}: spec.jwtRules[0].clockSkew:" in result.output
    assert "[jwt-clock-skew]" in result.output
    assert (out / "serviceentries.yaml").exists()
    strict = tmp_path / "strict"
    result = runner.invoke(
        app, ["render", "istio", "-p", str(policy), "-o", str(strict), "--strict"]
    )
    assert result.exit_code == 1
    assert not strict.exists()


def test_cli_invalid_policy_gives_validate_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((GOLDEN / "basic" / "in.yaml").read_text().replace("port: 8080", "port: 0"))
    rendered = runner.invoke(app, ["render", "istio", "-p", str(bad), "-o", str(tmp_path / "o")])
    validated = runner.invoke(app, ["validate", str(bad)])
    assert rendered.exit_code == validated.exit_code == 1
    assert f"{bad}:" in rendered.output
    assert rendered.output == validated.output


def test_a_gateway_and_a_service_of_one_name_are_refused(tmp_path: Path) -> None:
    """Istio selects both by `app: <name>`: each would get the other's plugins and policies
    (and their objects' names collide). meshfn runs them apart; for Istio, a clear refusal."""
    policies = tmp_path / "p.yaml"
    policies.write_text(
        (GOLDEN / "basic" / "in.yaml").read_text()
        + "\n---\napiVersion: meshfn.io/v1alpha1\nkind: Service\nmetadata: {name: edge}\n"
        "spec: {port: 9101, endpoints: [{address: 127.0.0.1, sidecar: {port: 15101}}]}\n"
    )
    assert runner.invoke(app, ["validate", str(policies)]).exit_code == 0
    out = tmp_path / "o"
    result = runner.invoke(app, ["render", "istio", "-p", str(policies), "-o", str(out)])
    assert result.exit_code == 1 and not out.exists()
    assert "Gateway default/edge and Service default/edge share the pod label 'app: edge'" in (
        " ".join(result.output.split())
    )


def test_what_istio_ignores_or_refuses_is_said(tmp_path: Path) -> None:
    """Istio applies maxRetries and minRetryConcurrency only above 0 and weighs a Kubernetes
    Service's pods alike: warnings naming the field. A route regex over 1024 characters makes
    istiod refuse the VirtualService: a refusal, nothing written."""
    from meshfn.istio import Unrenderable

    text = (GOLDEN / "basic" / "in.yaml").read_text()
    extra = (
        "\n---\napiVersion: meshfn.io/v1alpha1\nkind: FallbackPolicy\nmetadata: {name: fb}\n"
        "spec:\n  service: echo\n  outlierDetection: {consecutive5xxErrors: 3}\n"
        "  circuitBreakers: {maxRetries: 0}\n  retryBudget: {percent: 10, minRetryConcurrency: 0}\n"
    )
    policies = tmp_path / "p.yaml"
    policies.write_text(
        text.replace("address: 127.0.0.1}", "address: 127.0.0.1, weight: 3}") + extra
    )
    model = load_policies(policies)
    result = render(model, DIGESTS)
    warned = {(w.code, w.path) for w in result.warnings}
    assert ("istio-ignores-zero", ("spec", "circuitBreakers", "maxRetries")) in warned
    assert ("istio-ignores-zero", ("spec", "retryBudget", "minRetryConcurrency")) in warned
    assert ("endpoint-weight-ignored", ("spec", "endpoints", 0, "weight")) in warned
    (dr,) = [d for d in result.objects["DestinationRule"] if d["metadata"]["name"] == "echo"]
    assert "maxRetries" not in str(dr) and "minRetryConcurrency" not in str(dr)
    long = "^/(" + "|".join(f"v{i}" for i in range(300)) + ")$"
    assert len(long) > 1024
    policies.write_text(text.replace("prefix: /", f"regex: '{long}'", 1))
    with pytest.raises(Unrenderable, match="Istio refuses regexes over 1024"):
        render(load_policies(policies), DIGESTS)


def test_cli_uses_the_built_modules(tmp_path: Path) -> None:
    from meshfn.wasm_filters import artifacts, build

    digests = artifacts(build())
    result = runner.invoke(
        app,
        [
            "render",
            "istio",
            "-p",
            str(GOLDEN / "audit_drift" / "in.yaml"),
            "-o",
            str(tmp_path),
            "--state-dir",
            str(tmp_path / "state"),
        ],
    )
    assert result.exit_code == 0, result.output
    plugins = list(yaml.safe_load_all((tmp_path / "wasmplugins.yaml").read_text()))
    assert plugins
    for plugin in plugins:
        build_name = plugin["spec"]["vmConfig"]["env"][0]["value"]
        assert plugin["spec"]["sha256"] == digests[build_name]
    assert "00" * 32 not in (tmp_path / "wasmplugins.yaml").read_text()  # the state's salt


def test_kserve_grpc_goes_to_the_grpc_port_and_the_repository_is_guarded() -> None:
    """The KServe gRPC route addresses the backend Service's gRPC port, and load/unload is
    denied on the backend's sidecars as the xDS translator does (meshfn's own DENY policy,
    owned by the Functions it guards)."""
    model = load_policies(source("kserve"))
    result = rendering("kserve")
    backend = model.service(model.functions[0].backend)
    grpc = [
        http
        for vs in result.objects["VirtualService"]
        for http in vs["spec"]["http"]
        if http["name"].endswith("/kserve-grpc/0")
    ]
    assert grpc
    for http in grpc:
        ports = {d["destination"]["port"]["number"] for d in http["route"]}
        assert ports == {backend.grpc_service_port}
    guards = [
        p
        for p in result.objects["AuthorizationPolicy"]
        if p["metadata"]["name"].startswith("meshfn-kserve-repository-")
    ]
    assert guards and all(p["spec"]["action"] == "DENY" for p in guards)
    origins = {
        s.kind
        for key, sources in result.origins.items()
        for s in sources
        if key[0] == "AuthorizationPolicy" and key[2].startswith("meshfn-kserve")
    }
    assert origins == {"Function"}
