"""`meshfn status | config-dump`: inside a running control plane, from its admin port (and
each inference backend's own /meshfn/functions)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from meshfn.common.cli import err, fail, out
from meshfn.common.unix import unix_request
from meshfn.contracts import genai
from meshfn.contracts.function import BACKEND_STATUS_PATH
from meshfn.kube.cli import ContextOpt, KubeconfigOpt, NamespaceOpt

from .shared import DEFAULT_STATE, AdminOpt, ClientStateOpt, admin_url, get_json


def _type_cell(state: dict[str, Any] | None) -> str:
    if state is None:
        return "[dim]NOT SENT[/dim]"
    nack = state.get("last_nack")
    if nack and nack["version"] == state["sent"]:
        return f"[red]NACKED[/red] {state['acked'][:8] or '-'}"
    if state["in_sync"]:
        return f"[green]SYNCED[/green] {state['acked'][:8]}"
    if not state["sent"]:
        return "[dim]NOT SENT[/dim]"
    return f"[yellow]STALE[/yellow] {state['acked'][:8] or '-'}<{state['sent'][:8]}"


BackendFunctions = tuple[dict[str, Any], list[dict[str, Any]] | None, str]


def _backend_functions(backends: list[dict[str, Any]]) -> list[BackendFunctions]:
    """Each inference backend's own /meshfn/functions (on its private socket behind a sidecar,
    else on loopback), read once for every table that shows it: (backend, its functions or
    None, why not)."""
    fetched: list[BackendFunctions] = []
    for backend in backends:
        try:
            document = json.loads(_backend_get(backend, BACKEND_STATUS_PATH))
            tracing = {"tracing": document.get("tracing")}
            fetched.append(({**backend, **tracing}, document["functions"], ""))
        except (OSError, ValueError, KeyError) as exc:
            fetched.append((backend, None, str(exc)))
    return fetched


def _backend_get(backend: dict[str, Any], path: str) -> bytes:
    if not backend.get("socket"):
        url = f"http://{backend['address']}:{backend['port']}{path}"
        with urllib.request.urlopen(url, timeout=2) as response:
            return bytes(response.read())
    status, body = unix_request(backend["socket"], path, timeout=2)
    if status != 200:
        raise OSError(f"{backend['socket']}: GET {path} answered {status}")
    return body


def _print_qos(backends: list[BackendFunctions]) -> None:
    """Per function and tenant: admitted, limited, shed, guest CPU and budget use, as each
    inference backend counts them."""
    table = Table(title="multi-tenant QoS (per backend)", title_justify="left")
    for column in ("backend", "function", "tenant", "class", "admitted", "limited", "shed",
                   "guest CPU ms", "budget used ms", "tokens"):  # fmt: skip
        table.add_column(column)
    for backend, functions, problem in backends:
        where = f"{backend['address']}:{backend['port']}"
        if functions is None:
            err.print(f"backend {where}: {problem}", markup=False, highlight=False)
            continue
        for function in functions:
            for t in (function.get("qos") or {}).get("tenants", []):
                budget = ", ".join(f"{v}/{w}" for w, v in t["budget_used_ms"].items())
                table.add_row(
                    Text(where), Text(f"{function['name']}@{function['version']}"),
                    Text(t["tenant"] or "(no claim)"), Text(t["class"]), str(t["admitted"]),
                    str(t["limited"]), str(t["shed"]), str(t["guest_cpu_ms"]), budget or "-",
                    str(t.get("tokens_used", 0)),
                )  # fmt: skip
    if table.row_count:
        out.print(table)


def _print_proxy_refusals(rows: list[dict[str, Any]]) -> None:
    """QoS refusals the proxies' audit records name: a gateway's own (rate, shed) appear
    nowhere else."""
    table = Table(title="QoS refusals (audit records)", title_justify="left")
    for column in ("proxy", "tenant", "class", "limit", "requests"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            Text(row["source"]), Text(row["tenant"] or "(no claim)"), Text(row["class"] or "-"),
            Text(row["limit"]), str(row["count"]),
        )  # fmt: skip
    if table.row_count:
        out.print(table)


def _print_global_rates(rates: list[dict[str, Any]]) -> None:
    """The control plane's rate-limit service: per policy and tenant, its decisions."""
    table = Table(title="global rate limits (control plane)", title_justify="left")
    for column in ("policy", "tenant", "allowed", "over limit"):
        table.add_column(column)
    for row in rates:
        tenant = {"": "(no claim)", "*": "(other tenants)"}.get(row["tenant"], row["tenant"])
        table.add_row(
            Text(row["policy"]), Text(tenant), str(row["allowed"]), str(row["over_limit"])
        )
    if table.row_count:
        out.print(table)


def _print_generation(backends: list[BackendFunctions]) -> None:
    """Generative functions as each backend measures them (OpenTelemetry GenAI names,
    contracts.genai): streams, tokens, time to first token and per output token, how streams
    ended, and how many streams a decode step carried on average (continuous batching)."""
    table = Table(title="generative functions (per backend)", title_justify="left")
    for column in ("backend", "function", "streams", "finished", "tokens in/out",
                   f"{genai.TIME_TO_FIRST_TOKEN} p50/p99 ms",
                   f"{genai.TIME_PER_OUTPUT_TOKEN} p50/p99 ms", "streams per step"):  # fmt: skip
        table.add_column(column)
    for backend, functions, _ in backends:
        for f in functions or []:
            g = f.get("generation")
            if not g:
                continue
            finished = ", ".join(f"{n} {r}" for r, n in sorted(g["finished"].items()))
            table.add_row(
                Text(backend["service"]), Text(f"{f['name']}@{f['version']}"),
                f"{g['active_streams']} active", Text(finished or "-"),
                f"{g['prompt_tokens']}/{g['completion_tokens']}",
                f"{_num(g['ttft_p50_ms'])}/{_num(g['ttft_p99_ms'])}",
                f"{_num(g['tpot_p50_ms'])}/{_num(g['tpot_p99_ms'])}",
                _num(g["batched_tokens_ratio"]),
            )  # fmt: skip
    if table.row_count:
        out.print(table)


def _print_token_budgets(rows: list[dict[str, Any]]) -> None:
    """The mesh's book of token budgets (the control plane's ledger): per function, tenant and
    calendar window, the tokens used and those running requests hold."""
    table = Table(title="token budgets (control plane)", title_justify="left")
    for column in ("function", "tenant", "window", "used", "held"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            Text(row["function"]), Text(row["tenant"] or "(no claim)"), Text(row["window"]),
            str(row["used"]), str(row["reserved"]),
        )  # fmt: skip
    if table.row_count:
        out.print(table)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _print_rejected(errors: list[str]) -> None:
    if errors:
        err.print(
            "[red]the last policy change was rejected; the previous configuration is in force:[/red]"
        )
        for line in errors:
            err.print(f"  {line}", markup=False, highlight=False)


Nack = tuple[str, str, dict[str, Any]]


def _print_proxies(document: dict[str, Any]) -> list[Nack]:
    """Per proxy and type: SYNCED, STALE, NACKED or NOT SENT; the NACKs, for the last lines."""
    table = Table(
        title=f"configuration {document['generation']} from {document['policies']}",
        title_justify="left",
    )
    for column in ("node", "workload", "xds", "CDS", "EDS", "LDS", "RDS"):
        table.add_column(column)
    nacks = []
    for proxy in document["proxies"]:
        types = proxy["types"]
        # Node ids and workloads come from the proxies: text, never markup.
        workload = Text(proxy["workload"])
        if not proxy["known_workload"]:
            workload = Text(f"{proxy['workload']} (unknown)", style="red")
        table.add_row(
            Text(proxy["node"]),
            workload,
            proxy["protocol"],
            *(_type_cell(types.get(t)) for t in ("clusters", "endpoints", "listeners", "routes")),
        )
        for type_name, state in types.items():
            if state.get("last_nack"):
                nacks.append((proxy["node"], type_name, state["last_nack"]))
    out.print(table)
    if not document["proxies"]:
        out.print("no proxies connected")
    return nacks


def _print_acceleration(acceleration: dict[str, Any] | None) -> None:
    if acceleration:
        counters = acceleration["counters"]
        state = "[green]on[/green]" if acceleration["attached"] else "[yellow]off[/yellow]"
        out.print(
            f"eBPF acceleration {state} ({acceleration['mode']}): {acceleration['reason']}; "
            f"{counters.get('messages_redirected', 0)} messages redirected, "
            f"{counters.get('sockets_in_map', 0)} sockets in the map"
        )


_LAYER_STYLE = {"on": "green", "off": "yellow"}


def _print_sandbox(sandbox: dict[str, Any] | None) -> None:
    """Per inference backend: which kernel layers confine it, why any does not, and what the
    egress control refused (docs/concepts/sandbox.md)."""
    if not sandbox:
        return
    for backend in sandbox["backends"]:
        line = Text(f"sandbox {backend['backend']}: ")
        for i, layer in enumerate(("landlock", "seccomp", "egress")):
            state = backend[layer]["state"]
            line.append(", " if i else "")
            line.append(f"{layer} {state}", style=_LAYER_STYLE.get(state, "red"))
        out.print(line)
        for layer in ("landlock", "seccomp", "egress"):
            out.print(Text(f"  {layer}: {backend[layer]['detail']}"), highlight=False)
        if backend["denied"]:
            refused = ", ".join(
                f"{reason} {d['count']}" + (f" (last {d['last']})" if d["last"] else "")
                for reason, d in backend["denied"].items()
            )
            out.print(Text(f"  egress denied: {refused}", style="red"))


def _print_drift(routes: dict[str, Any]) -> None:
    """The drift breaker: per route its state, p95 against the baseline."""
    if not routes:
        return
    table = Table(title="drift breaker", title_justify="left")
    for column in ("route", "state", "p95 ms", "baseline ms", "samples", "transitions"):
        table.add_column(column)
    for name, route in routes.items():
        state = route["state"]
        table.add_row(
            Text(name),
            f"[red]{state}[/red]" if state == "degraded" else f"[green]{state}[/green]",
            f"{route['p95_ms']:.1f}",
            f"{route['baseline_ms']:.1f}",
            str(route["samples"]),
            str(route["transitions"]),
        )
    out.print(table)
    for name, route in routes.items():
        for trace in route.get("exemplars") or []:
            out.print(f"  {name} tripped on slow trace: meshfn trace show {trace}", highlight=False)


def _print_nacks(nacks: list[Nack]) -> None:
    for node, type_name, nack in nacks:
        out.print("[red]NACK[/red] ", end="")
        out.print(f"{node} {type_name} version {nack['version'][:8]}: ", end="", markup=False)
        out.print(nack["error"], markup=False, highlight=False)


def status(
    admin: AdminOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="raw JSON")] = False,
    kube: Annotated[
        bool, typer.Option("--kube", help="the cluster's meshfn objects: conditions, what they own")
    ] = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
    state_dir: ClientStateOpt = DEFAULT_STATE,
) -> None:
    """Every connected proxy: per type the version sent and ACKed, and the last NACK. With
    --kube: every meshfn custom resource, its conditions and the objects it owns."""
    if kube:
        from meshfn.kube.cli import print_status

        raise typer.Exit(print_status(out, kubeconfig, context, namespace))
    document = get_json(admin_url(admin, state_dir) + "/debug/status", state_dir)
    if as_json:
        out.print_json(json.dumps(document))
        return
    _print_rejected(document["policy_errors"])
    nacks = _print_proxies(document)
    _print_connection_limits(document.get("proxy_connections") or [])
    _print_acceleration(document.get("acceleration"))
    _print_sandbox(document.get("sandbox"))
    audit = document.get("audit")
    if audit and audit.get("enabled"):
        _print_audit(audit)
        _print_proxy_refusals(audit.get("qos_refusals") or [])
    backends = _backend_functions(document.get("inference_backends") or [])
    _print_qos(backends)
    _print_global_rates(document.get("global_rates") or [])
    _print_token_budgets(document.get("token_budgets") or [])
    _print_drift(document.get("routes") or {})
    _print_tracing(document.get("tracing"), backends)
    if backends:
        _print_functions(backends)
        _print_generation(backends)
    if document.get("kube"):
        from meshfn.kube.cli import print_operator

        print_operator(out, document["kube"])
    _print_nacks(nacks)


def _print_connection_limits(refusals: list[dict[str, Any]]) -> None:
    """The proxies that closed new connections at their connection limit (how many since they
    started): a flood, or a limit too low for the traffic (MESHFN_PROXY_MAX_CONNECTIONS)."""
    for proxy in refusals:
        out.print(
            f"[red]proxy {proxy['proxy']}: {proxy['connections_refused']} connection(s) refused"
            " at its connection limit[/red] (MESHFN_PROXY_MAX_CONNECTIONS)",
            highlight=False,
        )


def _print_tracing(collector: dict[str, Any] | None, backends: list[BackendFunctions]) -> None:
    """Spans: what the embedded collector keeps and dropped (by reason), what each backend
    exported and dropped, and what each proxy's tracer sent and failed to export (a collector
    down or slow never delays a request: its spans are dropped and counted here)."""
    if collector is not None and "otlp_grpc" in collector:
        dropped = collector["dropped_spans"]
        lost = sum(dropped.values())
        out.print(
            f"trace collector {collector['otlp_grpc']} (OTLP/gRPC), {collector['otlp_http']}"
            " (OTLP/HTTP): "
            f"{collector['traces']} trace(s), {collector['bytes'] // 1024} of"
            f" {collector['max_bytes'] // 1024} KiB, {collector['received_spans']} span(s)"
            f" received, {lost} dropped"
            + (" (" + ", ".join(f"{n} {r}" for r, n in dropped.items() if n) + ")" if lost else "")
            + f"; {collector.get('backend_collections', 0)} collection(s) from the backends,"
            f" {collector.get('backend_collection_failures', 0)} failed",
            highlight=False,
        )
    for proxy in (collector or {}).get("proxies") or []:
        failed = proxy.get("failed_exports", 0)
        colour = "red" if failed else "dim"
        out.print(
            f"  proxy {proxy['proxy']}: {proxy.get('spans_sent', 0)} span(s) sent,"
            f" [{colour}]{failed} export(s) failed[/{colour}]",
            highlight=False,
        )
    for backend, _, _ in backends:
        tracing = backend.get("tracing")
        if not tracing:
            continue
        colour = "red" if tracing["dropped_spans"] else "dim"
        error = f" (last error: {tracing['last_error']})" if tracing.get("last_error") else ""
        out.print(
            f"  backend {backend['address']}:{backend['port']}: {tracing['exported_spans']}"
            f" span(s) {_sent_to(tracing)}, [{colour}]{tracing['dropped_spans']}"
            f" dropped[/{colour}]{error}",
            highlight=False,
        )


def _sent_to(tracing: dict[str, Any]) -> str:
    if tracing.get("collected_by"):
        return f"collected by {tracing['collected_by']}"
    return f"exported to {tracing['endpoint']}"


def _print_audit(audit: dict[str, Any]) -> None:
    """The audit lines of `meshfn status`: what is stored and pending, what is signed, and
    every error loudly (store unwritable, signer unreachable or refusing)."""
    journals = audit.get("journals", [])
    stored = sum(j["stored"] for j in journals)
    pending = sum(j["pending_bytes"] for j in journals)
    out.print(
        f"audit trail {audit['store']}: {len(journals)} journal(s), {stored} record(s) stored"
        f" since start, {pending} byte(s) pending; {audit.get('unsigned', 0)} record(s) since"
        f" checkpoint {audit.get('last_checkpoint')}, witness {audit.get('witness')}",
        highlight=False,
    )
    if audit.get("error"):
        out.print(f"[red]audit store error: {audit['error']}[/red] (records wait in the journals)")
    if audit.get("signer_error"):
        out.print(f"[red]audit signer error: {audit['signer_error']}[/red] (records not signed)")
    for refusal in audit.get("refused") or []:
        out.print(f"[red]audit signer refuses {refusal}[/red]")
    if audit.get("parse_errors") or audit.get("conflicts"):
        out.print(
            f"audit: {audit.get('parse_errors', 0)} unparsable journal line(s) stored as such,"
            f" {audit.get('conflicts', 0)} batch(es) another collector had stored first"
        )


def _print_functions(backends: list[BackendFunctions]) -> None:
    """Each inference backend's functions: state, warm-up predictions, hits, misses, loads
    (cold starts, and of them how many found their code still deserialized)."""
    table = Table(title="functions", title_justify="left")
    for column in ("backend", "function", "state", "warmup", "predictions", "hits", "misses",
                   "cold requests", "warm s", "loads", "cached code"):  # fmt: skip
        table.add_column(column)
    for backend, functions, problem in backends:
        if functions is None:
            table.add_row(Text(backend["service"]), "-", f"[red]unreachable[/red] ({problem})")
            continue
        for f in functions:
            warm = f.get("warmup", {})
            table.add_row(
                Text(backend["service"]),
                Text(f"{f['name']}@{f['version']}"),
                Text(f["state"]),
                Text(warm.get("mode", "-")),
                *(str(warm.get(k, "-")) for k in ("predictions", "hits", "misses")),
                str(f.get("cold_requests", "-")),
                f"{f.get('warm_instance_seconds', 0):.1f}",
                str(f.get("cold_starts", "-")),
                str(f.get("code_cache_hits", "-")),
            )
    out.print(table)


def config_dump(
    node: Annotated[
        str, typer.Argument(help="node id (edge.default~0) or workload (edge.default)")
    ],
    admin: AdminOpt = None,
    resource_type: Annotated[
        str | None, typer.Option("--type", help="listeners | routes | clusters | endpoints")
    ] = None,
    state_dir: ClientStateOpt = DEFAULT_STATE,
) -> None:
    """What the control plane sends NODE, as YAML."""
    from meshfn.xds.dump import to_yaml

    query = urllib.parse.urlencode({"node": node})
    document = get_json(f"{admin_url(admin, state_dir)}/debug/config_dump?{query}", state_dir)
    if resource_type:
        if resource_type not in document:
            have = ", ".join(k for k in document if k not in ("workload", "version"))
            fail(f"no {resource_type} for {node} (have: {have})")
        document = {resource_type: document[resource_type]}
    out.print(to_yaml(document), end="", markup=False, highlight=False)
