"""How a model function is served: one schema from the `Function` policy to the backend's config.

A `kind: Function` policy's `spec` is `FunctionSettings` plus where it runs (`backend`,
`gateway`); the inference backend's configuration file lists `ServedFunction`s (the same
settings plus the function's name). The control plane writes that file (embedded mode) or a
ConfigMap (Kubernetes) straight from the validated policy, so there is no field mapping between
the two and one set of validation rules, with the same messages in `meshfn validate` and in the
backend's start-up errors.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .durations import Duration
from .principals import RequestPrincipal
from .qos import FunctionQoS
from .rollout import FunctionRollout
from .tracing import BackendTracing
from .words import OFF

# A published function's name and version (registry entries, /v2/models/{name}/versions/{v}).
FUNCTION_NAME = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"
FUNCTION_VERSION = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
NAME_RE = re.compile(FUNCTION_NAME)
VERSION_RE = re.compile(FUNCTION_VERSION)
ARTIFACT = rf"^{FUNCTION_NAME[1:-1]}@{FUNCTION_VERSION[1:-1]}$"
# The backend's own view of its functions and its tracing, on its private socket (inference's
# status.py writes it; `meshfn status`, the console and `meshfn up` read it).
BACKEND_STATUS_PATH = "/meshfn/functions"

Isolation = Literal["reuse", "fresh-instance-per-request"]


class _Strict(BaseModel):
    """Like every policy model: unknown fields and wrong types are errors, never coerced."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, populate_by_name=False, validate_default=False
    )


class FunctionPool(_Strict):
    """The function's pool of instances on each backend."""

    minIdle: Annotated[int, Field(ge=0, le=256)] = Field(
        0, description="pre-instantiated instances kept ready while the function is loaded"
    )
    maxIdle: Annotated[int, Field(ge=0, le=1024)] = Field(
        4, description="most idle instances kept for reuse"
    )


class FunctionLimits(_Strict):
    """Limits per instance and per request."""

    memoryMiB: Annotated[int, Field(ge=13, le=4096)] = Field(
        64, description="linear memory per instance (a componentize-py guest needs >= 13)"
    )
    timeout: Duration = Field(
        timedelta(seconds=1),
        description="wall-clock deadline per call (epoch interruption, 5 ms granularity)",
    )
    maxConcurrency: Annotated[int, Field(ge=1, le=10_000)] = Field(
        8, description="in-flight requests; more get 429 at once"
    )
    maxRequestBytes: Annotated[int, Field(ge=64, le=256 * 1024 * 1024)] = Field(
        1024 * 1024, description="larger request bodies get 413 before they are read"
    )


class FunctionBatching(_Strict):
    """Triton-style dynamic batching: concurrent requests are merged along the first dimension
    into one guest call (only for functions whose every input and output has a variable first
    dimension) and the outputs split back per request."""

    maxBatchSize: Annotated[int, Field(ge=1, le=4096)] = Field(
        description="most rows (first-dimension entries) in one guest call"
    )
    preferredBatchSizes: Annotated[list[Annotated[int, Field(ge=1)]], Field(max_length=32)] = Field(
        default_factory=list,
        description="batch sizes sent at once when the queue can form them; otherwise a "
        "batch waits up to maxQueueDelay to fill up to maxBatchSize",
    )
    maxQueueDelay: Duration = Field(
        timedelta(milliseconds=1),
        description="longest a request waits for others to join its batch (0s: never waits)",
    )
    oversize: Literal["refuse", "split"] = Field(
        "refuse",
        description="a request with more rows than maxBatchSize: refused (400), or split into "
        "guest calls of at most maxBatchSize rows whose outputs are joined again",
    )

    @model_validator(mode="after")
    def _sizes(self) -> Self:
        sizes = self.preferredBatchSizes
        if sizes != sorted(set(sizes)):
            raise ValueError("preferredBatchSizes must be distinct and ascending")
        if sizes and sizes[-1] > self.maxBatchSize:
            raise ValueError(f"preferredBatchSizes exceed maxBatchSize ({self.maxBatchSize})")
        if not timedelta(0) <= self.maxQueueDelay <= timedelta(seconds=1):
            raise ValueError("maxQueueDelay must be between 0s and 1s")
        return self


class FunctionProtocols(_Strict):
    """Which KServe v2 front ends serve the function (the gateway routes only those)."""

    rest: bool = Field(True, description="HTTP/REST: /v2/models/{name}/...")
    grpc: bool = Field(
        True,
        description="gRPC GRPCInferenceService (where the backend's endpoints have a grpcPort)",
    )

    @model_validator(mode="after")
    def _one(self) -> Self:
        if not (self.rest or self.grpc):
            raise ValueError("enable at least one of rest and grpc")
        return self


class FunctionRepository(_Strict):
    """Triton's model repository extension for this function: the index always lists it; load
    and unload are off unless callers are named."""

    callers: Annotated[list[RequestPrincipal], Field(max_length=256)] = Field(
        default_factory=list,
        description='request principals ("<issuer>/<subject>" of a verified JWT, "<issuer>/*") '
        "who may load and unload it; empty: nobody (enforced by its sidecars' authorization; the "
        "backend refuses load/unload outright while the list is empty)",
    )


WarmupMode = Annotated[Literal["off", "reactive", "predictive"], OFF]


class FunctionWarmup(_Strict):
    """When instances exist ahead of a request. Scale to zero holds in every mode: with no
    traffic nothing stays warm longer than idleTtl (reactive) or maxWarmIdle (a prediction)."""

    mode: WarmupMode = Field(
        "reactive",
        description="off: instances only on demand (no minIdle refill); reactive: keep used "
        "instances for idleTtl and refill pool.minIdle while loaded; predictive: reactive plus "
        "learning the arrival pattern and warming instances shortly before the predicted next "
        "request, releasing them when it does not come",
    )
    maxWarmIdle: Duration = Field(
        timedelta(seconds=30),
        description="longest a predicted warm-up keeps an instance waiting for its request",
    )
    memoryBudget: Annotated[int, Field(ge=0, le=1 << 20)] = Field(
        256,
        description="MiB this function's predicted warm instances may hold on each backend "
        "(each counted at limits.memoryMiB); the backend's warmupMemoryBudget caps them all",
    )

    @model_validator(mode="after")
    def _window(self) -> Self:
        if not timedelta(0) < self.maxWarmIdle <= timedelta(hours=1):
            raise ValueError("maxWarmIdle must be between 0s (exclusive) and 1h")
        return self


class GenerationBatching(_Strict):
    """Continuous batching of decode steps: the backend runs one step of every active stream of
    a step function in one guest call, streams joining and leaving between steps."""

    maxStreams: Annotated[int, Field(ge=1, le=256)] = Field(
        16, description="most streams whose steps share one call; more wait for a later step"
    )


GENERATION_TIMEOUT = timedelta(seconds=60)
TOKEN_TIMEOUT = timedelta(milliseconds=250)
IDLE_TIMEOUT = timedelta(seconds=10)


class FunctionGeneration(_Strict):
    """How a generative function generates, and the bounds its requests must keep (a request
    outside them is refused with 400 naming the field, and nothing is generated). Only for
    functions whose artifact is generative (its metadata has a `generate` section)."""

    maxTokens: Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        256, description="the most completion tokens a request may ask for (max_tokens)"
    )
    defaultMaxTokens: Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        64, description="completion tokens when a request does not say (at most maxTokens)"
    )
    maxTemperature: Annotated[float, Field(ge=0, le=100)] = Field(
        2.0, description="the highest sampling temperature a request may ask for"
    )
    maxStop: Annotated[int, Field(ge=0, le=64)] = Field(
        4, description="most stop sequences in one request"
    )
    timeout: Duration = Field(
        GENERATION_TIMEOUT,
        description="deadline of a whole generation: a longer one ends with finish_reason "
        "length (the gateway's route timeout sits above it, so it never cuts a healthy stream)",
    )
    tokenTimeout: Duration = Field(
        TOKEN_TIMEOUT,
        description="time budget of each decode step or generated piece: a guest stuck longer is "
        "interrupted (epoch deadline) and the stream fails; the proxies' idle timeout derives "
        "from it, so they cut a stuck stream too",
    )
    idleTimeout: Duration = Field(
        IDLE_TIMEOUT,
        description="the longest a stream may send nothing: the backend sends a keep-alive "
        "comment after half of it while a long prompt is read, and the proxies (the "
        "gateway's route) cut a stream quiet for longer, a stuck backend's",
    )
    truncatePrompt: bool = Field(
        False,
        description="a prompt longer than the model's context minus max_tokens: refused (400, "
        "saying the limit), or with true, cut to its last tokens that fit",
    )
    batching: GenerationBatching | None = Field(
        default_factory=GenerationBatching,
        description="continuous batching of decode steps across streams (step functions); "
        "null: each stream's steps are calls of their own",
    )
    streamInterval: Annotated[int, Field(ge=1, le=64)] = Field(
        1,
        description="completion tokens per streamed event after the first text (vLLM's "
        "stream interval): 1 sends each token as it comes; N joins N tokens into one event "
        "(the first text still goes at once, and a token that comes 50 ms or more after the "
        "last event goes at once with what waited), so each proxy on the way handles one "
        "chunk per N tokens instead of N",
    )
    auditText: Literal["none", "hmac"] = Field(
        "none",
        description="none: audit records keep no prompt or completion text; hmac: they carry "
        "HMAC-SHA256 digests of both (the text the client got) under the backend's audit text "
        "key, which lets an auditor check a text someone presents without the trail holding any",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.defaultMaxTokens > self.maxTokens:
            raise ValueError(
                f"defaultMaxTokens ({self.defaultMaxTokens}) exceeds maxTokens ({self.maxTokens})"
            )
        if not timedelta(0) < self.tokenTimeout <= self.timeout:
            raise ValueError("tokenTimeout must be positive and at most timeout")
        if self.idleTimeout < 2 * self.tokenTimeout:
            raise ValueError(
                "idleTimeout must be at least twice tokenTimeout (a healthy stream sends a token "
                "at least every tokenTimeout)"
            )
        if self.timeout > timedelta(hours=1):
            raise ValueError("timeout must be at most 1h")
        return self


class FunctionSettings(_Strict):
    """What the backend needs to serve one function (version)."""

    artifact: Annotated[str, Field(pattern=ARTIFACT)] | None = Field(
        None, description="registry entry NAME@VERSION; default: this name, latest"
    )
    version: Annotated[str, Field(pattern=FUNCTION_VERSION)] | None = Field(
        None, description="served version; default: the registry's latest"
    )
    isolation: Isolation = Field(
        "reuse", description="reuse instances, or a fresh instance for every request"
    )
    idleTtl: Duration = Field(
        timedelta(minutes=5), description="unload when idle this long (scale to zero)"
    )
    codeTtl: Duration | None = Field(
        None,
        description="keep the loaded code (not the instances) until unused this long: a request "
        "after idleTtl then only instantiates (~1.6 MiB per Python function); default: idleTtl",
    )
    pool: FunctionPool = Field(
        default_factory=FunctionPool, description="The instances kept ready on each backend."
    )
    limits: FunctionLimits = Field(
        default_factory=FunctionLimits,
        description="Memory, deadline, concurrency and request size limits.",
    )
    batching: FunctionBatching | None = Field(
        None, description="dynamic batching; default: every request is its own guest call"
    )
    protocols: FunctionProtocols = Field(
        default_factory=FunctionProtocols,
        description="Which KServe v2 front ends serve it (REST, gRPC).",
    )
    repository: FunctionRepository = Field(
        default_factory=FunctionRepository,
        description="Who may load and unload it through Triton's repository API.",
    )
    warmup: FunctionWarmup = Field(
        default_factory=FunctionWarmup, description="When instances are made ahead of requests."
    )
    generation: FunctionGeneration | None = Field(
        None,
        description="A generative function (OpenAI chat and completions, Triton's generate "
        "extension, gRPC streaming): its generation bounds. Required for, and only for, a "
        "function whose artifact generates.",
    )

    @model_validator(mode="after")
    def _sane(self) -> Self:
        if self.idleTtl <= timedelta(0) or self.limits.timeout <= timedelta(0):
            raise ValueError("idleTtl and limits.timeout must be positive")
        if self.codeTtl is not None and self.codeTtl < self.idleTtl:
            raise ValueError("codeTtl must not be shorter than idleTtl")
        if self.isolation == "reuse" and self.pool.minIdle > self.pool.maxIdle:
            raise ValueError("pool.minIdle exceeds pool.maxIdle")
        if self.warmup.mode == "predictive":
            if self.isolation != "reuse":
                raise ValueError("warmup.mode predictive needs isolation: reuse")
            if self.warmup.memoryBudget < self.limits.memoryMiB:
                raise ValueError(
                    f"warmup.memoryBudget ({self.warmup.memoryBudget} MiB) fits no instance of "
                    f"limits.memoryMiB {self.limits.memoryMiB}"
                )
        return self

    @property
    def code_ttl(self) -> timedelta:
        """How long the code stays loaded unused (codeTtl, else idleTtl)."""
        return self.idleTtl if self.codeTtl is None else self.codeTtl


class ServedFunction(FunctionSettings):
    """One entry of the backend's `functions`: a function's name and its settings."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME)] = Field(
        description="served as /v2/models/{name}"
    )
    qos: FunctionQoS | None = Field(
        None,
        description="the tenant classes of the QoSPolicy binding the function (control plane)",
    )
    rollout: FunctionRollout | None = Field(
        None,
        description="the Rollout this version takes part in (control plane): both of its "
        "versions are listed, each with the same rollout",
    )


class CodeCache(_Strict):
    """Deserialized code one backend process keeps once no function holds it (their codeTtl
    passed; a repository unload or a changed artifact drops it at once), so a request
    after the TTLs instantiates instead of deserializing (a Python guest: ~2.8 of a ~7 ms cold
    start). An entry is the artifact's mmapped code (clean file pages the kernel may reclaim)
    plus ~1.6 MiB of wasmtime's own data; functions of one artifact share one entry."""

    ttl: Duration = Field(
        timedelta(minutes=15),
        description="how long code no function holds stays deserialized (0s: drop it at once)",
    )
    maxEntries: Annotated[int, Field(ge=0, le=4096)] = Field(
        32, description="most entries no function holds, least recently released first out"
    )

    @model_validator(mode="after")
    def _ttl(self) -> Self:
        if not timedelta(0) <= self.ttl <= timedelta(days=1):
            raise ValueError("codeCache.ttl must be between 0s and 24h")
        return self


class TokenLedgerAccess(BaseModel):
    """Where the mesh keeps its token budgets (the control plane's limit service) and how this
    backend proves itself to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(description="host:port of the control plane's gRPC server")
    node: str = Field(description="the backend's identity there (backend:<namespace>/<service>)")
    authorization: str = Field(
        description="the bearer token the control plane issued to that identity for the ledger"
    )


LayerMode = Annotated[Literal["auto", "required", "off"], OFF]


class EgressAddress(BaseModel):
    """A peer the policy lets the backend connect to (`Function.spec.egress`, resolved)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(description="IP address (the eBPF layer matches it exactly)")
    port: Annotated[int, Field(ge=1, le=65535)] = Field(description="TCP or UDP port")


class SandboxSettings(BaseModel):
    """How the backend confines itself (docs/concepts/sandbox.md). `auto`: on where the kernel
    allows, else off with the reason in the log and `/meshfn/functions`; `required`: refuse to
    start without it; `off`: not applied. The eBPF egress layer is the control plane's (it owns
    the cgroup); `connect` is what the policy lets through, for Landlock's TCP port rules."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    landlock: LayerMode = Field(
        "auto",
        description="filesystem: read only the registry, the trusted keys, this config and the "
        "code; write only stateDir; TCP bind/connect only to its own and the `connect` ports",
    )
    seccomp: LayerMode = Field(
        "auto",
        description="after start-up, a syscall allow-list: no exec, ptrace, mount, bpf, keyring, "
        "process_vm_*, nor anonymous executable memory (the process is killed for those)",
    )
    stateDir: Path | None = Field(
        None, description="the one directory the backend may write (none: it writes nothing)"
    )
    connect: list[EgressAddress] = Field(
        default_factory=list, description="peers the policy names (Function.spec.egress)"
    )


class BackendConfig(BaseModel):
    """The inference backend's configuration file (YAML or JSON; relative paths are relative to
    the file). Generated by the control plane; also written by hand to run a backend alone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    registry: Path = Field(description="where `meshfn fn publish` put the artifacts")
    trustedKeys: list[Path] = Field(
        default_factory=list, description="ed25519 public keys (files or directories)"
    )
    workers: Annotated[int, Field(ge=1, le=64)] = Field(
        2, description="threads running wasm per process (the GIL is released while a guest runs)"
    )
    processes: Annotated[int, Field(ge=1, le=64)] = Field(
        1,
        description="serving processes sharing the listening sockets (each with its own pools, "
        "limits, statistics and warm-up; a process that dies is restarted)",
    )
    warmupMemoryBudget: Annotated[int, Field(ge=0, le=1 << 20)] = Field(
        1024, description="MiB all predicted warm instances of one process may hold together"
    )
    lowMemory: Annotated[int, Field(ge=0, le=1 << 20)] = Field(
        128,
        description="MiB of available system memory below which idle and predicted warm "
        "instances are released first and no warm-up starts (0: never)",
    )
    codeCache: CodeCache = Field(
        default_factory=CodeCache,
        description="deserialized code kept past the functions' codeTtl (evicted under memory "
        "pressure after the warm instances)",
    )
    functions: list[ServedFunction] | None = Field(
        None,
        description="None serves every function in the registry (each version) with defaults",
    )
    tracing: BackendTracing | None = Field(
        None, description="where the backend's spans go (OTLP) and how it samples; None: off"
    )
    auditTextKey: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="hex HMAC-SHA256 key for the digests of prompts and completions that "
        "Functions with generation.auditText hmac put in their usage records (the control "
        "plane derives it from the audit subject salt)",
    )
    tokenLedger: TokenLedgerAccess | None = Field(
        None,
        description="the mesh's book of token budgets (QoSPolicy tokens), shared by every "
        "backend and process; None: each process keeps its own",
    )
    sandbox: SandboxSettings = Field(
        default_factory=SandboxSettings,
        description="the kernel's confinement of the backend's processes (Landlock, seccomp)",
    )

    @model_validator(mode="after")
    def _unique(self) -> Self:
        seen: set[tuple[str, str | None]] = set()
        for spec in self.functions or []:
            if (spec.name, spec.version) in seen:
                raise ValueError(f"{spec.name}@{spec.version} declared twice")
            seen.add((spec.name, spec.version))
        return self

    def with_overrides(self, **values: object) -> BackendConfig:
        data = self.model_dump()
        data.update({k: v for k, v in values.items() if v is not None})
        return BackendConfig.model_validate(data)
