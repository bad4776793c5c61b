"""Translator properties beyond the golden files: memoisation on IR objects, scoping, ordering."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.extensions.matching.input_matchers.runtime_fraction.v3 import runtime_fraction_pb2
from envoy.type.matcher.v3 import http_inputs_pb2
from google.protobuf.message import Message

from meshfn import ir
from meshfn.contracts.qos import TENANT_HEADER
from meshfn.policy import load_policies
from meshfn.xds.fragments.messages import pack
from meshfn.xds.names import CLUSTER, ENDPOINT, LISTENER, ROUTE
from meshfn.xds.translate import OFFLINE_HOST, httpfilters, listeners, routes, sidecar, translate
from meshfn.xds.translate.httpfilters import FilterContext, HttpFilter, tracing
from meshfn.xds.translate.resources import Resources

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


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
    from meshfn.xds.fragments.routes import route_match as _match

    one = _match(ir.RouteMatch(ir.PathMatch("prefix", "/"), methods=("POST",)))
    assert one.headers[0].name == ":method" and one.headers[0].string_match.exact == "POST"
    two = _match(ir.RouteMatch(ir.PathMatch("prefix", "/"), methods=("GET", "POST")))
    assert two.headers[0].string_match.safe_regex.regex == "GET|POST"


GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_every_resource_is_memoised_with_filters_that_touch_routes() -> None:
    """The audit filter in jwt_headers mode and the combined plugin add early header mutations,
    route header removals and an ECDS resource: an equal IR still yields identical messages."""
    for case, node in (("audit_drift", "edge.default"), ("audit", "llm.default:15001")):
        first = translate(load_policies(GOLDEN / case / "in.yaml"), node)
        second = translate(load_policies(GOLDEN / case / "in.yaml"), node)
        assert first is not None and second is not None
        assert first.keys() == second.keys()
        for type_url, by_name in first.items():
            for name, message in by_name.items():
                assert second[type_url][name] is message, (case, type_url, name)


class _Stamp(HttpFilter[FilterContext]):
    """A filter a change might add: one entry, one header the routes remove, one cluster."""

    def config(self, ctx: FilterContext) -> FilterContext | None:
        return ctx if ctx.jwt_rules else None

    def http_filters(self, ctx: FilterContext, config: FilterContext) -> Iterable[hcm.HttpFilter]:
        return (hcm.HttpFilter(name="test.stamp", typed_config=pack(router_pb2.Router())),)

    def request_headers_to_remove(self, ctx: FilterContext, config: FilterContext) -> Iterable[str]:
        return ("x-test-stamp",)

    def resources(
        self, ctx: FilterContext, config: FilterContext, overlay: ir.Overlay
    ) -> Resources:
        return {CLUSTER: {"stamp": cluster_pb2.Cluster(name="stamp")}}


def _clear_caches() -> None:
    for cached in (
        listeners.listener,
        sidecar.inbound_listener,
        routes.route_configuration,
        httpfilters.request_headers_to_remove,
        httpfilters.resources,
    ):
        cached.cache_clear()


@pytest.fixture
def stamped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registry with _Stamp before the router: the one line a new filter adds."""
    registry = list(httpfilters.HTTP_FILTERS)
    registry.insert(len(registry) - 1, _Stamp())
    monkeypatch.setattr(httpfilters, "HTTP_FILTERS", tuple(registry))
    _clear_caches()
    yield
    monkeypatch.undo()
    _clear_caches()


def _chains(listener: Message) -> list[tuple[list[str], list[str]]]:
    """(filter names, route headers removed) of each connection manager of `listener`."""
    assert isinstance(listener, listener_pb2.Listener)
    out = []
    chains = [*listener.filter_chains]
    if listener.HasField("default_filter_chain"):
        chains.append(listener.default_filter_chain)
    for chain in chains:
        manager = hcm.HttpConnectionManager()
        chain.filters[0].typed_config.Unpack(manager)
        removed = list(manager.route_config.request_headers_to_remove)
        out.append(([f.name for f in manager.http_filters], removed))
    return out


@pytest.mark.usefixtures("stamped")
def test_a_registered_filter_reaches_gateways_and_sidecars() -> None:
    model = load_policies(GOLDEN / "jwt-authz" / "in.yaml")
    gateway = translate(model, "edge.default")
    sidecar = translate(model, "llm.models:15001")
    assert gateway is not None and sidecar is not None
    ((names, _),) = _chains(gateway[LISTENER]["http"])
    assert names == [
        "meshfn.whole_small_bodies",
        "envoy.filters.http.jwt_authn",
        "meshfn.authz.allow",
        "test.stamp",
        "envoy.filters.http.router",
    ]
    routes_removed = gateway[ROUTE]["http"]
    assert isinstance(routes_removed, route_pb2.RouteConfiguration)
    assert list(routes_removed.request_headers_to_remove) == ["x-test-stamp"]
    for names, removed in _chains(sidecar[LISTENER]["inbound"]):
        assert names[-2:] == ["test.stamp", "envoy.filters.http.router"]
        assert removed == ["x-test-stamp"]
    assert "stamp" in gateway[CLUSTER] and "stamp" in sidecar[CLUSTER]


def test_without_the_filter_nothing_of_it_remains() -> None:
    """`stamped` leaves no trace: the registry and the memoised builders are as they were."""
    model = load_policies(GOLDEN / "jwt-authz" / "in.yaml")
    gateway = translate(model, "edge.default")
    assert gateway is not None
    ((names, _),) = _chains(gateway[LISTENER]["http"])
    assert "test.stamp" not in names and "stamp" not in gateway[CLUSTER]


def test_dumps_redact_the_subject_salt_wherever_it_travels(tmp_path: Path) -> None:
    """The salt reaches Envoy inside the audit filter (listeners) or the combined audit+degrade
    plugin (ECDS extension configs): neither may show it in a config dump."""
    from meshfn.contracts.plugins import SubjectSalt
    from meshfn.xds.dump import REDACTED, resources_to_plain, to_yaml
    from meshfn.xds.translate import ProxyHost

    salt = SubjectSalt("5a" * 32)
    host = ProxyHost(tmp_path / "wasm", tmp_path, salt)
    seen = 0
    # the combined plugin on a gateway (audit_drift), the audit filter on sidecars (audit)
    cases = [
        load_policies(Path(__file__).resolve().parents[1] / "golden" / c / "in.yaml")
        for c in ("audit_drift", "audit")
    ]
    for model, workload in ((m, w) for m in cases for w in m.workloads):
        resources = translate(model, workload.node_cluster, host=host)
        assert resources is not None
        raw = str({t: [str(m) for m in r.values()] for t, r in resources.items()})
        if salt.hex not in raw:
            continue
        seen += 1
        dumped = to_yaml(resources_to_plain(resources))
        assert salt.hex not in dumped
        assert REDACTED in dumped
    assert seen >= 2


SMALL_LENGTH_CASES = ("", "-1", "1e3", " 12", "12 ", "0x10", "99999999999", "65537")


def test_small_bodies_are_exactly_those_up_to_the_limit() -> None:
    """The matcher's regex, matched whole, admits every decimal Content-Length up to
    WHOLE_BODY_BYTES and nothing else: a larger or malformed one streams as before. Checked
    exhaustively with Python's `re`, which reads this pattern (digit classes, counted
    repetition, alternation: no syntax where the two differ) as RE2 does; Envoy's own RE2
    gives the same verdicts in test_envoy_re2_agrees_on_small_bodies."""
    import re

    from meshfn.contracts.proxy import SMALL_CONTENT_LENGTH, WHOLE_BODY_BYTES

    small = re.compile(SMALL_CONTENT_LENGTH)
    assert all(small.fullmatch(str(n)) for n in range(WHOLE_BODY_BYTES + 1))
    assert not any(small.fullmatch(str(n)) for n in range(WHOLE_BODY_BYTES + 1, 10**6, 7))
    for bad in SMALL_LENGTH_CASES:
        assert not small.fullmatch(bad), bad


def test_each_filter_unit_emits_only_its_own_configuration(tmp_path: Path) -> None:
    """Audit alone: its filter and its access log. Degrade alone: its ECDS slot and config.
    Both: the combined plugin's slot in the audit filter's place and its config; the audit
    unit keeps its access log and the degrade unit adds nothing."""
    from meshfn.contracts.plugins import AuditSettings
    from meshfn.xds.names import EXTENSION
    from meshfn.xds.translate.httpfilters.audit import Audit
    from meshfn.xds.translate.httpfilters.base import AuditConfig, DegradeConfig
    from meshfn.xds.translate.httpfilters.degrade import Degrade
    from meshfn.xds.translate.httpfilters.plugin import Plugin

    settings = AuditSettings(subject_salt="12" * 20, salt_id="k1", subject_source="jwt_authn")
    audit = AuditConfig(settings, tmp_path / "journal", tmp_path)
    degrade = DegradeConfig("http", (("default/chat", ("default/chat/0",)),), None, tmp_path)
    overlay = ir.Overlay()

    def emitted(ctx: FilterContext) -> dict[str, tuple[list[str], int, list[str]]]:
        """Per unit that applies: its filters, access logs and ECDS resources."""
        out = {}
        for unit in (Audit(), Plugin(), Degrade()):
            config = unit.config(ctx)
            if config is not None:
                out[type(unit).__name__] = (
                    [f.name for f in unit.http_filters(ctx, config)],
                    len(list(unit.access_logs(ctx, config))),
                    list(unit.resources(ctx, config, overlay).get(EXTENSION, {})),
                )
        return out

    assert emitted(FilterContext(audit=audit)) == {"Audit": (["meshfn.meshfn_audit"], 1, [])}
    assert emitted(FilterContext(degrade=degrade)) == {
        "Degrade": (["meshfn.degrade.http"], 0, ["meshfn.degrade.http"])
    }
    assert emitted(FilterContext(audit=audit, degrade=degrade)) == {
        "Audit": ([], 1, []),
        "Plugin": (["meshfn.plugin.http"], 0, ["meshfn.plugin.http"]),
    }


@pytest.mark.envoy  # starts a real Envoy: never part of ./dev.sh unit
def test_envoy_re2_agrees_on_small_bodies(tmp_path: Path) -> None:
    """The whole-small-bodies matcher's value match (contracts.proxy: RE2, matched whole), as a
    real Envoy applies it to a header: a route on `x-len` with that very StringMatcher answers
    "small", the next "other". Its verdicts on the limits of every alternative, numbers around
    them, a seeded sample up to 200,000 and malformed values equal Python's (above)."""
    import random
    import re
    import socket

    from meshfn.contracts.proxy import SMALL_CONTENT_LENGTH, WHOLE_BODY_BYTES, WHOLE_SMALL_BODIES
    from meshfn.testing import envoy
    from meshfn.testing.ports import free_ports
    from meshfn.testing.processes import Processes, wait_for

    matcher = WHOLE_SMALL_BODIES["typed_config"]["xds_matcher"]["matcher_list"]["matchers"][0]
    value_match = matcher["predicate"]["not_matcher"]["single_predicate"]["value_match"]
    assert value_match["safe_regex"]["regex"] == SMALL_CONTENT_LENGTH

    def answer(name: str, header: dict[str, Any] | None = None) -> dict[str, Any]:
        match: dict[str, Any] = {"prefix": "/"}
        if header is not None:
            match["headers"] = [header]
        return {"match": match, "direct_response": {"status": 200, "body": {"inline_string": name}}}

    port, admin = free_ports(2)
    routes = [answer("small", {"name": "x-len", "string_match": value_match}), answer("other")]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "re2",
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
    address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "http",
                    "address": address,
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
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    limits = [9, 10, 9999, 10000, 19999, 20000, 59999, 60000, 64999, 65000, 65499, 65500]
    limits += [65529, 65530, WHOLE_BODY_BYTES, 99999, 100000, 10**6]
    numbers = set(range(0, 200)) | {n + d for n in limits for d in (-1, 0, 1)}
    numbers |= set(random.Random(7).sample(range(200_000), 400))
    # Header values Envoy keeps as they are (its codec trims surrounding spaces: not sent)
    values = [str(n) for n in sorted(numbers)] + [v for v in SMALL_LENGTH_CASES if v.strip() == v]
    values += ["0000", "00000", "065536", "+1", "1.5", "12a"]
    procs = Processes(tmp_path)
    try:
        proc = procs.start("envoy", envoy.argv(path))
        wait_for("envoy live", lambda: envoy.live(admin), timeout=30, proc=proc)
        verdicts = {}
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            reader = sock.makefile("rb")
            for value in values:
                sock.sendall(f"GET / HTTP/1.1\r\nhost: x\r\nx-len: {value}\r\n\r\n".encode())
                status = reader.readline()
                length = 0
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, field = line.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(field)
                assert status.startswith(b"HTTP/1.1 200"), (value, status)
                verdicts[value] = reader.read(length).decode()
    finally:
        procs.stop_all()
    small = re.compile(SMALL_CONTENT_LENGTH)
    expected = {v: "small" if small.fullmatch(v) else "other" for v in values}
    assert verdicts == expected, {v: verdicts[v] for v in values if verdicts[v] != expected[v]}
    assert verdicts["65536"] == "small" and verdicts["65537"] == "other"


def test_a_sidecar_reaches_an_application_on_unix_sockets_where_the_host_says_so() -> None:
    """`meshfn up` serves what runs behind a sidecar on unix sockets (ProxyHost.app_sockets):
    the sidecar's local clusters then have `pipe` endpoints, one per serving process, under the
    same names; without them (offline, `meshfn serve`) the endpoint's own port."""
    model = load_policies(EXAMPLES)
    node = next(w.node_cluster for w in model.workloads if w.name == "models")
    inbound = model.workload(node).inbound  # type: ignore[union-attr]
    assert inbound is not None and inbound.grpc_app_port is not None
    offline = translate(model, node)
    assert offline is not None
    http_name = sidecar.local_cluster_name(inbound)
    grpc_name = f"inbound|{inbound.grpc_app_port}"
    for name, port in ((http_name, inbound.app_port), (grpc_name, inbound.grpc_app_port)):
        (lb,) = offline[CLUSTER][name].load_assignment.endpoints[0].lb_endpoints
        assert lb.endpoint.address.socket_address.port_value == port

    sockets = {
        (inbound.address, inbound.app_port): ("/s/http.0.sock", "/s/http.1.sock"),
        (inbound.address, inbound.grpc_app_port): ("/s/grpc.0.sock", "/s/grpc.1.sock"),
    }
    host = dataclasses.replace(OFFLINE_HOST, app_sockets=tuple(sockets.items()))
    local = translate(model, node, host=host)
    assert local is not None
    for name, port in ((http_name, inbound.app_port), (grpc_name, inbound.grpc_app_port)):
        cluster = local[CLUSTER][name]
        paths = [
            lb.endpoint.address.pipe.path
            for lb in cluster.load_assignment.endpoints[0].lb_endpoints
        ]
        assert paths == list(sockets[(inbound.address, port)])
        assert cluster.type == cluster_pb2.Cluster.STATIC
    # gRPC still speaks HTTP/2 to its socket; nothing else of the sidecar changes
    assert local[CLUSTER][grpc_name].typed_extension_protocol_options
    assert local[LISTENER] == offline[LISTENER]
    # another sidecar (echo) is not named: its port
    echo = next(w.node_cluster for w in model.workloads if w.name == "echo")
    echo_clusters = translate(model, echo, host=host)
    assert echo_clusters is not None
    address = echo_clusters[CLUSTER]["inbound|9201"].load_assignment.endpoints[0].lb_endpoints[0]
    assert address.endpoint.address.socket_address.port_value == 9201


NO_ROUTE_SAMPLING = ("  tracing: {sampling: 20}\n", "")  # refused where a gateway honors


def _split_case(tmp_path: Path, *replace: tuple[str, str]) -> Resources:
    """golden/tracing-split's sidecar, translated from its policy with texts replaced."""
    text = (GOLDEN / "tracing-split" / "in.yaml").read_text()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new, 1)
    (tmp_path / "in.yaml").write_text(text)
    resources = translate(load_policies(tmp_path / "in.yaml"), "models.default:15101")
    assert resources is not None
    return resources


@pytest.mark.parametrize(
    ("replace", "split"),
    [
        ((), True),  # 5%, a route at 20%: every caller samples little
        ((("    sampling: 5\n", "    sampling: 24.9\n"),), True),
        ((("    sampling: 5\n", "    sampling: 25\n"),), False),
        ((("tracing: {sampling: 20}", "tracing: {sampling: 25}"),), False),  # one route will do
        # a gateway that honors its clients traces what they ask, up to all of it
        (
            (("spec: {listeners:", "spec: {tracing: {clientContext: honor}, listeners:"),
             NO_ROUTE_SAMPLING),
            False,
        ),
        ((("    sampling: 5\n", "    sampling: 5\n    clientContext: honor\n"), NO_ROUTE_SAMPLING),
         False),
    ],
)  # fmt: skip
def test_a_sidecar_traces_on_an_internal_listener_while_every_caller_samples_little(
    tmp_path: Path, replace: tuple[tuple[str, str], ...], split: bool
) -> None:
    resources = _split_case(tmp_path, *replace)
    mesh_rate = 249_000 if replace else 50_000  # per million
    listeners = resources[LISTENER]
    inbound = listeners["inbound"]
    manager = hcm.HttpConnectionManager()
    inbound.filter_chains[0].filters[0].typed_config.Unpack(manager)
    clusters = {c for _, route in _routes(manager) for c in [route.route.cluster]}
    # the internal listener is always there (a connection on an older configuration may use it)
    assert (
        set(listeners) == {"inbound", "meshfn-traced-inbound"}
        and "meshfn-traced-inbound" in resources[CLUSTER]
    )
    if not split:
        assert manager.HasField("tracing") and "meshfn-traced-inbound" not in clusters
        return
    assert not manager.HasField("tracing") and "meshfn-traced-inbound" in clusters
    inner = hcm.HttpConnectionManager()
    listeners["meshfn-traced-inbound"].filter_chains[0].filters[0].typed_config.Unpack(inner)
    assert listeners["meshfn-traced-inbound"].HasField("internal_listener")
    assert inner.tracing.random_sampling.value == 100.0
    assert [f.name for f in inner.http_filters] == [
        "envoy.filters.http.header_to_metadata",
        "envoy.filters.http.router",
    ]
    # the outer routes: sampled parent, then no parent at the mesh's rate, then the rest; each
    # drops a caller's carried tags, and the traced ones set their own
    routes = [route for _, route in _routes(manager)]
    assert [r.route.cluster for r in routes] == [
        "meshfn-traced-inbound",
        "meshfn-traced-inbound",
        "inbound|9101",
    ]
    sampled, unparented, _ = routes
    assert sampled.match.headers[-1].string_match.safe_regex.regex == ".*-[0-9a-f][13579bdf]"
    # no parent and no split gateway's mark that it chose not to sample
    assert [(h.name, h.invert_match) for h in unparented.match.headers] == [
        ("traceparent", True),
        (tracing.UNSAMPLED, True),
    ]
    assert unparented.match.runtime_fraction.default_value.numerator == mesh_rate
    carried = {h.header.key for h in sampled.request_headers_to_add}
    assert carried == {"x-meshfn-span-meshfn-tenant", "x-meshfn-span-meshfn-principal"}
    for route in routes:  # the application never sees the mark
        assert set(route.request_headers_to_remove) == carried | {tracing.UNSAMPLED}


@pytest.mark.parametrize(
    ("replace", "split"),
    [
        ((), True),
        ((("    sampling: 5\n", "    sampling: 25\n"),), False),
        ((("tracing: {sampling: 20}", "tracing: {sampling: 25}"),), False),
    ],
)
def test_a_gateway_traces_on_an_internal_listener_while_every_caller_samples_little(
    tmp_path: Path, replace: tuple[tuple[str, str], ...], split: bool
) -> None:
    """Its own listener has no tracer. One draw per request from its request id, at the
    highest rate of its routes (the chat route's 20%), picks the routes it walks: under it,
    the twins, each in its route's place (the mesh's 5% drawn again: a quarter of the 20%), to
    the internal listener with the key of the route it stands for; else the routes
    themselves. There, on the same route table (one resource), the route of that key, looked
    up first in its virtual host: the route's action, name and tags, traced every time, and the
    trace id back in the answer, which the outer listener moves into metadata for its access
    logs (a filter only the twins turn on). The gateway's own listener drops a client's key
    before it routes. The route itself marks what it sends unsampled. The internal listener is
    there either way. The listener's early header mutations are one extension."""
    text = (GOLDEN / "tracing-split" / "in.yaml").read_text()
    for old, new in replace:
        text = text.replace(old, new, 1)
    (tmp_path / "in.yaml").write_text(text)
    resources = translate(load_policies(tmp_path / "in.yaml"), "edge.default")
    assert resources is not None
    manager = hcm.HttpConnectionManager()
    resources[LISTENER]["http"].filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert set(resources[LISTENER]) == {"http", "meshfn-traced-http"}
    assert set(resources[ROUTE]) == {"http"} and "meshfn-traced-http" in resources[CLUSTER]
    inner_listener = resources[LISTENER]["meshfn-traced-http"]
    assert inner_listener.HasField("internal_listener")
    inner = hcm.HttpConnectionManager()
    inner_listener.filter_chains[0].filters[0].typed_config.Unpack(inner)
    assert inner.rds.route_config_name == manager.rds.route_config_name == "http"
    assert len(manager.early_header_mutation_extensions) == 1
    dropped = {
        m.remove
        for early in manager.early_header_mutation_extensions
        for m in json_format_parse(early).mutations
    }
    assert {"traceparent", "x-request-id"} <= dropped
    table = resources[ROUTE]["http"]
    if not split:
        assert manager.HasField("tracing") and not inner.HasField("tracing")
        assert all(r.HasField("tracing") for h in table.virtual_hosts for r in h.routes)
        assert "x-meshfn-traced-route" not in dropped
        return
    assert not manager.HasField("tracing") and "x-meshfn-traced-route" in dropped
    answer_filter = manager.http_filters[0]
    assert answer_filter.name == tracing.TRACED_ANSWER_FILTER and answer_filter.disabled
    assert inner.tracing.random_sampling.value == 100.0 and inner.preserve_external_request_id
    answer = [
        "x-meshfn-trace-id",
        "x-meshfn-traced-cluster",
        "x-meshfn-traced-flags",
        "x-meshfn-traced-upstream",
    ]
    for host in table.virtual_hosts:
        assert not host.routes
        tree = host.matcher.matcher_tree
        key = http_inputs_pb2.HttpRequestHeaderMatchInput()
        tree.input.typed_config.Unpack(key)
        assert key.header_name == "x-meshfn-traced-route"
        by_key = {}
        for name, on_match in tree.exact_match_map.map.items():
            by_key[name] = rc.Route()
            on_match.action.typed_config.Unpack(by_key[name])
        draws = host.matcher.on_no_match.matcher
        plain = _route_list(draws.on_no_match)
        upstream = [r for r in plain if r.HasField("route")]
        assert len(upstream) == len(by_key) > 0
        (field,) = draws.matcher_list.matchers
        single = field.predicate.single_predicate
        request_id = http_inputs_pb2.HttpRequestHeaderMatchInput()
        single.input.typed_config.Unpack(request_id)
        assert request_id.header_name == "x-request-id"
        draw = runtime_fraction_pb2.RuntimeFraction()
        single.custom_match.typed_config.Unpack(draw)
        # per ten thousand: the highest rate (the chat route's 20%)
        assert draw.runtime_fraction.default_value.numerator == 2000
        assert draw.runtime_fraction.default_value.denominator == 1  # TEN_THOUSAND
        under = iter(_route_list(field.on_match))
        for route in plain:
            twin = next(under)
            if not route.HasField("route"):
                assert twin == route
                continue
            added = {h.header.key: h.header.value for h in twin.request_headers_to_add}
            inside = by_key[added["x-meshfn-traced-route"]]
            assert twin.name == route.name == inside.name
            assert twin.route.cluster == "meshfn-traced-http" and not twin.HasField("tracing")
            bare = rc.RouteMatch()
            bare.CopyFrom(twin.match)
            if route.name.startswith("default/chat"):
                assert not twin.match.HasField("runtime_fraction")
            else:  # the mesh's 5% is a quarter of the 20% drawn; its route after its twin
                share = twin.match.runtime_fraction.default_value
                assert (share.numerator, share.denominator) == (250_000, 2)  # MILLION
                bare.ClearField("runtime_fraction")
                assert next(under) == route
            assert bare == route.match
            assert tracing.UNSAMPLED in twin.request_headers_to_remove
            assert set(twin.typed_per_filter_config) - set(route.typed_per_filter_config) == {
                tracing.TRACED_ANSWER_FILTER
            }
        assert next(under, None) is None
        for route in upstream:
            inside = next(r for r in by_key.values() if r.name == route.name)
            assert not route.HasField("tracing") and route.route.cluster == "models.default"
            assert {h.header.key: h.header.value for h in route.request_headers_to_add}[
                tracing.UNSAMPLED
            ] == "1"
            assert list(route.response_headers_to_remove) == answer
            assert inside.route == route.route and inside.metadata == route.metadata
            assert inside.tracing.random_sampling.numerator == 10_000
            assert [(h.header.key, h.header.value) for h in inside.response_headers_to_add] == list(
                zip(
                    answer,
                    [
                        "%TRACE_ID%",
                        "%UPSTREAM_CLUSTER%",
                        "%RESPONSE_FLAGS%",
                        "%UPSTREAM_LOCAL_ADDRESS%",
                    ],
                    strict=True,
                )
            )
    # the answer's headers go into metadata, out of the client's sight
    h2m = header_to_metadata_pb2.Config()
    answer_filter.typed_config.Unpack(h2m)
    assert [(r.header, r.remove) for r in h2m.response_rules] == [(h, True) for h in answer]


def _route_list(on_match: Any) -> list[rc.Route]:
    found = rc.RouteList()
    on_match.action.typed_config.Unpack(found)
    return list(found.routes)


def json_format_parse(extension: Any) -> Any:
    """An early header mutation extension's HeaderMutation."""
    from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
        header_mutation_pb2,
    )

    found = header_mutation_pb2.HeaderMutation()
    extension.typed_config.Unpack(found)
    return found


def _routes(manager: hcm.HttpConnectionManager) -> Iterator[tuple[str, rc.Route]]:
    for host in manager.route_config.virtual_hosts:
        for route in host.routes:
            yield host.name, route


def test_a_gateway_listener_that_sheds_keeps_its_tracer_at_a_low_rate(tmp_path: Path) -> None:
    """golden/qos-shed traced at 5%: the gateway sheds the lower priorities itself, which its
    own listener answers; it stays unsplit (the tracer on its own listener, no twins)."""
    text = (GOLDEN / "qos-shed" / "in.yaml").read_text()
    old = "spec: {trustDomain: golden.local}"
    assert old in text
    tracing = "tracing: {sampling: 5, collector: {host: 127.0.0.1, port: 4317}}"
    (tmp_path / "in.yaml").write_text(
        text.replace(old, "spec: {trustDomain: golden.local, " + tracing + "}", 1)
    )
    resources = translate(load_policies(tmp_path / "in.yaml"), "edge.default")
    assert resources is not None
    manager = hcm.HttpConnectionManager()
    resources[LISTENER]["http"].filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert manager.HasField("tracing") and manager.tracing.random_sampling.value == 5.0
    hosts = resources[ROUTE]["http"].virtual_hosts
    assert hosts and all(h.routes and not h.HasField("matcher") for h in hosts)


@pytest.mark.parametrize("golden", ["qos-shed", "qos"])
def test_a_gateways_internal_listener_replies_as_its_own_listener_with_the_tenant_from_the_header(
    golden: str,
) -> None:
    """A request shed or rate limited behind the internal listener gets the gateway's own
    reply; only the verified tenant comes from the header jwt_authn wrote it into (the
    internal listener has no jwt_authn payload of its own), never from the payload there."""
    resources = translate(load_policies(GOLDEN / golden / "in.yaml"), "edge.default")
    assert resources is not None
    outer, inner = hcm.HttpConnectionManager(), hcm.HttpConnectionManager()
    for name, manager in (("http", outer), ("meshfn-traced-http", inner)):
        resources[LISTENER][name].filter_chains[0].filters[0].typed_config.Unpack(manager)
    payload = "%DYNAMIC_METADATA(envoy.filters.http.jwt_authn:"
    outer_text = str(outer.local_reply_config)
    assert payload in outer_text  # the QoS replies name the verified tenant
    inner_text = str(inner.local_reply_config)
    assert payload not in inner_text
    assert inner_text == re.sub(
        re.escape(payload) + r"[^%]*\)%", f"%REQ({TENANT_HEADER})%", outer_text
    )
