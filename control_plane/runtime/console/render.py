"""Server-side rendering of the console: Jinja2 templates with autoescaping on, one HTML fragment
per panel (what the live stream sends; the rollouts' is rollouts.html), and the drift chart as
inline SVG computed here.

Every value a policy, a proxy or a request can influence (names, regexes, NACK texts, paths in
audit records) reaches HTML only through autoescaping; no template marks anything `safe` except
the SVG this module builds, whose text parts are escaped here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup, escape

from meshfn.contracts import genai
from meshfn.health.drift import RouteDrift

from .graph import SECURITY_WORDS, graph_svg
from .view import ConsoleView
from .waterfall import rows, waterfall_svg

PANELS = ("graph", "topology", "proxies", "drift", "rollouts", "functions", "audit", "policy")
TITLES = {
    "graph": "Service graph",
    "topology": "Topology",
    "proxies": "Proxies",
    "drift": "Drift breaker",
    "rollouts": "Rollouts",
    "functions": "Functions",
    "audit": "Audit",
    "policy": "Policy",
}
CHART_SECONDS = 120.0


def _clock(at: float | None) -> str:
    if not at:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(at))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


_env = Environment(
    loader=PackageLoader("meshfn.control_plane.runtime.console", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters["clock"] = _clock
_env.filters["ms"] = _ms
_env.globals["genai"] = genai  # the GenAI metric names, from their one place


@dataclass(frozen=True)
class Chart:
    svg: Markup
    summary: str


def drift_chart(route: RouteDrift, clock_offset: float, now: float) -> Chart:
    """p95 (solid) against the baseline (dashed) and the trip limit (dotted) over the last two
    minutes; degraded spans shaded, trips and recoveries as labelled vertical lines."""
    width, height, left, bottom, top = 640, 180, 48, 22, 10
    first = route.history[0].at + clock_offset if route.history else now
    span = min(CHART_SECONDS, max(10.0, now - first))  # a young mesh fills the chart too
    start = now - span
    points = [p for p in route.history if p.at + clock_offset >= start]
    events = [e for e in route.events if e.at + clock_offset >= start]
    peak = max(
        [1.0, route.trip_at_ms, *(p.p95_ms for p in points), *(p.baseline_ms for p in points)]
    )
    peak *= 1.15

    def x(at: float) -> float:
        return left + (at + clock_offset - start) / span * (width - left - 4)

    def y(ms: float) -> float:
        return top + (1 - min(ms, peak) / peak) * (height - top - bottom)

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-labelledby="chart-{_id(route.route)}-title">',
        f'<title id="chart-{_id(route.route)}-title">{escape(_summary(route, events))}</title>',
        f'<line class="axis" x1="{left}" y1="{height - bottom}" x2="{width}" '
        f'y2="{height - bottom}"/>',
        f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}"/>',
    ]
    for tick in (0.0, peak / 2, peak):
        parts.append(
            f'<text class="tick" x="{left - 4}" y="{y(tick) + 4:.1f}" text-anchor="end">'
            f"{tick:.{0 if peak >= 10 else 1}f}</text>"
        )
    parts.append(
        f'<text class="tick" x="{left}" y="{height - 6}">-{span:.0f} s</text>'
        f'<text class="tick" x="{width - 4}" y="{height - 6}" text-anchor="end">now (ms)</text>'
    )
    span_start = None
    for point in points:  # shade degraded spans
        if point.degraded and span_start is None:
            span_start = point.at
        if not point.degraded and span_start is not None:
            parts.append(_span(x(span_start), x(point.at), top, height - bottom))
            span_start = None
    if span_start is not None:
        parts.append(_span(x(span_start), x(now - clock_offset), top, height - bottom))
    for cls, values in (
        ("baseline", [(p.at, p.baseline_ms) for p in points]),
        ("p95", [(p.at, p.p95_ms) for p in points]),
    ):
        if values:
            line = " ".join(f"{x(at):.1f},{y(ms):.1f}" for at, ms in values)
            parts.append(f'<polyline class="{cls}" points="{line}"/>')
    if route.trip_at_ms:
        parts.append(
            f'<line class="limit" x1="{left}" y1="{y(route.trip_at_ms):.1f}" x2="{width}" '
            f'y2="{y(route.trip_at_ms):.1f}"/>'
        )
    for event in events:
        cls = "trip" if event.to == "degraded" else "recover"
        label = "trip" if event.to == "degraded" else "recovered"
        ex = x(event.at)
        parts.append(
            f'<g class="{cls}"><line x1="{ex:.1f}" y1="{top}" x2="{ex:.1f}" y2="{height - bottom}"/>'
            f'<text x="{ex + 3:.1f}" y="{top + 10}">{label}</text>'
            f"<title>{escape(f'{label} at {_clock(event.at + clock_offset)}: p95 {event.p95_ms:.1f} ms, baseline {event.baseline_ms:.1f} ms')}</title></g>"
        )
    parts.append("</svg>")
    return Chart(Markup("".join(parts)), _summary(route, events))


def _span(x1: float, x2: float, top: float, bottom: float) -> str:
    return f'<rect class="degraded" x="{x1:.1f}" y="{top}" width="{max(1.0, x2 - x1):.1f}" height="{bottom - top}"/>'


def _id(route: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in route)


def _summary(route: RouteDrift, events: list[Any]) -> str:
    trips = sum(1 for e in events if e.to == "degraded")
    recoveries = len(events) - trips
    return (
        f"{route.route}: p95 {route.p95_ms:.1f} ms against a baseline of {route.baseline_ms:.1f} ms;"
        f" {trips} trip(s) and {recoveries} recovery(ies) in the last {CHART_SECONDS:.0f} s"
    )


def panel(name: str, view: ConsoleView) -> str:
    """One panel's inner HTML (what the live stream sends and the page embeds)."""
    charts = {}
    extra: dict[str, Any] = {}
    if name == "drift":
        charts = {r.route: drift_chart(r, view.clock_offset, view.now) for r in view.drift}
    if name == "graph":
        extra = {
            "graph_svg": graph_svg(view.graph) if view.graph is not None else Markup(""),
            "security": SECURITY_WORDS,
        }
    return _env.get_template(f"{name}.html").render(view=view, charts=charts, chart_id=_id, **extra)


def page(view: ConsoleView, panels: Mapping[str, Markup]) -> str:
    """The whole page around the panels (already rendered, hence Markup)."""
    return _env.get_template("page.html").render(
        view=view, panels=panels, titles=TITLES, order=PANELS
    )


def traces_page(
    traces: list[dict[str, Any]],
    store: Mapping[str, Any],
    filters: Mapping[str, str],
    error: str | None = None,
) -> str:
    """The collector's recent traces, filtered (a node's or an edge's of the service graph)."""
    return _env.get_template("traces.html").render(
        traces=traces, store=store, filters=filters, error=error
    )


def trace_page(
    trace: Mapping[str, Any],
    audit: list[Any] | None,
    audit_error: str | None = None,
    reader: bool = True,
) -> str:
    """One trace: its waterfall, every span, and its audit records (`reader`: the auditor
    role, who may see records)."""
    return _env.get_template("trace.html").render(
        trace=trace,
        waterfall=waterfall_svg(trace),
        rows=rows(trace),
        audit=audit,
        audit_error=audit_error,
        reader=reader,
    )


def error_page(status: int, message: str) -> str:
    return _env.get_template("error.html").render(status=status, message=message)


def login_page(message: str = "") -> str:
    return _env.get_template("login.html").render(message=message)
