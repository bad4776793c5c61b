"""MeshModel: the intermediate representation between policies and every output (xDS, Istio).

Frozen and hashable all the way down, so downstream stages can memoise on IR objects: an unchanged
Service yields the identical Cluster message, whose serialised bytes the snapshot cache then reuses.
No policy-file details (lines, defaults, shorthands) survive into the IR.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from meshfn.contracts.function import FunctionSettings, LayerMode, ServedFunction
from meshfn.contracts.qos import (
    FunctionQoS,
    LoadBalancer,
    PrioritySplit,
    Window,
    split_priorities,
)
from meshfn.contracts.rollout import FunctionRollout
from meshfn.contracts.tracing import BackendTracing, ClientContext, TagName


@dataclass(frozen=True, slots=True)
class Locality:
    region: str = ""
    zone: str = ""
    sub_zone: str = ""


MtlsMode = Literal["STRICT", "PERMISSIVE", "DISABLE"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str
    port: int
    weight: int = 1
    locality: Locality = Locality()
    sidecar_port: int | None = None  # clients reach the endpoint through its sidecar here
    mtls: MtlsMode = "DISABLE"  # what the sidecar accepts (meaningful with a sidecar)
    grpc_port: int | None = None  # the application's gRPC port; its sidecar routes gRPC there


@dataclass(frozen=True, slots=True)
class Outlier:
    consecutive_5xx: int
    consecutive_gateway: int
    interval: timedelta
    base_ejection_time: timedelta
    max_ejection_percent: int


@dataclass(frozen=True, slots=True)
class CircuitBreakers:
    max_connections: int | None = None
    max_pending_requests: int | None = None
    max_requests: int | None = None
    max_retries: int | None = None
    retry_budget_percent: float | None = None
    retry_budget_min_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class HealthCheck:
    path: str
    interval: timedelta
    timeout: timedelta
    unhealthy_threshold: int
    healthy_threshold: int


@dataclass(frozen=True, slots=True)
class TrafficPolicy:
    """How a gateway reaches a service: which endpoints first, when to give up on one."""

    locality_failover: bool = False
    failover_regions: tuple[tuple[str, str], ...] = ()  # (from region, to region)
    outlier: Outlier | None = None
    breakers: CircuitBreakers | None = None
    health_check: HealthCheck | None = None
    policy: str = ""  # the FallbackPolicy's name (same namespace as the service)


@dataclass(frozen=True, slots=True)
class Drift:
    threshold_percent: float
    min_increase: timedelta
    min_samples: int
    window: timedelta
    baseline_window: timedelta
    cold_start_baseline: timedelta | None
    recover_after: timedelta
    probe_percent: int
    # what drifts on a generative route: a stream's time to first token or its inter-token
    # latency (other routes: their duration; health.drift)
    streams: Literal["ttft", "itl"] = "ttft"


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    namespace: str
    port: int
    protocol: Literal["http", "grpc"]
    connect_timeout: timedelta
    endpoints: tuple[Endpoint, ...]
    identity: str = ""  # SPIFFE ID of the service's workloads
    traffic: TrafficPolicy | None = None
    fallback: tuple[str, ...] = ()  # Service keys tried in order after this one (flattened)
    drift: Drift | None = None
    external: bool = False  # its endpoints run outside Kubernetes (renderers for a cluster)
    load_balancer: LoadBalancer | None = None  # None: round robin
    # Its functions' policies shed at the gateway: the limits of its cluster (every request to
    # it) and of each such function's own cluster (that function's REST routes).
    shed: PriorityLimits | None = None
    function_shed: tuple[tuple[str, PriorityLimits], ...] = ()
    # Its endpoints serve Functions: HTTP/1.1 trailers (a stream's usage record) pass through
    # its clusters.
    functions: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def has_sidecars(self) -> bool:
        """Its endpoints are behind sidecars (the policy checks: every one of them or none)."""
        return any(e.sidecar_port for e in self.endpoints)

    @property
    def speaks_grpc(self) -> bool:
        """gRPC requests can reach it: its protocol, or an HTTP service whose endpoints also
        have a gRPC port (their sidecars route gRPC there)."""
        return self.protocol == "grpc" or any(e.grpc_port for e in self.endpoints)

    @property
    def grpc_service_port(self) -> int | None:
        """Where a cluster's Service takes gRPC (Kubernetes/Istio: one port for every pod): the
        service's port for a gRPC service, else its endpoints' gRPC port."""
        if self.protocol == "grpc":
            return self.port
        return next((e.grpc_port for e in self.endpoints if e.grpc_port), None)


@dataclass(frozen=True, slots=True)
class PathMatch:
    kind: Literal["prefix", "exact", "regex"]
    value: str


@dataclass(frozen=True, slots=True)
class HeaderMatch:
    name: str
    kind: Literal["exact", "prefix", "regex", "present"]
    value: str = ""
    invert: bool = False


@dataclass(frozen=True, slots=True)
class RouteMatch:
    path: PathMatch
    headers: tuple[HeaderMatch, ...] = ()
    methods: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Retry:
    attempts: int
    retry_on: tuple[str, ...]
    per_try_timeout: timedelta | None = None


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: `requests` per `seconds`, holding at most `burst`."""

    requests: int
    seconds: int
    burst: int


@dataclass(frozen=True, slots=True)
class Budget:
    cpu_ms: int
    window: Window


@dataclass(frozen=True, slots=True)
class TokenBudget:
    tokens: int
    window: Window


@dataclass(frozen=True, slots=True)
class TenantLimits:
    rate: Bucket | None = None
    concurrency: int | None = None
    compute: tuple[Budget, ...] = ()
    tokens: tuple[TokenBudget, ...] = ()


@dataclass(frozen=True, slots=True)
class QoSClass:
    name: str
    priority: int
    limits: TenantLimits  # each of its tenants' own


@dataclass(frozen=True, slots=True)
class QoSTenant:
    name: str
    tenant_class: str
    limits: TenantLimits  # effective: the class's, with the tenant's own fields


@dataclass(frozen=True, slots=True)
class GlobalRate:
    """Rates counted across gateways by the control plane's rate-limit service; `deny`: refuse
    when it cannot answer within `timeout_ms` (else admit)."""

    deny: bool
    timeout_ms: int


@dataclass(frozen=True, slots=True)
class QoSPolicy:
    """A QoSPolicy, resolved: every listed tenant with its effective limits. Requests whose
    verified `claim` names no listed tenant get the default class's limits (each such tenant
    its own); requests without the claim share one anonymous tenant "" of the default class."""

    name: str
    namespace: str
    claim: str
    default_class: str
    classes: tuple[QoSClass, ...]
    tenants: tuple[QoSTenant, ...] = ()
    global_rate: GlobalRate | None = None
    # Shed the lower priorities at the gateway (QoSPolicy.spec.gatewayShedding): the top
    # priority's tenants route as Envoy's HIGH priority, the others DEFAULT (priority_split).
    gateway_shed: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def class_named(self, name: str) -> QoSClass:
        return next(c for c in self.classes if c.name == name)

    @property
    def default(self) -> QoSClass:
        return self.class_named(self.default_class)

    def limits_of(self, tenant: str) -> tuple[str, TenantLimits]:
        """(class, limits) of a tenant; "" is the anonymous tenant."""
        for entry in self.tenants:
            if entry.name == tenant:
                return entry.tenant_class, entry.limits
        return self.default_class, self.default.limits

    def every_limits(self) -> tuple[TenantLimits, ...]:
        return (*(c.limits for c in self.classes), *(t.limits for t in self.tenants))

    @property
    def rate_limited(self) -> bool:
        return any(limits.rate is not None for limits in self.every_limits())

    @property
    def concurrency_limited(self) -> bool:
        return any(limits.concurrency is not None for limits in self.every_limits())

    @property
    def budgeted(self) -> bool:
        """Some tenant has a compute or token budget: only a backend can meter those."""
        return any(limits.compute or limits.tokens for limits in self.every_limits())

    def priority_split(self) -> PrioritySplit:
        """Who routes HIGH at a shedding gateway (contracts.qos.split_priorities)."""
        return split_priorities(
            ((c.name, c.priority) for c in self.classes),
            self.default_class,
            ((t.name, t.tenant_class) for t in self.tenants),
        )


@dataclass(frozen=True, slots=True)
class PriorityLimits:
    """A gateway's concurrency towards one backend per Envoy routing priority (its cluster's
    circuit breakers): DEFAULT well below HIGH, so the lower classes shed at the gateway."""

    high: int
    default: int


@dataclass(frozen=True, slots=True)
class PathRewrite:
    """The path a route sends upstream: every match of `pattern` (RE2) replaced by
    `substitution` (\\1-style groups)."""

    pattern: str
    substitution: str


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    namespace: str
    hosts: tuple[str, ...]
    matches: tuple[RouteMatch, ...]
    service: str  # Service.key of the destination
    timeout: timedelta | None = None
    retries: Retry | None = None
    grpc: bool = False  # its traffic is gRPC: renderers that name a Service port use the gRPC one
    qos: QoSPolicy | None = None  # a QoSPolicy of its own (bound to the Route or Function)
    function: str = ""  # the Function whose KServe paths it serves (REST; gRPC: `model`)
    # The longest a response may send nothing (a stream's idle timeout; None: the proxy's own):
    # a generative function's routes cut a stuck stream, never a healthy one.
    idle_timeout: timedelta | None = None
    rewrite: PathRewrite | None = None
    # A model route: it serves the requests whose JSON body (OpenAI's) or gRPC message (`grpc`:
    # KServe's ModelInfer) names this model (the gateway's model router writes it to
    # contracts.plugins.MODEL_HEADER, which it matches)
    model: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Listener:
    name: str
    address: str
    port: int
    routes: tuple[Route, ...]


@dataclass(frozen=True, slots=True)
class JwtRule:
    issuer: str
    audiences: tuple[str, ...]
    jwks: str | None  # inline JWKS JSON
    jwks_uri: str | None  # or fetched by Envoy
    from_headers: tuple[tuple[str, str], ...]  # (header, value prefix)
    from_params: tuple[str, ...]
    claim_to_headers: tuple[tuple[str, str], ...]  # (header, claim)
    forward: bool
    clock_skew_seconds: int
    # Refuse tokens without `exp` (Envoy's require_expiration). Istio's RequestAuthentication
    # has no such field: a renderer for it must warn when this is True (the default).
    require_expiration: bool = True
    max_lifetime_seconds: int | None = None  # refuse tokens with exp - iat above it


@dataclass(frozen=True, slots=True)
class SourceMatch:
    principals: tuple[str, ...] = ()
    not_principals: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    not_namespaces: tuple[str, ...] = ()
    request_principals: tuple[str, ...] = ()
    not_request_principals: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class OperationMatch:
    paths: tuple[str, ...] = ()
    not_paths: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    not_methods: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ConditionMatch:
    key: str
    values: tuple[str, ...] = ()
    not_values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AuthzRule:
    """Matches when one source, one operation and every condition match (empty = any)."""

    sources: tuple[SourceMatch, ...] = ()
    operations: tuple[OperationMatch, ...] = ()
    conditions: tuple[ConditionMatch, ...] = ()


@dataclass(frozen=True, slots=True)
class AuthzPolicy:
    name: str  # namespace/name
    action: Literal["ALLOW", "DENY"]
    rules: tuple[AuthzRule, ...]


@dataclass(frozen=True, slots=True)
class Inbound:
    """What a sidecar serves: its TLS listener, and the application endpoint behind it."""

    service: str  # Service.key
    address: str
    port: int
    app_port: int
    protocol: Literal["http", "grpc"]
    mtls: MtlsMode
    grpc_app_port: int | None = None  # gRPC requests (content-type application/grpc) go here
    # The backend behind it serves functions with QoS: its jwt_authn writes this verified claim
    # as contracts.qos.TENANT_HEADER for the backend (priority, attribution).
    tenant_claim: str | None = None
    # The application is an inference backend serving Functions: its local replies on OpenAI
    # paths are OpenAI's error objects, and its streams' trailers (usage records) pass through.
    functions: bool = False


@dataclass(frozen=True, slots=True)
class Workload:
    """One kind of proxy the mesh configures; every Envoy whose node.cluster equals `node_cluster`
    receives the same configuration. Gateways take traffic from outside the mesh; a sidecar
    fronts one endpoint of a service (like a pod's sidecar)."""

    name: str
    namespace: str
    kind: Literal["gateway", "sidecar"]
    admin_port: int  # a TCP admin port the policy opts in to (Gateway adminPort); 0: none
    xds_protocol: Literal["delta", "sotw"]
    locality: Locality
    listeners: tuple[Listener, ...]
    identity: str = ""  # SPIFFE ID
    jwt_rules: tuple[JwtRule, ...] = ()
    authz: tuple[AuthzPolicy, ...] = ()
    inbound: Inbound | None = None  # sidecars only
    qos: QoSPolicy | None = None  # gateways: the QoSPolicy bound to the whole gateway

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def node_cluster(self) -> str:
        if self.inbound is not None:
            return f"{self.name}.{self.namespace}:{self.inbound.port}"
        return f"{self.name}.{self.namespace}"


@dataclass(frozen=True, slots=True)
class Function:
    """A model function and where it runs. `settings` is the backend's own schema, carried
    unchanged from the policy to the backend's configuration (one schema, no field mapping)."""

    name: str
    namespace: str
    backend: str  # Service.key
    settings: FunctionSettings
    # The tenant classes of the QoSPolicy binding it (its own, else its gateway's): the backend
    # orders and sheds its requests by their priority (contracts.qos, the backend's schema).
    qos: FunctionQoS | None = None
    # Services (keys) its backend's processes may connect to (Function.spec.egress).
    egress: tuple[str, ...] = ()
    # The Rollout of a new version (its backend serves both: stable and candidate).
    rollout: FunctionRollout | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def served(self) -> ServedFunction:
        """Its entry in an inference backend's configuration (meshfn up, Kubernetes alike)."""
        return ServedFunction.model_construct(name=self.name, qos=self.qos, **dict(self.settings))

    def served_versions(self) -> tuple[ServedFunction, ...]:
        """Its entries in an inference backend's configuration: itself, and during a rollout
        its candidate too (the same settings, the candidate's version or artifact)."""
        own = self.served()
        if self.rollout is None:
            return (own,)
        stable = own.model_copy(update={"version": self.rollout.stable, "rollout": self.rollout})
        artifact = self.settings.artifact
        candidate = own.model_copy(
            update={
                "version": self.rollout.candidate,
                "artifact": None
                if artifact is None
                else f"{artifact.partition('@')[0]}@{self.rollout.candidate}",
                "rollout": self.rollout,
            }
        )
        return (stable, candidate)


@dataclass(frozen=True, slots=True)
class Audit:
    proxies: Literal["sidecars", "gateways", "all"]
    retention_days: int
    tenant_claim: str
    body_hash: bool
    body_hash_max_bytes: int

    def records(self, kind: Literal["gateway", "sidecar"]) -> bool:
        return self.proxies in ("all", f"{kind}s")


@dataclass(frozen=True, slots=True)
class TraceCollector:
    """An OTLP collector (Mesh.spec.tracing.collector), or with `socket`, one on the proxies'
    own host reached over that unix socket instead of host:port (`meshfn up`'s embedded
    collector, OTLP/gRPC)."""

    protocol: Literal["grpc", "http"]
    host: str
    port: int
    path: str = "/v1/traces"
    timeout: timedelta = timedelta(seconds=1)
    socket: str = ""

    @classmethod
    def on_socket(cls, path: str) -> TraceCollector:
        """OTLP/gRPC over the unix socket at `path` (absolute)."""
        return cls("grpc", "localhost", 0, socket=path)

    @classmethod
    def parse(cls, endpoint: str) -> TraceCollector:
        """grpc://host:port or http://host:port[/path] (ValueError otherwise)."""
        scheme, sep, rest = endpoint.partition("://")
        address, _, path = rest.partition("/")
        host, _, port = address.rpartition(":")
        if scheme not in ("grpc", "http") or not sep or not host or not port.isdigit():
            raise ValueError(f"{endpoint!r}: give grpc://HOST:PORT or http://HOST:PORT/PATH")
        if not 0 < int(port) < 65536:
            raise ValueError(f"{endpoint!r}: the port must be 1-65535")
        protocol: Literal["grpc", "http"] = "grpc" if scheme == "grpc" else "http"
        return cls(protocol, host, int(port), "/" + path if path else "/v1/traces")

    @property
    def endpoint(self) -> str:
        """As the inference backend's settings name it (contracts.tracing.BackendTracing)."""
        if self.socket:
            return f"unix://{self.socket}"
        if self.protocol == "grpc":
            return f"grpc://{self.host}:{self.port}"
        return f"http://{self.host}:{self.port}{self.path}"


@dataclass(frozen=True, slots=True)
class GatewayTracing:
    """A gateway's effective tracing: its sampling percent and what it does with a client's
    trace context (contracts.tracing.CLIENT_CONTEXT_HEADERS)."""

    sampling: float
    client_context: ClientContext


# While every caller samples less than this percent, meshfn's own proxies trace on internal
# listeners that only the requests they trace take (meshfn.xds.translate.httpfilters.tracing).
# A traced request then crosses one more connection manager (~50 µs on the 2-vCPU bench
# machine), and every other request meets no tracer at all (a gateway's ~20 µs and a
# sidecar's ~30 µs of CPU, and the trace context every request would carry down the path):
# below ~35% the split wins.
SPLIT_BELOW = 25.0


@dataclass(frozen=True, slots=True)
class Tracing:
    """Mesh.spec.tracing with the gateways' and routes' overrides resolved. `collector` None:
    the run mode's own (meshfn up: its embedded collector, a fact of the host the proxies run
    on; Kubernetes: the render options' default)."""

    sampling: float
    collector: TraceCollector | None
    tags: tuple[TagName, ...]
    tenant_claim: str
    client_context: ClientContext
    gateways: tuple[tuple[str, GatewayTracing], ...] = ()  # (Workload.key, settings): overrides
    routes: tuple[tuple[str, float], ...] = ()  # (Route.key, sampling percent): overrides

    def gateway(self, key: str) -> GatewayTracing:
        return dict(self.gateways).get(key) or GatewayTracing(self.sampling, self.client_context)

    def route_sampling(self, key: str) -> float | None:
        return dict(self.routes).get(key)

    def highest_sampling(self) -> float:
        """The most any caller may sample: the mesh's, a gateway's or a route's percent (100 at
        a gateway that honors its clients' decisions)."""
        gateways = (
            GatewayTracing(self.sampling, self.client_context),
            *dict(self.gateways).values(),
        )
        return max(
            [100.0 if g.client_context == "honor" else g.sampling for g in gateways]
            + [percent for _, percent in self.routes]
        )

    @property
    def split(self) -> bool:
        """Every caller samples under SPLIT_BELOW: a request meshfn's proxies do not trace
        carries no trace context (translate.httpfilters.tracing)."""
        return self.highest_sampling() < SPLIT_BELOW

    def backend(
        self,
        service_key: str,
        fallback: TraceCollector | None,
        pull_token: str | None = None,
        sidecar: bool = False,
    ) -> BackendTracing | None:
        """The settings of the inference backends behind `service_key`: push to the policy's
        collector, else hold the spans for the run mode to collect (`pull_token`: meshfn up),
        else push to `fallback` (the operator's collector); None when there is none.
        `sidecar`: meshfn's own sidecar fronts them, which decides for every request; when it
        is split a request without a parent is one it chose not to trace, and the backend
        draws none of its own (it would start traces without their gateway and sidecar)."""
        collector = self.collector or (None if pull_token else fallback)
        if collector is None and pull_token is None:
            return None
        namespace, name = service_key.split("/", 1)
        return BackendTracing(
            endpoint=collector.endpoint if collector is not None else None,
            pullToken=None if collector is not None else pull_token,
            sampling=0.0 if sidecar and self.split else self.sampling,
            serviceName=f"{name}.{namespace} inference",
            timeout=(
                collector.timeout if collector is not None else timedelta(seconds=1)
            ).total_seconds(),
        )


@dataclass(frozen=True)
class Drill:
    """Callers who may force degraded routes with `header` (policy: Mesh.spec.drill)."""

    header: str
    request_principals: tuple[str, ...]  # "<iss>/<sub>", "<iss>/*", "*"


@dataclass(frozen=True, slots=True)
class RolloutStep:
    """One step of a rollout: `shadow` mirrors `percent` of the Function's requests to the
    candidate (its answers discarded), `canary` sends it `percent` of them. The step is done
    after `min_time` and `min_requests` candidate answers, with every check passing."""

    kind: Literal["shadow", "canary"]
    percent: int
    min_requests: int
    min_time: timedelta


@dataclass(frozen=True, slots=True)
class LatencyCheck:
    """The candidate's p`percentile` at most `max`, or at most `max_ratio` times the stable
    version's over the same window (and then only once it is also `min_increase` above it)."""

    percentile: Literal[95, 99]
    max: timedelta | None = None
    max_ratio: float | None = None
    min_increase: timedelta = timedelta(0)


@dataclass(frozen=True, slots=True)
class RolloutSlo:
    """What every step checks, candidate against stable over the same window. A check is
    judged on at least `min_samples` candidate answers (or sooner, once the answers so far
    break it whatever the rest would be)."""

    max_error_ratio: float
    max_error_increase: float | None
    latency: tuple[LatencyCheck, ...]
    min_agreement: float | None  # shadow steps: share of compared answers that agree
    tolerance: float  # numbers agree within it; labels must be equal
    min_samples: int


@dataclass(frozen=True, slots=True)
class Pinning:
    """Tenants (the verified JWT `claim`) kept on one version while the rollout runs."""

    claim: str
    stable: tuple[str, ...] = ()
    candidate: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Rollout:
    """A new version of a Function taking over from the one in service, step by step, judged
    on what the gateways and the backend measure (the rollout controller moves it; where it
    is now is runtime state: Overlay.splits)."""

    name: str
    namespace: str
    function: str  # Function.key
    stable: str
    candidate: str
    steps: tuple[RolloutStep, ...]
    slo: RolloutSlo
    on_breach: Literal["rollback", "pause"]
    interval: timedelta
    window: timedelta  # the most recent span a step's checks look at
    no_data_timeout: timedelta
    pinning: Pinning | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def function_name(self) -> str:
        return self.function.split("/", 1)[1]

    def initial(self) -> Split:
        """Where it starts: its first step."""
        return Split.at_step(self, 0)


@dataclass(frozen=True, slots=True)
class Split:
    """Where a rollout's traffic is now: `weight` percent of the Function's requests answered
    by the candidate, `mirror` percent copied to it, and whether its tenant pinning holds (it
    does until the rollout ends)."""

    rollout: str  # Rollout.key
    weight: int = 0
    mirror: int = 0
    pinned: bool = True

    @classmethod
    def at_step(cls, rollout: Rollout, index: int) -> Split:
        step = rollout.steps[index]
        if step.kind == "shadow":
            return cls(rollout.key, 0, step.percent)
        return cls(rollout.key, step.percent, 0)


@dataclass(frozen=True)
class Overlay:
    """Runtime state layered over the policies (never written back to them): routes the drift
    breaker has sent down their fallback chain, and where each rollout's traffic is (a rollout
    without a split here is at its first step)."""

    degraded_routes: frozenset[str] = frozenset()
    splits: tuple[Split, ...] = ()

    def split(self, rollout: Rollout) -> Split:
        for split in self.splits:
            if split.rollout == rollout.key:
                return split
        return rollout.initial()


# ---------------------------------------------------------------- policies as written
#
# The zero-trust policies also as the namespace-scoped objects the user wrote, with their
# selectors: a renderer whose target has the same concepts (Istio) renders them one to one, where
# the xDS translator uses the per-workload lowering above (Workload.jwt_rules/authz, Endpoint.mtls).


@dataclass(frozen=True, slots=True)
class Selector:
    """One Service (its sidecars) or one Gateway of the policy's namespace."""

    kind: Literal["service", "gateway"]
    name: str


@dataclass(frozen=True, slots=True)
class PeerPolicy:
    name: str
    namespace: str
    selector: Selector | None  # None: every workload of the namespace
    mtls: MtlsMode | None  # None: inherited (only port-level modes set)
    port_mtls: tuple[tuple[int, MtlsMode], ...] = ()  # (endpoint application port, mode)


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    name: str
    namespace: str
    selector: Selector | None
    rules: tuple[JwtRule, ...]


@dataclass(frozen=True, slots=True)
class AuthzObject:
    name: str
    namespace: str
    selector: Selector | None
    action: Literal["ALLOW", "DENY"]
    rules: tuple[AuthzRule, ...]
    # Policies meshfn writes itself (the KServe repository guard) name the objects they come
    # from, as (kind, namespace, name); empty: the AuthorizationPolicy of the same name.
    derived_from: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Policies:
    """`mtls` is the mesh-wide default (Mesh.spec.mtls); the rest in (namespace, name) order."""

    mtls: MtlsMode = "STRICT"
    peer: tuple[PeerPolicy, ...] = ()
    request: tuple[RequestPolicy, ...] = ()
    authz: tuple[AuthzObject, ...] = ()


@dataclass(frozen=True, slots=True)
class Sandbox:
    """How the kernel confines the inference backends (Mesh.spec.sandbox)."""

    landlock: LayerMode = "auto"
    seccomp: LayerMode = "auto"
    egress: LayerMode = "auto"


@dataclass(frozen=True)
class MeshModel:
    name: str
    trust_domain: str
    xds_port: int
    admin_port: int
    services: tuple[Service, ...]
    workloads: tuple[Workload, ...]
    certificate_ttl: timedelta = timedelta(hours=1)
    functions: tuple[Function, ...] = ()
    acceleration: Literal["ebpf", "off", "auto"] = "off"
    sandbox: Sandbox = Sandbox()
    audit: Audit | None = None
    drill: Drill | None = None
    policies: Policies = Policies()
    qos: tuple[QoSPolicy, ...] = ()  # every QoSPolicy, (namespace, name) order
    rollouts: tuple[Rollout, ...] = ()  # every Rollout, (namespace, name) order
    tracing: Tracing | None = None
    _services: dict[str, Service] = field(init=False, repr=False, compare=False, hash=False)
    _workloads: dict[str, Workload] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_services", {s.key: s for s in self.services})
        object.__setattr__(self, "_workloads", {w.node_cluster: w for w in self.workloads})

    def service(self, key: str) -> Service:
        return self._services[key]

    def workload(self, node_cluster: str) -> Workload | None:
        return self._workloads.get(node_cluster)

    def rollout_of(self, function_key: str) -> Rollout | None:
        """The Rollout of a Function (there is at most one)."""
        for rollout in self.rollouts:
            if rollout.function == function_key:
                return rollout
        return None

    def function(self, key: str) -> Function | None:
        return next((f for f in self.functions if f.key == key), None)
