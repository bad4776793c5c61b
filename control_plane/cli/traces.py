"""`meshfn trace list | show`: the traces `meshfn up`'s embedded collector holds, from its admin
port: a filtered list, and one trace as a waterfall in the terminal (each span a row, indented
under its parent, with a bar where it ran)."""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from meshfn.common.cli import command_app, out
from meshfn.contracts import genai

from .shared import DEFAULT_STATE, AdminOpt, ClientStateOpt, admin_url, get_json

trace_app = command_app(
    "trace", "Traces from meshfn up's embedded collector: list them, show one as a waterfall."
)

BAR_WIDTH = 40
JsonOpt = Annotated[bool, typer.Option("--json", help="the admin port's JSON")]


def _us(value: int) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value} us"


@trace_app.command("list")
def list_traces(
    route: Annotated[
        str | None, typer.Option(help="mesh route (namespace/name; a prefix ending in /)")
    ] = None,
    min_duration: Annotated[
        str | None, typer.Option("--min-duration", help="at least this long (250ms, 1s)")
    ] = None,
    status: Annotated[str | None, typer.Option(help="ok or error")] = None,
    service: Annotated[str | None, typer.Option(help="a service its spans came from")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 20,
    admin: AdminOpt = None,
    state_dir: ClientStateOpt = DEFAULT_STATE,
    as_json: JsonOpt = False,
) -> None:
    """The newest traces matching every given filter."""
    query = {
        k: v
        for k, v in {
            "route": route,
            "min_duration": min_duration,
            "status": status,
            "service": service,
            "limit": str(limit),
        }.items()
        if v
    }
    url = f"{admin_url(admin, state_dir)}/debug/traces?{urllib.parse.urlencode(query)}"
    document = get_json(url, state_dir)
    if as_json:
        out.print_json(json.dumps(document))
        return
    table = Table("trace", "started", "duration", "spans", "status", "route", "root", "services")
    for t in document["traces"]:
        table.add_row(
            t["trace_id"],
            time.strftime("%H:%M:%S", time.localtime(t["start_ns"] / 1e9)),
            _us(t["duration_us"]),
            str(t["spans"]),
            Text(t["status"], style="red" if t["status"] == "error" else "green"),
            Text(t["route"] or "-"),
            Text(t["root"]),
            Text(", ".join(t["services"])),
        )
    out.print(table)
    store = document["store"]
    dropped = sum(store["dropped_spans"].values())
    out.print(
        f"{len(document['traces'])} trace(s); the collector holds {store['traces']} trace(s),"
        f" {store['bytes'] // 1024} KiB, and dropped {dropped} span(s)"
        + (f" ({_reasons(store['dropped_spans'])})" if dropped else ""),
        highlight=False,
    )


def _reasons(dropped: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n)


def waterfall(trace: dict[str, Any], width: int = BAR_WIDTH) -> Table:
    """Each span a row, depth-first under its parent (siblings by start), with its offset,
    duration and a bar where it ran within the trace."""
    spans = trace["span_list"]
    start = min(s["start_ns"] for s in spans)
    total = max(1, max(s["end_ns"] for s in spans) - start)
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in ids else None
        children.setdefault(parent, []).append(span)
    table = Table("span", "service", "start", "duration", "", title=_title(trace))
    table.columns[4].no_wrap = True

    def add(span: dict[str, Any], depth: int) -> None:
        left = round((span["start_ns"] - start) / total * width)
        length = max(1, round((span["end_ns"] - span["start_ns"]) / total * width))
        bar = Text(" " * left + "█" * min(length, width - left))
        bar.stylize("red" if span["status"] == "error" else "cyan")
        table.add_row(
            Text("  " * depth + span["name"]),
            Text(span["service"]),
            _us((span["start_ns"] - start) // 1000),
            _us(span["duration_us"]),
            bar,
        )
        for child in sorted(children.get(span["span_id"], []), key=lambda s: s["start_ns"]):
            add(child, depth + 1)

    for root in sorted(children.get(None, []), key=lambda s: s["start_ns"]):
        add(root, 0)
    return table


def generations(trace: dict[str, Any]) -> list[str]:
    """A line per generation in the trace (a span with the GenAI conventions' usage): its
    tokens, when its first token came, why it ended."""
    lines = []
    for span in trace["span_list"]:
        attrs = span["attributes"]
        if genai.OPERATION not in attrs or genai.OUTPUT_TOKENS not in attrs:
            continue
        said = [f"{attrs.get(genai.INPUT_TOKENS)} prompt + {attrs[genai.OUTPUT_TOKENS]} "
                "completion tokens"]  # fmt: skip
        for event in span["events"]:
            ttft = event["attributes"].get(genai.TIME_TO_FIRST_TOKEN)
            if event["name"] == "first token" and isinstance(ttft, int | float):
                said.append(f"first token after {_us(round(ttft * 1e6))}")
        if attrs.get(genai.FINISH_REASON):
            said.append(f"ended: {attrs[genai.FINISH_REASON]}")
        lines.append(f"generation {span['name']}: " + ", ".join(said))
    return lines


def _title(trace: dict[str, Any]) -> str:
    route = f" route {trace['route']}" if trace.get("route") else ""
    return f"trace {trace['trace_id']}{route}: {_us(trace['duration_us'])}, {trace['status']}"


@trace_app.command("show")
def show(
    trace_id: Annotated[str, typer.Argument(help="the trace id (32 hex digits)")],
    admin: AdminOpt = None,
    state_dir: ClientStateOpt = DEFAULT_STATE,
    as_json: JsonOpt = False,
) -> None:
    """One trace as a waterfall: which hop took the time (gateway, sidecar, backend; admission,
    queue, batch, cold start, guest call; a generation's time to first token and decode loop)."""
    url = f"{admin_url(admin, state_dir)}/debug/traces/{urllib.parse.quote(trace_id)}"
    document = get_json(url, state_dir)
    if as_json:
        out.print_json(json.dumps(document))
        return
    out.print(waterfall(document))
    for line in generations(document):
        out.print(line, highlight=False)
    links = [
        f"{span['name']} -> {link['trace_id']}"
        for span in document["span_list"]
        for link in span["links"]
    ]
    if links:
        out.print("linked traces (the other members of a batch):", highlight=False)
        for line in links:
            out.print(f"  {line}", highlight=False)
    out.print(f"its audit record: meshfn audit query --trace {document['trace_id']}")
