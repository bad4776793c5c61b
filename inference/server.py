"""The KServe v2 HTTP surface of the backend (on the asyncio + httptools server in http.py).

Routes: /v2, /v2/health/{live,ready}, /v2/models/{name}[/versions/{v}][/ready|/infer], /metrics.
SIGTERM/SIGINT: readiness turns 503, the listener closes, running requests finish (bounded),
instances are released, exit 0.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
from importlib.metadata import version as package_version

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .backend import Backend, Reply
from .config import BackendConfig
from .http import HttpServer, Request, Response
from .kserve import error_body
from .status import STATUS_PATH, functions_document

log = logging.getLogger("meshfn.inference")


def _parse_model_path(parts: list[str]) -> tuple[str, str | None, str] | None:
    """['v2','models',name,('versions',v)?,(action)?] -> (name, version, action)."""
    if len(parts) < 3 or not parts[2]:
        return None
    name, rest = parts[2], parts[3:]
    version = None
    if len(rest) >= 2 and rest[0] == "versions" and rest[1]:
        version, rest = rest[1], rest[2:]
    if not rest:
        return name, version, "metadata"
    if len(rest) == 1 and rest[0] in ("ready", "infer"):
        return name, version, rest[0]
    return None


class Router:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.server_meta = json.dumps(
            {"name": "meshfn-inference", "version": package_version("meshfn"), "extensions": []}
        ).encode()

    def body_limit(self, path: str) -> int:
        parsed = (
            _parse_model_path(path.strip("/").split("/"))
            if path.startswith("/v2/models/")
            else None
        )
        if parsed is None or parsed[2] != "infer":
            return 64 << 10  # nothing else takes a body
        return self.backend.limit_for(parsed[0], parsed[1])

    async def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        if path.startswith("/v2/models/"):
            parsed = _parse_model_path(path.strip("/").split("/"))
            if parsed is None:
                return _json(Reply.error(404, f"no route for {path}"))
            name, version, action = parsed
            if action == "infer":
                if method != "POST":
                    return _json(Reply.error(405, "use POST for infer"))
                return _json(await self.backend.infer(name, version, request.body))
            if method != "GET":
                return _json(Reply.error(405, f"use GET for {path}"))
            if action == "ready":
                return _json(self.backend.model_ready(name, version))
            return _json(self.backend.metadata(name, version))
        if method != "GET":
            return _json(
                Reply.error(405 if path in _GET_ROUTES else 404, f"no {method} route for {path}")
            )
        if path == "/v2/health/ready":
            ready = self.backend.ready
            return _json(Reply(200 if ready else 503, json.dumps({"ready": ready}).encode()))
        if path == "/v2/health/live":
            return _json(Reply(200, b'{"live": true}'))
        if path == "/v2":
            return _json(Reply(200, self.server_meta))
        if path == "/metrics":
            data = generate_latest(self.backend.metrics.registry)
            return Response(200, data, content_type=CONTENT_TYPE_LATEST.encode())
        if path == STATUS_PATH:
            return Response(200, json.dumps(functions_document(self.backend)).encode())
        return _json(Reply.error(404, f"no route for {path}"))


_GET_ROUTES = {"/v2", "/v2/health/ready", "/v2/health/live", "/metrics", STATUS_PATH}


def _json(reply: Reply) -> Response:
    return Response(reply.status, reply.body)


async def serve(config: BackendConfig, host: str, port: int, drain_timeout: float = 10.0) -> None:
    """Run until SIGTERM/SIGINT, then drain and return (the caller exits 0)."""
    backend = Backend(config)
    router = Router(backend)
    http = HttpServer(router.handle, router.body_limit, error_body)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await http.start(host, port)  # bind first: a port conflict fails before verification
    try:
        await backend.start()
        # Everything allocated so far (modules, config, metrics, verified metadata) lives as
        # long as the process. Left to the cyclic GC, each full collection walks it all: ~30 ms
        # that would land inside some unlucky request. Frozen, full collections only walk what
        # requests allocate.
        gc.freeze()
        log.info("listening", extra={"host": host, "port": port, "workers": config.workers})
        await stop.wait()
        log.info("draining", extra={"inflight": backend.inflight})
        backend.ready = False
        http.stop_listening()
        await backend.drain(drain_timeout)
    finally:
        await http.close()
        if not backend.draining:
            await backend.drain(0)
