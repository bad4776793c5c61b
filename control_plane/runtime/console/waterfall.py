"""One trace as a waterfall, in server-rendered SVG: each span a row, indented under its parent
(depth first, siblings by start), a bar where it ran within the trace, its service and duration
beside it. Every text is escaped here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup, escape

ROW_H, LABEL_W, BAR_W, PAD = 22, 330, 560, 8


@dataclass(frozen=True)
class Row:
    depth: int
    span: Mapping[str, Any]


def rows(trace: Mapping[str, Any]) -> list[Row]:
    """Spans in waterfall order: a span whose parent is not in the trace is a root."""
    spans = list(trace["span_list"])
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[Mapping[str, Any]]] = {}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else None
        children.setdefault(parent, []).append(span)
    out: list[Row] = []

    def walk(span: Mapping[str, Any], depth: int) -> None:
        out.append(Row(depth, span))
        for child in sorted(children.get(span["span_id"], []), key=lambda s: s["start_ns"]):
            walk(child, depth + 1)

    for root in sorted(children.get(None, []), key=lambda s: s["start_ns"]):
        walk(root, 0)
    return out


def _duration(us: int) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us} µs"


def waterfall_svg(trace: Mapping[str, Any]) -> Markup:
    ordered = rows(trace)
    spans = trace["span_list"]
    start = min(s["start_ns"] for s in spans)
    total = max(1, max(s["end_ns"] for s in spans) - start)
    width = LABEL_W + BAR_W + 110
    summary = (
        f"Waterfall of trace {trace['trace_id']}: {len(ordered)} spans over"
        f" {_duration(total // 1000)} (the table below lists them)"
    )
    height = PAD * 2 + ROW_H * (len(ordered) + 1)
    parts = [
        f'<svg class="waterfall" viewBox="0 0 {width} {height}" role="img" '
        f'aria-labelledby="waterfall-title">',
        f'<title id="waterfall-title">{escape(summary)}</title>',
        f'<text class="tick" x="{LABEL_W}" y="{PAD + 12}">0</text>',
        f'<text class="tick" x="{LABEL_W + BAR_W}" y="{PAD + 12}" text-anchor="end">'
        f"{escape(_duration(total // 1000))}</text>",
    ]
    for i, row in enumerate(ordered, start=1):
        span = row.span
        y = PAD + i * ROW_H
        x = LABEL_W + (span["start_ns"] - start) / total * BAR_W
        w = max(2.0, (span["end_ns"] - span["start_ns"]) / total * BAR_W)
        cls = "bar bar-error" if span["status"] == "error" else f"bar bar-{_hop(span)}"
        label = f"{span['name']} ({span['service']})"
        parts.append(
            f'<g class="span-row" data-span="{escape(span["span_id"])}">'
            f'<text class="span-name" x="{PAD + row.depth * 14}" y="{y + 14}">'
            f"{escape(_clip(label, 46 - row.depth * 2))}</text>"
            f'<rect class="{cls}" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW_H - 8}"/>'
            f'<text class="span-time" x="{min(x + w + 4, LABEL_W + BAR_W + 4):.1f}" y="{y + 14}">'
            f"{escape(_duration(span['duration_us']))}</text>"
            f"<title>{escape(label + ': ' + _duration(span['duration_us']))}</title></g>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def _hop(span: Mapping[str, Any]) -> str:
    """Which part of the mesh a span is: the backend's, or a proxy's."""
    return "backend" if str(span["service"]).endswith(" inference") else "proxy"


def _clip(text: str, length: int) -> str:
    return text if len(text) <= length else text[: max(1, length - 1)] + "…"
