"""Free loopback ports for tests and benchmarks, and a retry for when one was taken anyway.

A port is picked by binding port 0 and closing the socket, so another process can take it
before ours binds it: a small race on a machine that runs other tests. Callers that start
something on picked ports wrap the start in `retry_on_port_clash`, which picks new ports when
the start fails with EADDRINUSE.
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# How processes say so: Envoy ("cannot bind ...: Address already in use"), asyncio/aiohttp
# ("[Errno 98] ... address already in use"), grpc ("Address already in use").
ADDRESS_IN_USE = "address already in use"


class PortInUse(OSError):
    """A port picked here was taken before its user bound it (EADDRINUSE, also when a child
    process reported it in its log)."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.EADDRINUSE, f"{what}: address already in use")


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago (all held open together,
    so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def named_ports(*names: str) -> dict[str, int]:
    """One free port per name: `named_ports("xds", "admin")` -> {"xds": 40123, "admin": 40124}."""
    return dict(zip(names, free_ports(len(names)), strict=True))


def is_port_clash(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE


def retry_on_port_clash(start: Callable[[], T], attempts: int = 3) -> T:
    """Call `start` (which picks its ports itself, e.g. with `free_ports`) again when it fails
    because a port was taken meanwhile (an OSError with EADDRINUSE, such as `PortInUse`);
    `start` must clean up what it started before it raises."""
    for _ in range(attempts - 1):
        try:
            return start()
        except OSError as exc:
            if not is_port_clash(exc):
                raise
    return start()


def hanging_server() -> tuple[socket.socket, int]:
    """A loopback TCP server that accepts connections and never answers (a collector, or any
    peer, that hangs); close the socket to stop it. Returns it and its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True, name="meshfn-hanging-server").start()
    return server, int(server.getsockname()[1])
