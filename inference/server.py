"""The KServe v2 HTTP surface of the backend (on the asyncio + httptools server in http.py), and
the process that serves it and the gRPC service (grpc_api.py) side by side.

Routes: /v2, /v2/health/{live,ready}, /v2/models (the list), /v2/models/stats,
/v2/models/{name}[/versions/{v}][/ready|/infer|/stats], Triton's /v2/repository/index and
/v2/repository/models/{name}[/versions/{v}]/{load,unload}, /metrics, /meshfn/functions,
/meshfn/shadow (a rollout's shadow comparisons, shadow.py) and POST /meshfn/spans (tracing.py).
SIGTERM/SIGINT: readiness turns 503, the listeners close, running requests finish (bounded),
instances are released, exit 0.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from meshfn.common import peerjson
from meshfn.common.unix import listen_private
from meshfn.contracts import otlp
from meshfn.contracts.function import BACKEND_STATUS_PATH
from meshfn.contracts.rollout import MODEL_VERSION_HEADER, SHADOW_PATH
from meshfn.contracts.tracing import SPANS_MAX_WAIT_S, SPANS_PATH, SPANS_WAIT

from .backend import Backend, Reply
from .config import BackendConfig, follow_config, load_config, reread_for_tracing
from .generate_http import OPENAI_OPERATIONS, GenerateFront, StreamReply
from .http import HttpServer, Request, Response, on_disconnect, query_values
from .kserve import KServeError, error_body, unsupported
from .openai_api import error_body as openai_error_body
from .sandbox import Sandbox
from .shadow import Shadows, is_shadow, requested_version
from .status import functions_document

if TYPE_CHECKING:
    from .grpc_api import GrpcServer

log = logging.getLogger("meshfn.inference")

_MODEL_ACTIONS = ("ready", "infer", "stats", "config", "generate", "generate_stream")
_SMALL_BODY = 64 << 10  # everything but infer
_BODY_ACTIONS = ("infer", "generate", "generate_stream")
# OpenAI's API at the root (/v1/...), in KServe's spelling (/openai/v1/...), and below a model
# (/v2/models/{model}/openai/v1/..., where the mesh's gateway sends what it routed by `model`)
_OPENAI_ROOTS = ("/v1/", "/openai/v1/")
_OPENAI = "openai:"  # a model route's action prefix for the OpenAI operation below the model


def _versioned(parts: list[str]) -> tuple[str, str | None, list[str]] | None:
    """[name, ('versions', v)?, rest...] -> (name, version, rest)."""
    if not parts or not parts[0]:
        return None
    name, rest = parts[0], parts[1:]
    version = None
    if len(rest) >= 2 and rest[0] == "versions" and rest[1]:
        version, rest = rest[1], rest[2:]
    elif rest and rest[0] == "versions":
        return None
    return name, version, rest


def _parse_model_path(parts: list[str]) -> tuple[str, str | None, str] | None:
    """['v2','models',name,('versions',v)?,(action)?] -> (name, version, action)."""
    parsed = _versioned(parts[2:])
    if parsed is None:
        return None
    name, version, rest = parsed
    if not rest:
        return name, version, "metadata"
    if len(rest) == 1 and rest[0] in _MODEL_ACTIONS:
        return name, version, rest[0]
    if len(rest) >= 3 and rest[:2] == ["openai", "v1"]:
        return name, version, _OPENAI + "/".join(rest[2:])
    return None


def _model_route(path: str) -> tuple[str, str | None, str] | None:
    """A /v2/models/... path's (name, version, action): the body limit and the route both need
    it on every request, so short paths are parsed once each (the cache holds at most 1,024 of
    at most 256 characters: a client sending many or long paths cannot grow it)."""
    if len(path) <= 256:
        return _cached_route(path)
    return _parse_model_path(path.strip("/").split("/"))


@functools.lru_cache(maxsize=1024)
def _cached_route(path: str) -> tuple[str, str | None, str] | None:
    return _parse_model_path(path.strip("/").split("/"))


def _parse_repository_path(parts: list[str]) -> tuple[str, str | None, str] | None:
    """['v2','repository','models',name,('versions',v)?,load|unload]."""
    if len(parts) < 4 or parts[2] != "models":
        return None
    parsed = _versioned(parts[3:])
    if parsed is None:
        return None
    name, version, rest = parsed
    if len(rest) == 1 and rest[0] in ("load", "unload"):
        return name, version, rest[0]
    return None


def _json_body(body: bytes, allowed: set[str]) -> dict[str, Any]:
    """The small JSON object the repository endpoints take (an empty body is {})."""
    if not body.strip():
        return {}
    try:
        value = peerjson.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise KServeError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise KServeError(400, "request body must be a JSON object")
    unknown = set(value) - allowed
    if unknown:
        raise KServeError(400, f"unknown request field(s): {', '.join(sorted(unknown))}")
    return value


_MODEL_VERSION = MODEL_VERSION_HEADER.encode()

_LOADED_PATHS = ("/infer", "/generate", "/generate_stream", "/completions", "/embeddings")


def _openai_405(message: str, allowed: str) -> Reply:
    return Reply(405, openai_error_body(405, message), ((b"Allow", allowed.encode()),))


class Router:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.shadows = Shadows(backend)
        self.front = GenerateFront(backend)
        # What `meshfn up` reads on the backend's own socket (the mesh's repository guard
        # denies these paths at every sidecar: policy.kserve).
        self._private: dict[str, Callable[[Request], Awaitable[Reply]]] = {
            SHADOW_PATH: self._shadow,
            SPANS_PATH: self._spans,
        }
        # The server-wide GET endpoints (each a handler of no arguments).
        self._gets: dict[str, Callable[[], Reply]] = {
            "/v2": lambda: Reply(200, self.backend.server_meta),
            "/v2/health/ready": self._ready,
            "/v2/health/live": lambda: Reply(200, b'{"live": true}'),
            "/v2/models": lambda: Reply.json({"models": self.backend.model_names()}),
            "/v2/models/stats": lambda: Reply.json(
                {"model_stats": self.backend.statistics(None, None)}
            ),
            "/metrics": lambda: Reply(
                200,
                generate_latest(self.backend.metrics.registry),
                content_type=CONTENT_TYPE_LATEST.encode(),
            ),
            BACKEND_STATUS_PATH: lambda: Reply.json(functions_document(self.backend)),
        }

    def body_limit(self, path: str) -> int:
        if path.startswith(_OPENAI_ROOTS):  # the model is in the body: the largest limit
            return self.backend.largest_limit()
        if not path.startswith("/v2/models/"):
            return _SMALL_BODY
        parsed = _model_route(path)
        if parsed is None or not (parsed[2] in _BODY_ACTIONS or parsed[2].startswith(_OPENAI)):
            return _SMALL_BODY
        return self.backend.limit_for(parsed[0], parsed[1])

    async def handle(self, request: Request) -> Response:
        # A trailing slash names the same resource (the OpenAPI document spells server
        # metadata `/v2/`)
        path = request.path.rstrip("/") or "/"
        try:
            reply = await self._route(request, path)
        except KServeError as exc:
            reply = Reply.of(exc)
        headers = list(reply.headers)
        if path.endswith(_LOADED_PATHS):  # ORCA load report, for weighted round robin
            headers.append(self.backend.orca.header(self.backend.dispatcher.inflight))
        if isinstance(reply, StreamReply):
            return Response(
                reply.status,
                b"",
                reply.content_type,
                extra_headers=headers,
                stream=reply.chunks,
                trailers=reply.trailers,
            )
        return Response(reply.status, reply.body, reply.content_type, extra_headers=headers)

    async def _route(self, request: Request, path: str) -> Reply | StreamReply:
        if path.startswith(_OPENAI_ROOTS):
            return await self._openai(request, path.split("/v1/", 1)[1], None)
        if path.startswith("/v2/models/") and path != "/v2/models/stats":
            return await self._model(request, path)
        if path.startswith("/v2/repository/"):
            return await self._repository(request, path)
        private = self._private.get(path)
        if private is not None:
            return await private(request)
        get = self._gets.get(path)
        if get is None:
            return Reply.error(404, _unsupported(path) or f"no route for {path}")
        _method(request.method, "GET", path)
        return get()

    async def _shadow(self, request: Request) -> Reply:
        """GET /meshfn/shadow: the controller reads the rollouts' comparisons (shadow.py)."""
        _method(request.method, "GET", SHADOW_PATH)
        return Reply.json(self.shadows.report(request.query))

    async def _spans(self, request: Request) -> Reply:
        """POST /meshfn/spans: `meshfn up` collects the queued spans (BackendTracing.pullToken,
        as a bearer token: the sidecar forwards mesh requests to this same socket, and no
        caller of the mesh may take them). 200 with OTLP protobuf, 204 while none wait;
        `?wait=S` (SPANS_WAIT) first waits up to S seconds for one."""
        _method(request.method, "POST", SPANS_PATH)
        exporter, settings = self.backend.tracer.exporter, self.backend.tracer.settings
        token = settings.pullToken if settings is not None else None
        offered = request.headers.get(b"authorization", b"")
        if token is None or exporter is None or not exporter.pulled:
            return Reply.error(404, "this backend's spans are not collected here")
        if not hmac.compare_digest(offered, b"Bearer " + token.encode()):
            return Reply.error(401, "the collector's token is wrong or missing")
        wait = _spans_wait(request.query)
        if wait is None:
            return Reply.error(
                400, f"{SPANS_WAIT} must be a number of seconds from 0 to {SPANS_MAX_WAIT_S:g}"
            )
        collected = await self._collect(wait)
        if collected is None:
            return Reply(204, b"")
        return Reply(200, collected, content_type=otlp.HTTP_CONTENT_TYPE.encode())

    async def _collect(self, wait: float) -> bytes | None:
        """The oldest waiting spans as OTLP, after waiting up to `wait` seconds for one; None
        when none waits."""
        tracer = self.backend.tracer
        if wait:
            lost = False

            def gone() -> None:  # the collector went away: what it would take stays queued
                nonlocal lost
                lost = True
                tracer.wake()

            forget = on_disconnect(gone)
            try:
                await tracer.queued(wait)
            finally:
                forget()
            if lost:
                return None
        exporter = tracer.exporter  # a reload may have replaced it while this waited
        if exporter is None or not exporter.pulled or not exporter.queue:
            return None  # the usual answer: no thread for nothing to encode
        collected = await asyncio.to_thread(exporter.collect)  # encoding: off the event loop
        return None if collected is None else collected[0]

    async def _openai(
        self, request: Request, operation: str, model: str | None
    ) -> Reply | StreamReply:
        """OpenAI's API: /v1/models[/{model}] (GET) and the operations (POST)."""
        if operation == "models" or operation.startswith("models/"):
            if request.method != "GET":
                return _openai_405(f"use GET for /v1/{operation}", "GET")
            name = operation.removeprefix("models").strip("/")
            return self.front.model(name) if name else self.front.models()
        if operation not in OPENAI_OPERATIONS:
            return Reply(404, openai_error_body(404, f"no OpenAI operation /v1/{operation}"))
        if request.method != "POST":
            return _openai_405(f"use POST for /v1/{operation}", "POST")
        return await self.front.openai(operation, request.body, request.headers, model)

    async def _model(self, request: Request, path: str) -> Reply | StreamReply:
        """/v2/models/NAME[/versions/V][/infer|ready|stats|config|generate|generate_stream],
        and OpenAI's operations below a model (/v2/models/NAME/openai/v1/...)."""
        b = self.backend
        parsed = _model_route(path)
        if parsed is None:
            return Reply.error(404, _unsupported(path) or f"no route for {path}")
        name, version, action = parsed
        if version is None:  # a gateway splitting a rollout names the version in a header
            version = requested_version(request.headers)
        if action.startswith(_OPENAI) or action in ("generate", "generate_stream"):
            return await self._generation(request, path, name, version, action)
        if action == "infer":
            _method(request.method, "POST", path)
            return await self._infer(name, version, request)
        _method(request.method, "GET", path)
        gets: dict[str, Callable[[], Reply]] = {
            "ready": lambda: b.model_ready(name, version),
            "stats": lambda: Reply.json({"model_stats": b.statistics(name, version)}),
            "config": lambda: Reply.json(b.model_config(name, version)),
        }
        return gets.get(action, lambda: b.metadata(name, version))()

    async def _generation(
        self, request: Request, path: str, name: str, version: str | None, action: str
    ) -> Reply | StreamReply:
        """A model's generate endpoints: Triton's, and OpenAI's below the model."""
        if action.startswith(_OPENAI):
            return await self._openai(request, action.removeprefix(_OPENAI), name)
        _method(request.method, "POST", path)
        return await self.front.generate(
            name, version, request.body, request.headers, action == "generate_stream"
        )

    async def _infer(self, name: str, version: str | None, request: Request) -> Reply:
        """An inference, its answer naming the version that computed it; a rollout's shadow
        copy answered by the candidate and compared (shadow.py)."""
        rollout = self.shadows.rollout(name) if is_shadow(request.headers) else None
        if rollout is not None:
            version = rollout.candidate
            reply = await self.shadows.infer(name, rollout, request.body, request.headers)
        else:
            reply = await self.backend.infer(name, version, request.body, request.headers)
        try:
            answered = self.backend.lookup(name, version).version
        except KServeError:
            return reply
        return Reply(
            reply.status,
            reply.body,
            (*reply.headers, (_MODEL_VERSION, answered.encode())),
            reply.content_type,
        )

    async def _repository(self, request: Request, path: str) -> Reply:
        """The model repository extension: index, load, unload."""
        b = self.backend
        _method(request.method, "POST", path)
        if path == "/v2/repository/index":
            ready = _json_body(request.body, {"ready"}).get("ready", False)
            if not isinstance(ready, bool):
                raise KServeError(400, "'ready' must be true or false")
            return Reply.json(b.repository_index(ready))
        target = _parse_repository_path(path.strip("/").split("/"))
        if target is None:
            return Reply.error(404, f"no route for {path}")
        name, version, action = target
        params = _json_body(request.body, {"parameters"}).get("parameters", {})
        if not isinstance(params, dict):
            raise KServeError(400, "'parameters' must be an object")
        await (b.load if action == "load" else b.unload)(name, version, params)
        return Reply(200, b"{}")

    def _ready(self) -> Reply:
        reasons = self.backend.unready_reasons()
        body: dict[str, Any] = {"ready": not reasons}
        if reasons:
            body["reasons"] = reasons
        return Reply.json(body, 503 if reasons else 200)


# The REST paths of Triton's extensions meshfn does not offer (kserve.UNSUPPORTED).
_UNSUPPORTED_PATHS = (
    ("/v2/systemsharedmemory", "system_shared_memory"),
    ("/v2/cudasharedmemory", "cuda_shared_memory"),
    ("/v2/trace/setting", "trace"),
    ("/v2/logging", "logging"),
)


def _unsupported(path: str) -> str | None:
    """What a client calling an unsupported extension is told, instead of "no route"."""
    if path.startswith("/v2/models/") and path.endswith("/trace/setting"):
        return unsupported("trace")
    for prefix, extension in _UNSUPPORTED_PATHS:
        if path == prefix or path.startswith(prefix + "/"):
            return unsupported(extension)
    return None


def _method(got: str, want: str, path: str) -> None:
    if got != want:
        error = KServeError(405, f"use {want} for {path}")
        error.headers = ((b"Allow", want.encode()),)  # a 405 must say what is allowed
        raise error


def reload_tracing(backend: Backend, config_path: Path, started: BackendConfig) -> None:
    """SIGHUP: the config file's `tracing` applies from the next request on (`meshfn up`
    rewrote it because the Mesh's tracing changed), without the restart that would cold-start
    every function (config.reread_for_tracing: nothing else is taken)."""
    fresh = reread_for_tracing(config_path, started)
    if fresh is None:
        return
    try:
        backend.tracer.reconfigure(fresh.tracing)
    except ValueError as exc:
        log.error("config reload: tracing unchanged: %s", exc)
        return
    log.info("tracing reloaded", extra={"tracing": backend.tracer.document()})


def _follow_config(
    backend: Backend, config_path: Path, watch_every: float
) -> asyncio.Task[None] | None:
    """The tracing reloads on SIGHUP and on a new file at `config_path` (config.follow_config)."""
    reload = functools.partial(reload_tracing, backend, config_path, load_config(config_path))
    return follow_config(config_path, watch_every, reload)


async def _start_grpc(
    grpc: GrpcServer, host: str, port: int | None, unix_socket: Path | None
) -> None:
    if unix_socket is not None:
        await grpc.start_unix(unix_socket)
    else:
        assert port is not None
        await grpc.start(host, port)


def _spans_wait(query: str) -> float | None:
    """SPANS_WAIT's seconds (0 when absent), None when it is not a number within bounds."""
    given = query_values(query, SPANS_WAIT)
    try:
        wait = float(given[-1]) if given else 0.0
    except ValueError:
        return None
    return wait if 0 <= wait <= SPANS_MAX_WAIT_S else None


async def serve(
    config: BackendConfig,
    host: str,
    port: int,
    drain_timeout: float = 10.0,
    grpc_port: int | None = None,
    listen_fd: int | None = None,
    unix_socket: Path | None = None,
    grpc_unix_socket: Path | None = None,
    sandbox: Sandbox | None = None,
    config_path: Path | None = None,
    watch_every: float = 0.0,
) -> None:
    """Run until SIGTERM/SIGINT, then drain and return (the caller exits 0). `listen_fd`: a
    child of the supervisor (supervisor.py) accepting from its shared socket. `unix_socket`,
    `grpc_unix_socket`: serve there (mode 0600) instead of host:port and grpc_port (what
    `meshfn up` does behind a sidecar: only the sidecar's user can connect). `sandbox`: its
    Landlock domain is in force already; its seccomp filter goes on once everything started.
    `config_path`: the file `config` came from, whose `tracing` SIGHUP takes anew
    (reload_tracing), as does a new file there when `watch_every` > 0 (config.watch_config)."""
    from .grpc_api import GrpcServer
    from .supervisor import adopt

    backend = Backend(config)
    router = Router(backend)
    http = HttpServer(router.handle, router.body_limit, error_body)
    # a supervisor's children share the gRPC port (SO_REUSEPORT); a lone backend owns it
    grpc_wanted = grpc_port is not None or grpc_unix_socket is not None
    grpc = GrpcServer(backend, share_port=listen_fd is not None) if grpc_wanted else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watching = _follow_config(backend, config_path, watch_every) if config_path else None
    # Alone, bind first: a port conflict fails before verification. A supervisor's child
    # (listen_fd) verifies first and only then accepts: its socket is bound already, and the
    # connections queued on it (a restarted child's, under load) must meet verified functions.
    child = listen_fd is not None
    # removed at exit (a child's HTTP socket is its supervisor's)
    owned = [p for p in (None if child else unix_socket, grpc_unix_socket) if p is not None]
    if not child:
        await http.start(
            host, port, sock=listen_private(unix_socket) if unix_socket is not None else None
        )
    try:
        if listen_fd is not None:
            await backend.start()
            await http.start(host, port, sock=adopt(listen_fd))
        if grpc is not None:
            await _start_grpc(grpc, host, grpc_port, grpc_unix_socket)
        if not child:
            await backend.start()
        if sandbox is not None:
            # Start-up is over: from here the process only serves (sandbox.py's allow-list).
            sandbox.confine_syscalls()
            backend.sandbox = sandbox.report()
            sandbox.write_report()
            log.info(sandbox.line(), extra={"sandbox": backend.sandbox})
        # Everything allocated so far (modules, config, metrics, verified metadata) lives as
        # long as the process. Left to the cyclic GC, each full collection walks it all: ~30 ms
        # that would land inside some unlucky request. Frozen, full collections only walk what
        # requests allocate.
        gc.freeze()
        where = (
            {"unix_socket": str(unix_socket), "grpc_unix_socket": str(grpc_unix_socket)}
            if unix_socket is not None
            else {"host": host, "port": port, "grpc_port": grpc_port}
        )
        log.info("listening", extra={**where, "workers": config.workers})
        await stop.wait()
        log.info("draining", extra={"inflight": backend.inflight})
        backend.tracer.wake(closing=True)  # a waiting collection takes the last spans now
        backend.dispatcher.draining = True
        http.stop_listening()
        if grpc is not None:
            await grpc.stop(drain_timeout)
        await backend.drain(drain_timeout)
    finally:
        if watching:
            watching.cancel()
        await http.close()
        if grpc is not None:
            await grpc.stop(0)
        if not backend.draining:
            await backend.drain(0)
        for path in owned:
            path.unlink(missing_ok=True)
