"""`meshfn analyze | validate | translate | schema`: the policies, checked and rendered offline
(no control plane needed; `analyze` also reads a running one's drift state when it can)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from meshfn.common.cli import err, fail, out
from meshfn.ir import MeshModel
from meshfn.policy import PolicyLoader

from .shared import (
    DEFAULT_POLICIES,
    DEFAULT_STATE,
    AdminOpt,
    AdminUnreachable,
    StateOpt,
    admin_json,
    known_workloads,
    load_model,
    loaded,
    recorded_admin,
)

ThresholdOpt = Annotated[
    str,
    typer.Option(
        "--failure-threshold", help="exit 1 on findings this severe: error | warning | info"
    ),
]
PathArg = Annotated[Path, typer.Argument(help="policy file or directory")]


def _drift(admin: str | None, state_dir: Path) -> dict[str, Any] | None:
    """The routes' drift state from the control plane at --admin (which must answer), or from
    the one `meshfn up` recorded in the state directory (if it still runs)."""
    url = admin.rstrip("/") if admin else recorded_admin(state_dir)
    if url is None:
        return None
    try:
        document = admin_json(url + "/debug/status", timeout=3, state_dir=state_dir)
        routes: dict[str, Any] = document.get("routes", {})
    except AdminUnreachable as exc:
        if admin is not None:
            fail(f"cannot read the control plane at {url}: {exc}")
        return None
    return routes


def _analysis(
    path: Path, model: MeshModel, items: list[Any], state_dir: Path, admin: str | None,
    as_json: bool, threshold: str,
) -> int:  # fmt: skip
    """Run `meshfn analyze` on a loaded policy set; print the findings; the exit status."""
    from ..analyze import SEVERITIES, analyze

    if threshold.capitalize() not in SEVERITIES:
        fail(f"--failure-threshold must be one of {', '.join(s.lower() for s in SEVERITIES)}")
    findings = analyze(items, model, state_dir, _drift(admin, state_dir))
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


def analyze(
    path: PathArg = DEFAULT_POLICIES,
    state_dir: StateOpt = DEFAULT_STATE,
    admin: AdminOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="findings as JSON")] = False,
    threshold: ThresholdOpt = "error",
) -> None:
    """Find unsafe or ineffective settings (codes MF01xx security, MF02xx reliability; one page
    each in docs/reference/analyze/), with file:line and the fix, like istioctl analyze. Exit 1
    on errors."""
    model, items = loaded(PolicyLoader(path).load_with_sources)
    raise typer.Exit(_analysis(path, model, items, state_dir, admin, as_json, threshold))


def validate(
    path: PathArg,
    run_analyze: Annotated[
        bool, typer.Option("--analyze", help="also run meshfn analyze on the policies")
    ] = False,
    state_dir: StateOpt = DEFAULT_STATE,
    threshold: ThresholdOpt = "error",
) -> None:
    """Check policies: schema, references, port clashes. Prints file:line: field: problem."""
    from ..runtime.bootstrap import admin_port_warnings

    model, items = loaded(PolicyLoader(path).load_with_sources)
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


def translate(
    path: PathArg,
    workload: Annotated[
        str | None, typer.Option(help="workload (name.namespace); default all")
    ] = None,
) -> None:
    """Print the Envoy resources meshfn would send, as YAML (offline, no server needed)."""
    from meshfn.xds.dump import resources_to_plain, to_yaml
    from meshfn.xds.translate import translate as run_translate

    model = load_model(path)
    groups = [workload] if workload else [w.node_cluster for w in model.workloads]
    documents: dict[str, Any] = {}
    for group in groups:
        resources = run_translate(model, group)
        if resources is None:
            fail(f"no workload {group!r} (known: {known_workloads(model)})")
        documents[group] = resources_to_plain(resources)
    out.print(to_yaml(documents), end="", markup=False, highlight=False)


def schema(
    out_dir: Annotated[Path, typer.Option("--out", help="directory")] = Path("policies/schema"),
) -> None:
    """Export the JSON Schema of every policy kind (generated from the models)."""
    from meshfn.policy.schema import export

    for path in export(out_dir):
        out.print(f"wrote {path}")
