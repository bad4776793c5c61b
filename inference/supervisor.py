"""`processes: N`: N serving processes behind one port, so every core runs guests and Python.

One Python process is bound by its GIL (HTTP parsing, KServe JSON and the host side of every
call hold it), so a second core sat idle. The supervisor binds N listening sockets to the one
port with SO_REUSEPORT (the kernel spreads new connections over them by their addresses) and
starts N children (`serve` with a hidden `--listen-fd`), child k accepting from socket k.

Measured first: one socket shared by all children (the pre-fork model) put all 8 of wrk's
connections on one process (whichever event loop woke first won every accept), so it bought
nothing. With SO_REUSEPORT a socket whose process closes it resets the connections queued on
it; here the supervisor keeps every socket open itself, so when a child dies its socket keeps
listening and queueing, and the restarted child adopts the same socket and answers them:
only the requests the dead process was running are lost (a gateway retries those on reset).
gRPC, whose server cannot adopt a socket, binds the same port in each child with SO_REUSEPORT
(set for children only: a lone backend owns its gRPC port). On unix sockets (`--unix-socket`,
what `meshfn up` uses behind a sidecar) there is no SO_REUSEPORT: each child has a socket of its
own (the supervisor keeps the HTTP ones, as above; a child binds its gRPC one), one per process,
and the sidecar's cluster balances over them. Children get PR_SET_PDEATHSIG, so a
SIGKILLed supervisor leaves no process serving on its port.

The children share the registry's artifacts through the page cache: each mmaps the same
`.cwasm` files (`deserialize_file`), so the code's pages exist once in memory.

Per process (documented, not shared): pools, warm-up predictions and budgets, the
`maxConcurrency` limit, statistics and /metrics (a scrape reads the process that accepted it;
`/meshfn/functions` names its `pid`), and scale-to-zero. A child that exits unexpectedly is
restarted (with a back-off when it keeps dying at start-up); SIGTERM/SIGINT is passed to every
child, each drains, and the supervisor exits 0 once all have exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from meshfn.common.processes import die_with_parent
from meshfn.common.unix import listen_private

from .config import BackendConfig, follow_config, load_config, reread_for_tracing

log = logging.getLogger("meshfn.inference.supervisor")

RESTART_BACKOFF_S = (0.05, 0.2, 1.0, 2.0)  # after quick successive deaths
STABLE_S = 5.0  # a child that lived this long resets the back-off


def listening_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


class Supervisor:
    def __init__(
        self,
        config: BackendConfig,
        host: str,
        port: int,
        drain_timeout: float,
        grpc_port: int | None,
        log_args: list[str],
        unix_sockets: Sequence[Path] = (),
        grpc_unix_sockets: Sequence[Path] = (),
        config_path: Path | None = None,
        watch_every: float = 0.0,
    ) -> None:
        self.config = config
        self.config_path = config_path  # SIGHUP takes its `tracing` anew (_reload)
        self.watch_every = watch_every  # and so does a new file there (config.watch_config)
        self._started: BackendConfig | None = None  # the file as it was at start
        self.host, self.port, self.grpc_port = host, port, grpc_port
        # One socket per child, instead of the shared port: child k accepts from the k-th (a
        # unix socket has no SO_REUSEPORT; the sidecar balances over the sockets).
        self.unix_sockets, self.grpc_unix_sockets = list(unix_sockets), list(grpc_unix_sockets)
        self.drain_timeout = drain_timeout
        self.log_args = log_args
        self.children: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = 0
        self.stopping = False

    def _argv(self, config_path: Path, index: int, fd: int) -> list[str]:
        argv = [sys.executable, "-P", "-m", "meshfn.inference", "serve", "--config",
                str(config_path), "--host", self.host, "--port", str(self.port),
                "--listen-fd", str(fd),
                "--drain-timeout", str(self.drain_timeout), *self.log_args]  # fmt: skip
        if self.unix_sockets:
            argv += ["--unix-socket", str(self.unix_sockets[index])]
        if self.grpc_unix_sockets:
            argv += ["--grpc-unix-socket", str(self.grpc_unix_sockets[index])]
        elif self.grpc_port is not None:
            argv += ["--grpc-port", str(self.grpc_port)]
        return argv

    def _listen(self) -> list[socket.socket]:
        if self.unix_sockets:
            return [listen_private(path) for path in self.unix_sockets]
        first = listening_socket(self.host, self.port)
        self.port = first.getsockname()[1]
        return [first] + [
            listening_socket(self.host, self.port) for _ in range(self.config.processes - 1)
        ]

    async def run(self) -> None:
        socks = self._listen()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        with tempfile.TemporaryDirectory(prefix="meshfn-backend-") as tmp:
            config_path = Path(tmp) / "backend.json"
            self._write_child_config(config_path, self.config)
            keepers = [
                asyncio.create_task(self._keep(i, config_path, sock.fileno()))
                for i, sock in enumerate(socks)
            ]
            watching = None
            if self.config_path is not None:
                self._started = load_config(self.config_path)
                reload = functools.partial(self._reload, config_path)
                watching = follow_config(self.config_path, self.watch_every, reload)
            where = (
                {"unix_sockets": [str(p) for p in self.unix_sockets]}
                if self.unix_sockets
                else {"host": self.host, "port": self.port}
            )
            log.info("supervising", extra={"processes": self.config.processes, **where})
            await stop.wait()
            self.stopping = True
            if watching is not None:
                watching.cancel()
            for child in list(self.children.values()):
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(
                    asyncio.gather(*keepers, return_exceptions=True), self.drain_timeout + 5
                )
            except TimeoutError:
                for child in list(self.children.values()):
                    with contextlib.suppress(ProcessLookupError):
                        child.kill()
                await asyncio.gather(*keepers, return_exceptions=True)
        for sock in socks:
            sock.close()
        for path in self.unix_sockets:
            path.unlink(missing_ok=True)

    def _write_child_config(self, path: Path, config: BackendConfig) -> None:
        # One process each: the children must not supervise again.
        child = config.model_copy(
            update={
                "processes": 1,
                "registry": config.registry.resolve(),
                "trustedKeys": [k.resolve() for k in config.trustedKeys],
            }
        )
        path.write_text(child.model_dump_json())

    def _reload(self, child_path: Path) -> None:
        """SIGHUP: the children's config takes the file's new `tracing`, and each child is
        told (server.reload_tracing); a child restarted later starts with it."""
        assert self.config_path is not None and self._started is not None
        fresh = reread_for_tracing(self.config_path, self._started)
        if fresh is None:
            return
        self.config = self.config.model_copy(update={"tracing": fresh.tracing})
        self._write_child_config(child_path, self.config)
        for child in list(self.children.values()):
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGHUP)

    async def _keep(self, index: int, config_path: Path, fd: int) -> None:
        """Run child `index` until stopping, restarting it whenever it exits."""
        quick_deaths = 0
        while not self.stopping:
            started = time.monotonic()
            child = await asyncio.create_subprocess_exec(
                *self._argv(config_path, index, fd),
                pass_fds=(fd,),
                stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=die_with_parent,  # a SIGKILLed supervisor leaves no server behind
            )
            self.children[index] = child
            code = await child.wait()
            self.children.pop(index, None)
            if self.stopping:
                return
            lived = time.monotonic() - started
            quick_deaths = 0 if lived > STABLE_S else quick_deaths + 1
            self.restarts += 1
            log.error(
                "backend process exited; restarting",
                extra={"index": index, "pid": child.pid, "code": code, "lived_s": round(lived, 2)},
            )
            if quick_deaths:
                await asyncio.sleep(
                    RESTART_BACKOFF_S[min(quick_deaths, len(RESTART_BACKOFF_S)) - 1]
                )


def adopt(fd: int) -> socket.socket:
    """The supervisor's listening socket in a child."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    os.set_inheritable(fd, False)
    return sock
