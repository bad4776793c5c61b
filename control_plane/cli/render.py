"""`meshfn render istio`: the policies as another control plane's objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from meshfn.common.cli import err, fail, out
from meshfn.istio.options import DEFAULT as ISTIO_DEFAULTS
from meshfn.kube.cli import ContextOpt, KubeconfigOpt, NamespaceOpt

from .shared import DEFAULT_POLICIES, DEFAULT_STATE, PoliciesOpt, StateOpt, loaded

render_app = typer.Typer(help="Render the policies for another control plane (Istio).")


def _model(
    policies: Path,
    from_cluster: bool,
    kubeconfig: Path | None,
    context: str | None,
    namespace: str | None,
) -> tuple[Any, Any]:
    """The model and where each of its objects came from: the policy files, or the cluster's
    meshfn objects."""
    if from_cluster:
        from meshfn.kube.cli import cluster_model

        return loaded(lambda: cluster_model(kubeconfig, context, namespace))
    from meshfn.policy import PolicyLoader

    loader = PolicyLoader(policies)
    return loaded(loader.load), loader.provenance()


def _warning_lines(rendering: Any, provenance: Any) -> list[str]:
    """What Istio cannot express, each at the policy field it comes from."""
    from meshfn.policy.source import format_loc

    lines = []
    for warning in rendering.warnings:
        source = warning.source
        where = provenance.where(source.kind, source.namespace, source.name, warning.path)
        lines.append(
            f"{where or source}: {format_loc(warning.path)}: {warning.message} "
            f"[{warning.code}] ({source})"
        )
    return lines


def _write(rendering: Any, rendered: dict[str, str], out_dir: Path) -> None:
    """One file per kind into `out_dir`, each replaced atomically; a kind no longer rendered
    loses its file."""
    from meshfn.istio.registry import KINDS, MESH_CONFIG_FILE

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in {k.file for k in KINDS} - set(rendered):
        (out_dir / stale).unlink(missing_ok=True)
    for name, text in rendered.items():
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)
    counts = ", ".join(f"{len(v)} {k}" for k, v in rendering.objects.items() if v)
    err.print(f"wrote {out_dir}/ ({counts}; {MESH_CONFIG_FILE})", markup=False, highlight=False)


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
    from meshfn.wasm_filters import BuildError, artifacts, build

    model, provenance = _model(policies, from_cluster, kubeconfig, context, namespace)
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
        fail(exc)
    except SchemaError as exc:
        fail(f"a rendered object fails Istio's schema (a meshfn bug; nothing written): {exc}")
    lines = _warning_lines(rendering, provenance)
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
    if out_dir is not None:
        _write(rendering, rendered, out_dir)
    elif not explain:
        text = "---\n".join(v for k, v in rendered.items() if k != "mesh-config.yaml")
        out.print(text, end="", markup=False, highlight=False)


def _explain(rendering: Any, provenance: Any) -> None:
    """policy -> the objects it became -> its warnings (rich Text: names are not markup)."""
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
