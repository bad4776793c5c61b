"""The protocol-independent core of the inference server: function table, verification,
readiness, Triton's repository and statistics extensions, drain; and the REST inference path.

Requests of every front end go through one Dispatcher (dispatch.py): the HTTP routes
(server.py) and the gRPC service (grpc_api.py) only translate their protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version as package_version
from typing import Any

from meshfn.contracts import genai
from meshfn.contracts.genai import GENERATION_HEADER
from meshfn.contracts.qos import TENANT_HEADER

from . import triton_generate
from .codecache import CodeCache
from .config import BackendConfig, ServedFunction
from .dispatch import Dispatcher
from .engine import EpochTicker, engine_key, new_engine
from .errors import ConfigError, SignatureError
from .generation import GenerationError
from .generative import Generative, bounds_of, collect, generation_record
from .host import component_linker
from .kserve import (
    COMPRESS_MIN_BYTES,
    InferRequest,
    KServeError,
    compress,
    envelope,
    error_body,
    header_length,
    http_response,
    inflate,
    model_config,
    model_metadata,
    parse_http,
    platform_of,
    response_coding,
    select,
)
from .ledger import TokenLedger
from .metrics import Metrics
from .pool import FunctionRuntime, Refused
from .qos import Load, tenant_of
from .registry import Registry, latest
from .results import Completed
from .signing import TrustedKeys
from .tracing import RequestSpan, TraceContext, Tracer, trace_of
from .warmup import WarmBudget

log = logging.getLogger("meshfn.inference")

SERVER_NAME = "meshfn-inference"
_TENANT_KEY = TENANT_HEADER.encode()
# What the server metadata lists (Triton's extension names).
EXTENSIONS = (
    "binary_tensor_data",
    "parameters",
    "model_repository",
    "statistics",
    "model_configuration",
)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/json"

    @classmethod
    def error(cls, status: int, message: str) -> Reply:
        return cls(status, error_body(message))

    @classmethod
    def of(cls, exc: KServeError) -> Reply:
        return cls(exc.status, exc.body(), exc.headers)

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Reply:
        return cls(status, json.dumps(value).encode())


class Backend:
    def __init__(self, config: BackendConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        # What the kernel confines this process with (sandbox.py), once serve() applied it.
        self.sandbox: dict[str, Any] = {}
        self.orca = Load(config.workers)
        self.registry = Registry(config.registry)
        if not config.trustedKeys:
            raise ConfigError("no trusted keys: pass --trusted-key FILE (ed25519 .pub) or a dir")
        try:
            self.trusted = TrustedKeys.from_paths(config.trustedKeys)
        except SignatureError as exc:
            raise ConfigError(str(exc)) from None
        if not len(self.trusted):
            raise ConfigError("no trusted keys found in " + ", ".join(map(str, config.trustedKeys)))
        self.engine = new_engine()
        # The process's deserialized code, shared by its functions and kept past their
        # codeTtl (codecache.py); one component linker for them all.
        self.code = CodeCache(
            self.engine, self.metrics, config.codeCache, component_linker(self.engine)
        )
        self.ticker = EpochTicker(self.engine)
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="meshfn-wasm")
        self.prewarm_executor = ThreadPoolExecutor(1, thread_name_prefix="meshfn-prewarm")
        self.tracer = Tracer(config.tracing, self.metrics.trace_spans_counters())
        self.dispatcher = Dispatcher(
            self.executor,
            self.metrics,
            config.workers,
            self.prewarm_executor,
            WarmBudget(config.warmupMemoryBudget),
            lambda: self.pressure,
            self.tracer,
        )
        if config.tokenLedger is not None:  # before any lane (their admissions use it)
            self.dispatcher.ledger = TokenLedger(config.tokenLedger, self.metrics)
        self.pressure = False  # available memory under config.lowMemory (the reaper checks)
        self.pressure_releases = 0
        self.functions: dict[str, dict[str, FunctionRuntime]] = {}
        self.defaults: dict[str, str] = {}
        self.started = False
        self._reaper: asyncio.Task[None] | None = None
        self.server_meta = json.dumps(self.server_metadata()).encode()
        self.generative = Generative(
            self.dispatcher,
            self.metrics,
            defaults=config.functions is None,
            text_key=bytes.fromhex(config.auditTextKey) if config.auditTextKey else None,
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def draining(self) -> bool:
        return self.dispatcher.draining

    @property
    def inflight(self) -> int:
        return self.dispatcher.inflight

    @property
    def runtimes(self) -> list[FunctionRuntime]:
        return [rt for versions in self.functions.values() for rt in versions.values()]

    def _specs(self) -> list[ServedFunction]:
        if self.config.functions is not None:
            return self.config.functions
        return [
            ServedFunction(name=name, version=version)
            for name in self.registry.names()
            for version in self.registry.versions(name)
        ]

    def _runtime(self, spec: ServedFunction) -> FunctionRuntime:
        if spec.artifact:
            art_name, _, art_version = spec.artifact.partition("@")
        else:
            art_name = spec.name
            versions = self.registry.versions(spec.name)
            art_version = spec.version or (latest(versions) if versions else "0")
        version = spec.version or art_version
        return FunctionRuntime(
            spec,
            version,
            (art_name, art_version),
            self.engine,
            self.registry,
            self.trusted,
            self.metrics,
            self.prewarm_executor,
            self.code,
        )

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        runtimes = [self._runtime(spec) for spec in self._specs()]
        for rt in runtimes:
            if rt.name == "stats":
                raise ConfigError("a function may not be called 'stats': /v2/models/stats is taken")
            if rt.version in self.functions.setdefault(rt.name, {}):
                raise ConfigError(f"{rt.label} declared twice")
            self.functions[rt.name][rt.version] = rt
        for name, versions in self.functions.items():
            self.defaults[name] = latest(list(versions))
        for rt in runtimes:  # in a rollout the stable version answers what names none
            if rt.spec.rollout is not None and rt.spec.rollout.stable in self.functions[rt.name]:
                self.defaults[rt.name] = rt.spec.rollout.stable
        await asyncio.gather(*(loop.run_in_executor(self.executor, rt.verify) for rt in runtimes))
        for rt in runtimes:
            if rt.spec.batching is not None and rt.signature and not rt.signature.batchable:
                raise ConfigError(
                    f"{rt.label}: batching needs a variable first dimension (-1) on every "
                    "input and output of its metadata"
                )
        self.ticker.start()
        self._reaper = asyncio.create_task(self._reap(), name="meshfn-reaper")
        self.started = True
        log.info(
            "inference backend ready",
            extra={
                "engine": engine_key(),
                "functions": [rt.label for rt in runtimes if rt.refusal is None],
                "refused": [rt.label for rt in runtimes if rt.refusal is not None],
            },
        )

    @property
    def ready(self) -> bool:
        """KServe server readiness: verification done and not draining. A refused function does
        not make the server unready (the others serve; its own ready answers 503 with why)."""
        return not self.unready_reasons()

    def unready_reasons(self) -> list[str]:
        if not self.started:
            return ["starting: verifying the functions"]
        if self.draining:
            return ["shutting down"]
        return []

    async def _reap(self) -> None:
        """Scale to zero: drop the instances of functions unused for their idle TTL, and their
        code too once unused for their code TTL (the same unless codeTtl)."""
        runtimes = self.runtimes
        if not runtimes:
            return
        interval = min(1.0, max(0.01, min(rt.spec.idleTtl.total_seconds() for rt in runtimes) / 4))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            if self.config.lowMemory:
                await self._check_pressure(runtimes)
            now = time.monotonic()
            for rt in runtimes:
                if not rt.loaded or rt.inflight or now < rt.hold_until:
                    continue
                idle = rt.idle_for(now)
                if idle > rt.spec.code_ttl.total_seconds():
                    await loop.run_in_executor(self.prewarm_executor, rt.unload)
                elif idle > rt.spec.idleTtl.total_seconds() and not rt.dormant:
                    await loop.run_in_executor(self.prewarm_executor, rt.drop_instances)
            if len(self.code) > self.code.held:
                await loop.run_in_executor(self.prewarm_executor, self.code.expire)

    async def _check_pressure(self, runtimes: list[FunctionRuntime]) -> None:
        """Under memory pressure warm instances go first: every predicted warm-up is released
        and every idle instance dropped, then the code no function holds (the code cache's
        free entries; loaded code and running instances stay), and no warm-up starts until
        memory is available again."""
        available = available_mib()
        self.pressure = available is not None and available < self.config.lowMemory
        if not self.pressure:
            return
        loop = asyncio.get_running_loop()
        released = False
        for lane in self.dispatcher.lanes.values():
            if lane.warmer is not None and lane.warmer.state != "idle":
                lane.warmer.release()
                released = True
        for rt in runtimes:
            if rt.idle_instances:
                await loop.run_in_executor(self.prewarm_executor, rt.drop_instances)
                released = True
        # then code no function holds (cheap to restore: a deserialize, no instance state)
        if await loop.run_in_executor(self.prewarm_executor, self.code.drop_free):
            released = True
        if released:
            self.pressure_releases += 1
            log.warning(
                "memory pressure: warm instances released",
                extra={"available_mib": available, "low_memory_mib": self.config.lowMemory},
            )

    async def drain(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let running ones finish (bounded), release everything."""
        self.dispatcher.draining = True
        if self.inflight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.dispatcher.drained.wait(), timeout)
        self.generative.close()
        if self.dispatcher.ledger is not None:  # the last settles
            await self.dispatcher.ledger.close()
        for lane in self.dispatcher.lanes.values():
            if lane.batcher is not None:
                lane.batcher.close()
            if lane.warmer is not None:
                lane.warmer.release()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.prewarm_executor.shutdown(wait=True, cancel_futures=True)
        for rt in self.runtimes:
            rt.close()
        self.code.drop_free()
        self.ticker.stop()
        self.tracer.close()

    # ------------------------------------------------------------------ lookups

    def lookup(self, name: str, version: str | None) -> FunctionRuntime:
        versions = self.functions.get(name)
        if versions is None:
            raise KServeError(404, f"unknown model {name!r}")
        if version is None:
            return versions[self.defaults[name]]
        rt = versions.get(version)
        if rt is None:
            known = ", ".join(sorted(versions))
            raise KServeError(404, f"model {name!r} has no version {version!r} (has: {known})")
        return rt

    def server_metadata(self) -> dict[str, Any]:
        return {
            "name": SERVER_NAME,
            "version": package_version("meshfn"),
            "extensions": list(EXTENSIONS),
        }

    def verified(self, name: str, version: str | None) -> FunctionRuntime:
        """A function that passed verification (else 403/404)."""
        rt = self.lookup(name, version)
        if rt.refusal is not None or rt.verified is None:
            refusal = rt.refusal or Refused("not verified", 403)
            raise KServeError(refusal.status, str(refusal))
        return rt

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        rt = self.verified(name, version)
        assert rt.verified is not None
        versions = [version] if version else sorted(self.functions[name])
        return model_metadata(name, versions, rt.verified.metadata)

    def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        rt = self.verified(name, version)
        assert rt.verified is not None and rt.signature is not None
        batching = rt.spec.batching  # (start refuses batching without a batch dimension)
        return model_config(
            name,
            rt.signature,
            platform_of(rt.verified.metadata),
            self.config.workers,
            batching.maxBatchSize if batching else 0,
            tuple(batching.preferredBatchSizes) if batching else (),
            round(batching.maxQueueDelay.total_seconds() * 1e6) if batching else 0,
            decoupled=self.generative.generates(rt),
        )

    def metadata(self, name: str, version: str | None) -> Reply:
        try:
            return Reply.json(self.model_metadata(name, version))
        except KServeError as exc:
            return Reply.of(exc)

    def is_ready(self, rt: FunctionRuntime) -> bool:
        return (
            self.started
            and not self.draining
            and rt.refusal is None
            and rt.verified is not None
            and rt.available
        )

    def model_ready(self, name: str, version: str | None) -> Reply:
        try:
            rt = self.lookup(name, version)
        except KServeError as exc:
            return Reply.of(exc)
        ready = self.is_ready(rt)
        body: dict[str, Any] = {"name": name, "ready": ready}
        if rt.refusal is not None:
            body["error"] = str(rt.refusal)
        elif not rt.available:
            body["error"] = f"model {rt.label} is unloaded"
        return Reply.json(body, 200 if ready else 503)

    def largest_limit(self) -> int:
        """The largest request body any function takes (a body that names its model)."""
        return max((rt.spec.limits.maxRequestBytes for rt in self.runtimes), default=1 << 20)

    def limit_for(self, name: str, version: str | None) -> int:
        try:
            return self.lookup(name, version).spec.limits.maxRequestBytes
        except KServeError:
            return 1 << 20

    # ------------------------------------------------------------------ repository, statistics

    def model_names(self) -> list[str]:
        return sorted(self.functions)

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: every served model version with its state."""
        out = []
        for name in self.model_names():
            for version, rt in sorted(self.functions[name].items()):
                entry = {"name": name, "version": version}
                if rt.refusal is not None:
                    entry |= {"state": "UNAVAILABLE", "reason": str(rt.refusal)}
                elif not rt.available:
                    entry |= {"state": "UNAVAILABLE", "reason": "unloaded"}
                elif not self.is_ready(rt):
                    entry |= {"state": "UNAVAILABLE", "reason": self.unready_reasons()[0]}
                else:
                    entry |= {"state": "READY", "reason": ""}
                if not ready_only or entry["state"] == "READY":
                    out.append(entry)
        return out

    def _repository_target(
        self, name: str, version: str | None, action: str, params: dict[str, Any]
    ) -> list[FunctionRuntime]:
        """The versions a load/unload acts on (all of the model's without /versions/{v})."""
        runtimes = (
            list(self.functions.get(name, {}).values())
            if version is None
            else [self.lookup(name, version)]
        )
        if not runtimes:
            raise KServeError(404, f"unknown model {name!r}")
        closed = [rt for rt in runtimes if not rt.spec.repository.callers]
        if closed:
            raise KServeError(
                403,
                f"{action} of {name} is off: its Function names no repository.callers "
                "(Triton's load/unload are off by default)",
            )
        allowed = {"unload_dependents"} if action == "unload" else set()
        unknown = set(params) - allowed
        if unknown:
            raise KServeError(
                400,
                f"{action} parameter(s) {', '.join(sorted(unknown))} are not supported: meshfn "
                "serves signed artifacts only (no configuration or file overrides)",
            )
        if "unload_dependents" in params and not isinstance(params["unload_dependents"], bool):
            raise KServeError(400, "unload_dependents must be true or false")
        return runtimes

    async def load(self, name: str, version: str | None, params: dict[str, Any]) -> None:
        """Triton's load: re-verify every version, load its code, fill its warm pool."""
        if self.draining:
            raise KServeError(503, "the inference backend is shutting down")
        loop = asyncio.get_running_loop()
        for rt in self._repository_target(name, version, "load", params):
            await loop.run_in_executor(self.executor, rt.verify)
            if rt.refusal is not None:
                raise KServeError(rt.refusal.status, str(rt.refusal))
            rt.available = True
            await loop.run_in_executor(self.prewarm_executor, rt.load_and_prewarm)
            log.info("function loaded (repository)", extra={"function": rt.label})

    async def unload(self, name: str, version: str | None, params: dict[str, Any]) -> None:
        """Triton's unload: new requests get 503 until a load; running ones finish."""
        loop = asyncio.get_running_loop()
        for rt in self._repository_target(name, version, "unload", params):
            rt.available = False
            await loop.run_in_executor(self.prewarm_executor, rt.unload, "repository")

    def statistics(self, name: str | None, version: str | None) -> list[dict[str, Any]]:
        if name is None:
            runtimes = self.runtimes
        elif version is None:
            self.lookup(name, None)
            runtimes = list(self.functions[name].values())
        else:
            runtimes = [self.lookup(name, version)]
        return [
            self.dispatcher.lane(rt).stats.as_json(rt.name, rt.version)
            for rt in sorted(runtimes, key=lambda r: (r.name, r.version))
        ]

    # ------------------------------------------------------------------ REST inference

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        headers: dict[bytes, bytes] | None = None,
        operation: str | None = None,
    ) -> Reply:
        """POST /v2/models/{name}[/versions/{v}]/infer: JSON or the binary tensor extension.
        `operation`: the GenAI operation it serves (OpenAI's embeddings), which names its
        span as the conventions do instead of `infer {name}`."""
        try:
            rt = self.lookup(name, version)
        except KServeError as exc:
            return Reply.of(exc)

        given = headers or {}

        def parse() -> InferRequest:
            return self._parse_http(rt, body, given)

        if self.generative.generates(rt):
            return await self._generate_infer(
                rt, parse, tenant_of(given.get(_TENANT_KEY)), trace_of(given)
            )

        def encode(completed: Completed, request: InferRequest) -> Reply:
            if completed.text is not None and request.outputs is None and not request.binary_output:
                out = envelope(completed.text, rt.name, rt.version, request.id)
                if out is None:
                    raise KServeError(
                        500, f"function {rt.label} returned a response that is not a JSON object"
                    )
                return coded(Reply(200, out))
            outputs, params = completed.parsed(rt.label)
            chosen = select(outputs, request.outputs, rt.label)
            data, json_length = http_response(request, chosen, params, rt.name, rt.version)
            if json_length is None:
                return coded(Reply(200, data))
            return coded(
                Reply(
                    200,
                    data,
                    ((b"Inference-Header-Content-Length", str(json_length).encode()),),
                    b"application/octet-stream",
                )
            )

        def coded(reply: Reply) -> Reply:
            if len(reply.body) < COMPRESS_MIN_BYTES:  # before parsing Accept-Encoding
                return reply
            coding = response_coding(given.get(b"accept-encoding"))
            if coding is None:
                return reply
            return Reply(
                reply.status,
                compress(reply.body, coding),
                (*reply.headers, (b"Content-Encoding", coding)),
                reply.content_type,
            )

        try:
            tenant = tenant_of(given.get(_TENANT_KEY))
            span = self._span(name, given, operation)
            return await self.dispatcher.serve(rt, "rest", parse, encode, tenant, span)
        except KServeError as exc:
            return Reply.of(exc)

    @staticmethod
    def _parse_http(rt: FunctionRuntime, body: bytes, given: dict[bytes, bytes]) -> InferRequest:
        limit = rt.spec.limits.maxRequestBytes
        if len(body) > limit:
            raise KServeError(413, f"request body exceeds {limit} bytes for {rt.label}")
        # The binary extension's header length counts the decoded body, as in Triton.
        data = inflate(body, given.get(b"content-encoding", b""), limit)
        assert rt.signature is not None  # admitted: verified
        length = header_length(given, len(data))
        return parse_http(data, rt.signature, length, (rt.name, rt.version))

    def _span(
        self, name: str, given: dict[bytes, bytes], operation: str | None
    ) -> RequestSpan | None:
        """An inference's server span: `infer {name}`, or as the GenAI conventions name the
        `operation` it serves."""
        if not operation:
            return self.tracer.begin(f"infer {name}", *trace_of(given))
        span = self.tracer.begin(genai.span_name(operation, name), *trace_of(given))
        if span is not None:
            span.attrs.update(genai.span_attributes(operation, name))
        return span

    async def _generate_infer(
        self,
        rt: FunctionRuntime,
        parse: Callable[[], InferRequest],
        tenant: str,
        trace: TraceContext,
    ) -> Reply:
        """/infer of a generative model: the whole text as text_output (its settings are the
        request's parameters; usage and finish reason come back as response parameters)."""
        generative = self.generative
        operation = "text_completion"
        try:
            with generative.traced(rt, "rest", operation, trace, tenant) as span:
                self.dispatcher.admit(rt, "rest")  # (refusals are KServeError: the caller's)
                request, _ = triton_generate.from_infer(parse(), bounds_of(generative.settings(rt)))
                opened = await generative.open(
                    rt, "rest", request.prompt, request.sampling, tenant, operation, span
                )
        except GenerationError as exc:
            return Reply.error(exc.status, str(exc))
        text, done = await collect(opened.stream)
        if done.reason == "error":
            return Reply.error(500, f"model {rt.label} failed: {done.error}")
        header = (GENERATION_HEADER.encode(), generation_record(rt, "text_completion", done))
        body = triton_generate.infer_response(rt, request.id, text, done)
        return Reply(200, body, (*opened.headers, header))


def available_mib() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
