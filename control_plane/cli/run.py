"""`meshfn up | serve | bootstrap`: run the mesh, only its control plane, or an Envoy of your own
against it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshfn.common.cli import err, fail, out
from meshfn.common.logs import setup_logging
from meshfn.common.processes import cpu_list

from .shared import (
    DEFAULT_POLICIES,
    DEFAULT_STATE,
    AdminListenOpt,
    AdminTokenOpt,
    LogFormatOpt,
    LogLevelOpt,
    PoliciesOpt,
    StateOpt,
    admin_token,
    known_workloads,
    load_model,
)

if TYPE_CHECKING:
    from ..runtime.bootstrap import ProxyIdentity


def _published_examples(registry: Path) -> Path:
    """Build, sign and publish the example functions into `registry` (cached; progress bars
    while something builds, one line saying what was cached); the key they are signed with."""
    from meshfn.inference.cli import InferenceError, publish_examples

    try:
        _, public = publish_examples(registry, err)
    except (InferenceError, OSError) as exc:
        fail(f"publishing the example functions failed: {exc}")
    return public


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
    proxy_cpus: Annotated[
        str | None,
        typer.Option(
            help="CPUs every Envoy runs on, a Linux CPU list (0-3,8; default: any). With "
            "--backend-cpus: the proxies and the backends apart"
        ),
    ] = None,
    backend_cpus: Annotated[
        str | None,
        typer.Option(
            help="CPUs the inference backends and placeholder upstreams run on (default: any); "
            "one CPU keeps a backend's threads together (docs/operations/placement.md)"
        ),
    ] = None,
    log_format: LogFormatOpt = "human",
    log_level: LogLevelOpt = "info",
    admin_listen: AdminListenOpt = "127.0.0.1",
    admin_token_file: AdminTokenOpt = None,
) -> None:
    """Run the control plane, one Envoy per gateway and sidecar, the inference backends and
    placeholder upstreams; hot-reload policies. The web console is at ADMIN/ui."""
    from meshfn.common.files import secure_state_dir
    from meshfn.inference.cli import published_versions

    from ..runtime.up import run_up
    from ..runtime.upstreams import FunctionsSetup

    setup_logging(log_format, log_level)
    placed: dict[str, frozenset[int] | None] = {}
    for flag, text in (("--proxy-cpus", proxy_cpus), ("--backend-cpus", backend_cpus)):
        try:
            placed[flag] = cpu_list(text) if text is not None else None
        except ValueError as exc:
            fail(f"{flag}: {exc}")
    secure_state_dir(state_dir)  # before anything is published into it
    registry = functions_registry or state_dir / "functions"
    keys = list(trusted_key or [])
    if publish_examples:
        keys.append(_published_examples(registry))
    setup = (
        FunctionsSetup(registry, tuple(keys), backend_workers, backend_processes) if keys else None
    )
    token = admin_token(admin_token_file)
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
            published_versions(registry) if setup is not None else None,
            placed["--proxy-cpus"],
            placed["--backend-cpus"],
        )
    )
    raise typer.Exit(code)


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
    from ..runtime.serve import run_serve

    setup_logging(log_format, log_level)
    token = admin_token(admin_token_file)
    raise typer.Exit(
        asyncio.run(
            run_serve(policies, state_dir, xds_port, admin_port, watch, admin_listen, token)
        )
    )


def bootstrap(
    workload: Annotated[str, typer.Argument(help="workload (name.namespace)")],
    policies: PoliciesOpt = DEFAULT_POLICIES,
    state_dir: StateOpt = DEFAULT_STATE,
    instance: Annotated[int, typer.Option(help="instance number in the node id")] = 0,
    admin_socket: Annotated[
        Path | None,
        typer.Option(
            help="Envoy's admin interface on this unix socket (mode 0600) "
            "[default: STATE_DIR/envoy/NODE.sock, in a directory only you may enter]"
        ),
    ] = None,
    admin_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="also serve admin on 127.0.0.1:PORT, unauthenticated: any local user could "
            "read the bootstrap token and stop the proxy (a warning says so)",
        ),
    ] = None,
) -> None:
    """Print the Envoy bootstrap for a workload, to run an Envoy against meshfn yourself. It
    carries the workload's bootstrap token: treat it as a secret. Envoy's admin interface (which
    shows that token to whoever connects) is a unix socket only its user reaches; a TCP admin
    port only with --admin-port or the Gateway's adminPort, and a warning."""
    from ..identity.bootstrap_token import BootstrapTokens
    from ..runtime.bootstrap import (
        ProxyIdentity,
        admin_port_warning,
        admin_tcp_warning,
        bootstrap_json,
    )

    model = load_model(policies)
    found = model.workload(workload)
    if found is None:
        fail(f"no workload {workload!r} (known: {known_workloads(model)})")
    tokens = BootstrapTokens(state_dir / "xds-token.key")
    identity = ProxyIdentity.for_workload(found, tokens.header(found.node_cluster), instance)
    if admin_port is not None:
        identity = dataclasses.replace(identity, admin_port=admin_port)
        opted = f"--admin-port {admin_port} for {found.node_cluster}"
        err.print(admin_tcp_warning(opted, admin_port, "Drop --admin-port"), markup=False)
    elif found.admin_port:
        err.print(admin_port_warning(found), markup=False)
    socket = admin_socket.absolute() if admin_socket else _default_admin_socket(state_dir, identity)
    try:
        config = bootstrap_json(identity, "127.0.0.1", model.xds_port, socket)
    except ValueError as exc:  # MESHFN_PROXY_MAX_CONNECTIONS
        fail(str(exc))
    out.print_json(json.dumps(config))


def _default_admin_socket(state_dir: Path, identity: ProxyIdentity) -> Path:
    """STATE_DIR/envoy/NODE.sock, its directory made (0700) for Envoy to bind in."""
    from meshfn.common.files import private_directory

    from ..runtime.bootstrap import AdminSocketPathTooLong, admin_socket_path

    try:
        socket = admin_socket_path(state_dir, identity.node_id)
    except AdminSocketPathTooLong as exc:
        fail(exc.strerror or str(exc))
    private_directory(socket.parent)
    return socket
