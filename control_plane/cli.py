"""`meshfn`: run the mesh, validate policies, and see inside the control plane."""

from __future__ import annotations

import os

# Must precede the first gRPC import: our children exec right after fork, so grpc-core's fork
# handlers only print warnings.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import asyncio
import dataclasses
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshfn.audit.cli import audit_app
from meshfn.common.clihelp import reflow_help
from meshfn.common.logs import setup_logging
from meshfn.istio.options import DEFAULT as ISTIO_DEFAULTS
from meshfn.kube.cli import ContextOpt, KubeconfigOpt, NamespaceOpt
from meshfn.policy import PolicyErrors, load_policies

app = typer.Typer(
    name="meshfn",
    help="meshfn: a zero-trust service mesh for serverless AI inference (xDS control plane).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output keeps full lines (rich would otherwise wrap tables at 80 columns).
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 200)

DEFAULT_POLICIES = Path("policies/examples")
DEFAULT_STATE = Path(".meshfn")

PoliciesOpt = Annotated[Path, typer.Option("--policies", "-p", help="policy file or directory")]
AdminOpt = Annotated[
    str | None,
    typer.Option(
        "--admin", help="control plane admin URL (default: $MESHFN_ADMIN, .meshfn/state.json)"
    ),
]
LogFormatOpt = Annotated[str, typer.Option("--log-format", help="human | json")]
StateOpt = Annotated[
    Path, typer.Option("--state-dir", help="CA, token keys, logs, bootstraps (keep private)")
]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error")]
AdminListenOpt = Annotated[
    str,
    typer.Option(
        "--admin-listen",
        help="address of the admin port and its web console (beyond loopback it needs a token)",
    ),
]
AdminTokenOpt = Annotated[
    Path | None,
    typer.Option(
        "--admin-token-file",
        help="file holding the admin token (default: $MESHFN_ADMIN_TOKEN); every admin request"
        " and the console must then present it",
    ),
]


def _admin_token(path: Path | None) -> str | None:
    """The admin token from --admin-token-file or $MESHFN_ADMIN_TOKEN (at least 16 characters)."""
    try:
        token = path.read_text().strip() if path else os.environ.get("MESHFN_ADMIN_TOKEN", "")
    except OSError as exc:
        _fail(f"--admin-token-file {path}: {exc.strerror or exc}")
        return None
    if token and len(token) < 16:
        _fail("the admin token must have at least 16 characters")
    return token or None


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


# ------------------------------------------------------------------ policies


ThresholdOpt = Annotated[
    str,
    typer.Option(
        "--failure-threshold", help="exit 1 on findings this severe: error | warning | info"
    ),
]


def _load_or_exit(path: Path) -> tuple[Any, list[Any]]:
    from meshfn.policy import PolicyLoader

    try:
        return PolicyLoader(path).load_with_sources()
    except PolicyErrors as exc:
        for error in exc.errors:
            err.print(str(error), highlight=False, markup=False)
        err.print(f"[red]{len(exc.errors)} error(s)[/red]")
        raise typer.Exit(1) from None


def _analysis(
    path: Path, model: Any, items: list[Any], state_dir: Path, admin: str | None,
    as_json: bool, threshold: str,
) -> int:  # fmt: skip
    """Run `meshfn analyze` on a loaded policy set; print the findings; the exit status."""
    from .analyze import SEVERITIES, analyze

    if threshold.capitalize() not in SEVERITIES:
        _fail(f"--failure-threshold must be one of {', '.join(s.lower() for s in SEVERITIES)}")
    drift = None
    state_file = state_dir / "state.json"
    if admin is not None or state_file.exists():
        url = admin.rstrip("/") if admin else None
        if url is None:
            try:
                url = str(json.loads(state_file.read_text())["admin"]).rstrip("/")
            except (OSError, ValueError, KeyError):
                url = None
        if url is not None:
            try:
                with urllib.request.urlopen(url + "/debug/status", timeout=3) as response:
                    drift = json.loads(response.read()).get("routes", {})
            except (urllib.error.URLError, OSError, ValueError):
                if admin is not None:
                    _fail(f"cannot reach the control plane at {url}")
    findings = analyze(items, model, state_dir, drift)
    if as_json:
        print(json.dumps([f.as_dict() for f in findings], indent=2))
    else:
        for finding in findings:
            line = finding.line()
            style = {"Error": "red", "Warning": "yellow"}.get(finding.severity)
            (err if style == "red" else out).print(
                f"[{style}]{line}[/{style}]" if style else line, highlight=False, markup=True
            )
        if not findings:
            out.print(f"[green]✔ No problems found in {path}[/green]")
    limit = SEVERITIES.index(threshold.capitalize())
    return int(any(SEVERITIES.index(f.severity) <= limit for f in findings))


@app.command()
def analyze(
    path: Annotated[Path, typer.Argument(help="policy file or directory")] = DEFAULT_POLICIES,
    state_dir: StateOpt = DEFAULT_STATE,
    admin: AdminOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="findings as JSON")] = False,
    threshold: ThresholdOpt = "error",
) -> None:
    """Find unsafe or ineffective settings (codes MF01xx security, MF02xx reliability; see the
    README), with file:line and the fix, like istioctl analyze. Exit 1 on errors."""
    model, items = _load_or_exit(path)
    raise typer.Exit(_analysis(path, model, items, state_dir, admin, as_json, threshold))


@app.command()
def validate(
    path: Annotated[Path, typer.Argument(help="policy file or directory")],
    run_analyze: Annotated[
        bool, typer.Option("--analyze", help="also run meshfn analyze on the policies")
    ] = False,
    state_dir: StateOpt = DEFAULT_STATE,
    threshold: ThresholdOpt = "error",
) -> None:
    """Check policies: schema, references, port clashes. Prints file:line: field: problem."""
    from .runtime.bootstrap import admin_port_warnings

    model, items = _load_or_exit(path)
    routes = sum(len(lst.routes) for w in model.workloads for lst in w.listeners)
    gateways = sum(1 for w in model.workloads if w.kind == "gateway")
    sidecars = sum(1 for w in model.workloads if w.kind == "sidecar")
    out.print(
        f"[green]ok[/green]: mesh {model.name}: {gateways} gateway(s), "
        f"{len(model.services)} service(s), {sidecars} sidecar(s), "
        f"{routes} route attachment(s)"
    )
    for warning in admin_port_warnings(model):
        err.print(f"[yellow]{warning}[/yellow]", highlight=False)
    if run_analyze:
        raise typer.Exit(_analysis(path, model, items, state_dir, None, False, threshold))


@app.command()
def translate(
    path: Annotated[Path, typer.Argument(help="policy file or directory")],
    workload: Annotated[
        str | None, typer.Option(help="workload (name.namespace); default all")
    ] = None,
) -> None:
    """Print the Envoy resources meshfn would send, as YAML (offline, no server needed)."""
    from meshfn.xds.dump import resources_to_plain, to_yaml
    from meshfn.xds.translate import translate as run_translate

    try:
        model = load_policies(path)
    except PolicyErrors as exc:
        _fail(str(exc))
        return
    groups = [workload] if workload else [w.node_cluster for w in model.workloads]
    documents: dict[str, Any] = {}
    for group in groups:
        resources = run_translate(model, group)
        if resources is None:
            known = ", ".join(w.node_cluster for w in model.workloads)
            _fail(f"no workload {group!r} (known: {known})")
            return
        documents[group] = resources_to_plain(resources)
    out.print(to_yaml(documents), end="", markup=False, highlight=False)


@app.command()
def schema(
    out_dir: Annotated[Path, typer.Option("--out", help="directory")] = Path("policies/schema"),
) -> None:
    """Export the JSON Schema of every policy kind (generated from the models)."""
    from meshfn.policy.schema import export

    for path in export(out_dir):
        out.print(f"wrote {path}")


@app.command()
def bootstrap(
    workload: Annotated[str, typer.Argument(help="workload (name.namespace)")],
    policies: PoliciesOpt = DEFAULT_POLICIES,
    state_dir: StateOpt = DEFAULT_STATE,
    instance: Annotated[int, typer.Option(help="instance number in the node id")] = 0,
) -> None:
    """Print the Envoy bootstrap for a workload, to run an Envoy against meshfn yourself. It
    carries the workload's bootstrap token: treat it as a secret."""
    from .identity.bootstrap_token import BootstrapTokens
    from .runtime.bootstrap import ProxyIdentity, bootstrap_json

    try:
        model = load_policies(policies)
    except PolicyErrors as exc:
        _fail(str(exc))
        return
    found = model.workload(workload)
    if found is None:
        _fail(
            f"no workload {workload!r} (known: {', '.join(w.node_cluster for w in model.workloads)})"
        )
        return
    tokens = BootstrapTokens(state_dir / "xds-token.key")
    identity = ProxyIdentity.for_workload(found, tokens.header(found.node_cluster), instance)
    out.print_json(json.dumps(bootstrap_json(identity, "127.0.0.1", model.xds_port)))


# ------------------------------------------------------------------ running


@app.command()
def up(
    policies: PoliciesOpt = DEFAULT_POLICIES,
    state_dir: StateOpt = DEFAULT_STATE,
    envoy_concurrency: Annotated[int, typer.Option(help="Envoy worker threads")] = 2,
    envoy_log_level: Annotated[str, typer.Option(help="Envoy log level")] = "warning",
    functions_registry: Annotated[
        Path | None, typer.Option(help="published functions (default: STATE_DIR/functions)")
    ] = None,
    trusted_key: Annotated[
        list[Path] | None, typer.Option(help="ed25519 public key functions must be signed with")
    ] = None,
    publish_examples: Annotated[
        bool, typer.Option(help="build, sign and publish the example functions first (cached)")
    ] = False,
    backend_processes: Annotated[
        int,
        typer.Option(
            min=1, max=64, help="serving processes per inference backend, sharing its port"
        ),
    ] = 1,
    backend_workers: Annotated[
        int, typer.Option(min=1, max=64, help="threads running wasm per backend process")
    ] = 2,
    log_format: LogFormatOpt = "human",
    log_level: LogLevelOpt = "info",
    admin_listen: AdminListenOpt = "127.0.0.1",
    admin_token_file: AdminTokenOpt = None,
) -> None:
    """Run the control plane, one Envoy per gateway and sidecar, the inference backends and
    placeholder upstreams; hot-reload policies. The web console is at ADMIN/ui."""
    from meshfn.common.files import secure_state_dir

    from .runtime.up import run_up
    from .runtime.upstreams import FunctionsSetup

    setup_logging(log_format, log_level)
    secure_state_dir(state_dir)  # before anything is published into it
    registry = functions_registry or state_dir / "functions"
    keys = list(trusted_key or [])
    if publish_examples:
        from meshfn.inference.cli import InferenceError
        from meshfn.inference.cli import publish_examples as publish

        try:  # progress bars while something builds; one line saying what was cached
            _, public = publish(registry, err)
        except (InferenceError, OSError) as exc:
            _fail(f"publishing the example functions failed: {exc}")
            return
        keys.append(public)
    setup = (
        FunctionsSetup(registry, tuple(keys), backend_workers, backend_processes) if keys else None
    )
    token = _admin_token(admin_token_file)
    code = asyncio.run(
        run_up(
            policies,
            state_dir,
            envoy_concurrency,
            envoy_log_level,
            out,
            setup,
            admin_listen,
            token,
        )
    )
    raise typer.Exit(code)


@app.command()
def serve(
    policies: PoliciesOpt = DEFAULT_POLICIES,
    state_dir: StateOpt = DEFAULT_STATE,
    xds_port: Annotated[int | None, typer.Option(help="override the Mesh xds port")] = None,
    admin_port: Annotated[int | None, typer.Option(help="override the Mesh admin port")] = None,
    watch: Annotated[bool, typer.Option(help="hot-reload on policy changes")] = True,
    log_format: LogFormatOpt = "json",
    log_level: LogLevelOpt = "info",
    admin_listen: AdminListenOpt = "127.0.0.1",
    admin_token_file: AdminTokenOpt = None,
) -> None:
    """Run only the control plane (ADS + admin and its console), for Envoys you run yourself."""
    from .runtime.serve import run_serve

    setup_logging(log_format, log_level)
    token = _admin_token(admin_token_file)
    raise typer.Exit(
        asyncio.run(
            run_serve(policies, state_dir, xds_port, admin_port, watch, admin_listen, token)
        )
    )


# ------------------------------------------------------------------ seeing inside


def _admin_url(admin: str | None) -> str:
    if admin:
        return admin.rstrip("/")
    if os.environ.get("MESHFN_ADMIN"):
        return os.environ["MESHFN_ADMIN"].rstrip("/")
    state = DEFAULT_STATE / "state.json"
    if state.exists():
        try:
            return str(json.loads(state.read_text())["admin"]).rstrip("/")
        except (ValueError, KeyError):
            pass
    return "http://127.0.0.1:18001"


def _get_json(url: str) -> Any:
    request = urllib.request.Request(url)
    if token := os.environ.get("MESHFN_ADMIN_TOKEN"):  # an admin port beyond loopback
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            detail = exc.reason
        _fail(str(detail))
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        _fail(f"cannot reach the control plane at {url}: {reason} (is meshfn up running?)")
    return None


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
    """Each inference backend's own /meshfn/functions (on loopback), read once for every table
    that shows it: (backend, its functions or None, why not)."""
    fetched: list[BackendFunctions] = []
    for backend in backends:
        url = f"http://{backend['address']}:{backend['port']}/meshfn/functions"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                fetched.append((backend, json.loads(response.read())["functions"], ""))
        except (OSError, ValueError, KeyError) as exc:
            fetched.append((backend, None, str(exc)))
    return fetched


def _print_qos(backends: list[BackendFunctions]) -> None:
    """Per function and tenant: admitted, limited, shed, guest CPU and budget use, as each
    inference backend counts them."""
    table = Table(title="multi-tenant QoS (per backend)", title_justify="left")
    for column in ("backend", "function", "tenant", "class", "admitted", "limited", "shed",
                   "guest CPU ms", "budget used ms"):  # fmt: skip
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


@app.command()
def status(
    admin: AdminOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="raw JSON")] = False,
    kube: Annotated[
        bool, typer.Option("--kube", help="the cluster's meshfn objects: conditions, what they own")
    ] = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Every connected proxy: per type the version sent and ACKed, and the last NACK. With
    --kube: every meshfn custom resource, its conditions and the objects it owns."""
    if kube:
        from meshfn.kube.cli import print_status

        raise typer.Exit(print_status(out, kubeconfig, context, namespace))
    document = _get_json(_admin_url(admin) + "/debug/status")
    if as_json:
        out.print_json(json.dumps(document))
        return
    if document["policy_errors"]:
        err.print(
            "[red]the last policy change was rejected; the previous configuration is in force:[/red]"
        )
        for line in document["policy_errors"]:
            err.print(f"  {line}", markup=False, highlight=False)
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
    acceleration = document.get("acceleration")
    if acceleration:
        counters = acceleration["counters"]
        state = "[green]on[/green]" if acceleration["attached"] else "[yellow]off[/yellow]"
        out.print(
            f"eBPF acceleration {state} ({acceleration['mode']}): {acceleration['reason']}; "
            f"{counters.get('messages_redirected', 0)} messages redirected, "
            f"{counters.get('sockets_in_map', 0)} sockets in the map"
        )
    _print_sandbox(document.get("sandbox"))
    audit = document.get("audit")
    if audit and audit.get("enabled"):
        _print_audit(audit)
        _print_proxy_refusals(audit.get("qos_refusals") or [])
    backends = _backend_functions(document.get("inference_backends") or [])
    _print_qos(backends)
    _print_global_rates(document.get("global_rates") or [])
    if document.get("routes"):
        routes = Table(title="drift breaker", title_justify="left")
        for column in ("route", "state", "p95 ms", "baseline ms", "samples", "transitions"):
            routes.add_column(column)
        for name, route in document["routes"].items():
            state = route["state"]
            routes.add_row(
                Text(name),
                f"[red]{state}[/red]" if state == "degraded" else f"[green]{state}[/green]",
                f"{route['p95_ms']:.1f}",
                f"{route['baseline_ms']:.1f}",
                str(route["samples"]),
                str(route["transitions"]),
            )
        out.print(routes)
    if backends:
        _print_functions(backends)
    if document.get("kube"):
        from meshfn.kube.cli import print_operator

        print_operator(out, document["kube"])
    for node, type_name, nack in nacks:
        out.print("[red]NACK[/red] ", end="")
        out.print(f"{node} {type_name} version {nack['version'][:8]}: ", end="", markup=False)
        out.print(nack["error"], markup=False, highlight=False)


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
            entry = backend[layer]
            out.print(Text(f"  {layer}: {entry['detail']}"), highlight=False)
        if backend["denied"]:
            refused = ", ".join(
                f"{reason} {d['count']}" + (f" (last {d['last']})" if d["last"] else "")
                for reason, d in backend["denied"].items()
            )
            out.print(Text(f"  egress denied: {refused}", style="red"))


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


@app.command("config-dump")
def config_dump(
    node: Annotated[
        str, typer.Argument(help="node id (edge.default~0) or workload (edge.default)")
    ],
    admin: AdminOpt = None,
    resource_type: Annotated[
        str | None, typer.Option("--type", help="listeners | routes | clusters | endpoints")
    ] = None,
) -> None:
    """What the control plane sends NODE, as YAML."""
    from meshfn.xds.dump import to_yaml

    query = urllib.parse.urlencode({"node": node})
    document = _get_json(f"{_admin_url(admin)}/debug/config_dump?{query}")
    if resource_type:
        if resource_type not in document:
            _fail(
                f"no {resource_type} for {node} (have: {', '.join(k for k in document if k not in ('workload', 'version'))})"
            )
        document = {resource_type: document[resource_type]}
    out.print(to_yaml(document), end="", markup=False, highlight=False)


# ------------------------------------------------------------------ render

render_app = typer.Typer(help="Render the policies for another control plane (Istio).")
app.add_typer(render_app, name="render")


@render_app.command("istio")
def render_istio(
    policies: PoliciesOpt = DEFAULT_POLICIES,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="write one file per kind here (default: stdout)"),
    ] = None,
    explain: Annotated[
        bool, typer.Option("--explain", help="print what each policy became, and warnings")
    ] = False,
    strict: Annotated[
        bool, typer.Option("--strict", help="a policy Istio cannot express is an error")
    ] = False,
    label_key: Annotated[
        str, typer.Option(help="pod label that names a Service's or Gateway's workloads")
    ] = "app",
    root_namespace: Annotated[
        str, typer.Option(help="Istio's root namespace (mesh-wide policies)")
    ] = "istio-system",
    cluster_domain: Annotated[str, typer.Option(help="hosts are <svc>.<ns>.svc.<domain>")] = (
        "cluster.local"
    ),
    wasm_base_url: Annotated[
        str,
        typer.Option(help="http(s)://... (modules at <base><sha256>.wasm) or oci://registry/repo"),
    ] = ISTIO_DEFAULTS.wasm_base_url,
    control_plane_host: Annotated[
        str, typer.Option(help="the control plane's Service host (access-log stream)")
    ] = ISTIO_DEFAULTS.control_plane_host,
    journal_path: Annotated[
        str, typer.Option(help="where istio-proxy writes the audit journal")
    ] = "/var/run/meshfn/journal/audit.jsonl",
    state_dir: StateOpt = DEFAULT_STATE,
    from_cluster: Annotated[
        bool, typer.Option("--from-cluster", help="the cluster's meshfn objects, not --policies")
    ] = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Istio objects for the policies (PeerAuthentication ... Telemetry), validated against
    Istio's schemas; kubectl-apply-ready. Nothing is written when anything is wrong."""
    from meshfn.audit.salt import load_or_create
    from meshfn.istio import MissingModule, RenderOptions, SchemaError, Unrenderable, render
    from meshfn.istio.output import files
    from meshfn.policy import PolicyLoader
    from meshfn.wasm_filters import BuildError, artifacts, build

    loader = PolicyLoader(policies)
    try:
        if from_cluster:
            from meshfn.kube.cli import cluster_model

            model, provenance = cluster_model(kubeconfig, context, namespace)
        else:
            model = loader.load()
            provenance = loader.provenance()
    except PolicyErrors as exc:
        for error in exc.errors:
            err.print(str(error), highlight=False, markup=False)
        err.print(f"[red]{len(exc.errors)} error(s)[/red]")
        raise typer.Exit(1) from None
    options = RenderOptions(
        label_key=label_key,
        root_namespace=root_namespace,
        cluster_domain=cluster_domain,
        wasm_base_url=wasm_base_url,
        control_plane_host=control_plane_host,
        journal_path=journal_path,
    )
    if model.audit is not None:
        options = dataclasses.replace(options, salt=load_or_create(state_dir))
    try:
        rendering = render(model, artifacts(build()), options)
    except (BuildError, MissingModule, Unrenderable) as exc:
        _fail(str(exc))
        return
    except SchemaError as exc:
        _fail(f"a rendered object fails Istio's schema (a meshfn bug; nothing written): {exc}")
        return
    lines = []
    for warning in rendering.warnings:
        source = warning.source
        where = provenance.where(source.kind, source.namespace, source.name, warning.path)
        from meshfn.policy.source import format_loc

        lines.append(
            f"{where or source}: {format_loc(warning.path)}: {warning.message} "
            f"[{warning.code}] ({source})"
        )
    for line in lines:
        err.print(("error: " if strict else "warning: ") + line, markup=False, highlight=False)
    if explain:
        _explain(rendering, provenance)
    if strict and lines:
        err.print(
            f"[red]{len(lines)} part(s) Istio cannot express (--strict): nothing written[/red]"
        )
        raise typer.Exit(1)
    rendered = files(rendering)
    if out_dir is None:
        if not explain:
            text = "---\n".join(v for k, v in rendered.items() if k != "mesh-config.yaml")
            out.print(text, end="", markup=False, highlight=False)
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    from meshfn.istio.registry import KINDS, MESH_CONFIG_FILE

    for stale in {k.file for k in KINDS} - set(rendered):
        (out_dir / stale).unlink(missing_ok=True)
    for name, text in rendered.items():
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)
    counts = ", ".join(f"{len(v)} {k}" for k, v in rendering.objects.items() if v)
    err.print(f"wrote {out_dir}/ ({counts}; {MESH_CONFIG_FILE})", markup=False, highlight=False)


def _explain(rendering: Any, provenance: Any) -> None:
    """policy -> the objects it became -> its warnings (rich Text: names are not markup)."""
    from rich.text import Text

    became: dict[Any, list[str]] = {}
    for (kind, namespace, name), sources in rendering.origins.items():
        for source in sources:
            became.setdefault(source, []).append(f"{kind} {namespace}/{name}")
    warned: dict[Any, list[str]] = {}
    for warning in rendering.warnings:
        warned.setdefault(warning.source, []).append(f"[{warning.code}] {warning.message}")
    table = Table("policy", "where", "Istio objects", "warnings")
    for source in sorted(set(became) | set(warned)):
        where = provenance.where(source.kind, source.namespace, source.name) or ""
        table.add_row(
            Text(str(source)),
            Text(where),
            Text("\n".join(sorted(became.get(source, []))) or "-"),
            Text("\n".join(warned.get(source, [])) or "-"),
        )
    out.print(table)


# ------------------------------------------------------------------ identity

token_app = typer.Typer(help="JWTs from the local issuer the example policies trust.")
certs_app = typer.Typer(help="Workload certificates (SPIFFE X.509).")
ca_app = typer.Typer(help="The mesh CA: rotate with an overlap, then retire the old root.")
app.add_typer(token_app, name="token")
app.add_typer(audit_app, name="audit")


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


app.add_typer(certs_app, name="certs")
app.add_typer(ca_app, name="ca")


@token_app.command("issue")
def token_issue(
    sub: Annotated[str, typer.Option("--sub", help="subject")],
    aud: Annotated[list[str], typer.Option("--aud", help="audience (repeatable)")],
    claim: Annotated[
        list[str] | None, typer.Option("--claim", help="k=v; repeat a key for a list")
    ] = None,
    ttl: Annotated[str, typer.Option(help='lifetime, e.g. "1h", "15m"')] = "1h",
    state_dir: StateOpt = DEFAULT_STATE,
) -> None:
    """Sign a token with the local issuer (ES256); prints the token."""
    from meshfn.contracts.durations import parse_duration

    from .identity.issuer import LocalIssuer

    try:
        lifetime = parse_duration(ttl)
    except ValueError as exc:
        _fail(str(exc))
        return
    claims: dict[str, Any] = {}
    for item in claim or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(f"--claim {item!r}: use key=value")
        if key in ("iss", "sub", "aud", "exp", "nbf", "iat"):
            _fail(f"--claim {key}: set it with its own option")
        if key in claims:
            previous = claims[key]
            claims[key] = [*previous, value] if isinstance(previous, list) else [previous, value]
        else:
            claims[key] = value
    issuer = LocalIssuer(state_dir / "issuer")
    out.print(issuer.issue(sub, aud, claims, lifetime), markup=False, highlight=False)


@certs_app.command("show")
def certs_show(
    node: Annotated[str, typer.Argument(help="node id or workload")],
    admin: AdminOpt = None,
    pem: Annotated[bool, typer.Option(help="also print the PEM chain")] = False,
) -> None:
    """Chain, SANs and expiry of the certificate a proxy holds (never its key)."""
    from cryptography import x509

    query = urllib.parse.urlencode({"node": node})
    document = _get_json(f"{_admin_url(admin)}/debug/certs?{query}")
    leaf = x509.load_pem_x509_certificate(document["certificate_pem"].encode())
    roots = x509.load_pem_x509_certificates(document["trust_bundle_pem"].encode())
    try:
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    out.print(f"workload   {document['workload']}")
    out.print(f"SPIFFE ID  {document['spiffe_id']}")
    out.print(f"URI SANs   {', '.join(uris) or '-'}")
    out.print(f"serial     {document['serial']}")
    out.print(f"valid      {document['not_before']} .. {document['not_after']}")
    out.print(f"renews at  {document['renew_at']}")
    out.print(f"issuer     {leaf.issuer.rfc4514_string()} (root {document['issuer_root']})")
    for root in roots:
        out.print(
            f"trusts     {root.subject.rfc4514_string()} until {root.not_valid_after_utc.isoformat()}"
        )
    if document.get("rolling_out"):
        out.print(
            f"rollout    a CA root change is rolling out (signing: {document['signing_root']})"
        )
    if pem:
        out.print(document["certificate_pem"] + document["trust_bundle_pem"], markup=False)


def _ca(policies: Path, state_dir: Path) -> Any:
    from .identity.ca import CertificateAuthority

    try:
        model = load_policies(policies)
    except PolicyErrors as exc:
        _fail(str(exc))
        return None
    return CertificateAuthority(state_dir / "ca" / model.trust_domain, model.trust_domain)


@ca_app.command("rotate")
def ca_rotate(
    policies: PoliciesOpt = DEFAULT_POLICIES, state_dir: StateOpt = DEFAULT_STATE
) -> None:
    """Add a new root. A running control plane puts it in every trust bundle, and once every
    proxy has ACKed that bundle, re-issues every workload certificate from it; both roots stay
    trusted until `retire`."""
    ca = _ca(policies, state_dir)
    new = ca.rotate()
    out.print(f"new root {new}; trusted: {', '.join(ca.root_fingerprints())}")


@ca_app.command("retire")
def ca_retire(
    policies: PoliciesOpt = DEFAULT_POLICIES, state_dir: StateOpt = DEFAULT_STATE
) -> None:
    """Stop trusting every root but the newest. A running control plane keeps a retired root
    in the trust bundles until every proxy has ACKed a certificate from the newest (at most
    60 s), so no live certificate is distrusted by a peer."""
    ca = _ca(policies, state_dir)
    retired = ca.retire()
    out.print(
        f"retired {', '.join(retired) or 'nothing'}; trusted: {', '.join(ca.root_fingerprints())}"
    )


# ------------------------------------------------------------------ proxy-wasm filters

filters_app = typer.Typer(help="meshfn's proxy-wasm filters (audit, degrade), built from C.")
app.add_typer(filters_app, name="filters")


@filters_app.command("build")
def filters_build(
    native: Annotated[
        bool, typer.Option("--native", help="also the native test-harness builds")
    ] = False,
) -> None:
    """Build the filter modules (clang + lld) into the content-addressed cache; print where."""
    from meshfn.common.progress import RichReporter
    from meshfn.wasm_filters import BuildError, artifacts, build

    try:
        with RichReporter(err, "filters") as progress:
            directory = build(native, progress)
        digests = artifacts(directory)
    except BuildError as exc:
        _fail(str(exc))
    out.print(str(directory), markup=False, highlight=False)
    for name, digest in sorted(digests.items()):
        err.print(f"  {name}.wasm  sha256:{digest}", markup=False, highlight=False)


def _mount_kube_cli() -> None:
    from meshfn.kube.cli import kube_app

    app.add_typer(kube_app, name="kube")


_mount_kube_cli()


def _mount_function_cli() -> None:
    from meshfn.inference.cli import fn_app

    app.add_typer(fn_app, name="fn", help="Model functions: build, sign, publish (WASM).")


_mount_function_cli()
reflow_help(app)  # last: every command and sub-app is registered by now


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
