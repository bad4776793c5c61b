"""`meshfn kube ...` and `meshfn status --kube`: the operator and what it did, from the CLI."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from meshfn.common.cli import fail
from meshfn.common.kube.api import ApiError, KubeClient, KubeConfig, Obj, Unreachable
from meshfn.common.logs import setup_logging
from meshfn.contracts.kube import KINDS
from meshfn.ir import MeshModel
from meshfn.policy.kube_source import ObjectKey, compile_objects, resource
from meshfn.policy.loader import Provenance

log = logging.getLogger("meshfn.kube")

kube_app = typer.Typer(
    help="Kubernetes mode: meshfn as an operator beside istiod (CRDs, controller, status).",
    no_args_is_help=True,
)

KubeconfigOpt = Annotated[
    Path | None,
    typer.Option("--kubeconfig", help="default: $KUBECONFIG, the pod's account, ~/.kube/config"),
]
ContextOpt = Annotated[str | None, typer.Option("--context", help="kubeconfig context")]
NamespaceOpt = Annotated[
    str | None, typer.Option("--namespace", help="one namespace's meshfn objects (default all)")
]


def load_config(kubeconfig: Path | None, context: str | None) -> KubeConfig:
    try:
        return KubeConfig.load(kubeconfig, context)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None


@kube_app.command("crds")
def crds(
    out_dir: Annotated[Path, typer.Option("--out", help="directory")] = Path("manifests/crds"),
) -> None:
    """Write the CustomResourceDefinitions, generated from the policy models."""
    from meshfn.policy.crds import export

    for path in export(out_dir):
        typer.echo(f"wrote {path}")


@kube_app.command("run")
def run(
    config: Annotated[
        Path | None, typer.Option("--config", help="operator configuration (YAML)")
    ] = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: Annotated[
        str | None, typer.Option(help="the control plane's namespace (Lease, Events)")
    ] = None,
    instance: Annotated[str | None, typer.Option(help="installation name (labels)")] = None,
    watch_namespace: Annotated[str | None, typer.Option(help="watch only this namespace")] = None,
    listen: Annotated[str | None, typer.Option(help="address for admin and access logs")] = None,
    admin_port: Annotated[int | None, typer.Option(help="/metrics, /healthz, /wasm")] = None,
    als_port: Annotated[int | None, typer.Option(help="Envoy access-log service (gRPC)")] = None,
    lease_duration: Annotated[float | None, typer.Option(help="seconds")] = None,
    renew_deadline: Annotated[float | None, typer.Option(help="seconds")] = None,
    retry_period: Annotated[float | None, typer.Option(help="seconds")] = None,
    force_conflicts: Annotated[
        bool,
        typer.Option(
            "--force-conflicts",
            help="take over fields that another field manager owns (default: report and skip)",
        ),
    ] = False,
    identity: Annotated[str | None, typer.Option(help="this replica's name in the Lease")] = None,
    log_format: Annotated[str, typer.Option(help="human | json")] = "json",
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
) -> None:
    """Run the operator: watch meshfn's custom resources, render, apply (leader only)."""
    from .controller import Operator, OperatorConfig

    setup_logging(log_format, log_level)
    try:
        settings = OperatorConfig.load(
            config,
            namespace=namespace,
            instance=instance,
            watchNamespace=watch_namespace,
            listen=listen,
            adminPort=admin_port,
            alsPort=als_port,
            leaseDuration=lease_duration,
            renewDeadline=renew_deadline,
            retryPeriod=retry_period,
            forceConflicts=force_conflicts or None,
        )
    except ValueError as exc:
        fail(exc, 2)
    kube_config = load_config(kubeconfig, context)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with KubeClient(kube_config, user_agent="meshfn-operator") as kube:
            operator = Operator(kube, settings, identity=identity)
            try:
                await operator.run(stop)
            except OSError as exc:
                log.error("cannot start the operator: %s", exc)
                return 1
        return 0

    raise typer.Exit(asyncio.run(main()))


# ---------------------------------------------------------------- status --kube


def _condition(obj: Obj, kind: str) -> dict[str, Any]:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return {}


def cluster_model(
    kubeconfig: Path | None, context: str | None, namespace: str | None
) -> tuple[MeshModel, Provenance]:
    """`meshfn render istio --from-cluster`: the cluster's meshfn objects compiled as the
    operator compiles them; errors name `Kind namespace/name` (PolicyErrors)."""
    config = load_config(kubeconfig, context)
    try:
        objects = asyncio.run(cluster_status(config, namespace))
    except (Unreachable, ApiError, RuntimeError) as exc:
        fail(f"cannot read meshfn objects from {config.server}: {exc}")
    model = compile_objects({ObjectKey.of(o): o for o in objects})
    return model, Provenance({})


async def cluster_status(config: KubeConfig, namespace: str | None) -> list[Obj]:
    async with KubeClient(config, user_agent="meshfn-cli") as kube:
        found: list[Obj] = []
        for info in KINDS:
            try:
                items, _ = await kube.list(resource(info), namespace)
            except ApiError as exc:
                if exc.status == 404:
                    raise RuntimeError(
                        f"the meshfn CRDs are not installed ({info.crd_name} missing): "
                        "helm install meshfn manifests/ (or kubectl apply -f manifests/crds/)"
                    ) from None
                raise
            found.extend(items)
        return found


def print_status(
    console: Console, kubeconfig: Path | None, context: str | None, namespace: str | None
) -> int:
    """`meshfn status --kube`: every meshfn object, its conditions and what it owns."""
    config = load_config(kubeconfig, context)
    try:
        objects = asyncio.run(cluster_status(config, namespace))
    except Unreachable as exc:
        console.print(f"[red]cannot reach the apiserver[/red] {config.server}: {exc}")
        return 1
    except (ApiError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 1
    table = Table(title=f"meshfn objects in {config.server}", title_justify="left")
    for column in ("object", "accepted", "reason", "generation", "owns"):
        table.add_column(column)
    problems: list[tuple[str, str]] = []
    for obj in objects:
        meta = obj.get("metadata") or {}
        ref = f"{obj['kind']} " + (
            f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]
        )
        accepted = _condition(obj, "Accepted")
        status = accepted.get("status", "Unknown")
        observed = accepted.get("observedGeneration")
        generation = f"{observed}/{meta.get('generation')}"
        if observed != meta.get("generation"):
            generation = f"[yellow]{generation}[/yellow]"
        owned = (obj.get("status") or {}).get("resources") or []
        colour = {"True": "green", "False": "red"}.get(status, "yellow")
        table.add_row(
            ref,
            f"[{colour}]{status}[/{colour}]",
            accepted.get("reason", "-"),
            generation,
            ", ".join(f"{r['kind']} {r.get('namespace', '')}/{r['name']}" for r in owned) or "-",
        )
        if status != "True" and accepted.get("message"):
            problems.append((ref, accepted["message"]))
    console.print(table)
    if not objects:
        console.print("no meshfn objects")
    for ref, message in problems:
        console.print(f"[red]{ref}[/red]:")
        for line in message.splitlines():
            console.print(f"  {line}", markup=False, highlight=False)
    return 0


def print_operator(console: Console, kube: dict[str, Any]) -> None:
    """The `kube` section of an operator's /debug/status (`meshfn status --admin URL`)."""
    election, apply = kube["election"], kube["apply"]
    role = (
        "[green]leader[/green]"
        if election["leader"]
        else f"follower (leader: {election['holder'] or 'none'})"
    )
    console.print(f"operator {kube['identity']}: {role}, Lease {election['lease']}")
    if apply["apiserver_reachable"]:
        console.print(
            f"apiserver reachable; {apply['inventory']} object(s) applied and tracked",
            highlight=False,
        )
    else:
        console.print(
            f"[red]apiserver unreachable[/red]: {apply['error']}; keeping what was applied, "
            f"retrying in {apply['retry_in_s']}s",
            highlight=False,
        )
    last = apply.get("last") or {}
    for what in ("conflicts", "failed"):
        for ref, text in (last.get(what) or {}).items():
            console.print(
                f"[red]{what[:-1] if what == 'conflicts' else 'rejected'}[/red] {ref}: {text}",
                highlight=False,
            )
    for kind, state in kube["source"]["kinds"].items():
        if state["error"]:
            console.print(f"[yellow]watch {kind}[/yellow]: {state['error']}", highlight=False)
