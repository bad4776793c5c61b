"""Helpers shared by the benchmark and the e2e tests: a static Envoy in front of the backend
(the control plane's translator owns the real routes) and a minimal keep-alive HTTP client whose
own overhead is small enough to time microsecond-scale requests."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any


def envoy_static_config(
    listener_port: int,
    admin_port: int,
    backend_port: int,
    retries: int = 0,
    backend_socket: Path | None = None,
) -> dict[str, Any]:
    """Envoy bootstrap routing /v2/ on `listener_port` to the backend on loopback, or on its
    unix socket (`backend_socket`: as a sidecar of `meshfn up` reaches it); `retries`: retry a
    request whose upstream connection failed or was reset (as a Route's retryOn)."""
    route: dict[str, Any] = {"cluster": "inference", "timeout": "10s"}
    if retries:
        route["retry_policy"] = {
            "retry_on": "reset,connect-failure,refused-stream",
            "num_retries": retries,
        }
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "inference",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/v2/"},
                            "route": route,
                        }
                    ],
                }
            ]
        },
        "http_filters": [router],
    }
    address: dict[str, Any] = (
        {"pipe": {"path": str(backend_socket)}}
        if backend_socket is not None
        else {"socket_address": {"address": "127.0.0.1", "port_value": backend_port}}
    )
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": listener_port}
                    },
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "inference",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    # Envoy's default allows 3 retries in flight per cluster: a killed backend
                    # process resets all its connections at once, and the 4th retry would be
                    # refused (upstream_rq_retry_overflow). As the control plane's clusters do.
                    "circuit_breakers": {"thresholds": [{"max_retries": 0xFFFFFFFF}]},
                    "load_assignment": {
                        "cluster_name": "inference",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
                    },
                }
            ],
        },
    }


def write_envoy_config(
    path: Path,
    listener_port: int,
    admin_port: int,
    backend_port: int,
    retries: int = 0,
    backend_socket: Path | None = None,
) -> Path:
    config = envoy_static_config(listener_port, admin_port, backend_port, retries, backend_socket)
    path.write_text(json.dumps(config))
    return path


def get_json(port: int, path: str) -> Any:
    """GET `path` from a loopback port on a new connection; the JSON of its 200 answer."""
    client = RawHttp("127.0.0.1", port)
    try:
        status, body = client.request("GET", path)
    finally:
        client.close()
    if status != 200:
        raise AssertionError(f"GET {path}: {status} {body[:200]!r}")
    return json.loads(body)


class RawHttp:
    """One keep-alive HTTP/1.1 connection with TCP_NODELAY; requests are pre-encoded."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.host, self.port = host, port
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def encode(self, method: str, path: str, body: bytes = b"") -> bytes:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    def send(self, raw: bytes) -> tuple[int, bytes]:
        self.sock.sendall(raw)
        return self._read()

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        return self.send(self.encode(method, path, body))

    def _read(self) -> tuple[int, bytes]:
        while b"\r\n\r\n" not in self._buf:
            self._fill()
        head, _, rest = self._buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            self._buf = rest
            self._fill()
            rest = self._buf
        self._buf = rest[length:]
        return status, rest[:length]

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("connection closed by peer")
        self._buf += chunk

    def close(self) -> None:
        self.sock.close()
