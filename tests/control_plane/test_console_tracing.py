"""The console's service graph, trace pages and /debug/traces with a real ControlPlane and a
real aiohttp server: figures from the proxies' statistics, fallback and degraded marks, links
to traces, escaping of hostile span content, filters, and the admin guard on every new page (viewers see no audit records)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from meshfn import ir
from meshfn.audit import layout
from meshfn.common.adminauth import VIEWER, AdminTokens, admin_headers, key_path
from meshfn.control_plane.runtime.admin import AdminServer
from meshfn.control_plane.runtime.console.graph import (
    ProxyMetrics,
    ProxyStats,
    Rates,
    build_graph,
    graph_svg,
    parse_stats,
)
from meshfn.control_plane.runtime.console.sources import AuditView, ConsoleSources
from meshfn.control_plane.runtime.traces import Span, TraceStore
from meshfn.control_plane.service import ControlPlane
from meshfn.testing import policies as p

HOSTILE = "<img src=x onerror=alert(1)>"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _policies(root: Path) -> Path:
    """A gateway, a service behind sidecars with a fallback, one route; tracing on."""
    root.mkdir(parents=True, exist_ok=True)
    p.write(
        root / "mesh.yaml",
        p.documents(
            p.mesh("m", "m.local", tracing={"collector": {"host": "127.0.0.1", "port": 4317}}),
            p.gateway(None, 10000),
            p.service("models", 9000, [p.endpoint(sidecar=15000)]),
            p.service("lite", 9001, [p.endpoint(sidecar=15001)]),
            p.doc("FallbackPolicy", "models", {"service": "models", "chain": ["lite"]}),
            p.route("main", "models"),
        ),
    )
    return root


def _stats(total: int, errors: int, p50: float, p99: float, cluster: str) -> dict[str, object]:
    """Envoy's /stats?format=json for one upstream cluster and the edge listener."""
    return {
        "stats": [
            {"name": f"cluster.{cluster}.upstream_rq_total", "value": total},
            {"name": f"cluster.{cluster}.upstream_rq_5xx", "value": errors},
            {"name": f"cluster.{cluster}.ssl.handshake", "value": 2},
            {"name": "http.http.downstream_rq_total", "value": total},
            {"name": "http.http.downstream_rq_5xx", "value": errors},
            {
                "histograms": {
                    "supported_quantiles": [0, 25, 50, 75, 90, 95, 99, 99.5, 99.9, 100],
                    "computed_quantiles": [
                        {
                            "name": f"cluster.{cluster}.upstream_rq_time",
                            "values": [
                                {"interval": None, "cumulative": v}
                                for v in (0, 1, p50, 3, 4, 5, p99, 7, 8, 9)
                            ],
                        }
                    ],
                }
            },
        ]
    }


def _rates(cluster: str) -> Rates:
    rates = Rates()
    for at, total, errors in ((100.0, 0, 0), (105.0, 50, 5)):
        counters, quantiles = parse_stats(_stats(total, errors, 2.5, 40.0, cluster))
        rates.record("edge.default", counters, quantiles, at)
    return rates


def test_the_graph_has_rates_errors_latency_and_mtls_from_the_proxies_statistics(
    tmp_path: Path,
) -> None:
    model = _load(tmp_path)
    graph = build_graph(model, _rates("models.default"), None, frozenset(), {})
    edge = next(
        e for e in graph.edges if (e.source, e.target) == ("gw:default/edge", "svc:default/models")
    )
    assert edge.rps == pytest.approx(10.0) and edge.error_ratio == pytest.approx(0.1)
    assert (edge.p50_ms, edge.p99_ms, edge.security) == (2.5, 40.0, "mtls")
    assert edge.health == "bad" and not edge.fallback
    clients = next(e for e in graph.edges if e.source == "clients")
    assert clients.rps == pytest.approx(10.0)
    lite = next(e for e in graph.edges if e.target == "svc:default/lite")
    assert lite.fallback and not lite.active and lite.rps == 0.0
    kinds = {n.kind for n in graph.nodes}
    assert kinds == {"clients", "gateway", "service", "workload"}
    assert "svc:default/models" in {e.target for e in graph.edges}
    svg = str(graph_svg(graph))
    assert "10.0 rps · 10% err · p99 40ms" in svg and 'class="lock lock-mtls"' in svg
    assert 'href="/ui/traces?service=edge.default&amp;peer=models.default"' in svg


def test_fallback_in_use_and_degraded_routes_are_marked(tmp_path: Path) -> None:
    model = _load(tmp_path)
    graph = build_graph(
        model,
        _rates("lite.default"),
        None,
        frozenset({"default/main"}),
        {"default/models": "default/lite"},
    )
    lite = next(e for e in graph.edges if e.target == "svc:default/lite")
    assert lite.fallback and lite.active and lite.degraded
    assert graph.node("svc:default/models").marks == ("degraded", "serving from default/lite")
    svg = str(graph_svg(graph))
    assert "fallback in use, degraded" in svg and "edge-degraded" in svg and "mark-degraded" in svg


def test_a_rolled_out_functions_versions_count_on_its_services_edge(tmp_path: Path) -> None:
    """During a rollout the gateway sends the Function's requests through one twin of the
    service's cluster per version: the edge adds them up (and times them there)."""
    root = _policies(tmp_path / "p")
    p.write(
        root / "rollout.yaml",
        p.documents(
            p.doc("Function", "iris", {"backend": "models", "version": "1"}),
            p.doc(
                "Rollout",
                "iris-v2",
                {
                    "function": "iris",
                    "stable": "1",
                    "candidate": "2",
                    "canary": {"steps": [{"weight": 10}]},
                },
            ),
        ),
    )
    from meshfn.policy.loader import load_policies
    from meshfn.xds.names import version_cluster_name

    model = load_policies(root)
    rates = Rates()
    for at, total, errors in ((100.0, 0, 0), (105.0, 50, 5)):
        counters: dict[str, float] = {}
        quantiles: dict[str, tuple[float | None, float | None]] = {}
        for version in ("1", "2"):
            c, q = parse_stats(
                _stats(
                    total,
                    errors,
                    2.5,
                    40.0,
                    version_cluster_name("models.default", "iris", version),
                )
            )
            counters.update({k: counters.get(k, 0) + v for k, v in c.items()})
            quantiles.update(q)
        rates.record("edge.default", counters, quantiles, at)
    graph = build_graph(model, rates, None, frozenset(), {})
    edge = next(
        e for e in graph.edges if (e.source, e.target) == ("gw:default/edge", "svc:default/models")
    )
    assert edge.rps == pytest.approx(20.0) and edge.error_ratio == pytest.approx(0.1)
    assert (edge.p50_ms, edge.p99_ms, edge.security) == (2.5, 40.0, "mtls")


def _tracer_stats(sent: int, connect_fail: int, timeouts: int, errors: int) -> dict[str, object]:
    """Envoy's /stats?format=json: its tracer's and its meshfn-otlp cluster's counters."""
    return {
        "stats": [
            {"name": "tracing.opentelemetry.spans_sent", "value": sent},
            {"name": "cluster.meshfn-otlp.upstream_cx_connect_fail", "value": connect_fail},
            {"name": "cluster.meshfn-otlp.upstream_rq_timeout", "value": timeouts},
            {"name": "cluster.meshfn-otlp.upstream_rq_5xx", "value": errors},
            {"name": "cluster.meshfn-otlp.upstream_rq_total", "value": 99},
        ]
    }


def test_connections_refused_at_the_limit_are_counted_per_proxy() -> None:
    """Each proxy's listeners' downstream_global_cx_overflow, summed: a counter in /metrics for
    every proxy read (0 included), and in `meshfn status` the proxies that refused any."""
    proxies = ProxyStats(lambda: {})
    registry = CollectorRegistry()
    registry.register(ProxyMetrics(proxies))
    overflow = {
        "stats": [
            {"name": "listener.0.0.0.0_10000.downstream_global_cx_overflow", "value": 3},
            {"name": "listener.127.0.0.1_9443.downstream_global_cx_overflow", "value": 2},
            {"name": "http.http.downstream_rq_total", "value": 40},
        ]
    }
    for group, document in (("edge.ingress", overflow), ("alpha.default", _stats(5, 0, 1, 2, "x"))):
        counters, quantiles = parse_stats(document)
        proxies.rates.record(group, counters, quantiles, 1.0)

    def refused(proxy: str) -> float | None:
        return registry.get_sample_value("meshfn_proxy_connections_refused_total", {"proxy": proxy})

    assert refused("edge.ingress") == 5 and refused("alpha.default") == 0
    assert proxies.connection_status() == [{"proxy": "edge.ingress", "connections_refused": 5}]


def test_the_proxies_span_exports_are_counters_in_metrics_as_last_fetched() -> None:
    """/metrics shows what `meshfn status` shows per proxy, from the latest recorded sample:
    a scrape fetches nothing (the sockets are never asked for), a proxy without a tracer is
    not listed."""

    def no_fetch() -> dict[str, Path]:
        raise AssertionError("a scrape must not fetch the proxies' statistics")

    proxies = ProxyStats(no_fetch)
    registry = CollectorRegistry()
    registry.register(ProxyMetrics(proxies))
    assert "{proxy=" not in generate_latest(registry).decode()  # nothing fetched yet
    samples = {
        "edge.default": [(100.0, _tracer_stats(10, 0, 0, 0)), (105.0, _tracer_stats(40, 2, 1, 1))],
        "alpha.default:15000": [(105.0, _tracer_stats(7, 0, 0, 0))],
        "beta.default": [(105.0, _stats(5, 0, 1.0, 2.0, "beta.default"))],  # no tracer
    }
    for group, recorded in samples.items():
        for at, document in recorded:
            counters, quantiles = parse_stats(document)
            proxies.rates.record(group, counters, quantiles, at)

    def value(name: str, proxy: str) -> float | None:
        return registry.get_sample_value(name, {"proxy": proxy})

    assert value("meshfn_proxy_trace_spans_sent_total", "edge.default") == 40
    assert value("meshfn_proxy_trace_exports_failed_total", "edge.default") == 4
    assert value("meshfn_proxy_trace_spans_sent_total", "alpha.default:15000") == 7
    assert value("meshfn_proxy_trace_exports_failed_total", "alpha.default:15000") == 0
    assert value("meshfn_proxy_trace_spans_sent_total", "beta.default") is None
    text = generate_latest(registry).decode()
    assert "# TYPE meshfn_proxy_trace_exports_failed_total counter" in text
    assert 'meshfn_proxy_trace_exports_failed_total{proxy="edge.default"} 4.0' in text
    # the same figures as meshfn status's
    assert {
        (x["proxy"], x["spans_sent"], x["failed_exports"]) for x in proxies.export_status()
    } == {("edge.default", 40, 4), ("alpha.default:15000", 7, 0)}


def _load(tmp_path: Path) -> ir.MeshModel:
    from meshfn.policy.loader import load_policies

    return load_policies(_policies(tmp_path / "p"))


def _store() -> TraceStore:
    store = TraceStore()
    spans = [
        Span(TRACE, "0000000000000001", "", f"GET {HOSTILE}", "edge.default", "server", 1_000_000, 9_000_000,
             {"meshfn.route": "default/main", "peer": HOSTILE}),
        Span(TRACE, "0000000000000002", "0000000000000001", "GET models.default", "models.default",
             "server", 2_000_000, 8_000_000, {}),
        Span(TRACE, "0000000000000003", "0000000000000002", "infer iris", "models.default inference",
             "server", 3_000_000, 7_000_000, {"meshfn.model": "iris", "http.response.status_code": 503},
             links=[("0af7651916cd43dd8448eb211c80319c", "00f067aa0ba902b7")]),
    ]  # fmt: skip
    store.add(spans)
    store.add(
        [Span("1" * 32, "0000000000000009", "", "GET /other", "edge.default", "server", 1, 2, {})]
    )
    return store


@pytest.fixture
async def console(tmp_path: Path) -> AsyncIterator[str]:
    cp = ControlPlane(_policies(tmp_path / "p"), tmp_path / "state")
    assert (await cp.reload()).ok
    proxies = ProxyStats(dict)
    proxies.rates = _rates("models.default")
    server = AdminServer(cp, ConsoleSources(traces=_store(), proxies=proxies))
    port = await server.start()
    OWNER.update(admin_headers(cp.state_dir))
    yield f"http://127.0.0.1:{port}"
    await server.stop()


OWNER: dict[str, str] = {}  # the owner's admin token (an auditor), once the console runs


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers=OWNER if headers is None else headers) as reply,
    ):
        return reply.status, await reply.text()


async def test_the_console_draws_the_graph_and_opens_traces_from_it(console: str) -> None:
    status, page = await _get(console + "/ui")
    assert status == 200 and '<svg class="graph"' in page and 'id="graph"' in page
    assert 'data-edge="gw:default/edge&gt;svc:default/models"' in page
    status, listing = await _get(console + "/ui/traces?service=edge.default&peer=models.default")
    assert status == 200 and f"/ui/traces/{TRACE}" in listing and "1" * 32 not in listing
    assert HOSTILE not in listing and "&lt;img src=x" in listing
    status, listing = await _get(console + "/ui/traces?model=iris&status=error")
    assert f"/ui/traces/{TRACE}" in listing
    status, detail = await _get(f"{console}/ui/traces/{TRACE}")
    assert status == 200 and '<svg class="waterfall"' in detail
    assert HOSTILE not in detail and "&lt;img src=x onerror=alert(1)&gt;" in detail
    # waterfall order: the gateway, the sidecar under it, the backend under that
    order = re.findall(r'data-span="(0{15}\d)"', detail)
    assert order[:3] == ["0000000000000001", "0000000000000002", "0000000000000003"]
    assert "/ui/traces/0af7651916cd43dd8448eb211c80319c" in detail  # a batch's linked trace
    assert "The audit trail is off" in detail
    assert (await _get(console + "/ui/traces/" + "f" * 32))[0] == 404
    assert (await _get(console + "/ui/traces/not-a-trace"))[0] == 404
    assert (await _get(console + "/ui/traces?min_duration=soon"))[0] == 400


async def test_debug_traces_filters_and_refuses_bad_ones(console: str) -> None:
    async with aiohttp.ClientSession(headers=OWNER) as session:
        async with session.get(console + "/debug/traces", params={"route": "default/"}) as r:
            document = await r.json()
        assert [t["trace_id"] for t in document["traces"]] == [TRACE]
        assert document["traces"][0]["status"] == "error" and document["store"]["traces"] == 2
        async with session.get(console + "/debug/traces", params={"min_duration": "9ms"}) as r:
            assert (await r.json())["traces"] == []
        async with session.get(console + f"/debug/traces/{TRACE}") as r:
            spans = (await r.json())["span_list"]
        assert [s["service"] for s in spans] == [
            "edge.default",
            "models.default",
            "models.default inference",
        ]
        for bad in ({"status": "maybe"}, {"limit": "0"}, {"bogus": "1"}, {"route": "\x01"}):
            async with session.get(console + "/debug/traces", params=bad) as r:
                assert r.status == 400, bad
        async with session.get(console + "/debug/traces/xyz") as r:
            assert r.status == 400


async def test_the_admin_guard_covers_the_trace_pages_and_viewers_see_no_records(
    tmp_path: Path,
) -> None:
    """Every trace page and /debug/traces needs a credential; a viewer sees traces but not
    the audit records a trace's page shows an auditor."""
    cp = ControlPlane(_policies(tmp_path / "p"), tmp_path / "state")
    assert (await cp.reload()).ok
    state = tmp_path / "state"
    audit = AuditView(lambda: layout.store_path(state), state)
    server = AdminServer(cp, ConsoleSources(traces=_store(), audit=audit))
    port = await server.start()
    url = f"http://127.0.0.1:{port}"
    viewer = AdminTokens(key_path(state)).issue("vera", VIEWER, timedelta(minutes=5))
    try:
        for path in (
            "/ui/traces",
            f"/ui/traces/{TRACE}",
            "/debug/traces",
            f"/debug/traces/{TRACE}",
        ):
            assert (await _get(url + path, {}))[0] == 401, path
            status, _ = await _get(url + path, {"Authorization": f"Bearer {viewer}"})
            assert status == 200, path
            assert (await _get(url + path, admin_headers(state)))[0] == 200, path
        _, page = await _get(f"{url}/ui/traces/{TRACE}", {"Authorization": f"Bearer {viewer}"})
        assert 'id="audit-restricted"' in page and "audit-records" not in page
        _, page = await _get(f"{url}/ui/traces/{TRACE}", admin_headers(state))
        assert 'id="audit-restricted"' not in page and "audit-records" in page
    finally:
        await server.stop()
