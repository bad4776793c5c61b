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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshfn import ir
from meshfn.ebpf import AccelerationUnavailable

from .. import filters
from ..audit.collector import CollectorMetrics
from ..audit.store import StoreError
from ..service import ControlPlane, tune_gc
from .acceleration import Acceleration, AccelerationCollector
from .admin import AdminServer
from .audit import AuditTrail
from .bootstrap import ProxyIdentity
from .envoy import EnvoyProcess, envoy_process
from .process import ProcessFailed, SupervisedProcess
from .upstreams import FunctionsSetup, UpstreamSpec, upstream_process, upstreams_for

log = logging.getLogger("meshfn.up")


@dataclass
class Mesh:
    """What `meshfn up` runs, reconciled against each new MeshModel."""

    cp: ControlPlane
    state_dir: Path
    functions: FunctionsSetup | None = None
    concurrency: int = 2
    envoy_log_level: str = "warning"
    preexec: Callable[[], None] | None = None  # e.g. join the eBPF cgroup
    audit: AuditTrail | None = None
    envoys: dict[str, tuple[ProxyIdentity, SupervisedProcess]] = field(default_factory=dict)
    upstreams: dict[tuple[str, int], tuple[UpstreamSpec, SupervisedProcess]] = field(
        default_factory=dict
    )

    async def reconcile(self, model: ir.MeshModel, _old: ir.MeshModel | None = None) -> None:
        wanted_upstreams = upstreams_for(model)
        for key, (spec, proc) in list(self.upstreams.items()):
            if wanted_upstreams.get(key) != spec:
                del self.upstreams[key]
                await proc.stop()
        starts = []
        for key, spec in wanted_upstreams.items():
            if key not in self.upstreams:
                proc = upstream_process(spec, self.state_dir, self.functions, self.preexec)
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

        wanted_envoys = {
            w.node_cluster: ProxyIdentity.for_workload(w, self.cp.tokens.header(w.node_cluster))
            for w in model.workloads
        }
        for group, (identity, proc) in list(self.envoys.items()):
            if wanted_envoys.get(group) != identity:
                del self.envoys[group]
                await proc.stop()
        starts = []
        for group, identity in wanted_envoys.items():
            if group not in self.envoys:
                proc = envoy_process(
                    identity,
                    self.cp.xds_port,
                    self.state_dir,
                    self.concurrency,
                    self.envoy_log_level,
                    preexec=self.preexec,
                )
                self.envoys[group] = (identity, proc)
                starts.append(proc.start())
        await _gather_or_raise(starts)
        if self.audit is not None:
            reopen = {group: self._reopen(group) for group in self.envoys}
            await self.audit.reconcile(model, self.cp.proxy_host(model), reopen)

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
        if self.audit is not None:  # after the proxies: it stores the last lines they wrote
            await self.audit.stop()

    def pids(self) -> dict[str, int | None]:
        return {
            **{p.name: p.pid for _, p in self.envoys.values()},
            **{p.name: p.pid for _, p in self.upstreams.values()},
        }


async def _gather_or_raise(starts: Sequence[Awaitable[None]]) -> None:
    results = await asyncio.gather(*starts, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise ProcessFailed("; ".join(str(f) for f in failures))


def endpoints_table(model: ir.MeshModel) -> tuple[Table, list[str]]:
    """The routes per gateway, and a curl command for each match that has a literal path."""
    table = Table(title="meshfn is up", title_justify="left")
    for column in ("gateway", "listener", "route", "match", "service"):
        table.add_column(column)
    tries = []
    for workload in model.workloads:
        for listener in workload.listeners:
            host = "127.0.0.1" if listener.address in ("0.0.0.0", "::") else listener.address
            base = f"http://{host}:{listener.port}"
            for route in listener.routes:
                for match in route.matches:
                    described = f"{match.path.kind} {match.path.value}"
                    if match.methods:
                        described += f" [{','.join(match.methods)}]"
                    table.add_row(
                        workload.key,
                        f"{base} ({listener.name})",
                        route.key,
                        described,
                        route.service,
                    )
                    # Regexes have no literal path; "/v2/models/x/" duplicates its exact sibling.
                    if match.path.kind != "regex" and not match.path.value.endswith("/"):
                        tries.append(
                            curl_example(base, route, match, needs_token(model, route.service))
                        )
    return table, tries


def needs_token(model: ir.MeshModel, service_key: str) -> bool:
    return any(
        w.jwt_rules
        for w in model.workloads
        if w.inbound is not None and w.inbound.service == service_key
    )


def curl_example(base: str, route: ir.Route, match: ir.RouteMatch, with_token: bool = False) -> str:
    parts = ["curl", "-s"]
    if with_token:
        parts += ["-H", '"authorization: Bearer $TOKEN"']
    if match.methods and "GET" not in match.methods:
        parts += ["-X", match.methods[0]]
    for header in match.headers:
        if header.invert:
            continue
        value = header.value if header.kind in ("exact", "prefix") else "demo"
        parts += ["-H", f"'{header.name}: {value}'"]
    host = next((h for h in route.hosts if h != "*"), None)
    if host is not None:
        parts += ["-H", f"'host: {host.replace('*', 'www')}'"]
    parts.append(base + match.path.value)
    return " ".join(parts)


async def run_up(
    policies: Path,
    state_dir: Path,
    concurrency: int = 2,
    envoy_log_level: str = "warning",
    console: Console | None = None,
    functions: FunctionsSetup | None = None,
) -> int:
    console = console or Console()
    wasm_dir, wasm_missing = await asyncio.to_thread(filters.prepare)
    cp = ControlPlane(policies, state_dir, wasm_dir=wasm_dir, wasm_missing=wasm_missing)
    result = await cp.reload()
    tune_gc()
    if not result.ok:
        console.print(f"[red]{len(result.errors)} policy error(s); nothing started:[/red]")
        for error in result.errors:
            console.print(f"  {error}", markup=False, highlight=False)
        return 1
    model = cp.model
    assert model is not None
    state_dir.mkdir(parents=True, exist_ok=True)
    admin = AdminServer(cp)
    if model.functions and functions is None:
        console.print("[red]the policies declare functions: give --functions-registry[/red]")
        return 1
    acceleration = None
    if model.acceleration != "off":
        acceleration = Acceleration(state_dir)
        try:
            await acceleration.setup(model.acceleration)
        except AccelerationUnavailable as exc:
            console.print(f"[red]acceleration: ebpf was required but is unavailable: {exc}[/red]")
            return 1
        cp.status_providers["acceleration"] = acceleration.document
        cp.metrics.registry.register(AccelerationCollector(acceleration))
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
    cp.metrics.registry.register(CollectorMetrics(lambda: audit.collector))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    state_file = state_dir / "state.json"
    watcher: asyncio.Task[None] | None = None
    rotator: asyncio.Task[None] | None = None
    drift: asyncio.Task[None] | None = None
    try:
        try:
            await cp.start()
            await admin.start(port=model.admin_port)
        except OSError as exc:
            console.print(f"[red]cannot start the control plane: {exc}[/red]")
            return 1
        try:
            await mesh.reconcile(model)
        except (ProcessFailed, OSError, StoreError) as exc:
            console.print(f"[red]could not start the mesh: {exc}[/red]")
            return 1
        cp.on_model(mesh.reconcile)
        state_file.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "admin": f"http://127.0.0.1:{admin.port}",
                    "xds": f"127.0.0.1:{cp.xds_port}",
                    "policies": str(policies),
                    "children": mesh.pids(),
                },
                indent=2,
            )
        )
        watcher = asyncio.create_task(cp.watch(stop))
        rotator = asyncio.create_task(cp.rotate_credentials_forever(stop))
        drift = asyncio.create_task(cp.drift_forever(stop))
        table, tries = endpoints_table(model)
        console.print(table)
        console.print("try:")
        if any("$TOKEN" in line for line in tries):
            console.print(
                f"  TOKEN=$(meshfn token issue --state-dir {state_dir} --sub you --aud meshfn "
                "--claim tenant=acme)",
                markup=False,
                highlight=False,
            )
        for line in tries:
            console.print(f"  {line}", markup=False, highlight=False)
        console.print(
            f"control plane: xds 127.0.0.1:{cp.xds_port}, admin http://127.0.0.1:{admin.port} "
            f"(meshfn status, meshfn config-dump NODE); watching {policies} for changes; "
            "Ctrl-C stops everything."
        )
        await stop.wait()
        console.print("stopping...")
        return 0
    finally:
        stop.set()
        for task in (watcher, rotator, drift):
            if task is not None:
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
