"""The HTTP-independent core of the inference server: function table, invoke, drain.

The HTTP layer (server.py) only maps routes onto these coroutines, which keeps the protocol
logic testable without sockets and let us measure HTTP stacks against the same core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .config import BackendConfig, ServedFunction
from .engine import EpochTicker, engine_key, new_engine
from .errors import ConfigError, SignatureError
from .host import Outcome, component_linker
from .kserve import (
    KServeError,
    envelope,
    error_body,
    model_metadata,
    parse_request,
    select_outputs,
)
from .metrics import Metrics
from .pool import FunctionRuntime, Refused
from .registry import Registry, latest
from .signing import TrustedKeys

log = logging.getLogger("meshfn.inference")


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes

    @classmethod
    def error(cls, status: int, message: str) -> Reply:
        return cls(status, error_body(message))


class Backend:
    def __init__(self, config: BackendConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
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
        self.linker = component_linker(self.engine)  # one for every component function
        self.ticker = EpochTicker(self.engine)
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="meshfn-wasm")
        self.prewarm_executor = ThreadPoolExecutor(1, thread_name_prefix="meshfn-prewarm")
        self.functions: dict[str, dict[str, FunctionRuntime]] = {}
        self.defaults: dict[str, str] = {}
        self.ready = False
        self.draining = False
        self.inflight = 0
        self._reaper: asyncio.Task[None] | None = None
        self._drained = asyncio.Event()  # set whenever no request is in flight

    # ------------------------------------------------------------------ lifecycle

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
            self.linker,
        )

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        runtimes = [self._runtime(spec) for spec in self._specs()]
        for rt in runtimes:
            if rt.version in self.functions.setdefault(rt.name, {}):
                raise ConfigError(f"{rt.label} declared twice")
            self.functions[rt.name][rt.version] = rt
        for name, versions in self.functions.items():
            self.defaults[name] = latest(list(versions))
        await asyncio.gather(*(loop.run_in_executor(self.executor, rt.verify) for rt in runtimes))
        self.ticker.start()
        self._reaper = asyncio.create_task(self._reap(), name="meshfn-reaper")
        self.ready = True
        log.info(
            "inference backend ready",
            extra={
                "engine": engine_key(),
                "functions": [rt.label for rt in runtimes if rt.refusal is None],
                "refused": [rt.label for rt in runtimes if rt.refusal is not None],
            },
        )

    async def _reap(self) -> None:
        """Scale to zero: drop the instances of functions unused for their idle TTL, and their
        code too once unused for their code TTL (the same unless codeTtl)."""
        runtimes = [rt for versions in self.functions.values() for rt in versions.values()]
        if not runtimes:
            return
        interval = min(1.0, max(0.01, min(rt.spec.idleTtl.total_seconds() for rt in runtimes) / 4))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for rt in runtimes:
                if not rt.loaded or rt.inflight:
                    continue
                idle = rt.idle_for(now)
                if idle > rt.spec.code_ttl.total_seconds():
                    await loop.run_in_executor(self.prewarm_executor, rt.unload)
                elif idle > rt.spec.idleTtl.total_seconds() and not rt.dormant:
                    await loop.run_in_executor(self.prewarm_executor, rt.drop_instances)

    async def drain(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let running ones finish (bounded), release everything."""
        self.draining = True
        self.ready = False
        if self.inflight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.prewarm_executor.shutdown(wait=True, cancel_futures=True)
        for versions in self.functions.values():
            for rt in versions.values():
                rt.close()
        self.ticker.stop()

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

    def metadata(self, name: str, version: str | None) -> Reply:
        import json

        try:
            rt = self.lookup(name, version)
        except KServeError as exc:
            return Reply(exc.status, exc.body())
        if rt.refusal is not None or rt.verified is None:
            refusal = rt.refusal or Refused("not verified", 403)
            return Reply.error(refusal.status, str(refusal))
        versions = [version] if version else sorted(self.functions[name])
        body = model_metadata(name, versions, rt.verified.metadata)
        return Reply(200, json.dumps(body).encode())

    def model_ready(self, name: str, version: str | None) -> Reply:
        import json

        try:
            rt = self.lookup(name, version)
        except KServeError as exc:
            return Reply(exc.status, exc.body())
        ready = self.ready and rt.refusal is None and rt.verified is not None
        body: dict[str, Any] = {"name": name, "ready": ready}
        if rt.refusal is not None:
            body["error"] = str(rt.refusal)
        return Reply(200 if ready else 503, json.dumps(body).encode())

    def limit_for(self, name: str, version: str | None) -> int:
        try:
            return self.lookup(name, version).spec.limits.maxRequestBytes
        except KServeError:
            return 1 << 20

    # ------------------------------------------------------------------ infer

    async def infer(self, name: str, version: str | None, body: bytes) -> Reply:
        started = time.perf_counter()
        try:
            rt = self.lookup(name, version)
        except KServeError as exc:
            return Reply(exc.status, exc.body())
        reply = await self._infer(rt, body)
        elapsed = time.perf_counter() - started
        self.metrics.requests.labels(rt.label, str(reply.status)).inc()
        self.metrics.latency.labels(rt.label).observe(elapsed)
        rt.latencies.append(elapsed)
        return reply

    async def _infer(self, rt: FunctionRuntime, body: bytes) -> Reply:
        if self.draining:
            return Reply.error(503, "the inference backend is shutting down")
        if rt.refusal is not None or rt.signature is None:
            refusal = rt.refusal or Refused(f"function {rt.label} is not verified", 403)
            return Reply.error(refusal.status, str(refusal))
        limit = rt.spec.limits.maxRequestBytes
        if len(body) > limit:
            return Reply.error(413, f"request body exceeds {limit} bytes for {rt.label}")
        try:
            request = parse_request(body, rt.signature)
        except KServeError as exc:
            return Reply(exc.status, exc.body())
        if rt.inflight >= rt.spec.limits.maxConcurrency:
            return Reply.error(
                429,
                f"function {rt.label} is at its concurrency limit ({rt.spec.limits.maxConcurrency})",
            )
        rt.inflight += 1
        self.inflight += 1
        self._drained.clear()
        self.metrics.inflight.labels(rt.label).set(rt.inflight)
        try:
            loop = asyncio.get_running_loop()
            invocation = await loop.run_in_executor(self.executor, rt.invoke, request.text)
        except Refused as exc:
            return Reply.error(exc.status, str(exc))
        except Exception as exc:
            log.exception("invoke failed", extra={"function": rt.label})
            return Reply.error(500, f"function {rt.label} could not run: {exc}")
        finally:
            rt.inflight -= 1
            self.inflight -= 1
            if not self.inflight:
                self._drained.set()
            rt.last_used = time.monotonic()
            self.metrics.inflight.labels(rt.label).set(rt.inflight)
        result = invocation.result
        outcome = result.outcome
        if outcome is Outcome.OK:
            text = result.body
            if request.outputs is not None:
                text = select_outputs(text, request.outputs) or ""
            out = envelope(text, rt.name, rt.version, request.id)
            if out is None:
                return Reply.error(
                    500, f"function {rt.label} returned a response that is not a JSON object"
                )
            return Reply(200, out)
        if outcome is Outcome.BAD_REQUEST:
            return Reply.error(400, f"model {rt.label} rejected the input: {result.body}")
        if outcome is Outcome.TIMEOUT:
            log.warning("function interrupted at deadline", extra={"function": rt.label})
            return Reply.error(
                504,
                f"function {rt.label} exceeded its {round(rt.spec.limits.timeout.total_seconds() * 1000)} ms deadline "
                "and was interrupted",
            )
        if outcome is Outcome.OUT_OF_MEMORY:
            log.warning("function out of memory", extra={"function": rt.label})
            return Reply.error(
                500,
                f"function {rt.label} exceeded its memory limit of "
                f"{rt.spec.limits.memoryMiB} MiB: {result.body}",
            )
        if outcome is Outcome.TRAP:
            log.warning("function trapped", extra={"function": rt.label, "trap": result.body})
            return Reply.error(500, f"function {rt.label} trapped: {result.body}")
        return Reply.error(500, f"function {rt.label} failed: {result.body}")
