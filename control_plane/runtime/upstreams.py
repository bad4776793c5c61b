"""What `meshfn up` runs behind the sidecars: the inference backend for services that serve
functions, a placeholder upstream for the other loopback HTTP endpoints."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from meshfn import ir
from meshfn.contracts.function import BackendConfig, TokenLedgerAccess
from meshfn.policy import compile

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


def served_functions(model: ir.MeshModel) -> dict[str, list[ir.Function]]:
    """Service key -> functions its endpoints must serve (see policy.compile)."""
    return compile.served_functions(list(model.functions), {s.key: s for s in model.services})


def upstreams_for(model: ir.MeshModel) -> dict[tuple[str, int], UpstreamSpec]:
    """One process per loopback HTTP endpoint; endpoints elsewhere are the user's to run."""
    functions = served_functions(model)
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
                out[(e.address, e.port)] = UpstreamSpec(
                    service.key,
                    e.address,
                    e.port,
                    locality,
                    served,
                    e.grpc_port if served else None,
                )
    return out


@dataclass(frozen=True)
class BackendLinks:
    """What a backend gets from the control plane beyond its functions: where the mesh's token
    budgets are kept (and its proof), the key of its functions' audit text digests."""

    ledger: TokenLedgerAccess | None = None
    audit_text_key: str | None = None


def backend_config(
    spec: UpstreamSpec, setup: FunctionsSetup, links: BackendLinks | None = None
) -> dict[str, Any]:
    """The inference backend's config for one endpoint: each Function's settings as the policy
    gave them (the same schema), named, and its links to the control plane."""
    links = links or BackendLinks()
    config = BackendConfig(
        registry=setup.registry.resolve(),
        trustedKeys=[k.resolve() for k in setup.trusted_keys],
        workers=setup.workers,
        processes=setup.processes,
        functions=[f.served() for f in spec.functions],
        tokenLedger=links.ledger,
        auditTextKey=links.audit_text_key,
    )
    result: dict[str, Any] = config.model_dump(mode="json", exclude_none=True)
    return result


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
    if spec.functions:
        if setup is None:
            raise ValueError(f"{spec.service} serves functions but no registry is configured")
        config = state_dir / "inference" / f"{spec.address}-{spec.port}.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(backend_config(spec, setup, links), indent=2))
        config.chmod(0o600)  # its ledger token and audit text key

        async def backend_ready() -> bool:
            timeout = aiohttp.ClientTimeout(total=1)
            url = f"http://{spec.address}:{spec.port}/v2/health/ready"
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as r:
                return r.status == 200

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
                "--host",
                spec.address,
                "--port",
                str(spec.port),
                *(("--grpc-port", str(spec.grpc_port)) if spec.grpc_port else ()),
                "--log-format",
                "json",
            ],
            log_path=log_path,
            ready=backend_ready,
            ready_timeout=60,
            preexec=preexec,
        )

    async def ready() -> bool:
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
