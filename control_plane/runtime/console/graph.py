"""The service graph (Kiali's main view for this mesh): gateways, services, workloads (each
endpoint's sidecar) and functions as nodes; the traffic between them as edges, each with its
requests per second, error ratio, p50 and p99 and whether it is mTLS, all from the Envoys' own
statistics (and, for the last hop, the backend's own counts), refreshed while someone watches.

A layered layout (clients | gateways | services | workloads | functions) computed here and drawn
as server-rendered SVG, as the drift chart is: no layout library, no script. Nodes and edges
are links to their recent traces; a degraded route and a fallback tier in use are marked.
Every text in the SVG is escaped here.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from meshfn import ir
from meshfn.health.drift import carrying_clusters
from meshfn.xds.names import primary_clusters

from .sources import Fetched, FunctionStats, _local_json

# The statistics each Envoy is asked for (RE2, whole names): request counts, errors and time per
# upstream cluster and per connection manager, TLS handshakes, the tracer's own counters, and
# the connections its listeners closed at the proxy's connection limit (bootstrap.py).
STATS_FILTER = (
    r"^(cluster\..+\.(upstream_rq_total|upstream_rq_5xx|upstream_rq_time|ssl\.handshake"
    r"|upstream_cx_connect_fail|upstream_rq_timeout)"
    r"|http\..+\.downstream_rq_(total|5xx|time)|tracing\..+"
    r"|listener\..+\.downstream_global_cx_overflow)$"
)
OVERFLOW = ".downstream_global_cx_overflow"
STATS_PATH = "/stats?format=json&usedonly&filter=" + urllib.parse.quote(STATS_FILTER)
WINDOW_S = 5.0  # rates over the last five seconds of samples
KEEP_S = 15.0
QUANTILES = (50.0, 99.0)

Counters = dict[str, float]
Quantiles = dict[str, tuple[float | None, float | None]]


def parse_stats(document: Mapping[str, Any]) -> tuple[Counters, Quantiles]:
    """Envoy's /stats?format=json -> counters and gauges by name, and each histogram's p50 and
    p99 (the last interval's, else since start)."""
    counters: Counters = {}
    quantiles: Quantiles = {}
    for entry in document.get("stats") or []:
        if "name" in entry and isinstance(entry.get("value"), int | float):
            counters[str(entry["name"])] = float(entry["value"])
            continue
        histograms = entry.get("histograms")
        if not isinstance(histograms, dict):
            continue
        supported = histograms.get("supported_quantiles") or []
        index = [supported.index(q) if q in supported else None for q in QUANTILES]
        for computed in histograms.get("computed_quantiles") or []:
            values = computed.get("values") or []

            def pick(i: int | None, values: list[Any] = values) -> float | None:
                if i is None or i >= len(values):
                    return None
                value = values[i].get("interval")
                if value is None:
                    value = values[i].get("cumulative")
                return float(value) if isinstance(value, int | float) else None

            quantiles[str(computed.get("name"))] = (pick(index[0]), pick(index[1]))
    return counters, quantiles


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic
    counters: Counters
    quantiles: Quantiles


class Rates:
    """Counters sampled over time, per source (a proxy, a backend function): rates over the
    last WINDOW_S seconds."""

    def __init__(self) -> None:
        self.samples: dict[str, deque[Sample]] = {}
        self.errors: dict[str, str] = {}

    def record(self, source: str, counters: Counters, quantiles: Quantiles, at: float) -> None:
        history = self.samples.setdefault(source, deque())
        history.append(Sample(at, counters, quantiles))
        while history and history[0].at < at - KEEP_S:
            history.popleft()
        self.errors.pop(source, None)

    def latest(self, source: str) -> Sample | None:
        history = self.samples.get(source)
        return history[-1] if history else None

    def rate(self, source: str, names: Iterable[str]) -> float | None:
        """Per second, summed over `names`, between the newest sample and the one closest to
        WINDOW_S before it; None before there are two samples."""
        history = self.samples.get(source)
        if not history or len(history) < 2:
            return None
        newest = history[-1]
        older = min((s for s in list(history)[:-1]), key=lambda s: abs(newest.at - WINDOW_S - s.at))
        span = newest.at - older.at
        if span <= 0:
            return None
        wanted = list(names)
        total = sum(newest.counters.get(n, 0.0) - older.counters.get(n, 0.0) for n in wanted)
        return max(0.0, total) / span

    def quantiles(self, source: str, names: Iterable[str]) -> tuple[float | None, float | None]:
        """The p50 and p99 of the busiest of `names` (histograms of one kind)."""
        sample = self.latest(source)
        if sample is None:
            return None, None
        found = [(n, sample.quantiles[n]) for n in names if n in sample.quantiles]
        if not found:
            return None, None
        busiest = max(found, key=lambda pair: sample.counters.get(_count_of(pair[0]), 0.0))
        return busiest[1]


def _count_of(histogram: str) -> str:
    """The request counter beside a request-time histogram (…rq_time -> …rq_total)."""
    return histogram.removesuffix("_time") + "_total"


class ProxyStats:
    """Every Envoy's statistics (`sockets()`: node cluster -> its admin socket), and the
    request counts of the backends' functions (`functions`, fetched just before)."""

    def __init__(
        self, sockets: Callable[[], dict[str, Path]], functions: FunctionStats | None = None
    ) -> None:
        self.sockets = sockets
        self.functions = functions
        self.rates = Rates()

    async def refresh(self, _session: Any = None) -> None:
        wanted = self.sockets()
        results: list[Fetched] = await asyncio.gather(
            *(_local_json(socket, STATS_PATH) for socket in wanted.values())
        )
        now = time.monotonic()
        for group, fetched in zip(wanted, results, strict=True):
            if fetched.error is not None:
                self.rates.errors[group] = fetched.error
                continue
            counters, quantiles = parse_stats(fetched.document)
            self.rates.record(group, counters, quantiles, now)
        for gone in {k for k in self.rates.samples if not k.startswith("fn:")} - set(wanted):
            del self.rates.samples[gone]
        record_functions(self.rates, self.functions, now)

    def export_status(self) -> list[dict[str, Any]]:
        """Per proxy: spans its tracer sent, and exports to the collector that failed."""
        out = []
        for group in sorted(self.rates.samples):
            sample = self.rates.latest(group)
            if sample is None:
                continue
            c = sample.counters
            failed = sum(
                v
                for k, v in c.items()
                if k.startswith("cluster.meshfn-otlp.")
                and k.endswith(
                    ("upstream_rq_5xx", "upstream_cx_connect_fail", "upstream_rq_timeout")
                )
            )
            if "tracing.opentelemetry.spans_sent" in c or failed:
                out.append(
                    {
                        "proxy": group,
                        "spans_sent": int(c.get("tracing.opentelemetry.spans_sent", 0)),
                        "failed_exports": int(failed),
                    }
                )
        return out

    def refused_connections(self) -> dict[str, int]:
        """Per proxy: new connections its listeners closed at its connection limit."""
        out = {}
        for group in sorted(self.rates.samples):
            sample = self.rates.latest(group)
            if sample is not None and not group.startswith("fn:"):
                c = sample.counters
                out[group] = int(sum(v for k, v in c.items() if k.endswith(OVERFLOW)))
        return out

    def connection_status(self) -> list[dict[str, Any]]:
        """For `meshfn status`: the proxies that refused connections at their limit."""
        return [
            {"proxy": group, "connections_refused": n}
            for group, n in self.refused_connections().items()
            if n
        ]


class ProxyMetrics(Collector):
    """/metrics of each proxy's tracer and connection limit, the figures `meshfn status`
    shows, from the proxies' statistics as last fetched (a scrape fetches them first, at most
    once a second)."""

    def __init__(self, proxies: ProxyStats) -> None:
        self.proxies = proxies

    def collect(self) -> Iterator[Metric]:
        sent = CounterMetricFamily(
            "meshfn_proxy_trace_spans_sent",
            "Spans each proxy's tracer sent to the collector (its tracing.opentelemetry"
            ".spans_sent, as last read from the proxy's statistics)",
            labels=["proxy"],
        )
        failed = CounterMetricFamily(
            "meshfn_proxy_trace_exports_failed",
            "Span exports from each proxy to the collector that failed, their spans dropped"
            " (connect failures, timeouts and 5xx of its meshfn-otlp cluster, as last read"
            " from the proxy's statistics)",
            labels=["proxy"],
        )
        refused = CounterMetricFamily(
            "meshfn_proxy_connections_refused",
            "New downstream connections each proxy closed as it accepted them, at its"
            " connection limit (MESHFN_PROXY_MAX_CONNECTIONS; its listeners'"
            " downstream_global_cx_overflow, as last read from the proxy's statistics)",
            labels=["proxy"],
        )
        for proxy in self.proxies.export_status():
            sent.add_metric([proxy["proxy"]], proxy["spans_sent"])
            failed.add_metric([proxy["proxy"]], proxy["failed_exports"])
        for group, n in self.proxies.refused_connections().items():
            refused.add_metric([group], n)
        yield from (sent, failed, refused)


# ---------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Node:
    id: str
    kind: str  # clients | gateway | service | workload | function
    label: str
    detail: str
    href: str | None  # its recent traces
    marks: tuple[str, ...] = ()  # "degraded", "serving from fallback ...", ...


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    rps: float | None
    error_ratio: float | None
    p50_ms: float | None
    p99_ms: float | None
    security: str  # mtls | partial | plaintext | local
    href: str | None
    fallback: bool = False  # a fallback chain's member (marked when it carries traffic)
    tier: str = ""  # the locality tiers that carried traffic, beyond the nearest
    degraded: bool = False  # a route on it has tripped its drift breaker

    @property
    def active(self) -> bool:
        return bool(self.rps)

    @property
    def health(self) -> str:
        if self.error_ratio is None or not self.active:
            return "idle"
        if self.error_ratio >= 0.05:
            return "bad"
        return "warn" if self.error_ratio >= 0.01 else "good"


@dataclass(frozen=True)
class ServiceGraph:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    problems: tuple[str, ...]  # proxies or backends whose figures are missing, and why

    def node(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.id == node_id)


def _traces(**query: str) -> str:
    return "/ui/traces?" + urllib.parse.urlencode(query)


def _span_service(workload: ir.Workload) -> str:
    """The service.name the workload's Envoy reports spans under (translate.tracing_for)."""
    return f"{workload.name}.{workload.namespace}"


def _ratio(rates: Rates, source: str, total: list[str], errors: list[str]) -> float | None:
    rps = rates.rate(source, total)
    bad = rates.rate(source, errors)
    if not rps or bad is None:
        return None if rps is None else 0.0
    return min(1.0, bad / rps)


def _security(service: ir.Service) -> str:
    modes = [e.mtls for e in service.endpoints if e.sidecar_port is not None]
    if not modes:
        return "plaintext"
    secured = [m for m in modes if m != "DISABLE"]
    if len(secured) == len(service.endpoints):
        return "mtls"
    return "partial" if secured else "plaintext"


class _Builder:
    def __init__(self, model: ir.MeshModel, rates: Rates, degraded: frozenset[str]) -> None:
        self.model = model
        self.rates = rates
        self.degraded = degraded
        self.nodes: dict[str, Node] = {}
        self.edges: list[Edge] = []

    def node(self, node: Node) -> None:
        self.nodes.setdefault(node.id, node)

    def clients(self, gw: ir.Workload) -> None:
        group = gw.node_cluster
        names = [f"http.{lst.name}.downstream_rq_" for lst in gw.listeners]
        total = [n + "total" for n in names]
        self.edges.append(
            Edge(
                "clients",
                f"gw:{gw.key}",
                self.rates.rate(group, total),
                _ratio(self.rates, group, total, [n + "5xx" for n in names]),
                *self.rates.quantiles(group, [n + "time" for n in names]),
                security="plaintext",
                href=_traces(service=_span_service(gw)),
            )
        )

    def gateway_service(
        self, gw: ir.Workload, service: ir.Service, fallback: bool, routes: list[ir.Route]
    ) -> None:
        group = gw.node_cluster
        own = sorted(primary_clusters(service.key))
        # with the twins a shedding gateway and a rollout's versions send through
        carrying = carrying_clusters(self.model, service, routes)
        clusters = own + sorted(carrying - set(own))
        total = [f"cluster.{c}.upstream_rq_total" for c in clusters]
        rps = self.rates.rate(group, total)
        tiers = [
            c.rsplit("|", 1)[1]
            for c in own
            if "|p" in c
            and not c.endswith("|p0")
            and (self.rates.rate(group, [f"cluster.{c}.upstream_rq_total"]) or 0) > 0
        ]
        sample = self.rates.latest(group)
        handshakes = sample is not None and any(
            sample.counters.get(f"cluster.{c}.ssl.handshake", 0) > 0 for c in clusters
        )
        # a route with a fallback chain sends through the chain's aggregate cluster, where
        # Envoy times the requests (its members count them)
        timed = [f"cluster.{c}.upstream_rq_time" for c in clusters]
        if sample is not None and not fallback:
            timed += [
                name
                for name in sample.quantiles
                if name.startswith("cluster.fallback|")
                and name.removeprefix("cluster.fallback|").split(">", 1)[0] in carrying
            ]
        security = _security(service)
        if security == "plaintext" and handshakes:
            security = "mtls"
        peers = [w for w in self.model.workloads if w.inbound and w.inbound.service == service.key]
        self.edges.append(
            Edge(
                f"gw:{gw.key}",
                f"svc:{service.key}",
                rps,
                _ratio(
                    self.rates, group, total, [f"cluster.{c}.upstream_rq_5xx" for c in clusters]
                ),
                *self.rates.quantiles(group, timed),
                security=security,
                href=_traces(service=_span_service(gw), peer=_span_service(peers[0]))
                if peers
                else _traces(service=_span_service(gw)),
                fallback=fallback,
                tier=", ".join(tiers),
                degraded=any(r.key in self.degraded for r in routes),
            )
        )

    def sidecar(self, workload: ir.Workload) -> None:
        inbound = workload.inbound
        assert inbound is not None
        group = workload.node_cluster
        prefix = f"http.inbound_{inbound.port}.downstream_rq_"
        self.node(
            Node(
                f"wl:{group}",
                "workload",
                f"{inbound.address}:{inbound.port}",
                f"sidecar of {workload.name}, app :{inbound.app_port}",
                _traces(service=_span_service(workload)),
            )
        )
        security = {"STRICT": "mtls", "PERMISSIVE": "partial"}.get(inbound.mtls, "plaintext")
        self.edges.append(
            Edge(
                f"svc:{inbound.service}",
                f"wl:{group}",
                self.rates.rate(group, [prefix + "total"]),
                _ratio(self.rates, group, [prefix + "total"], [prefix + "5xx"]),
                *self.rates.quantiles(group, [prefix + "time"]),
                security=security,
                href=_traces(service=_span_service(workload)),
            )
        )


def _function_docs(functions: FunctionStats | None) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(address, port) of each backend -> its functions' status documents."""
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    if functions is None:
        return out
    for backend, fetched in functions.latest.items():
        if fetched.error is None:
            out[(backend.address, backend.port)] = list(fetched.document.get("functions") or [])
    return out


def record_functions(rates: Rates, functions: FunctionStats | None, at: float) -> None:
    """Each backend function's request counts, so the last hop has rates too."""
    for (address, port), docs in _function_docs(functions).items():
        for doc in docs:
            requests = doc.get("requests") or {}
            counters = {k: float(v) for k, v in requests.items() if isinstance(v, int | float)}
            quantiles: Quantiles = {"time": (doc.get("p50_ms"), doc.get("p99_ms"))}
            rates.record(f"fn:{address}:{port}:{doc.get('name')}", counters, quantiles, at)


def _functions(builder: _Builder, functions: FunctionStats | None) -> None:
    docs = _function_docs(functions)
    for workload in builder.model.workloads:
        inbound = workload.inbound
        if inbound is None:
            continue
        for doc in docs.get((inbound.address, inbound.app_port), []):
            name = str(doc.get("name"))
            source = f"fn:{inbound.address}:{inbound.app_port}:{name}"
            builder.node(
                Node(
                    f"fn:{name}",
                    "function",
                    name,
                    f"{doc.get('state', '?')}, {doc.get('kind') or '?'}",
                    _traces(model=name),
                    ("refused",) if doc.get("state") == "refused" else (),
                )
            )
            builder.edges.append(
                Edge(
                    f"wl:{workload.node_cluster}",
                    f"fn:{name}",
                    builder.rates.rate(source, ["ok", "failed"]),
                    _ratio(builder.rates, source, ["ok", "failed"], ["failed"]),
                    *builder.rates.quantiles(source, ["time"]),
                    security="local",
                    href=_traces(model=name),
                )
            )


def build_graph(
    model: ir.MeshModel,
    rates: Rates,
    functions: FunctionStats | None,
    degraded: frozenset[str],
    serving: Mapping[str, str | None],
) -> ServiceGraph:
    """`serving`: per service key the chain member serving now (the topology's view);
    `degraded`: the routes whose drift breaker has tripped."""
    builder = _Builder(model, rates, degraded)
    builder.node(Node("clients", "clients", "clients", "outside the mesh", None))
    for gw in (w for w in model.workloads if w.kind == "gateway"):
        builder.node(
            Node(
                f"gw:{gw.key}",
                "gateway",
                gw.key,
                f"gateway, {sum(len(lst.routes) for lst in gw.listeners)} route(s)",
                _traces(service=_span_service(gw)),
            )
        )
        builder.clients(gw)
        reached: dict[str, tuple[bool, list[ir.Route]]] = {}
        for route in (r for lst in gw.listeners for r in lst.routes):
            service = model.service(route.service)
            for i, key in enumerate((service.key, *service.fallback)):
                fallback, routes = reached.get(key, (True, []))
                reached[key] = (fallback and i > 0, [*routes, route])
        for key, (fallback, routes) in reached.items():
            _service_node(builder, model.service(key), routes, serving)
            builder.gateway_service(gw, model.service(key), fallback, routes)
    for workload in model.workloads:
        if workload.inbound is not None:
            _service_node(builder, model.service(workload.inbound.service), [], serving)
            builder.sidecar(workload)
    _functions(builder, functions)
    problems = tuple(f"{k}: {v}" for k, v in sorted(rates.errors.items()))
    return ServiceGraph(tuple(builder.nodes.values()), tuple(builder.edges), problems)


def _service_node(
    builder: _Builder,
    service: ir.Service,
    routes: list[ir.Route],
    serving: Mapping[str, str | None],
) -> None:
    marks = []
    if any(r.key in builder.degraded for r in routes):
        marks.append("degraded")
    now = serving.get(service.key)
    if now is not None and now != service.key and service.fallback:
        marks.append(f"serving from {now}")
    peers = [w for w in builder.model.workloads if w.inbound and w.inbound.service == service.key]
    builder.node(
        Node(
            f"svc:{service.key}",
            "service",
            service.key,
            f"service, {len(service.endpoints)} endpoint(s)"
            + (f", fallback {' > '.join(service.fallback)}" if service.fallback else ""),
            _traces(service=_span_service(peers[0])) if peers else None,
            tuple(marks),
        )
    )


# ---------------------------------------------------------------- drawing

COLUMNS = ("clients", "gateway", "service", "workload", "function")
NODE_W, NODE_H, ROW_H, COL_W, PAD = 190, 50, 90, 300, 24


def _fmt(value: float | None, unit: str, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def edge_label(edge: Edge) -> str:
    if edge.rps is None:
        return "no figures yet"
    errors = "-" if edge.error_ratio is None else f"{edge.error_ratio * 100:.1f}%"
    return (
        f"{edge.rps:.1f} rps, {errors} err, p50 {_fmt(edge.p50_ms, ' ms')}, "
        f"p99 {_fmt(edge.p99_ms, ' ms')}"
    )


SECURITY_WORDS = {
    "mtls": "mTLS",
    "partial": "mTLS or plaintext",
    "plaintext": "plaintext",
    "local": "loopback",
}


def _positions(graph: ServiceGraph) -> dict[str, tuple[float, float]]:
    columns: dict[str, list[Node]] = {kind: [] for kind in COLUMNS}
    for node in graph.nodes:
        columns[node.kind].append(node)
    rows = max(len(c) for c in columns.values())
    out: dict[str, tuple[float, float]] = {}
    for col, kind in enumerate(COLUMNS):
        nodes = columns[kind]
        offset = (rows - len(nodes)) * ROW_H / 2
        for row, node in enumerate(nodes):
            out[node.id] = (float(PAD + col * COL_W), PAD + offset + row * ROW_H)
    return out


def _lock(x: float, y: float, security: str) -> str:
    """A small padlock (closed for mTLS, open for plaintext) with its word as a title."""
    closed = security in ("mtls", "local")
    shackle = (
        f'<path d="M{x + 2:.1f},{y + 5:.1f} v-2 a3,3 0 0 1 6,0 v2" />'
        if closed
        else f'<path d="M{x + 2:.1f},{y + 5:.1f} v-2 a3,3 0 0 1 6,0" transform="translate(3,-1)" />'
    )
    return (
        f'<g class="lock lock-{security}">{shackle}'
        f'<rect x="{x:.1f}" y="{y + 5:.1f}" width="10" height="8" rx="1"/>'
        f"<title>{escape(SECURITY_WORDS[security])}</title></g>"
    )


def _edge_svg(edge: Edge, src: tuple[float, float], dst: tuple[float, float]) -> str:
    """A curve from the source's right side to the target's left side; an active edge carries
    its figures above the curve's middle (an idle one only its padlock and notes, the table
    below the graph has every figure)."""
    x1, y1 = src[0] + NODE_W, src[1] + NODE_H / 2
    x2, y2 = dst[0], dst[1] + NODE_H / 2
    mid = (x1 + x2) / 2
    classes = ["edge", f"edge-{edge.health}"]
    if edge.fallback:
        classes.append("edge-fallback")
    if edge.degraded:
        classes.append("edge-degraded")
    notes = []
    if edge.fallback:
        notes.append("fallback in use" if edge.active else "fallback")
    if edge.tier:
        notes.append(f"tier {edge.tier}")
    if edge.degraded:
        notes.append("degraded")
    label = edge_label(edge)
    title = f"{edge.source} to {edge.target}: {label}; {SECURITY_WORDS[edge.security]}" + (
        "; " + ", ".join(notes) if notes else ""
    )
    ly = (y1 + y2) / 2
    parts = [
        f'<path class="{" ".join(classes)}" d="M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f}'
        f' {mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"/>',
        _lock(mid - 5, ly - 9, edge.security),
    ]
    if edge.active:
        parts.append(
            f'<text class="edge-label" x="{mid + 8:.1f}" y="{ly - 2:.1f}">{escape(_short(edge))}</text>'
        )
    if notes:
        parts.append(
            f'<text class="edge-note" x="{mid + 8:.1f}" y="{ly + 11:.1f}">{escape(", ".join(notes))}</text>'
        )
    parts.append(f"<title>{escape(title)}</title>")
    body = "".join(parts)
    data = f'data-edge="{escape(edge.source + ">" + edge.target)}"'
    if edge.href:
        return f'<a class="edge-link" href="{escape(edge.href)}" {data}>{body}</a>'
    return f"<g {data}>{body}</g>"


def _short(edge: Edge) -> str:
    if edge.rps is None:
        return "…"
    errors = "" if not edge.error_ratio else f" · {edge.error_ratio * 100:.0f}% err"
    p99 = "" if edge.p99_ms is None else f" · p99 {edge.p99_ms:.0f}ms"
    return f"{edge.rps:.1f} rps{errors}{p99}"


def _node_svg(node: Node, at: tuple[float, float]) -> str:
    x, y = at
    classes = f"node node-{node.kind}" + "".join(f" mark-{m.split()[0]}" for m in node.marks)
    marks = f" ({', '.join(node.marks)})" if node.marks else ""
    body = (
        f'<rect class="{classes}" x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="6"/>'
        f'<text class="node-label" x="{x + 8:.1f}" y="{y + 19:.1f}">{escape(_clip(node.label, 26))}</text>'
        f'<text class="node-detail" x="{x + 8:.1f}" y="{y + 37:.1f}">'
        f"{escape(_clip(node.marks[0] if node.marks else node.detail, 30))}</text>"
        f"<title>{escape(node.kind + ' ' + node.label + ': ' + node.detail + marks)}</title>"
    )
    data = f'data-node="{escape(node.id)}"'
    if node.href:
        return f'<a class="node-link" href="{escape(node.href)}" {data}>{body}</a>'
    return f"<g {data}>{body}</g>"


def _clip(text: str, length: int) -> str:
    return text if len(text) <= length else text[: length - 1] + "…"


def graph_svg(graph: ServiceGraph) -> Markup:
    at = _positions(graph)
    rows = max(1, max((sum(1 for n in graph.nodes if n.kind == k) for k in COLUMNS), default=1))
    width = PAD * 2 + (len(COLUMNS) - 1) * COL_W + NODE_W
    height = PAD * 2 + (rows - 1) * ROW_H + NODE_H + 20
    parts = [
        f'<svg class="graph" viewBox="0 0 {width} {height}" role="img" aria-labelledby="graph-title">',
        '<title id="graph-title">Service graph: gateways, services, workloads and functions, '
        "with the traffic between them (the table below lists every edge)</title>",
    ]
    parts += [
        _edge_svg(e, at[e.source], at[e.target])
        for e in graph.edges
        if e.source in at and e.target in at
    ]
    parts += [_node_svg(n, at[n.id]) for n in graph.nodes]
    parts.append("</svg>")
    return Markup("".join(parts))
