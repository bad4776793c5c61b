"""One served function: verification state, lazy load, warm pool, isolation, scale to zero.

Thread model: `invoke`, `prewarm` and `unload` run on worker threads (wasm releases the GIL);
`inflight` and the 429 decision belong to the event loop. `_lock` guards the artifact and the
idle deque and is never held while wasm runs; `_load_lock` serialises the one cold load so
concurrent first requests wait for it instead of loading twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import wasmtime

from meshfn.contracts.function import CodeCache as CodeCacheSettings

from .codecache import CodeCache, CodeKey
from .config import ServedFunction
from .engine import deadline_ticks
from .errors import InferenceError, RegistryError, SignatureError
from .host import Artifact, CallResult, GuestRequest, Instance, Outcome
from .kserve import InferRequest, KServeError, Signature
from .metrics import Metrics
from .registry import Registry, VerifiedArtifact
from .signing import TrustedKeys
from .tensorio import TensorIO

log = logging.getLogger("meshfn.inference")

_METRIC_FLUSH_S = 0.1  # see FunctionRuntime._idle_changed


class Refused(InferenceError):
    """The function cannot be served (failed verification or missing artifact)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ColdStart(NamedTuple):
    """A request that waited for an instance to be made (perf_counter_ns): the code looked up
    in the process's code cache and, on a miss, deserialized (`loaded`: the function's code was
    not loaded; else both equal `begin`), then the instance made."""

    begin: int
    looked_up: int
    deserialized: int
    instantiated: int
    loaded: bool
    hit: bool


@dataclass(frozen=True, slots=True)
class Invocation:
    result: CallResult
    cold: bool
    seconds: float = 0.0  # the guest call itself (statistics: compute_infer)
    cpu_ns: int = 0  # the worker thread's CPU time during the call (QoS compute budgets)
    started_ns: int = 0  # when the guest call began (perf_counter_ns)
    cold_start: ColdStart | None = None  # an instance was made for it first


class FunctionRuntime:
    def __init__(
        self,
        spec: ServedFunction,
        version: str,
        artifact_ref: tuple[str, str],
        engine: wasmtime.Engine,
        registry: Registry,
        trusted: TrustedKeys,
        metrics: Metrics,
        prewarm_executor: Executor,
        code: CodeCache | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.version = version
        self.artifact_ref = artifact_ref
        self.engine = engine
        self.registry = registry
        self.trusted = trusted
        self.metrics = metrics
        self.prewarm_executor = prewarm_executor
        # The process's deserialized code (the Backend's, shared by its functions); alone, a
        # cache of its own that keeps nothing this function lets go.
        self.code = (
            code
            if code is not None
            else CodeCache(engine, metrics, CodeCacheSettings(ttl=timedelta(0)))
        )
        self._code_key: CodeKey | None = None  # what this function holds of it while loaded
        self.verified: VerifiedArtifact | None = None
        self.signature: Signature | None = None
        # A compiled model's (ABI v2) tensor calls and their checks; None for other kinds.
        self.tensors: TensorIO | None = None
        self.refusal: Refused | None = None
        # Triton's repository unload makes the model unavailable until a load (event loop).
        self.available = True
        self.inflight = 0  # event loop only
        self.last_used = time.monotonic()
        self.ticks = deadline_ticks(spec.limits.timeout.total_seconds())
        self.memory_bytes = spec.limits.memoryMiB << 20
        self._artifact: Artifact | None = None
        self._generation = 0
        self._idle: deque[Instance] = deque()
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._refilling = False
        self._dormant = False  # instances dropped at the idle TTL, code kept (codeTtl)
        self.label = f"{self.name}@{self.version}"
        # For /meshfn/functions (status.py): loads so far, and recent request latencies.
        self.cold_starts = 0
        self.code_cache_hits = 0  # loads that found the code still deserialized (codecache.py)
        self.latencies: deque[float] = deque(maxlen=1024)
        # Requests that found no idle instance and waited for one to be made (load or
        # instantiate), and the instance-seconds idle instances were kept (the cost of warmth).
        self.cold_requests = 0
        self.warm_seconds = 0.0
        self._idle_count = 0
        self._idle_since = time.monotonic()
        # A predicted warm-up holds its instances against the reaper until then (event loop).
        self.hold_until = 0.0
        self._cold_requests = metrics.cold_requests.labels(self.label)
        self._warm_seconds = metrics.warm_seconds.labels(self.label)
        metrics.idle.labels(self.label).set_function(lambda: self._idle_count)
        self._exported = 0.0  # of warm_seconds, in the counter so far
        self._flushed = time.monotonic()

    # ------------------------------------------------------------------ verification

    def verify(self) -> None:
        """Full signature + digest check (worker thread); records a refusal instead of raising."""
        name, version = self.artifact_ref
        try:
            verified = self.registry.verify(name, version, self.trusted)
            signature = Signature.from_metadata(verified.metadata)
            tensors = None
            # a compiled model's tensor calls; a generative step function's steps are the
            # decode loop's (generation.py), its KServe signature is its text interface
            if verified.kind == "onnx" and "generate" not in verified.metadata:
                tensors = TensorIO(verified.metadata, self.memory_bytes, self.label)
                too_big = tensors.refusal()
                if too_big is not None:
                    self._refuse(too_big, 403)
                    return
            self.signature, self.tensors = signature, tensors
            self.verified, self.refusal = verified, None
            self.metrics.refused.labels(self.label).set(0)
        except SignatureError as exc:
            self._refuse(str(exc), 403)
        except (RegistryError, OSError, KeyError, TypeError, ValueError) as exc:
            self._refuse(str(exc), 404 if isinstance(exc, RegistryError) else 403)

    def _refuse(self, message: str, status: int) -> None:
        self.refusal = Refused(f"function {self.label} refused: {message}", status)
        self.verified = None
        self.metrics.refused.labels(self.label).set(1)
        log.error("function refused", extra={"function": self.label, "reason": message})
        self.unload(reason="refused")

    @property
    def loaded(self) -> bool:
        return self._artifact is not None

    @property
    def batch_dimension(self) -> bool:
        """Every input and output has a variable first dimension: rows can be batched."""
        return self.signature is not None and self.signature.batchable

    @property
    def raw_inputs(self) -> bool:
        """Whether the guest reads input data as base64 `raw` (built by an SDK or core header
        that declares it in the signed metadata), else it gets JSON `data`."""
        return self.verified is not None and self.verified.metadata.get("raw_inputs") is True

    def guest_request(self, request: InferRequest) -> GuestRequest:
        """The request as this function's guest takes it: raw tensors for a compiled model
        (ABI v2; a shape it cannot take is a 400 here), else the request JSON."""
        tensors = self.tensors
        if tensors is not None:
            return tensors.call(request)
        if self.verified is not None and self.verified.kind == "onnx":  # a step function's
            raise KServeError(
                400, f"{self.label} is a generative step function: use its generate endpoints"
            )
        return request.guest_json(self.raw_inputs)

    # ------------------------------------------------------------------ load / unload

    def _load(self, timing: list[int] | None = None) -> tuple[Artifact, int]:
        with self._load_lock:
            artifact = self._artifact
            if artifact is not None:
                return artifact, self._generation
            verified = self.verified
            if verified is None:
                raise self.refusal or Refused(f"function {self.label} is not verified", 403)
            if not verified.intact():  # a file changed since verification: check it all again
                log.warning(
                    "artifact changed on disk; re-verifying", extra={"function": self.label}
                )
                self.verify()
                verified = self.verified
                if verified is None:
                    raise self.refusal or Refused(f"function {self.label} refused", 403)
            key = verified.code_key
            try:
                artifact, hit = self.code.acquire(key, self.label, timing)
            except wasmtime.WasmtimeError as exc:
                self._refuse(f"cannot load the precompiled artifact: {exc}", 403)
                raise self.refusal or Refused(str(exc), 403) from None
            with self._lock:
                self._artifact, self._code_key = artifact, key
                self._generation += 1
                generation = self._generation
            if hit:
                self.code_cache_hits += 1
            self.metrics.loaded.labels(self.label).set(1)
            self.metrics.cold_starts.labels(self.label).inc()
            self.cold_starts += 1
            return artifact, generation

    def _code(
        self, artifact: Artifact | None, generation: int, timing: list[int] | None = None
    ) -> tuple[Artifact, int, bool]:
        """The code to instantiate from, and whether it had to be loaded. Kept code (codeTtl)
        can sit unused for hours: before it makes a new instance, its files' identities are
        checked again (a `stat` each, ~20 us), so code whose artifact was replaced or rewritten
        since verification is dropped and the artifact verified and loaded afresh."""
        verified = self.verified
        if artifact is not None and verified is not None and verified.intact():
            return artifact, generation, False
        if artifact is not None:
            log.warning(
                "artifact changed on disk; dropping its code", extra={"function": self.label}
            )
            self.unload(reason="changed")
        return *self._load(timing), True

    def unload(self, reason: str = "idle") -> None:
        with self._lock:
            if self._artifact is None:
                return
            self._artifact = None
            self._dormant = False
            self._generation += 1
            idle, self._idle = self._idle, deque()
            self._idle_changed()
            key, self._code_key = self._code_key, None
        for instance in idle:
            instance.close()
        # Only code let go at the code TTL stays in the cache: an artifact that changed or was
        # refused is stale, and a repository unload (Triton's) means the memory goes now.
        if key is not None:
            self.code.release(key, keep=reason == "idle")
        self.metrics.loaded.labels(self.label).set(0)
        if reason == "idle":
            self.metrics.unloads.labels(self.label).inc()
        log.info("function unloaded", extra={"function": self.label, "reason": reason})

    @property
    def dormant(self) -> bool:
        return self._dormant

    @property
    def idle_instances(self) -> int:
        return len(self._idle)

    def drop_instances(self) -> None:
        """Scale to zero but keep the code (codeTtl): the next request instantiates
        from the loaded artifact instead of loading it again."""
        with self._lock:
            if self._artifact is None or self._dormant:
                return
            self._dormant = True
            idle, self._idle = self._idle, deque()
            self._idle_changed()
        for instance in idle:
            instance.close()
        log.debug("function instances dropped, code kept", extra={"function": self.label})

    def _idle_changed(self) -> None:
        """The idle deque changed (caller holds `_lock`): instance-seconds. A warm request
        changes it twice (take, give back), so the counter catches up at most every
        _METRIC_FLUSH_S and whenever the pool empties, not on each change: two locked metric
        updates per request cost more than the pool's own work (the idle gauge is read when
        /metrics is scraped)."""
        now = time.monotonic()
        self.warm_seconds += self._idle_count * (now - self._idle_since)
        self._idle_count, self._idle_since = len(self._idle), now
        if not self._idle_count or now - self._flushed >= _METRIC_FLUSH_S:
            if self.warm_seconds > self._exported:
                self._warm_seconds.inc(self.warm_seconds - self._exported)
                self._exported = self.warm_seconds
            self._flushed = now

    def warm_instance_seconds(self) -> float:
        """Idle instance-seconds so far, including the current stretch."""
        with self._lock:
            return self.warm_seconds + self._idle_count * (time.monotonic() - self._idle_since)

    # ------------------------------------------------------------------ instances

    def _take(self) -> tuple[Instance, int, ColdStart | None]:
        """An idle instance, else a new one (loading the artifact first if needed), and how
        that went (None: an idle one)."""
        with self._lock:
            # Any request ends dormancy, also one that races the drop and finds an instance
            # given back after it: the pool is then refilled and dropped again as usual.
            dormant, self._dormant = self._dormant, False
            if self._idle:
                instance = self._idle.popleft()
                self._idle_changed()
                return instance, self._generation, None
            artifact, generation = self._artifact, self._generation
            if dormant and artifact is not None:
                self.metrics.resumes.labels(self.label).inc()
            self.cold_requests += 1
        self._cold_requests.inc()
        started = time.perf_counter_ns()
        timing: list[int] = []
        artifact, generation, cold = self._code(artifact, generation, timing)
        instance = artifact.instantiate(self.memory_bytes)
        made = time.perf_counter_ns()
        if cold:
            self.metrics.cold_start_seconds.labels(self.label).observe((made - started) / 1e9)
        looked_up, deserialized = timing if len(timing) == 2 else (started, started)
        return (
            instance,
            generation,
            ColdStart(
                started, looked_up, deserialized, made, cold, cold and looked_up == deserialized
            ),
        )

    def _give_back(self, instance: Instance, generation: int, result: CallResult) -> None:
        poisoned = result.outcome.poisons
        if poisoned:
            self.metrics.traps.labels(self.label, result.outcome.value).inc()
        keep = not poisoned and self.spec.isolation == "reuse" and generation == self._generation
        if keep:
            with self._lock:
                if generation == self._generation and len(self._idle) < self.spec.pool.maxIdle:
                    self._idle.append(instance)
                    self._idle_changed()
                    return
        instance.close()

    def invoke(
        self, request: GuestRequest, ticks: int | None = None, preemptible: bool = False
    ) -> Invocation:
        """Run one guest call on an instance (worker thread); `ticks` may shorten the deadline
        (a client's own timeout), never lengthen it. `preemptible`: a slice of the deadline
        on the event loop (dispatch.py); its interruption is no trap, the caller runs the
        request again on a fresh instance, so the interrupted one is closed uncounted."""
        instance, generation, made = self._take()
        cold = made is not None and made.loaded
        started = time.perf_counter_ns()
        cpu = time.thread_time_ns()
        try:
            result = instance.call(request, min(ticks, self.ticks) if ticks else self.ticks)
        except BaseException:
            instance.close()
            raise
        cpu_ns = time.thread_time_ns() - cpu
        seconds = (time.perf_counter_ns() - started) / 1e9
        if preemptible and result.outcome is Outcome.TIMEOUT:
            instance.close()
            return Invocation(result, cold, seconds, 0, started, made)
        self._give_back(instance, generation, result)
        self._maybe_refill()
        return Invocation(result, cold, seconds, cpu_ns, started, made)

    def lease(self) -> tuple[Instance, int]:
        """An instance for a caller that runs it itself (worker thread): generation's steps
        and generator streams. Give it back with `give_back`."""
        instance, generation, _ = self._take()
        return instance, generation

    def give_back(self, instance: Instance, generation: int, outcome: Outcome) -> None:
        """A leased instance back to the pool (dropped if `outcome` poisons it)."""
        self._give_back(instance, generation, CallResult(outcome, ""))
        self._maybe_refill()

    def _maybe_refill(self) -> None:
        if self.spec.warmup.mode == "off":
            return  # instances only on demand
        if self.spec.pool.minIdle and len(self._idle) < self.spec.pool.minIdle:
            with self._lock:
                if self._refilling or self._artifact is None:
                    return
                self._refilling = True
            self.prewarm_executor.submit(self.prewarm)

    def prewarm(self) -> None:
        """Fill the warm pool up to minIdle while the function stays loaded (prewarm thread)."""
        try:
            while True:
                with self._lock:
                    artifact, generation = self._artifact, self._generation
                    full = len(self._idle) >= self.spec.pool.minIdle
                    if artifact is None or self._dormant or full:
                        return
                instance = prefaulted(artifact.instantiate(self.memory_bytes))
                with self._lock:
                    if generation != self._generation or self._dormant:
                        instance.close()
                        return
                    self._idle.append(instance)
                    self._idle_changed()
        except Exception:
            log.exception("prewarm failed", extra={"function": self.label})
        finally:
            with self._lock:
                self._refilling = False

    def warm(self, instances: int) -> float:
        """A predicted warm-up (prewarm thread): load the code if it is gone and have
        `instances` idle ones; returns the seconds it took (the predictor's lead)."""
        started = time.perf_counter()
        with self._lock:
            artifact, generation = self._artifact, self._generation
        artifact, generation, _ = self._code(artifact, generation)
        while True:
            with self._lock:
                if generation != self._generation or len(self._idle) >= instances:
                    break
            instance = prefaulted(artifact.instantiate(self.memory_bytes))
            with self._lock:
                if generation != self._generation:
                    instance.close()
                    break
                self._dormant = False
                self._idle.append(instance)
                self._idle_changed()
        return time.perf_counter() - started

    def load_and_prewarm(self) -> None:
        """Load now (no request waiting) and fill the pool: used for minIdle at start-up."""
        self._load()
        self.prewarm()

    def idle_for(self, now: float) -> float:
        return now - self.last_used

    def close(self) -> None:
        self.unload(reason="shutdown")


def prefaulted(instance: Instance) -> Instance:
    """An instance made ahead of its request (warm pool, predicted warm-up) calls its cheap
    `metadata` export once: the guest's first call copies its heap pages on write, and doing
    that here takes it off the request path (measured for iris: first call 1.7 -> 1.3 ms;
    bench/coldstart.py `levers`)."""
    instance.metadata()
    return instance
