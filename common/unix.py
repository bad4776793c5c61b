"""Private unix sockets: where meshfn's own processes talk to each other without a TCP port
that every local user could reach.

Loopback TCP is shared by every user of a host: a port is no boundary. A unix socket is a file,
so the kernel checks its permissions on `connect()`: one in a directory only its owner may enter
(0700), with mode 0600 itself, reaches its owner's processes only. `meshfn up` serves Envoy's
admin interface and the applications behind the sidecars this way.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

SOCKET_MODE = 0o600
# sockaddr_un.sun_path holds 108 bytes on Linux, the terminating NUL included (Envoy refuses a
# longer pipe path).
MAX_SOCKET_PATH = 107


class SocketPathTooLong(OSError):
    """A directory is too deep for a unix socket path."""


def socket_path(directory: Path, name: str, what: str) -> Path:
    """DIRECTORY/<name>.sock (absolute: a process may run elsewhere than its supervisor's cwd),
    or DIRECTORY/<digest>.sock when `name` would not fit in a socket address. `what` names the
    socket in the error raised when even the digest does not fit."""
    directory = Path(os.path.abspath(directory))
    for stem in (name, hashlib.sha256(name.encode()).hexdigest()[:16]):
        path = directory / f"{stem}.sock"
        if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
            return path
    raise SocketPathTooLong(
        36,  # ENAMETOOLONG
        f"the state directory {directory.parent} is too deep for {what} "
        f"({len(os.fsencode(path))} bytes in {path}; a unix socket path holds at most "
        f"{MAX_SOCKET_PATH}): use a shorter --state-dir",
    )


def listen_private(path: Path, backlog: int = 1024) -> socket.socket:
    """A listening unix stream socket at `path`, mode 0600 before it listens (so no other user
    ever connects), replacing a stale socket a previous process left there (never another kind
    of file). Non-blocking, for an event loop."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(17, f"{path} exists and is not a socket")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, SOCKET_MODE)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a unix socket (an Envoy admin `pipe` address, a workload's socket)."""

    def __init__(self, path: Path | str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_file = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_file)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def unix_request(
    socket_file: Path | str,
    path: str,
    timeout: float = 5.0,
    method: str = "GET",
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    """One HTTP/1.1 request over a unix socket: (status, body)."""
    connection = UnixHTTPConnection(socket_file, timeout)
    try:
        connection.request(method, path, body, dict(headers or {}))
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()
