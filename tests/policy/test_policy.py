"""Policy loading: every bad input gets file, line, field path and a clear message."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from meshfn import ir
from meshfn.policy import PolicyError, PolicyErrors, PolicyLoader, load_policies
from meshfn.xds.names import cluster_name

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"

MESH = """\
apiVersion: meshfn.io/v1alpha1
kind: Mesh
metadata: {name: test}
spec: {trustDomain: test.local, ports: {xds: 18000, admin: 18001}}
"""
GATEWAY = """\
apiVersion: meshfn.io/v1alpha1
kind: Gateway
metadata: {name: edge}
spec:
  adminPort: 19000
  listeners: [{name: http, port: 10000}]
"""
SERVICE = """\
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {name: echo}
spec:
  port: 8080
  endpoints: [{address: 127.0.0.1}]
"""
ROUTE = """\
apiVersion: meshfn.io/v1alpha1
kind: Route
metadata: {name: echo}
spec:
  destination: {service: echo}
"""


def write(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def base_files() -> dict[str, str]:
    return {"mesh.yaml": MESH + "---\n" + GATEWAY, "svc.yaml": SERVICE, "route.yaml": ROUTE}


def errors_for(tmp_path: Path, extra: str, name: str = "zz-extra.yaml") -> list[PolicyError]:
    files = base_files()
    files[name] = extra
    with pytest.raises(PolicyErrors) as caught:
        load_policies(write(tmp_path, files))
    return caught.value.errors


def test_examples_load() -> None:
    model = load_policies(EXAMPLES)
    assert model.name == "demo"
    assert [w.node_cluster for w in model.workloads] == [
        "edge.ingress",
        "echo.default:15201",
        "models.default:15101",
        "models.default:15102",
        "models-lite.default:15103",
    ]
    assert {s.key for s in model.services} == {
        "default/echo",
        "default/models",
        "default/models-lite",
    }
    assert [f.name for f in model.functions] == [
        "cancer", "digits", "digits-cnn", "embedder", "iris", "tiny-lm",
    ]  # fmt: skip


def test_base_loads_with_defaults(tmp_path: Path) -> None:
    model = load_policies(write(tmp_path, base_files()))
    service = model.service("default/echo")
    assert service.endpoints == (ir.Endpoint("127.0.0.1", 8080, 1, ir.Locality()),)
    assert service.protocol == "http"
    route = model.workloads[0].listeners[0].routes[0]
    assert route.matches == (ir.RouteMatch(ir.PathMatch("prefix", "/")),)
    assert cluster_name(route.service) == "echo.default"
    assert model.workloads[0].xds_protocol == "delta"


def doc(kind: str, body: str, name: str = "x", namespace: str | None = None) -> str:
    meta = f"{{name: {name}}}" if namespace is None else f"{{name: {name}, namespace: {namespace}}}"
    return f"apiVersion: meshfn.io/v1alpha1\nkind: {kind}\nmetadata: {meta}\nspec:\n{body}"


# (extra document, line, field path, message fragment)
SCHEMA_CASES = [
    (
        doc("Service", "  port: 80\n  protocl: http\n"),
        6,
        "spec.protocl",
        "unknown field 'protocl' (did you mean 'protocol'?)",
    ),
    (doc("Service", "  port: '80'\n"), 5, "spec.port", "valid integer, got the string '80'"),
    (doc("Service", "  port: 70000\n"), 5, "spec.port", "less than or equal to 65535"),
    (doc("Service", "  protocol: http\n"), 4, "spec.port", "required field is missing"),
    (doc("Service", "  port: 80\n  protocol: udp\n"), 6, "spec.protocol", "'http' or 'grpc'"),
    (
        doc("Service", "  port: 80\n  endpoints: [{address: localhost}]\n"),
        6,
        "spec.endpoints[0].address",
        "not an IPv4 or IPv6 address",
    ),
    (
        doc("Service", "  port: 80\n  endpoints:\n    - address: 10.0.0.1\n      weight: 0\n"),
        8,
        "spec.endpoints[0].weight",
        "greater than or equal to 1",
    ),
    (
        doc("Service", "  port: 80\n  endpoints: [{address: 10.0.0.1, locality: {zone: a}}]\n"),
        6,
        "spec.endpoints[0].locality",
        "zone needs locality.region",
    ),
    (
        doc("Service", "  port: 80\n  connectTimeout: 5 s\n"),
        6,
        "spec.connectTimeout",
        "invalid duration '5 s'",
    ),
    (
        # Past timedelta's C int: a fuzzer found it raised OverflowError instead of this error.
        doc("Service", "  port: 80\n  connectTimeout: " + "3" * 120 + "ms\n"),
        6,
        "spec.connectTimeout",
        "longer than 365 days",
    ),
    (
        doc("Service", "  port: 80\n  connectTimeout: 0s\n"),
        4,
        "spec",
        "connectTimeout must be positive",
    ),
    (doc("Service", "  port: 80\n", name="Bad_Name"), 3, "metadata.name", "lowercase DNS label"),
    (
        doc("Route", "  destination: {service: echo}\n  matches: [{path: {regex: 'a(?=b)'}}]\n"),
        6,
        "spec.matches[0].path.regex",
        "invalid RE2 regex 'a(?=b)'",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  matches: [{path: {regex: '(unclosed'}}]\n"),
        6,
        "spec.matches[0].path.regex",
        "missing )",
    ),
    (
        doc(
            "Route",
            "  destination: {service: echo}\n  matches: [{path: {prefix: /a, exact: /b}}]\n",
        ),
        6,
        "spec.matches[0].path",
        "set exactly one of: prefix, exact, regex (got prefix, exact)",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  matches: [{path: {prefix: nope}}]\n"),
        6,
        "spec.matches[0].path.prefix",
        "must start with '/'",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  matches: [{headers: [{name: x}]}]\n"),
        6,
        "spec.matches[0].headers[0]",
        "set exactly one of",
    ),
    (
        doc(
            "Route",
            "  destination: {service: echo}\n  matches: [{headers: [{name: x, present: false}]}]\n",
        ),
        6,
        "spec.matches[0].headers[0]",
        "invert: true",
    ),
    (
        doc(
            "Route",
            "  destination: {service: echo}\n  matches: [{headers: [{name: ':method', exact: GET}]}]\n",
        ),
        6,
        "spec.matches[0].headers[0]",
        "`methods` field",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  matches: [{methods: [FETCH]}]\n"),
        6,
        "spec.matches[0].methods[0]",
        "'GET'",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  hosts: ['bad host']\n"),
        6,
        "spec.hosts[0]",
        "host name",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  timeout: -1s\n"),
        6,
        "spec.timeout",
        "invalid duration",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  retries: {attempts: 11}\n"),
        6,
        "spec.retries.attempts",
        "less than or equal to 10",
    ),
    (
        doc(
            "Route",
            "  destination: {service: echo}\n  retries: {attempts: 1, retryOn: [sometimes]}\n",
        ),
        6,
        "spec.retries.retryOn[0]",
        "'5xx'",
    ),
    (
        doc("Route", "  destination: {service: echo}\n  retries: {attempts: 1, on: [5xx]}\n"),
        6,
        "spec.retries",
        "mapping keys must be strings, got bool",
    ),
    (
        doc("Route", "  destination: {}\n"),
        5,
        "spec.destination.service",
        "required field is missing",
    ),
    (
        doc("Gateway", "  adminPort: 19001\n  listeners: []\n"),
        6,
        "spec.listeners",
        "at least 1 item",
    ),
    (
        doc(
            "Gateway", "  adminPort: 19001\n  listeners: [{name: a, port: 1}, {name: a, port: 2}]\n"
        ),
        4,
        "spec",
        "listener name 'a' is used twice",
    ),
    (
        doc(
            "Gateway",
            "  adminPort: 19001\n  xdsProtocol: rest\n  listeners: [{name: a, port: 1}]\n",
        ),
        6,
        "spec.xdsProtocol",
        "'delta' or 'sotw'",
    ),
    (
        "apiVersion: meshfn.io/v1beta9\nkind: Service\nmetadata: {name: x}\nspec: {port: 1}\n",
        1,
        "apiVersion",
        "unsupported apiVersion 'meshfn.io/v1beta9'",
    ),
    (
        "apiVersion: meshfn.io/v1alpha1\nkind: Widget\n",
        2,
        "kind",
        "unknown kind 'Widget'; known kinds: AuthorizationPolicy, FallbackPolicy, Function, Gateway, Mesh, PeerAuthentication, QoSPolicy, RequestAuthentication, Rollout, Route, Service",
    ),
    (
        "apiVersion: meshfn.io/v1alpha1\nmetadata: {name: x}\n",
        1,
        "kind",
        "required field is missing",
    ),
    ("- just\n- a list\n", 1, "", "a policy document is a mapping"),
    (
        "apiVersion: meshfn.io/v1alpha1\nkind: Mesh\nmetadata: {name: m2}\nspec:\n"
        "  drill:\n    requestPrincipals: ['https://i.example/a,b']\n",
        6,
        "spec.drill.requestPrincipals[0]",
        "the degrade filter compares callers as printable ASCII",
    ),
    (
        doc(
            "RequestAuthentication",
            "  jwtRules:\n    - issuer: https://i.example\n"
            "      jwks: '{\"keys\": []}'\n"
            "      outputClaimToHeaders: [{header: x_tenant, claim: tenant}]\n",
        ),
        8,
        "spec.jwtRules[0].outputClaimToHeaders[0].header",
        "should match pattern",
    ),
    (
        doc(
            "FallbackPolicy",
            "  service: echo\n  locality:\n    failover:\n      - {from: eu-west, to: eu-west}\n",
        ),
        8,
        "spec.locality.failover[0]",
        "region 'eu-west' cannot fail over to itself",
    ),
    (
        "apiVersion: meshfn.io/v1alpha1\nkind: Service\nmetadata: {name: x}\nspec: {port: 1}\nstatus: {}\n",
        5,
        "status",
        "unknown field 'status'",
    ),
]


@pytest.mark.parametrize(("extra", "line", "path", "fragment"), SCHEMA_CASES)
def test_schema_errors(tmp_path: Path, extra: str, line: int, path: str, fragment: str) -> None:
    errors = errors_for(tmp_path, extra)
    matching = [e for e in errors if e.path == path and fragment in e.message]
    assert matching, f"no error at {path} containing {fragment!r} in {[str(e) for e in errors]}"
    assert matching[0].file.endswith("zz-extra.yaml")
    assert matching[0].line == line


# (extra document, path, message fragment); loaded last, so the error is reported on it.
REFERENCE_CASES = [
    (
        doc("Service", "  port: 9\n", name="echo"),
        "metadata.name",
        "duplicate Service default/echo (first defined at",
    ),
    (
        doc("Route", "  destination: {service: ecko}\n", name="r2"),
        "spec.destination.service",
        "unknown Service default/ecko (did you mean default/echo?)",
    ),
    (
        doc("Route", "  destination: {service: echo, namespace: other}\n", name="r2"),
        "spec.destination.service",
        "unknown Service other/echo",
    ),
    (
        doc(
            "Route",
            "  gateway: egde\n  destination: {service: echo}\n  hosts: [a.com]\n",
            name="r2",
        ),
        "spec.gateway",
        "unknown Gateway default/egde (did you mean default/edge?)",
    ),
    (
        doc(
            "Route",
            "  listener: https\n  destination: {service: echo}\n  hosts: [a.com]\n",
            name="r2",
        ),
        "spec.listener",
        "has no listener 'https' (it has: http)",
    ),
    (
        doc("Route", "  destination: {service: echo}\n", name="r2"),
        "spec.matches[0]",
        "identical match to Route default/echo on host '*'",
    ),
    (doc("Mesh", "  trustDomain: other\n", name="second"), "kind", "a second Mesh"),
    (
        doc("Gateway", "  adminPort: 19001\n  listeners: [{name: a, port: 10000}]\n", name="gw2"),
        "spec.listeners[0].port",
        "port 10000 clashes with listener http of Gateway default/edge",
    ),
    (
        doc("Gateway", "  adminPort: 18000\n  listeners: [{name: a, port: 10001}]\n", name="gw2"),
        "spec.adminPort",
        "port 18000 clashes with the Mesh xds port",
    ),
    (
        doc(
            "Gateway",
            "  adminPort: 19001\n  listeners: [{name: a, port: 10000, address: 0.0.0.0}]\n",
            name="gw2",
        ),
        "spec.listeners[0].port",
        "clashes",
    ),
    (
        doc("Service", "  port: 8080\n  endpoints: [{address: 127.0.0.1}]\n", name="echo2"),
        "spec.endpoints[0]",
        "endpoint 127.0.0.1:8080 is also an endpoint of Service default/echo",
    ),
    (
        doc("Service", "  port: 10000\n  endpoints: [{address: 127.0.0.1}]\n", name="loop"),
        "spec.endpoints[0]",
        "points at listener http of Gateway default/edge",
    ),
    (
        doc("Service", "  port: 1\n  endpoints: [{address: '::1', port: 18001}]\n", name="loop6"),
        "spec.endpoints[0]",
        "[::1]:18001 points at the Mesh admin port",
    ),
    (
        doc("Function", "  backend: echo\n  egress: [{service: echo}, {service: nowhere}]\n"),
        "spec.egress[1].service",
        "unknown Service default/nowhere: an egress peer must be a Service of the mesh",
    ),
]


@pytest.mark.parametrize(("extra", "path", "fragment"), REFERENCE_CASES)
def test_reference_errors(tmp_path: Path, extra: str, path: str, fragment: str) -> None:
    errors = errors_for(tmp_path, extra)
    matching = [e for e in errors if e.path == path and fragment in e.message]
    assert matching, f"no error at {path} containing {fragment!r} in {[str(e) for e in errors]}"
    assert matching[0].file.endswith("zz-extra.yaml")
    assert matching[0].line >= 1


def test_ambiguous_gateway(tmp_path: Path) -> None:
    second = doc(
        "Gateway", "  adminPort: 19001\n  listeners: [{name: a, port: 10001}]\n", name="gw2"
    )
    errors = errors_for(tmp_path, second)
    assert any("several Gateways exist (default/edge, default/gw2)" in e.message for e in errors)
    assert all(e.file.endswith("route.yaml") for e in errors)


def test_no_mesh(tmp_path: Path) -> None:
    with pytest.raises(PolicyErrors) as caught:
        load_policies(write(tmp_path, {"svc.yaml": SERVICE}))
    assert [e.message for e in caught.value.errors] == [
        "no Mesh found: a policy set needs one kind: Mesh"
    ]


def test_empty_and_missing_directories(tmp_path: Path) -> None:
    with pytest.raises(PolicyErrors, match="no policy files"):
        load_policies(tmp_path)
    with pytest.raises(PolicyErrors, match="no such file or directory"):
        load_policies(tmp_path / "nope")


def test_hidden_and_non_yaml_files_are_ignored(tmp_path: Path) -> None:
    files = base_files()
    files[".swap.yaml"] = "garbage: ["
    files["notes.txt"] = "not yaml: ["
    model = load_policies(write(tmp_path, files))  # the broken files would raise if read
    assert [s.key for s in model.services] == ["default/echo"]
    assert [w.node_cluster for w in model.workloads] == [
        w.node_cluster for w in base_model(tmp_path).workloads
    ]


def base_model(tmp_path: Path) -> ir.MeshModel:
    other = tmp_path.parent / (tmp_path.name + "-base")
    other.mkdir()
    return load_policies(write(other, base_files()))


def test_errors_from_many_files_are_all_reported_sorted(tmp_path: Path) -> None:
    files = base_files()
    files["a.yaml"] = doc("Service", "  port: x\n")
    files["b.yaml"] = doc("Service", "  port: 1\n  oops: 1\n")
    with pytest.raises(PolicyErrors) as caught:
        load_policies(write(tmp_path, files))
    rendered = [str(e) for e in caught.value.errors]
    assert rendered[0].startswith(f"{tmp_path}/a.yaml:5: spec.port:")
    assert rendered[1].startswith(f"{tmp_path}/b.yaml:6: spec.oops: unknown field 'oops'")


def test_loader_reparses_only_changed_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import meshfn.policy.loader as loader_module

    write(tmp_path, base_files())
    parsed: list[str] = []
    real = loader_module.parse_documents

    def counting(raw: bytes, display: str):  # type: ignore[no-untyped-def]
        parsed.append(Path(display).name)
        return real(raw, display)

    monkeypatch.setattr(loader_module, "parse_documents", counting)
    loader = PolicyLoader(tmp_path)
    first = loader.load()
    assert sorted(parsed) == ["mesh.yaml", "route.yaml", "svc.yaml"]
    parsed.clear()
    assert loader.load() == first
    assert parsed == []
    (tmp_path / "svc.yaml").write_text(SERVICE.replace("8080", "8081"))
    second = loader.load()
    assert parsed == ["svc.yaml"]
    assert second.service("default/echo").endpoints[0].port == 8081
    # The unchanged route is the very same IR object: downstream memoisation relies on it.
    assert second.workloads[0].listeners[0].routes[0] == first.workloads[0].listeners[0].routes[0]


def test_a_bad_change_then_a_fix(tmp_path: Path) -> None:
    write(tmp_path, base_files())
    loader = PolicyLoader(tmp_path)
    good = loader.load()
    (tmp_path / "svc.yaml").write_text(SERVICE.replace("port: 8080", "port: eighty"))
    with pytest.raises(PolicyErrors):
        loader.load()
    (tmp_path / "svc.yaml").write_text(SERVICE)
    assert loader.load() == good
    (tmp_path / "svc.yaml").unlink()
    with pytest.raises(PolicyErrors, match="unknown Service default/echo"):
        loader.load()


FUNCTION_CASES = [
    ("  backend: ghost\n", "spec.backend", "unknown Service default/ghost"),
    ("  backend: echo\n  artifact: 'no-version'\n", "spec.artifact", "String should match pattern"),
    (
        "  backend: echo\n  limits: {memoryMiB: 4}\n",
        "spec.limits.memoryMiB",
        "greater than or equal to 13",
    ),
    (
        "  backend: echo\n  pool: {minIdle: 5, maxIdle: 1}\n",
        "spec",
        "pool.minIdle exceeds pool.maxIdle",
    ),
    ("  backend: echo\n  idleTtl: 0s\n", "spec", "must be positive"),
    ("  backend: echo\n  idleTtl: 10m\n  codeTtl: 5m\n", "spec", "codeTtl must not be shorter"),
    (
        "  backend: echo\n  isolation: shared\n",
        "spec.isolation",
        "'reuse' or 'fresh-instance-per-request'",
    ),
    (
        "  backend: grpcsvc\n",
        "spec.backend",
        "speaks grpc; the inference backend speaks KServe v2 over HTTP",
    ),
]


FUNCTION_CASES += [
    (
        "  backend: echo\n  batching: {maxBatchSize: 8, preferredBatchSizes: [16]}\n",
        "spec.batching",
        "preferredBatchSizes exceed maxBatchSize (8)",
    ),
    (
        "  backend: echo\n  protocols: {rest: false, grpc: false}\n",
        "spec.protocols",
        "at least one",
    ),
    (
        "  backend: echo\n  repository: {callers: [ops]}\n",
        "spec.repository.callers[0]",
        '"<issuer>/<subject>"',
    ),
]


@pytest.mark.parametrize(("spec", "path", "fragment"), FUNCTION_CASES)
def test_function_errors(tmp_path: Path, spec: str, path: str, fragment: str) -> None:
    grpc = doc("Service", "  port: 7777\n  protocol: grpc\n", name="grpcsvc")
    errors = errors_for(tmp_path, grpc + "---\n" + doc("Function", spec, name="fn"))
    matching = [e for e in errors if e.path == path and fragment in e.message]
    assert matching, f"no error at {path} containing {fragment!r} in {[str(e) for e in errors]}"


def test_function_policies_become_the_backend_config(tmp_path: Path) -> None:
    """The Function policy's fields reach the inference backend's config, which accepts them."""
    from meshfn.control_plane.runtime.upstreams import FunctionsSetup, backend_config, upstreams_for
    from meshfn.inference.config import parse_config

    files = base_files()
    files["fn.yaml"] = (
        doc(
            "Function",
            "  backend: echo\n  idleTtl: 30s\n  codeTtl: 1h\n  pool: {minIdle: 1}\n",
            name="iris",
        )
        + "---\n"
        + doc("Function", "  backend: echo\n  artifact: iris@1\n", name="alias")
    )
    model = load_policies(write(tmp_path, files))
    (spec,) = upstreams_for(model).values()
    raw = backend_config(spec, FunctionsSetup(tmp_path / "reg", (tmp_path / "k.pub",)))
    served = {f.name: f for f in parse_config(raw).functions or []}
    iris, alias = served["iris"], served["alias"]
    seconds = timedelta(seconds=1)
    assert (iris.idleTtl, iris.codeTtl, iris.code_ttl) == (
        30 * seconds,
        3600 * seconds,
        3600 * seconds,
    )
    assert iris.pool.minIdle == 1 and alias.artifact == "iris@1"
    assert (alias.codeTtl, alias.code_ttl) == (None, alias.idleTtl)
    config = parse_config(raw)
    assert (config.processes, config.workers) == (1, 2)
    raw = backend_config(spec, FunctionsSetup(tmp_path / "reg", (tmp_path / "k.pub",), 3, 2))
    config = parse_config(raw)
    assert (config.processes, config.workers) == (2, 3)  # meshfn up --backend-processes/-workers


def test_two_functions_with_one_name_clash(tmp_path: Path) -> None:
    """Two namespaces, one model name, one gateway: /v2/models/iris cannot go to both."""
    one = doc("Function", "  backend: echo\n", name="iris")
    backend = doc(
        "Service",
        "  port: 8090\n  endpoints: [{address: 127.0.0.9}]\n",
        name="m",
        namespace="team-b",
    )
    other = doc(
        "Function", "  backend: m\n  gateway: default/edge\n", name="iris", namespace="team-b"
    )
    errors = errors_for(tmp_path, one + "---\n" + backend + "---\n" + other)
    assert any("identical match to Function default/iris" in e.message for e in errors), errors


def mesh_with(tmp_path: Path, spec_extra: str) -> Path:
    files = base_files()
    files["mesh.yaml"] = MESH.replace("admin: 18001}}", f"admin: 18001}}, {spec_extra}}}") + (
        "---\n" + GATEWAY
    )
    return write(tmp_path, files)


def test_drill_compiles_to_spiffe_ids_and_request_principals(tmp_path: Path) -> None:
    root = mesh_with(
        tmp_path,
        "drill: {requestPrincipals: ['https://id.example/sre', 'https://chaos.example/*', '*']}",
    )
    assert load_policies(root).drill == ir.Drill(
        header="x-meshfn-degrade",
        request_principals=("https://id.example/sre", "https://chaos.example/*", "*"),
    )
    assert load_policies(write(tmp_path, base_files())).drill is None


DRILL_CASES = [
    ("drill: {}", "spec.drill.requestPrincipals", "required"),
    ("drill: {requestPrincipals: []}", "spec.drill.requestPrincipals", "at least 1"),
    ("drill: {requestPrincipals: [a/b], principals: [x]}", "spec.drill.principals", "unknown"),
    ("drill: {requestPrincipals: [a/b], header: X-Drill}", "spec.drill", "lowercase"),
    (
        "drill: {requestPrincipals: [a/b], header: x-meshfn-degrade-route}",
        "spec.drill",
        "not the internal routing header",
    ),
    ("drill: {requestPrincipals: [no-slash]}", "spec.drill.requestPrincipals[0]", "must be"),
    (
        "drill: {requestPrincipals: ['https://x/a/b*']}",
        "spec.drill.requestPrincipals[0]",
        "must be",
    ),
]


@pytest.mark.parametrize(("extra", "path", "fragment"), DRILL_CASES)
def test_drill_errors(tmp_path: Path, extra: str, path: str, fragment: str) -> None:
    with pytest.raises(PolicyErrors) as caught:
        load_policies(mesh_with(tmp_path, extra))
    errors = caught.value.errors
    assert [e for e in errors if e.path == path and fragment in e.message], [str(e) for e in errors]


def test_request_principals_with_url_issuers(tmp_path: Path) -> None:
    """Istio's requestPrincipals are "<iss>/<sub>" and issuers are usually URLs."""
    files = base_files()
    files["authz.yaml"] = doc(
        "AuthorizationPolicy",
        "  rules:\n    - from: [{source: {requestPrincipals: ['https://id.example/alice']}}]\n",
    )
    model = load_policies(write(tmp_path, files))
    (policy,) = model.workloads[0].authz
    assert policy.rules[0].sources[0].request_principals == ("https://id.example/alice",)


GRPC_PORT_CASES = [
    ("  port: 8091\n  endpoints: [{address: 127.0.0.1, grpcPort: 9111}]\n", "needs a sidecar"),
    (
        "  port: 8091\n  protocol: grpc\n"
        "  endpoints: [{address: 127.0.0.1, grpcPort: 9111, sidecar: {port: 15091}}]\n",
        "the service speaks gRPC already",
    ),
    (
        "  port: 8091\n  endpoints: [{address: 127.0.0.1, grpcPort: 15091, sidecar: {port: 15091}}]\n",
        "must differ from its other ports",
    ),
]


@pytest.mark.parametrize(("spec", "fragment"), GRPC_PORT_CASES)
def test_grpc_port_errors(tmp_path: Path, spec: str, fragment: str) -> None:
    errors = errors_for(tmp_path, doc("Service", spec, name="models"))
    assert any(e.path == "spec" and fragment in e.message for e in errors), errors


@pytest.mark.parametrize(
    ("grpc_port", "fragment"),
    [(8080, "is also an endpoint of Service default/echo"), (18000, "traffic would loop into")],
)
def test_grpc_port_clashes(tmp_path: Path, grpc_port: int, fragment: str) -> None:
    spec = f"  port: 8091\n  endpoints: [{{address: 127.0.0.1, grpcPort: {grpc_port}, sidecar: {{port: 15091}}}}]\n"
    errors = errors_for(tmp_path, doc("Service", spec, name="models"))
    assert any(e.path == "spec.endpoints[0].grpcPort" and fragment in e.message for e in errors), (
        errors
    )


def test_functions_on_one_gateway_share_a_backend(tmp_path: Path) -> None:
    """KServe's server endpoints and gRPC have no model in the path: one backend per gateway."""
    other = doc("Service", "  port: 8090\n  endpoints: [{address: 127.0.0.9}]\n", name="other")
    fns = doc("Function", "  backend: echo\n", name="iris") + "---\n"
    fns += doc("Function", "  backend: other\n", name="digits")
    errors = errors_for(tmp_path, other + "---\n" + fns)
    (error,) = [e for e in errors if e.path == "spec.backend"]
    assert "must share one backend: iris is served by default/echo, digits by default/other" in (
        error.message
    )


def test_kserve_routes_follow_the_protocol_switches(tmp_path: Path) -> None:
    files = base_files()
    files["svc.yaml"] = SERVICE.replace(
        "endpoints: [{address: 127.0.0.1}]",
        "endpoints: [{address: 127.0.0.1, grpcPort: 8081, sidecar: {port: 15080}}]",
    )
    files["fn.yaml"] = doc("Function", "  backend: echo\n  protocols: {grpc: false}\n", name="a")
    model = load_policies(write(tmp_path, files))
    routes = {r.name for r in model.workloads[0].listeners[0].routes}
    # no function wants gRPC; OpenAI's API (by the body's model, and the model list) is REST
    assert routes == {"echo", "function-a", "openai-a", "kserve-server", "openai-models"}
    files["fn.yaml"] += "---\n" + doc(
        "Function", "  backend: echo\n  protocols: {rest: false}\n", name="b"
    )
    model = load_policies(write(tmp_path, files))
    gateway = model.workloads[0]
    assert {r.name for r in gateway.listeners[0].routes} == {
        "echo", "function-a", "openai-a", "kserve-server", "openai-models", "kserve-grpc",
    }  # fmt: skip
    (sidecar,) = [w for w in model.workloads if w.inbound is not None]
    assert sidecar.inbound is not None and sidecar.inbound.grpc_app_port == 8081
    (guard,) = [p for p in sidecar.authz if p.name.endswith("meshfn-kserve-repository")]
    assert guard.action == "DENY" and gateway.authz == ()  # the sidecars hold it


def test_unknown_key_that_looks_like_a_tag(tmp_path: Path) -> None:
    """`spec:[x` (no space after the colon) is a key, however much it looks like one of
    pydantic's location tags (fuzz finding policy/unknown-key-like-a-pydantic-tag)."""
    extra = "apiVersion: meshfn.io/v1alpha1\nkind: Service\nmetadata: {name: s}\nspec:[x: 1\n"
    errors = errors_for(tmp_path, extra)
    unknown = [e for e in errors if "unknown field" in e.message]
    assert [(e.line, e.path) for e in unknown] == [(4, "spec:[x")], errors
    assert "(did you mean 'spec'?)" in unknown[0].message


def with_mesh_spec(extra: str) -> dict[str, str]:
    """The base files with `extra` (flow YAML) added to the Mesh's spec."""
    files = base_files()
    ports = "ports: {xds: 18000, admin: 18001}"
    files["mesh.yaml"] = MESH.replace(ports + "}", f"{ports}, {extra}}}") + "---\n" + GATEWAY
    return files


def test_a_bare_yaml_off_is_the_word_off_in_every_field_that_has_it(tmp_path: Path) -> None:
    """YAML 1.1 reads `off` as false; `acceleration: off` (the Mesh) and `warmup: {mode: off}`
    (a Function) were refused with "should be ... 'off' ..." for the word the user wrote."""
    files = with_mesh_spec("acceleration: off")
    files["fn.yaml"] = doc("Function", "  backend: echo\n  warmup: {mode: off}\n")
    model = load_policies(write(tmp_path, files))
    assert model.acceleration == "off"
    (function,) = model.functions
    assert function.settings.warmup.mode == "off"
    # true is no word of these fields: still refused, naming the words
    files["fn.yaml"] = doc("Function", "  backend: echo\n  warmup: {mode: on}\n")
    (tmp_path / "on").mkdir()
    errors = errors_for(tmp_path / "on", files["fn.yaml"])
    assert any("'off', 'reactive' or 'predictive'" in e.message for e in errors), errors


def test_sandbox_modes_and_egress_peers_reach_the_ir(tmp_path: Path) -> None:
    # a bare YAML `off` is read as false: for a sandbox layer it means "off"
    files = with_mesh_spec("sandbox: {landlock: off, seccomp: required}")
    files["fn.yaml"] = doc("Function", "  backend: echo\n  egress: [{service: default/echo}]\n")
    model = load_policies(write(tmp_path, files))
    assert model.sandbox == ir.Sandbox(landlock="off", seccomp="required", egress="auto")
    (function,) = model.functions
    assert function.egress == ("default/echo",)
