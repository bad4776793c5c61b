"""`meshfn up`: the control plane, one Envoy per workload, inference backends and placeholder
upstreams; hot reload.

Everything started here is a child process tracked by PID and stopped on Ctrl-C/SIGTERM (and
killed by the kernel if meshfn itself dies: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.text import Text

from meshfn import ir
from meshfn import wasm_filters as filters
from meshfn.audit.collector import CollectorMetrics
from meshfn.audit.salt import audit_text_key, load_or_create
from meshfn.audit.store import StoreError
from meshfn.common import env
from meshfn.common.adminauth import owner_token_path
from meshfn.common.cli import console as cli_console
from meshfn.common.files import secure_state_dir
from meshfn.common.processes import pinned, raise_open_files_limit
from meshfn.common.progress import RichReporter
from meshfn.common.unix import SocketPathTooLong
from meshfn.contracts.function import BACKEND_STATUS_PATH, TokenLedgerAccess
from meshfn.contracts.qos import TOKEN_LEDGER_PURPOSE, has_token_budgets, ledger_node
from meshfn.ebpf import AccelerationUnavailable, EgressUnavailable
from meshfn.policy.rollout import Published
from meshfn.rollout.controller import Event as RolloutEvent
from meshfn.rollout.shadow import Backend as ShadowBackend

from ..service import ControlPlane, tune_gc
from .acceleration import Acceleration, AccelerationCollector
from .admin import AdminServer
from .audit import AuditTrail
from .bootstrap import (
    ProxyIdentity,
    admin_port_warning,
    admin_port_warnings,
    admin_socket_path,
)
from .console.graph import ProxyMetrics, ProxyStats
from .console.sources import AuditView, Backend, ConsoleSources, EndpointHealth, FunctionStats
from .envoy import EnvoyProcess, envoy_process
from .hints import hints, meshfn_command, print_hints, sample_request, shell_path, state_option
from .process import ProcessFailed, SupervisedProcess
from .sandbox import BackendSandbox, EgressCollector
from .traces import TraceCollector, TraceMetrics
from .upstreams import (
    BackendLinks,
    FunctionsSetup,
    UpstreamSpec,
    app_sockets,
    collector_directory,
    embedded_collector,
    local_upstreams,
    retraceable,
    tracing_applied,
    upstream_process,
    upstream_request,
    write_backend_config,
)

log = logging.getLogger("meshfn.up")
RETRACE_S = 10.0  # a backend shows reloaded tracing within this, or it restarts


@dataclass
class Mesh:
    """What `meshfn up` runs, reconciled against each new MeshModel."""

    cp: ControlPlane
    state_dir: Path
    functions: FunctionsSetup | None = None
    concurrency: int = 2
    envoy_log_level: str = "warning"
    preexec: Callable[[], None] | None = None  # e.g. join the eBPF cgroup
    proxy_cpus: frozenset[int] | None = None  # where the Envoys run (None: anywhere)
    backend_cpus: frozenset[int] | None = None  # where the upstreams run
    audit: AuditTrail | None = None
    sandbox: BackendSandbox | None = None  # the backends' egress cgroups
    traces: TraceCollector = field(default_factory=TraceCollector)
    envoys: dict[str, tuple[ProxyIdentity, SupervisedProcess]] = field(default_factory=dict)
    upstreams: dict[tuple[str, int], tuple[UpstreamSpec, SupervisedProcess]] = field(
        default_factory=dict
    )

    async def reconcile(self, model: ir.MeshModel, _old: ir.MeshModel | None = None) -> None:
        """Make the running processes what `model` wants: upstreams first (the Envoys route to
        them), then one Envoy per workload, then the audit collectors of their journals. The
        embedded trace collector comes first, once the mesh traces without naming one."""
        await self._reconcile_traces(model)
        await self._reconcile_upstreams(model)
        if _old is not None:  # a reload; `meshfn up` printed the first model's warnings
            before = {w.node_cluster: w.admin_port for w in _old.workloads}
            for w in model.workloads:
                if w.kind == "gateway" and w.admin_port not in (0, before.get(w.node_cluster)):
                    log.warning("%s", admin_port_warning(w))
        await self._reconcile_envoys(model)
        if self.audit is not None:
            reopen = {group: self._reopen(group) for group in self.envoys}
            await self.audit.reconcile(model, self.cp.proxy_host(model), reopen)

    async def _reconcile_traces(self, model: ir.MeshModel) -> None:
        """Start the embedded collector when it is first needed; it keeps running (and its
        traces) if a reload stops tracing or names another collector."""
        wanted = embedded_collector(model, self.state_dir)
        if wanted is None or self.traces.started:
            return
        directory = collector_directory(self.state_dir)
        try:
            await self.traces.start(directory)
        except (OSError, RuntimeError) as exc:
            raise OSError(
                f"the embedded trace collector cannot listen in {directory}: {exc}; or name a"
                " collector in the Mesh's spec.tracing.collector"
            ) from None
        self.traces.pull_from(self._span_sources)

    def _span_sources(self) -> list[tuple[Path | str, str]]:
        """Each serving process of each backend whose spans wait for this collector."""
        out: list[tuple[Path | str, str]] = []
        for spec, _ in self.upstreams.values():
            token = spec.tracing.pullToken if spec.tracing is not None else None
            if token is not None:
                out += [(where, token) for where in spec.sockets or (spec.where,)]
        return out

    async def _reconcile_upstreams(self, model: ir.MeshModel) -> None:
        if self.sandbox is not None and model.sandbox.egress != self.sandbox.mode:
            log.warning(
                "sandbox.egress is now %s: the egress control stays %s until meshfn up restarts"
                " (Landlock and seccomp follow the policy: the backends restart)",
                model.sandbox.egress,
                self.sandbox.mode,
            )
        wanted = local_upstreams(model, self.state_dir, self.functions)
        for key, (spec, proc) in list(self.upstreams.items()):
            want = wanted.get(key)
            if want == spec:
                continue
            if want is not None and retraceable(spec, want) and await self._retrace(want, proc):
                self.upstreams[key] = (want, proc)
                continue
            del self.upstreams[key]
            await proc.stop()
            if self.sandbox is not None:
                self.sandbox.release(spec)
        starts = []
        for key, spec in wanted.items():
            if key not in self.upstreams:
                run, links = self._run_spec(spec)
                own = self.sandbox.preexec(run) if self.sandbox is not None else None
                preexec = pinned(self.backend_cpus, own or self.preexec)
                proc = upstream_process(run, self.state_dir, self.functions, preexec, links)
                self.upstreams[key] = (spec, proc)
                starts.append(proc.start())
        for service in model.services:
            if service.protocol == "grpc" and service.endpoints:
                log.info(
                    "service %s speaks gRPC: run its server yourself (the placeholder upstream "
                    "speaks HTTP/1.1 only)",
                    service.key,
                )
        await _gather_or_raise(starts)

    def _run_spec(self, spec: UpstreamSpec) -> tuple[UpstreamSpec, BackendLinks]:
        """What a backend runs with: its links, and the ledger among its peers when it has
        token budgets (its sandbox lets it reach the ledger, no more)."""
        links = self._links(spec)
        if links.ledger is None:
            return spec, links
        peer = ("127.0.0.1", self.cp.xds_port)
        return replace(spec, egress=tuple(sorted({*spec.egress, peer}))), links

    async def _retrace(self, spec: UpstreamSpec, proc: SupervisedProcess) -> bool:
        """Only the Mesh's tracing changed for a running backend: rewrite its config and
        SIGHUP it (no restart: its warm instances stay), then wait until every serving process
        shows the new tracing. False (the caller restarts it, as for any other change) when it
        is not running or does not show it within RETRACE_S."""
        pid = proc.pid
        if pid is None or self.functions is None or not await self._serving(spec):
            return False  # not serving yet (restarting): a SIGHUP before its handler ends it
        run, links = self._run_spec(spec)
        write_backend_config(run, self.state_dir, self.functions, links)
        os.kill(pid, signal.SIGHUP)
        deadline = asyncio.get_running_loop().time() + RETRACE_S
        pending = list(spec.sockets or (spec.where,))
        while pending:
            document = await _backend_status(pending[0])
            if document is not None and tracing_applied(document, spec.tracing):
                pending.pop(0)
                continue
            if asyncio.get_running_loop().time() > deadline:
                log.warning(
                    "%s did not take the new tracing within %.0f s: restarting it",
                    proc.name,
                    RETRACE_S,
                )
                return False
            await asyncio.sleep(0.05)
        log.info("%s: tracing reloaded without a restart", proc.name)
        return True

    async def _serving(self, spec: UpstreamSpec) -> bool:
        return all([await _backend_status(w) is not None for w in spec.sockets or (spec.where,)])

    def _links(self, spec: UpstreamSpec) -> BackendLinks:
        """A backend's proof towards the mesh's token ledger when one of its Functions has
        token budgets, and the key of its audit text digests (derived from the audit subject
        salt) when one asks for them."""
        ledger = None
        if any(has_token_budgets(f.qos) for f in spec.functions):
            node = ledger_node(spec.service)
            ledger = TokenLedgerAccess(
                target=f"127.0.0.1:{self.cp.xds_port}",
                node=node,
                authorization=self.cp.tokens.header(node, TOKEN_LEDGER_PURPOSE),
            )
        hashed = any(
            f.settings.generation is not None and f.settings.generation.auditText == "hmac"
            for f in spec.functions
        )
        key = audit_text_key(load_or_create(self.state_dir)) if hashed else None
        return BackendLinks(ledger, key)

    async def _reconcile_envoys(self, model: ir.MeshModel) -> None:
        wanted = {
            w.node_cluster: ProxyIdentity.for_workload(w, self.cp.tokens.header(w.node_cluster))
            for w in model.workloads
        }
        for group, (identity, proc) in list(self.envoys.items()):
            if wanted.get(group) != identity:
                del self.envoys[group]
                await proc.stop()
        starts = []
        for group, identity in wanted.items():
            if group not in self.envoys:
                proc = envoy_process(
                    identity,
                    self.cp.xds_port,
                    self.state_dir,
                    self.concurrency,
                    self.envoy_log_level,
                    preexec=pinned(self.proxy_cpus, self.preexec),
                )
                self.envoys[group] = (identity, proc)
                starts.append(proc.start())
        await _gather_or_raise(starts)

    def _reopen(self, group: str) -> Callable[[], Awaitable[None]]:
        async def reopen() -> None:  # whichever process serves the group by then
            _, proc = self.envoys[group]
            assert isinstance(proc, EnvoyProcess)
            await proc.reopen_logs()

        return reopen

    async def stop(self) -> None:
        procs = [p for _, p in self.envoys.values()] + [p for _, p in self.upstreams.values()]
        self.envoys.clear()
        self.upstreams.clear()
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        if self.sandbox is not None:  # the egress cgroups nest in the acceleration cgroup
            await self.sandbox.shutdown()
        if self.audit is not None:  # after the proxies: it stores the last lines they wrote
            await self.audit.stop()
        await self.traces.stop()  # after the proxies and backends: their last spans arrive

    def shadow_backends(self) -> list[ShadowBackend]:
        """Every serving process of every inference backend (each keeps its own shadow
        comparisons), for the rollout controller."""
        out = []
        for spec, _ in self.upstreams.values():
            if not spec.functions:
                continue
            for where in spec.sockets or (spec.where,):
                out.append(ShadowBackend(spec.service, str(where), _fetcher(where)))
        return out

    def backends(self) -> list[Backend]:
        """The inference backends running now (for the console's Functions panel)."""
        return [
            Backend(spec.service, spec.address, spec.port, spec.where)
            for spec, _ in self.upstreams.values()
            if spec.functions
        ]

    def gateway_admin_sockets(self) -> dict[str, Path]:
        """Gateway node cluster -> its Envoy's admin socket (for endpoint health)."""
        model = self.cp.model
        gateways = (
            {w.node_cluster for w in model.workloads if w.kind == "gateway"} if model else set()
        )
        return {
            group: proc.admin_socket
            for group, (_, proc) in self.envoys.items()
            if group in gateways and isinstance(proc, EnvoyProcess)
        }

    def admin_sockets(self) -> dict[str, Path]:
        """Every Envoy's admin socket by node cluster (the service graph's statistics)."""
        return {
            group: proc.admin_socket
            for group, (_, proc) in self.envoys.items()
            if isinstance(proc, EnvoyProcess)
        }

    def console_sources(self, acceleration: Acceleration | None) -> ConsoleSources:
        audit = self.audit
        functions = FunctionStats(self.backends)
        return ConsoleSources(
            functions=functions,
            health=EndpointHealth(self.gateway_admin_sockets),
            audit=AuditView(
                lambda: audit.store.path if audit is not None and audit.store else None,
                self.state_dir,
            )
            if audit is not None
            else None,
            acceleration=acceleration.document if acceleration is not None else None,
            trail=audit,
            traces=self.traces.store,
            proxies=ProxyStats(self.admin_sockets, functions),
        )

    def tracing_status(self, proxies: ProxyStats | None = None) -> dict[str, Any] | None:
        """The embedded collector's counts (when it runs), and each proxy's exports to
        whichever collector (as last fetched); None while nothing traces."""
        status: dict[str, Any] = self.traces.status() if self.traces.started else {}
        exports = proxies.export_status() if proxies is not None else []
        if exports:
            status["proxies"] = exports
        return status or None

    def pids(self) -> dict[str, int | None]:
        return {
            **{p.name: p.pid for _, p in self.envoys.values()},
            **{p.name: p.pid for _, p in self.upstreams.values()},
        }


def _fetcher(where: Path | str) -> Callable[[str], Awaitable[tuple[int, bytes]]]:
    async def fetch(path: str) -> tuple[int, bytes]:
        try:
            return await upstream_request(where, path, timeout=2)
        except aiohttp.ClientError as exc:
            raise OSError(str(exc)) from exc

    return fetch


async def _backend_status(where: Path | str) -> dict[str, Any] | None:
    """A backend process's own status document, None while it does not answer."""
    with contextlib.suppress(OSError, ValueError, TimeoutError, aiohttp.ClientError):
        status, body = await upstream_request(where, BACKEND_STATUS_PATH, timeout=1)
        if status == 200:
            document: dict[str, Any] = json.loads(body)
            return document
    return None


async def _gather_or_raise(starts: Sequence[Awaitable[None]]) -> None:
    results = await asyncio.gather(*starts, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise ProcessFailed("; ".join(str(f) for f in failures))


async def function_samples(
    upstreams: Iterable[UpstreamSpec], timeout: float = 2.0
) -> dict[str, str]:
    """An example infer body per function, from the KServe metadata its backend serves (the
    backend, not the control plane, knows a function's inputs)."""
    where = {f.name: spec for spec in upstreams for f in spec.functions}
    out: dict[str, str] = {}
    for name, spec in where.items():
        try:
            status, raw = await upstream_request(spec.where, f"/v2/models/{name}", timeout)
            metadata = json.loads(raw) if status == 200 else {}
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            continue
        body = sample_request(metadata) if isinstance(metadata, dict) else None
        if body is not None:
            out[name] = body
    return out


class _Refused(Exception):
    """`meshfn up` does not start, or stops starting; each argument is a line saying why (markup,
    or rich Text for what must print as it is)."""

    def print(self, console: Console) -> None:
        for line in self.args:
            console.print(line)


async def run_up(
    policies: Path,
    state_dir: Path,
    concurrency: int = 2,
    envoy_log_level: str = "warning",
    console: Console | None = None,
    functions: FunctionsSetup | None = None,
    admin_host: str = "127.0.0.1",
    admin_token: str | None = None,
    published: Published | None = None,
    proxy_cpus: frozenset[int] | None = None,
    backend_cpus: frozenset[int] | None = None,
) -> int:
    """`meshfn up`: run the whole mesh until Ctrl-C or SIGTERM; the exit status. `published`:
    the function registry's versions of a function (Rollouts are checked against it).
    `proxy_cpus`, `backend_cpus`: the CPUs the Envoys and the upstreams run on (None: any).

    It runs in three steps, and the order is the point:
    1. Check everything that can refuse the start before anything runs (policy errors, socket
       paths (Envoy admin, the applications behind sidecars) too long for a unix socket,
       functions without a registry, eBPF required but unavailable): a refusal leaves no
       process behind and says what to change.
    2. Start the control plane and its admin port before the mesh: every Envoy connects to the
       control plane as it starts, and the console must see the first proxy arrive.
    3. Once the mesh runs, write STATE/state.json (`meshfn status` and `analyze` find the admin
       port there), print how to try it, and wait. Teardown is a `finally` in the reverse
       order, so Ctrl-C, SIGTERM and a failed start all stop every child.
    """
    console = console or cli_console()
    try:
        cp, model = await _loaded(policies, state_dir, functions, console, published)
        _check_functions(model, functions)
        acceleration = await _accelerated(cp, model, state_dir)
        sandbox = await _sandboxed(cp, model, state_dir, acceleration)
    except _Refused as refused:
        refused.print(console)
        return 1
    mesh = _wired_mesh(cp, state_dir, functions, concurrency, envoy_log_level, acceleration)
    mesh.proxy_cpus, mesh.backend_cpus = proxy_cpus, backend_cpus
    if sandbox is not None:
        mesh.sandbox = sandbox
        sandbox.backends = lambda: [spec for spec, _ in mesh.upstreams.values()]
    sources = mesh.console_sources(acceleration)
    admin = AdminServer(cp, sources, admin_token)
    proxies = sources.proxies
    if isinstance(proxies, ProxyStats):  # what each proxy's tracer sent and failed to export
        cp.status_providers["tracing"] = lambda: mesh.tracing_status(proxies)
        cp.status_providers["proxy_connections"] = proxies.connection_status
        cp.metrics.registry.register(ProxyMetrics(proxies))
    return await _serve(cp, model, mesh, admin, acceleration, admin_host, policies, console)


async def _loaded(
    policies: Path,
    state_dir: Path,
    functions: FunctionsSetup | None,
    console: Console,
    published: Published | None = None,
) -> tuple[ControlPlane, ir.MeshModel]:
    """The control plane with the policies loaded (the proxy-wasm filters built first, with
    progress on stderr and one line saying what was cached); its warnings printed."""
    secure_state_dir(state_dir)
    with RichReporter(cli_console(stderr=True), "proxy-wasm filters") as progress:
        wasm_dir, wasm_missing = await asyncio.to_thread(filters.prepare, progress)
    cp = ControlPlane(
        policies,
        state_dir,
        wasm_dir=wasm_dir,
        wasm_missing=wasm_missing,
        # the sidecars reach what Mesh.reconcile starts behind them over its unix sockets
        app_sockets=lambda m: app_sockets(local_upstreams(m, state_dir, functions).values()),
        published=published,
    )
    # the proxies send spans to meshfn up's own collector where the Mesh names none
    cp.trace_collector = lambda m: embedded_collector(m, state_dir)
    result = await cp.reload()
    tune_gc()
    if not result.ok:
        raise _Refused(
            f"[red]{len(result.errors)} policy error(s); nothing started:[/red]",
            *(Text(f"  {error}") for error in result.errors),
        )
    model = cp.model
    assert model is not None
    try:
        for workload in model.workloads:
            admin_socket_path(state_dir, ProxyIdentity.for_workload(workload, "").node_id)
        local_upstreams(model, state_dir, functions)
    except SocketPathTooLong as exc:
        raise _Refused(Text(f"{exc.strerror}", style="red")) from None
    # what the Envoys inherit, and so how many connections each may take (bootstrap.py)
    raise_open_files_limit()
    try:
        env.check_integers("mesh")  # MESHFN_PROXY_MAX_CONNECTIONS, the trace store's bounds
    except ValueError as exc:
        raise _Refused(Text(str(exc), style="red")) from None
    for warning in admin_port_warnings(model):
        console.print(f"[yellow]{warning}[/yellow]", highlight=False)
    return cp, model


def _check_functions(model: ir.MeshModel, functions: FunctionsSetup | None) -> None:
    if model.functions and functions is None:
        raise _Refused("[red]the policies declare functions: give --functions-registry[/red]")


async def _accelerated(
    cp: ControlPlane, model: ir.MeshModel, state_dir: Path
) -> Acceleration | None:
    """eBPF acceleration as the policies ask for it (set up before any child starts: they join
    its cgroup), reported in /debug/status and /metrics."""
    if model.acceleration == "off":
        return None
    acceleration = Acceleration(state_dir)
    try:
        await acceleration.setup(model.acceleration)
    except AccelerationUnavailable as exc:
        raise _Refused(
            f"[red]acceleration: ebpf was required but is unavailable: {exc}[/red]"
        ) from None
    cp.status_providers["acceleration"] = acceleration.document
    cp.metrics.registry.register(AccelerationCollector(acceleration))
    return acceleration


async def _sandboxed(
    cp: ControlPlane, model: ir.MeshModel, state_dir: Path, acceleration: Acceleration | None
) -> BackendSandbox | None:
    """The inference backends' egress control as the policies ask for it (set up before any
    backend starts: each joins its own cgroup, inside the acceleration cgroup when that is
    on), and what confines each backend in /debug/status and /metrics."""
    if not model.functions:
        return None
    sandbox = BackendSandbox(
        state_dir,
        model.sandbox.egress,
        parent=acceleration.status.cgroup if acceleration and acceleration.status else None,
    )
    try:
        await sandbox.setup()
    except EgressUnavailable as exc:
        raise _Refused(
            f"[red]sandbox: egress was required but is unavailable: {exc}[/red]"
        ) from None
    cp.status_providers["sandbox"] = sandbox.document
    cp.metrics.registry.register(EgressCollector(sandbox))
    return sandbox


def _wired_mesh(
    cp: ControlPlane,
    state_dir: Path,
    functions: FunctionsSetup | None,
    concurrency: int,
    envoy_log_level: str,
    acceleration: Acceleration | None,
) -> Mesh:
    """The mesh, not started yet, with what it runs reported in /debug/status and /metrics."""
    audit = AuditTrail(state_dir)
    mesh = Mesh(
        cp,
        state_dir,
        functions,
        concurrency,
        envoy_log_level,
        preexec=acceleration.preexec() if acceleration else None,
        audit=audit,
    )
    cp.status_providers["audit"] = audit.status
    cp.shadow_backends = mesh.shadow_backends

    async def record(events: list[RolloutEvent]) -> None:
        await audit.record([event.audit_record() for event in events])

    cp.rollout_listeners.append(record)
    # Where `meshfn status` reads each backend's own /meshfn/functions (warm-up, cold requests,
    # per-tenant QoS counts).
    cp.status_providers["inference_backends"] = lambda: [
        {
            "service": b.service,
            "address": b.address,
            "port": b.port,
            "socket": str(b.where) if isinstance(b.where, Path) else None,
        }
        for b in mesh.backends()
    ]
    cp.metrics.registry.register(
        CollectorMetrics(lambda: audit.collector, classify=audit.tenant_class)
    )
    cp.metrics.registry.register(TraceMetrics(mesh.traces))
    return mesh


async def _start(
    cp: ControlPlane, admin: AdminServer, admin_host: str, model: ir.MeshModel, mesh: Mesh
) -> None:
    """The control plane and its admin port, then the mesh (the Envoys connect at once)."""
    try:
        await cp.start()
        await admin.start(admin_host, port=model.admin_port)
    except OSError as exc:
        raise _Refused(f"[red]cannot start the control plane: {exc}[/red]") from None
    try:
        await mesh.reconcile(model)
    except (ProcessFailed, OSError, StoreError) as exc:
        raise _Refused(f"[red]could not start the mesh: {exc}[/red]") from None
    cp.on_model(mesh.reconcile)


def _state_document(cp: ControlPlane, admin: AdminServer, mesh: Mesh, policies: Path) -> str:
    """STATE/state.json: where the running mesh is (read by `meshfn status`, `analyze`, tests)."""
    return json.dumps(
        {
            "pid": os.getpid(),
            "admin": admin.url,
            "xds": f"127.0.0.1:{cp.xds_port}",
            "policies": str(policies),
            "children": mesh.pids(),
        },
        indent=2,
    )


async def _print_ready(
    console: Console, cp: ControlPlane, model: ir.MeshModel, admin: AdminServer, mesh: Mesh,
    policies: Path,
) -> None:  # fmt: skip
    """The routes, commands to try them with, and the console: a one-time login link (as
    Jupyter prints one), and where the admin token is."""
    samples = await function_samples(spec for spec, _ in mesh.upstreams.values())
    another = f"{meshfn_command()} console{state_option(mesh.state_dir)} prints another"
    token = shell_path(owner_token_path(mesh.state_dir))
    print_hints(
        console,
        hints(model, mesh.state_dir, admin.url, samples),
        [
            f"console: {admin.login_link()}   # a one-time login link ({another})",
            f"control plane: xds 127.0.0.1:{cp.xds_port}, admin {admin.url} (token in {token});"
            f" watching {policies} for changes; Ctrl-C stops everything.",
        ],
    )


async def _serve(
    cp: ControlPlane, model: ir.MeshModel, mesh: Mesh, admin: AdminServer,
    acceleration: Acceleration | None, admin_host: str, policies: Path, console: Console,
) -> int:  # fmt: skip
    """Start, serve until a signal, and stop everything in the reverse order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    state_file = mesh.state_dir / "state.json"
    tasks: list[asyncio.Task[None]] = []
    try:
        try:
            await _start(cp, admin, admin_host, model, mesh)
        except _Refused as refused:
            refused.print(console)
            return 1
        state_file.write_text(_state_document(cp, admin, mesh, policies))
        tasks = [
            asyncio.create_task(cp.watch(stop)),
            asyncio.create_task(cp.rotate_credentials_forever(stop)),
            asyncio.create_task(cp.drift_forever(stop)),
            asyncio.create_task(cp.rollouts_forever(stop)),
        ]
        if mesh.sandbox is not None:
            tasks.append(asyncio.create_task(mesh.sandbox.log_denials_forever(stop)))
            for line in mesh.sandbox.start_lines():
                console.print(line, markup=False, highlight=False)
        await _print_ready(console, cp, model, admin, mesh, policies)
        await stop.wait()
        console.print("stopping...")
        return 0
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await mesh.stop()
        if acceleration is not None:  # after the children: their sockets must be closed first
            await acceleration.shutdown()
        await admin.stop()
        await cp.stop()
        with contextlib.suppress(FileNotFoundError):
            state_file.unlink()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
