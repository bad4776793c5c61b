"""What `meshfn up` runs behind the sidecars: the inference backend for services that serve
functions, a placeholder upstream for the other loopback HTTP endpoints.

An endpoint behind a sidecar is reached through its sidecar only: its application listens on
unix sockets in STATE/workloads (an inference backend: in its own STATE/inference/<address>-
<port>/; 0700, each socket 0600), not on its loopback port, which any local user could call
directly, past mTLS, JWT, authorization, QoS and the audit trail. The
sidecar reaches the sockets over Envoy `pipe` addresses (the control plane learns them from
`app_sockets`). The policy's ports still name the endpoint (its sidecar's cluster, logs,
`endpoint` in the placeholder's answers). An endpoint without a sidecar is called directly by
the gateways, so its application listens on its port."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from meshfn import ir
from meshfn.common.files import private_directory, secret_key
from meshfn.common.unix import socket_path
from meshfn.contracts.function import (
    BackendConfig,
    EgressAddress,
    SandboxSettings,
    TokenLedgerAccess,
)
from meshfn.contracts.tracing import BackendTracing
from meshfn.policy import compile
from meshfn.xds.translate import AppSockets

from . import traces
from .envoy import local_session
from .process import SupervisedProcess


@dataclass(frozen=True)
class FunctionsSetup:
    """Where the backends find published functions and which signing keys they trust."""

    registry: Path
    trusted_keys: tuple[Path, ...]
    workers: int = 2
    processes: int = 1  # serving processes per backend (BackendConfig.processes)


@dataclass(frozen=True)
class UpstreamSpec:
    service: str
    address: str
    port: int
    locality: str
    functions: tuple[ir.Function, ...] = ()  # non-empty: run the inference backend
    grpc_port: int | None = None  # the backend's KServe gRPC port (the endpoint's grpcPort)
    # Behind a sidecar: serve on these unix sockets (one per serving process) instead of
    # address:port, and gRPC on `grpc_sockets` instead of grpc_port.
    sockets: tuple[Path, ...] = ()
    grpc_sockets: tuple[Path, ...] = ()
    # Where its functions' egress peers are reached (Function.spec.egress): each endpoint's
    # sidecar where it has one (the mesh's way in), else the endpoint itself.
    egress: tuple[tuple[str, int], ...] = ()
    sandbox: ir.Sandbox = field(default_factory=ir.Sandbox)
    tracing: BackendTracing | None = None  # where the backend's spans go

    @property
    def where(self) -> Path | str:
        """Where to reach it: its (first) socket, or address:port."""
        return self.sockets[0] if self.sockets else f"{self.address}:{self.port}"

    @property
    def name(self) -> str:
        """The backend's name in its egress cgroup, /metrics and `meshfn status`."""
        return f"{self.service} {self.address}:{self.port}"


def served_functions(model: ir.MeshModel) -> dict[str, list[ir.Function]]:
    """Service key -> functions its endpoints must serve (see policy.compile)."""
    return compile.served_functions(list(model.functions), {s.key: s for s in model.services})


def embedded_collector(model: ir.MeshModel, state_dir: Path) -> ir.TraceCollector | None:
    """Where `meshfn up`'s own trace collector listens (its OTLP/gRPC socket in the state
    directory), when the Mesh traces without naming a collector (traces.TraceCollector)."""
    tracing = model.tracing
    if tracing is None or tracing.collector is not None:
        return None
    return ir.TraceCollector.on_socket(str(collector_sockets(state_dir)[0]))


def spans_token(state_dir: Path) -> str:
    """The bearer token meshfn up collects the backends' spans with (POST /meshfn/spans on
    their private sockets; inference.tracing): a key in the collector's directory, so it stays
    the same across reloads and restarts (a new one would restart every backend)."""
    directory = collector_directory(state_dir)
    private_directory(directory)
    return secret_key(directory / "spans.key", 16).hex()


def collector_directory(state_dir: Path) -> Path:
    """The embedded trace collector's sockets' directory (private)."""
    return state_dir / "collector"


def collector_sockets(state_dir: Path) -> tuple[Path, Path]:
    """The embedded trace collector's OTLP/gRPC and OTLP/HTTP sockets."""
    return traces.sockets(collector_directory(state_dir))


def workload_sockets(state_dir: Path) -> Path:
    """The directory of the applications' sockets (private, like the state directory)."""
    return state_dir / "workloads"


def app_socket(state_dir: Path, address: str, port: int) -> Path:
    """The socket of a one-process application behind a sidecar (e.g. the echo placeholder)."""
    return _sockets(workload_sockets(state_dir), _stem(address, port), 1)[0]


def backend_state_dir(state_dir: Path, address: str, port: int) -> Path:
    """An inference backend's own directory, the one place it may write (its Landlock rules):
    its config, the report of what confines it (sandbox.json) and, behind a sidecar, its
    sockets. In the shared STATE/workloads it would need the right to remove files there, and
    with it the other workloads' sockets."""
    return state_dir / "inference" / _stem(address, port)


def backend_socket(state_dir: Path, address: str, port: int) -> Path:
    """The REST socket of a one-process inference backend behind a sidecar."""
    return _sockets(backend_state_dir(state_dir, address, port), "http", 1)[0]


def _stem(address: str, port: int) -> str:
    return f"{address.replace(':', '_')}-{port}"


def _sockets(directory: Path, stem: str, count: int) -> tuple[Path, ...]:
    names = [stem] if count == 1 else [f"{stem}.{k}" for k in range(count)]
    return tuple(socket_path(directory, name, "the workloads' sockets") for name in names)


def upstreams_for(
    model: ir.MeshModel, state_dir: Path | None = None, processes: int = 1
) -> dict[tuple[str, int], UpstreamSpec]:
    """One process per loopback HTTP endpoint; endpoints elsewhere are the user's to run.
    With `state_dir`, those behind a sidecar listen on unix sockets in it (`processes`: the
    inference backends' serving processes, one socket each); SocketPathTooLong if they do not
    fit."""
    functions = served_functions(model)
    tracing = model.tracing
    # meshfn up's own collector takes the backends' spans from them (pull_token)
    pull = spans_token(state_dir) if state_dir and embedded_collector(model, state_dir) else None
    out: dict[tuple[str, int], UpstreamSpec] = {}
    for service in model.services:
        if service.protocol != "http":
            continue
        for e in service.endpoints:
            if ipaddress.ip_address(e.address).is_loopback:
                locality = "/".join(
                    p for p in (e.locality.region, e.locality.zone, e.locality.sub_zone) if p
                )
                served = tuple(functions.get(service.key, ()))
                grpc_port = e.grpc_port if served else None
                sockets: tuple[Path, ...] = ()
                grpc_sockets: tuple[Path, ...] = ()
                if state_dir is not None and e.sidecar_port is not None and served:
                    directory = backend_state_dir(state_dir, e.address, e.port)
                    sockets = _sockets(directory, "http", processes)
                    if grpc_port is not None:
                        grpc_sockets = _sockets(directory, "grpc", processes)
                elif state_dir is not None and e.sidecar_port is not None:
                    directory = workload_sockets(state_dir)
                    sockets = _sockets(directory, _stem(e.address, e.port), 1)
                out[(e.address, e.port)] = UpstreamSpec(
                    service.key,
                    e.address,
                    e.port,
                    locality,
                    served,
                    grpc_port,
                    sockets,
                    grpc_sockets,
                    egress_peers(model, served),
                    model.sandbox if served else ir.Sandbox(),
                    tracing.backend(service.key, None, pull, e.sidecar_port is not None)
                    if tracing and served
                    else None,
                )
    return out


def egress_peers(
    model: ir.MeshModel, functions: tuple[ir.Function, ...]
) -> tuple[tuple[str, int], ...]:
    """(address, port) of every endpoint of the Services the functions name as egress peers,
    and of the Mesh's trace collector where it is an address (the backends push spans there;
    a name cannot be allowed: push to it from a sandboxed backend is refused)."""
    peers = set()
    for function in functions:
        for key in function.egress:
            for e in model.service(key).endpoints:
                peers.add((e.address, e.sidecar_port or e.port))
    collector = model.tracing.collector if model.tracing is not None and functions else None
    if collector is not None and _is_ip(collector.host):  # the backends push spans there
        peers.add((collector.host.strip("[]"), collector.port))
    return tuple(sorted(peers))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def local_upstreams(
    model: ir.MeshModel, state_dir: Path, setup: FunctionsSetup | None
) -> dict[tuple[str, int], UpstreamSpec]:
    """What `meshfn up` runs: upstreams_for with its state directory and backend processes."""
    return upstreams_for(model, state_dir, setup.processes if setup is not None else 1)


def app_sockets(upstreams: Iterable[UpstreamSpec]) -> AppSockets:
    """What the translator needs (ProxyHost.app_sockets): each port served on sockets."""
    out = []
    for spec in upstreams:
        if spec.sockets:
            out.append(((spec.address, spec.port), tuple(map(str, spec.sockets))))
        if spec.grpc_sockets and spec.grpc_port is not None:
            out.append(((spec.address, spec.grpc_port), tuple(map(str, spec.grpc_sockets))))
    return tuple(sorted(out))


@dataclass(frozen=True)
class BackendLinks:
    """What a backend gets from the control plane beyond its functions: where the mesh's token
    budgets are kept (and its proof), the key of its functions' audit text digests."""

    ledger: TokenLedgerAccess | None = None
    audit_text_key: str | None = None


def backend_config(
    spec: UpstreamSpec,
    setup: FunctionsSetup,
    state: Path | None = None,
    links: BackendLinks | None = None,
) -> dict[str, Any]:
    """The inference backend's config for one endpoint: each Function's settings as the policy
    gave them (the same schema), named; its sandbox (`state`: its own state directory); its
    links to the control plane."""
    links = links or BackendLinks()
    config = BackendConfig(
        registry=setup.registry.resolve(),
        trustedKeys=[k.resolve() for k in setup.trusted_keys],
        workers=setup.workers,
        processes=setup.processes,
        functions=[v for f in spec.functions for v in f.served_versions()],
        tracing=spec.tracing,
        sandbox=SandboxSettings(
            landlock=spec.sandbox.landlock,
            seccomp=spec.sandbox.seccomp,
            stateDir=state.resolve() if state is not None else None,
            connect=[EgressAddress(address=a, port=p) for a, p in spec.egress],
        ),
        tokenLedger=links.ledger,
        auditTextKey=links.audit_text_key,
    )
    result: dict[str, Any] = config.model_dump(mode="json", exclude_none=True)
    return result


def write_backend_config(
    spec: UpstreamSpec, state_dir: Path, setup: FunctionsSetup, links: BackendLinks | None
) -> Path:
    """The backend's config file, in its own state directory (owner-only: its ledger token and
    audit text key); rewritten when only its tracing changed, then SIGHUP (retraceable)."""
    own = backend_state_dir(state_dir, spec.address, spec.port)
    config = own / "backend.json"
    config.write_text(json.dumps(backend_config(spec, setup, own, links), indent=2))
    config.chmod(0o600)
    return config


def retraceable(old: UpstreamSpec, new: UpstreamSpec) -> bool:
    """Whether a running backend can take `new` by reloading its tracing (SIGHUP,
    inference.server.reload_tracing) instead of restarting: nothing else changed, and its
    spans go nowhere its sandbox did not allow at start (collected by `meshfn up`, or the
    same endpoint)."""
    if not new.functions or replace(old, tracing=new.tracing) != new:
        return False
    had = old.tracing.endpoint if old.tracing is not None else None
    return new.tracing is None or new.tracing.endpoint in (None, had)


def tracing_applied(status: dict[str, Any], tracing: BackendTracing | None) -> bool:
    """Whether a backend's status document (/meshfn/functions) shows `tracing` in force."""
    shown = status.get("tracing")
    if tracing is None or shown is None:
        return shown is None and tracing is None
    return bool(
        shown.get("sampling") == tracing.sampling and shown.get("endpoint") == tracing.endpoint
    )


def delay_file(state_dir: Path, spec: UpstreamSpec) -> Path:
    """Milliseconds a placeholder upstream waits before each answer (absent: none)."""
    return state_dir / "delay" / f"{spec.address}-{spec.port}"


def upstream_process(
    spec: UpstreamSpec,
    state_dir: Path,
    setup: FunctionsSetup | None,
    preexec: Callable[[], None] | None = None,
    links: BackendLinks | None = None,
) -> SupervisedProcess:
    log_path = state_dir / "logs" / f"upstream-{spec.address}-{spec.port}.log"
    for directory in {p.parent for p in (*spec.sockets, *spec.grpc_sockets)}:
        private_directory(directory)
    if spec.sockets:
        listen = [arg for path in spec.sockets for arg in ("--unix-socket", str(path))]
        listen += [arg for path in spec.grpc_sockets for arg in ("--grpc-unix-socket", str(path))]
    else:
        listen = ["--host", spec.address, "--port", str(spec.port)]
        listen += ["--grpc-port", str(spec.grpc_port)] if spec.grpc_port else []
    if spec.functions:
        if setup is None:
            raise ValueError(f"{spec.service} serves functions but no registry is configured")
        own = backend_state_dir(state_dir, spec.address, spec.port)
        private_directory(own)
        (own / "sandbox.json").unlink(missing_ok=True)  # the report of the backend to come
        config = write_backend_config(spec, state_dir, setup, links)

        async def backend_ready() -> bool:
            # every serving process, where each has a socket of its own
            for where in spec.sockets or (spec.where,):
                status, _ = await upstream_request(where, "/v2/health/ready", timeout=1)
                if status != 200:
                    return False
            return True

        return SupervisedProcess(
            name=f"inference {spec.service} {spec.address}:{spec.port}",
            argv=[
                sys.executable,
                "-P",
                "-m",
                "meshfn.inference",
                "serve",
                "--config",
                str(config),
                *listen,
                "--log-format",
                "json",
            ],
            log_path=log_path,
            ready=backend_ready,
            ready_timeout=60,
            preexec=preexec,
        )

    async def ready() -> bool:
        if spec.sockets:
            _, writer = await asyncio.open_unix_connection(spec.sockets[0])
        else:
            _, writer = await asyncio.open_connection(spec.address, spec.port)
        writer.close()
        return True

    return SupervisedProcess(
        name=f"upstream {spec.service} {spec.address}:{spec.port}",
        argv=[
            sys.executable,
            "-P",
            "-m",
            "meshfn.control_plane.runtime.upstream",
            "--service",
            spec.service,
            "--address",
            spec.address,
            "--port",
            str(spec.port),
            *(("--unix-socket", str(spec.sockets[0])) if spec.sockets else ()),
            "--locality",
            spec.locality,
            # Demos and tests make an endpoint slow by writing milliseconds into this file.
            "--delay-file",
            str(delay_file(state_dir, spec)),
        ],
        log_path=log_path,
        ready=ready,
        preexec=preexec,
    )


async def upstream_request(where: Path | str, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET `path` from an application `meshfn up` runs: its unix socket, or "address:port"."""
    session, base = local_session(where, aiohttp.ClientTimeout(total=timeout))
    async with session, session.get(base + path) as response:
        return response.status, await response.read()
