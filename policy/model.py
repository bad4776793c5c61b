"""meshfn.io/v1alpha1: the policy kinds users write.

Kubernetes-shaped (apiVersion, kind, metadata, spec) so the same models back the CRDs. Strict:
unknown fields and wrong types are errors, never coerced, because a typo that silently falls back to
a default is how meshes get opened up.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from meshfn.contracts.durations import MAX_DURATION, Duration
from meshfn.contracts.function import FunctionSettings
from meshfn.contracts.plugins import CALLER_PATTERN
from meshfn.contracts.principals import RequestPrincipal
from meshfn.contracts.qos import GatewayShedding, LoadBalancer, TenantClasses

from .types import (
    ConditionKey,
    HeaderName,
    Host,
    HttpPath,
    IPAddress,
    Jwks,
    JwksUri,
    LocalityName,
    Name,
    NamespaceMatch,
    ObjectRef,
    PathPattern,
    Port,
    Principal,
    Regex,
    TrustDomain,
)


class Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, populate_by_name=False, validate_default=False
    )


def _exactly_one(model: BaseModel, fields: tuple[str, ...]) -> None:
    given = [f for f in fields if getattr(model, f) is not None]
    if len(given) != 1:
        choices = ", ".join(fields)
        if not given:
            raise ValueError(f"set exactly one of: {choices}")
        raise ValueError(f"set exactly one of: {choices} (got {', '.join(given)})")


# ---------------------------------------------------------------- metadata


class ObjectMeta(Strict):
    name: Name
    namespace: Name = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class ClusterMeta(Strict):
    """Metadata of cluster-scoped kinds (Mesh): no namespace."""

    name: Name
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class Locality(Strict):
    """Where an endpoint or proxy runs; `node` maps to Envoy's sub_zone."""

    region: LocalityName | None = None
    zone: LocalityName | None = None
    node: LocalityName | None = None

    @model_validator(mode="after")
    def _nested(self) -> Self:
        if self.node is not None and self.zone is None:
            raise ValueError("locality.node needs locality.zone")
        if self.zone is not None and self.region is None:
            raise ValueError("locality.zone needs locality.region")
        return self


# ---------------------------------------------------------------- Mesh


class MeshPorts(Strict):
    xds: Port = Field(18000, description="ADS (gRPC) port of the control plane, on loopback")
    admin: Port = Field(18001, description="control plane admin: /metrics, /debug/*")


MtlsMode = Literal["STRICT", "PERMISSIVE", "DISABLE"]


class MtlsSetting(Strict):
    mode: MtlsMode


class Identity(Strict):
    """Workload certificates (SPIFFE X.509 SVIDs) issued by the mesh CA."""

    certificateTTL: Duration = Field(timedelta(hours=1), description="re-issued at half-life")


class BodyHashing(Strict):
    enabled: bool = Field(False, description="record SHA-256 of request bodies (not streams)")
    maxBytes: Annotated[int, Field(ge=1, le=1 << 30)] = Field(
        1 << 20, description="longer bodies are recorded as too large, not hashed"
    )


class Audit(Strict):
    """The request audit trail: every request a proxy answers becomes one hash-chained record in
    the control plane's store (subject as a salted HMAC, never the raw token or body)."""

    proxies: Literal["sidecars", "gateways", "all"] = Field(
        "sidecars",
        description="which proxies record: sidecars see the mTLS caller, the verified JWT and the"
        " authorization verdict; gateways see every client request",
    )
    retentionDays: Annotated[int, Field(ge=1, le=36500)] = Field(
        730, description="records older than this are deleted (the rest stays verifiable)"
    )
    tenantClaim: Annotated[str, Field(pattern=r"^[!-~]{0,128}$")] = Field(
        "tenant", description="JWT claim recorded as tenant; empty: none"
    )
    bodyHash: BodyHashing = Field(default_factory=BodyHashing)


def _filter_caller(value: str) -> str:
    if not re.fullmatch(CALLER_PATTERN, value):
        raise ValueError(
            f"{value!r}: the degrade filter compares callers as printable ASCII without spaces, "
            "quotes, commas or backslashes"
        )
    return value


DrillCaller = Annotated[RequestPrincipal, AfterValidator(_filter_caller)]


class Drill(Strict):
    """Callers allowed to force drift-guarded routes onto their degraded route (game days,
    testing a fallback before it is needed): a request from them carrying `<header>: 1` goes
    where a tripped breaker would send it (the route's probePercent share still reaches the
    primary). The header is stripped from every request; from
    anyone else it is ignored (and counted). Callers are named by verified JWT: degraded routes
    live on gateways, whose clients authenticate with tokens, not mTLS."""

    header: HeaderName = Field("x-meshfn-degrade", description="the drill header (lowercase)")
    requestPrincipals: Annotated[list[DrillCaller], Field(min_length=1, max_length=256)] = Field(
        description="callers with a verified JWT: <iss>/<sub>, <iss>/* or *, as in"
        " AuthorizationPolicy (printable ASCII without spaces, quotes, commas or backslashes:"
        " the degrade filter compares them as they are)"
    )

    @model_validator(mode="after")
    def _header(self) -> Self:
        if not self.header.islower() or self.header == "x-meshfn-degrade-route":
            raise ValueError("header must be lowercase and not the internal routing header")
        return self


def _yaml_off(value: object) -> object:
    """YAML 1.1 reads a bare `off` as false: a sandbox layer written `landlock: off` means it."""
    return "off" if value is False else value


SandboxMode = Annotated[Literal["auto", "required", "off"], BeforeValidator(_yaml_off)]


class Sandbox(Strict):
    """How the kernel confines the inference backends `meshfn up` runs (docs/concepts/sandbox.md).
    Each layer: `auto` (on where the kernel allows it, otherwise off with the reason at start and
    in `meshfn status`), `required` (refuse to start without it) or `off`."""

    landlock: SandboxMode = Field(
        "auto",
        description="filesystem (and, with Landlock ABI 4+, TCP ports): read the registry, keys, "
        "config and code only, write the backend's state directory only, execute nothing",
    )
    seccomp: SandboxMode = Field(
        "auto",
        description="after start-up, a syscall allow-list; exec, ptrace, mount, bpf, keyring, "
        "process_vm_* and anonymous executable memory kill the process",
    )
    egress: SandboxMode = Field(
        "auto",
        description="eBPF on the backend's cgroup: no outbound connection or datagram except to "
        "the peers its Functions name in spec.egress (needs root and bcc)",
    )


class MeshSpec(Strict):
    trustDomain: TrustDomain
    ports: MeshPorts = Field(default_factory=MeshPorts)
    mtls: MtlsSetting = Field(
        default_factory=lambda: MtlsSetting(mode="STRICT"),
        description="mesh-wide default for sidecars (Istio defaults to PERMISSIVE)",
    )
    identity: Identity = Field(default_factory=Identity)
    acceleration: Literal["ebpf", "off", "auto"] = Field(
        "off",
        description="eBPF socket redirection between the mesh's own processes (meshfn up): "
        "ebpf requires it, auto uses it where the kernel allows",
    )
    sandbox: Sandbox = Field(
        default_factory=Sandbox,
        description="the kernel's confinement of the inference backends (meshfn up)",
    )
    audit: Audit | None = Field(None, description="request audit trail; absent: off")
    drill: Drill | None = Field(
        None, description="JWT callers who may force degraded routes with a header; absent: nobody"
    )

    @model_validator(mode="after")
    def _ttl(self) -> Self:
        ttl = self.identity.certificateTTL
        if not timedelta(seconds=10) <= ttl <= timedelta(days=30):
            raise ValueError("identity.certificateTTL must be between 10s and 30 days")
        return self


class Mesh(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["Mesh"]
    metadata: ClusterMeta
    spec: MeshSpec


# ---------------------------------------------------------------- Gateway


class GatewayListener(Strict):
    name: Name
    port: Port
    address: IPAddress = "127.0.0.1"
    protocol: Literal["http"] = "http"


class GatewaySpec(Strict):
    """An Envoy the mesh runs and configures: the entry point that clients call."""

    listeners: Annotated[list[GatewayListener], Field(min_length=1, max_length=64)]
    adminPort: Port | None = Field(
        None,
        description=(
            "also serve the gateway Envoy's admin interface on this port of 127.0.0.1 (without"
            " it, only on a unix socket in the state directory). Unauthenticated: every local"
            " user can read its configuration, including its ADS token, and drain or stop it"
        ),
    )
    serviceAccount: Name | None = Field(None, description="identity; defaults to the name")
    locality: Locality | None = None
    xdsProtocol: Literal["delta", "sotw"] = Field(
        "delta", description="incremental (delta) or state-of-the-world ADS"
    )

    @model_validator(mode="after")
    def _unique_listeners(self) -> Self:
        seen_names: set[str] = set()
        seen_ports: set[int] = set()
        for listener in self.listeners:
            if listener.name in seen_names:
                raise ValueError(f"listener name {listener.name!r} is used twice")
            if listener.port in seen_ports:
                raise ValueError(f"listener port {listener.port} is used twice")
            seen_names.add(listener.name)
            seen_ports.add(listener.port)
        return self


class Gateway(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["Gateway"]
    metadata: ObjectMeta
    spec: GatewaySpec


# ---------------------------------------------------------------- Service


class Sidecar(Strict):
    """A server-side Envoy meshfn runs in front of this endpoint: mTLS, JWT and authorization
    are enforced there, and the gateways reach the endpoint only through it."""

    port: Port


class Endpoint(Strict):
    address: IPAddress
    port: Port | None = Field(None, description="defaults to the service port")
    grpcPort: Port | None = Field(
        None,
        description="where the endpoint also speaks gRPC (HTTP/2), e.g. the inference backend's "
        "KServe GRPCInferenceService; its sidecar sends gRPC requests there",
    )
    weight: Annotated[int, Field(ge=1, le=10_000)] = 1
    locality: Locality | None = None
    sidecar: Sidecar | None = None


class ServiceSpec(Strict):
    port: Port = Field(description="service port; endpoints without a port use it")
    protocol: Literal["http", "grpc"] = "http"
    serviceAccount: Name | None = Field(None, description="identity; defaults to the name")
    connectTimeout: Duration = timedelta(seconds=1)
    loadBalancer: LoadBalancer | None = Field(
        None,
        description="how a gateway picks an endpoint. weighted-round-robin: Envoy's "
        "client_side_weighted_round_robin, weighted by the load each endpoint reports (ORCA "
        "endpoint-load-metrics; the inference backend does); least-request; round-robin. "
        "Default: weighted-round-robin for a service that serves Functions (bench/qos.py: "
        "with a slow endpoint it beat least-request), else round-robin",
    )
    endpoints: Annotated[list[Endpoint], Field(max_length=10_000)] = Field(default_factory=list)
    external: bool = Field(
        False,
        description="the endpoints run outside Kubernetes (VMs, other hosts). Rendered for Istio "
        "as a ServiceEntry with one WorkloadEntry per endpoint; otherwise the Kubernetes Service "
        "of this name and namespace provides the endpoints there. meshfn's own Envoys always use "
        "`endpoints`",
    )

    @model_validator(mode="after")
    def _timeouts(self) -> Self:
        if self.connectTimeout <= timedelta(0):
            raise ValueError("connectTimeout must be positive")
        if self.external and not self.endpoints:
            raise ValueError("an external service needs its endpoints")
        with_sidecar = sum(1 for e in self.endpoints if e.sidecar is not None)
        if 0 < with_sidecar < len(self.endpoints):
            raise ValueError("either every endpoint has a sidecar or none does")
        for i, e in enumerate(self.endpoints):
            if e.grpcPort is None:
                continue
            if self.protocol == "grpc":
                raise ValueError(f"endpoints[{i}].grpcPort: the service speaks gRPC already")
            if e.sidecar is None:
                # Without a sidecar a gateway reaches the endpoint's own port, which speaks HTTP/1.
                raise ValueError(
                    f"endpoints[{i}].grpcPort needs a sidecar (it routes gRPC requests there)"
                )
            if e.grpcPort in (e.port or self.port, e.sidecar.port):
                raise ValueError(f"endpoints[{i}].grpcPort must differ from its other ports")
        return self


class Service(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["Service"]
    metadata: ObjectMeta
    spec: ServiceSpec


# ---------------------------------------------------------------- Route


class PathMatch(Strict):
    prefix: HttpPath | None = None
    exact: HttpPath | None = None
    regex: Regex | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        _exactly_one(self, ("prefix", "exact", "regex"))
        return self


class HeaderMatch(Strict):
    name: HeaderName
    exact: Annotated[str, Field(max_length=4096)] | None = None
    prefix: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    regex: Regex | None = None
    present: bool | None = None
    invert: bool = Field(
        False,
        description="match requests whose header does NOT match; a request without the header "
        "matches an inverted value (x-env not prod), as Istio's withoutHeaders",
    )

    @model_validator(mode="after")
    def _one(self) -> Self:
        _exactly_one(self, ("exact", "prefix", "regex", "present"))
        if self.present is False:
            raise ValueError("present: false is spelled present: true with invert: true")
        if self.name.lower() == ":method":
            raise ValueError("match methods with the `methods` field, not a :method header")
        return self


Method = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"]


class RouteMatch(Strict):
    path: PathMatch = Field(default_factory=lambda: PathMatch(prefix="/"))
    headers: Annotated[list[HeaderMatch], Field(max_length=32)] = Field(default_factory=list)
    methods: Annotated[list[Method], Field(max_length=9)] = Field(default_factory=list)


class Destination(Strict):
    service: Name
    namespace: Name | None = Field(None, description="defaults to the route's namespace")


RetryOn = Literal[
    "5xx",
    "gateway-error",
    "reset",
    "reset-before-request",
    "connect-failure",
    "refused-stream",
    "retriable-4xx",
    "envoy-ratelimited",
    "cancelled",
    "deadline-exceeded",
    "internal",
    "resource-exhausted",
    "unavailable",
]

DEFAULT_RETRY_ON: tuple[RetryOn, ...] = ("connect-failure", "refused-stream", "reset")


class Retries(Strict):
    attempts: Annotated[int, Field(ge=0, le=10)]
    perTryTimeout: Duration | None = None
    retryOn: Annotated[list[RetryOn], Field(min_length=1)] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_ON)
    )

    @model_validator(mode="after")
    def _positive(self) -> Self:
        if self.perTryTimeout is not None and self.perTryTimeout <= timedelta(0):
            raise ValueError("perTryTimeout must be positive")
        return self


class RouteSpec(Strict):
    gateway: ObjectRef | None = Field(
        None,
        description='"name" or "namespace/name" of a Gateway; may be omitted when there is one',
    )
    listener: Name | None = Field(None, description="one listener of the gateway; default all")
    hosts: Annotated[list[Host], Field(min_length=1, max_length=64)] = Field(
        default_factory=lambda: ["*"]
    )
    matches: Annotated[list[RouteMatch], Field(min_length=1, max_length=64)] = Field(
        default_factory=lambda: [RouteMatch()]
    )
    destination: Destination
    timeout: Duration | None = Field(None, description='upstream timeout; "0s" disables it')
    retries: Retries | None = None

    @model_validator(mode="after")
    def _timeouts(self) -> Self:
        if self.timeout is not None and self.timeout < timedelta(0):
            raise ValueError("timeout must not be negative")
        return self


class Route(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["Route"]
    metadata: ObjectMeta
    spec: RouteSpec


# ---------------------------------------------------------------- zero trust


class WorkloadSelector(Strict):
    """Selects one Service (its sidecars) or one Gateway in the policy's namespace; without a
    selector a policy applies to every such workload of its namespace."""

    service: Name | None = None
    gateway: Name | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        _exactly_one(self, ("service", "gateway"))
        return self


class PeerAuthenticationSpec(Strict):
    selector: WorkloadSelector | None = None
    mtls: MtlsSetting | None = None
    portLevelMtls: dict[Annotated[str, Field(pattern=r"^[1-9][0-9]{0,4}$")], MtlsSetting] = Field(
        default_factory=dict, description="endpoint (application) port -> mode"
    )

    @model_validator(mode="after")
    def _gateway(self) -> Self:
        if self.selector is not None and self.selector.gateway is not None:
            raise ValueError(
                "PeerAuthentication applies to services (their sidecars), not gateways"
            )
        if self.mtls is None and not self.portLevelMtls:
            raise ValueError("set mtls or portLevelMtls")
        if self.portLevelMtls and (self.selector is None or self.selector.service is None):
            raise ValueError("portLevelMtls needs a selector naming a service")
        return self


class PeerAuthentication(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["PeerAuthentication"]
    metadata: ObjectMeta
    spec: PeerAuthenticationSpec


class JwtHeader(Strict):
    name: HeaderName
    prefix: Annotated[str, Field(max_length=64)] = ""


class ClaimToHeader(Strict):
    # letters, digits and '-' (what Istio's validateJwtRule takes): every proxy drops headers
    # with underscores (contracts.proxy.REQUEST_HYGIENE), so such a claim header never arrives
    header: Annotated[str, Field(pattern=r"^[-A-Za-z0-9]+$", min_length=1, max_length=256)]
    claim: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]+$", max_length=128)]


class JwtRule(Strict):
    issuer: Annotated[str, Field(min_length=1, max_length=512)]
    audiences: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(
        default_factory=list, description="accepted `aud` values; empty accepts any"
    )
    jwks: Jwks | None = Field(None, description="inline JWKS (JSON text)")
    jwksUri: JwksUri | None = Field(None, description="fetched by Envoy through a cluster")
    fromHeaders: list[JwtHeader] = Field(
        default_factory=lambda: [JwtHeader(name="authorization", prefix="Bearer ")]
    )
    fromParams: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")]] = Field(
        default_factory=list
    )
    outputClaimToHeaders: list[ClaimToHeader] = Field(default_factory=list)
    forwardOriginalToken: bool = False
    clockSkew: Duration = Field(timedelta(seconds=60), description="allowed leeway for exp/nbf")
    requireExpiration: bool = Field(
        True,
        description="refuse tokens without `exp` (401); false only for an issuer that cannot set"
        " one, whose tokens must then be revocable some other way (rotate its keys)",
    )
    maxLifetime: Duration | None = Field(
        None,
        description="refuse tokens whose `exp - iat` (without `iat`: `exp - now`) exceeds this",
    )

    @model_validator(mode="after")
    def _source(self) -> Self:
        _exactly_one(self, ("jwks", "jwksUri"))
        if not timedelta(0) <= self.clockSkew <= timedelta(minutes=10):
            raise ValueError("clockSkew must be between 0s and 10m")
        if self.maxLifetime is not None:
            if not timedelta(seconds=1) <= self.maxLifetime <= MAX_DURATION:
                raise ValueError("maxLifetime must be between 1s and 365 days (8760h)")
            if not self.requireExpiration:
                raise ValueError(
                    "maxLifetime bounds exp - iat: it needs requireExpiration (a token without"
                    " exp has no lifetime to bound)"
                )
        return self


class RequestAuthenticationSpec(Strict):
    selector: WorkloadSelector | None = None
    jwtRules: Annotated[list[JwtRule], Field(min_length=1, max_length=16)]


class RequestAuthentication(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["RequestAuthentication"]
    metadata: ObjectMeta
    spec: RequestAuthenticationSpec


class Source(Strict):
    principals: list[Principal] = Field(default_factory=list)
    notPrincipals: list[Principal] = Field(default_factory=list)
    namespaces: list[NamespaceMatch] = Field(default_factory=list)
    notNamespaces: list[NamespaceMatch] = Field(default_factory=list)
    requestPrincipals: list[RequestPrincipal] = Field(default_factory=list)
    notRequestPrincipals: list[RequestPrincipal] = Field(default_factory=list)


class From(Strict):
    source: Source


class Operation(Strict):
    paths: list[PathPattern] = Field(default_factory=list)
    notPaths: list[PathPattern] = Field(default_factory=list)
    methods: list[Method] = Field(default_factory=list)
    notMethods: list[Method] = Field(default_factory=list)


class To(Strict):
    operation: Operation


class Condition(Strict):
    key: ConditionKey
    values: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list)
    notValues: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _some(self) -> Self:
        if not self.values and not self.notValues:
            raise ValueError("set values or notValues")
        return self


class Rule(Strict):
    from_: list[From] = Field(default_factory=list, alias="from")
    to: list[To] = Field(default_factory=list)
    when: list[Condition] = Field(default_factory=list)


class AuthorizationPolicySpec(Strict):
    selector: WorkloadSelector | None = None
    action: Literal["ALLOW", "DENY"] = "ALLOW"
    rules: list[Rule] = Field(
        default_factory=list,
        description="ALLOW with no rules allows nothing; a rule with no fields matches anything",
    )


class AuthorizationPolicy(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["AuthorizationPolicy"]
    metadata: ObjectMeta
    spec: AuthorizationPolicySpec


# ---------------------------------------------------------------- topology fallback


class OutlierDetection(Strict):
    """Passive health: eject an endpoint after consecutive failures (connection failures count
    as gateway errors and 5xx), like Istio's DestinationRule.outlierDetection."""

    consecutive5xxErrors: Annotated[int, Field(ge=0, le=1000)] = 5
    consecutiveGatewayErrors: Annotated[int, Field(ge=0, le=1000)] = 0
    interval: Duration = timedelta(seconds=1)
    baseEjectionTime: Duration = timedelta(seconds=30)
    maxEjectionPercent: Annotated[int, Field(ge=0, le=100)] = 100

    @model_validator(mode="after")
    def _sane(self) -> Self:
        if self.interval <= timedelta(0) or self.baseEjectionTime <= timedelta(0):
            raise ValueError("interval and baseEjectionTime must be positive")
        if self.consecutive5xxErrors == 0 and self.consecutiveGatewayErrors == 0:
            raise ValueError("set consecutive5xxErrors or consecutiveGatewayErrors above 0")
        return self


class CircuitBreakers(Strict):
    maxConnections: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    maxPendingRequests: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    maxRequests: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    maxRetries: Annotated[int, Field(ge=0, le=1_000_000)] | None = None


class RetryBudget(Strict):
    """Retries may add at most `percent` of active requests (Envoy's retry budget)."""

    percent: Annotated[float, Field(gt=0, le=100)] = 20.0
    minRetryConcurrency: Annotated[int, Field(ge=0, le=10_000)] = 3


class HealthCheck(Strict):
    """Active HTTP health checks."""

    path: HttpPath = "/"
    interval: Duration = timedelta(seconds=1)
    timeout: Duration = timedelta(milliseconds=500)
    unhealthyThreshold: Annotated[int, Field(ge=1, le=100)] = 2
    healthyThreshold: Annotated[int, Field(ge=1, le=100)] = 1

    @model_validator(mode="after")
    def _sane(self) -> Self:
        if self.interval <= timedelta(0) or self.timeout <= timedelta(0):
            raise ValueError("interval and timeout must be positive")
        return self


class RegionFailover(Strict):
    from_: LocalityName = Field(alias="from")
    to: LocalityName

    @model_validator(mode="after")
    def _elsewhere(self) -> Self:
        # the region's own endpoints come first anyway; Istio refuses it (and the whole
        # DestinationRule with it)
        if self.from_ == self.to:
            raise ValueError(f"region {self.to!r} cannot fail over to itself")
        return self


class LocalityLb(Strict):
    """Prefer endpoints near the calling proxy: same node, then zone, then region, then the
    `failover` region, then anywhere (EDS priorities)."""

    enabled: bool = True
    failover: list[RegionFailover] = Field(default_factory=list)


class DriftBreaker(Strict):
    """Trips a route to its fallback chain when its latency drifts above its own baseline."""

    threshold: Annotated[float, Field(gt=0, le=1000)] = Field(
        40.0, description="percent above the baseline p95 that trips the breaker"
    )
    minIncrease: Duration = Field(
        timedelta(milliseconds=10),
        description="the p95 must also rise by at least this much: at a 2 ms baseline, +40% "
        "is noise (a retry, a new connection), not a degraded model",
    )
    minSamples: Annotated[int, Field(ge=5, le=100_000)] = 20
    window: Duration = Field(timedelta(seconds=3), description="recent samples compared")
    baselineWindow: Duration = Field(timedelta(seconds=60), description="what normal looks like")
    coldStartBaseline: Duration | None = Field(
        None, description="baseline p95 to assume until the baseline has minSamples"
    )
    recoverAfter: Duration = Field(
        timedelta(seconds=5), description="sustained healthy time before traffic returns"
    )
    probePercent: Annotated[int, Field(ge=1, le=50)] = Field(
        5, description="traffic still sent to the primary while tripped, to see it recover"
    )

    @model_validator(mode="after")
    def _windows(self) -> Self:
        if self.window <= timedelta(0) or self.recoverAfter <= timedelta(0):
            raise ValueError("window and recoverAfter must be positive")
        if self.baselineWindow < self.window:
            raise ValueError("baselineWindow must not be shorter than window")
        return self


class FallbackPolicySpec(Strict):
    service: Name = Field(description="the primary service, in this namespace")
    locality: LocalityLb | None = None
    outlierDetection: OutlierDetection | None = None
    circuitBreakers: CircuitBreakers | None = None
    retryBudget: RetryBudget | None = None
    healthCheck: HealthCheck | None = None
    chain: Annotated[list[Name], Field(max_length=16)] = Field(
        default_factory=list,
        description="services tried in order when the primary has no healthy endpoint",
    )
    maxFallbackDepth: Annotated[int, Field(ge=1, le=16)] = 3
    driftBreaker: DriftBreaker | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.service in self.chain:
            raise ValueError(f"the chain contains the primary service {self.service!r} itself")
        if len(set(self.chain)) != len(self.chain):
            raise ValueError("the chain names a service twice")
        if self.driftBreaker is not None and not self.chain:
            raise ValueError("driftBreaker needs a chain to send traffic to")
        if (
            self.locality is not None
            and self.locality.enabled
            and self.outlierDetection is None
            and self.healthCheck is None
        ):
            raise ValueError(
                "locality failover needs outlierDetection or healthCheck: without them Envoy "
                "never sees the local endpoints fail"
            )
        return self


class FallbackPolicy(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["FallbackPolicy"]
    metadata: ObjectMeta
    spec: FallbackPolicySpec


# ---------------------------------------------------------------- functions


class EgressPeer(Strict):
    """A peer a function may reach: a Service of the mesh, on the addresses and ports it is
    reached at (each endpoint's sidecar where it has one: the mesh's way in, mTLS and all)."""

    service: ObjectRef = Field(description='"name" (this namespace) or "namespace/name"')


class FunctionSpec(FunctionSettings):
    """A model function served over KServe v2 at /v2/models/{metadata.name} by the inference
    backend running on the endpoints of `backend` (and of the services in its fallback chain).
    The serving settings are the backend's own schema (meshfn.contracts.function)."""

    backend: Name = Field(description="the Service (this namespace) whose endpoints serve it")
    gateway: ObjectRef | None = Field(None, description="like Route.spec.gateway")
    egress: Annotated[list[EgressPeer], Field(max_length=64)] = Field(
        default_factory=list,
        description="what the function may connect to beyond its backend, which is nothing by "
        "default: its backend's processes may then open connections to these peers (Landlock's "
        "TCP ports and the eBPF egress control's addresses let them through; every other "
        "connection stays refused)",
    )


class Function(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["Function"]
    metadata: ObjectMeta
    spec: FunctionSpec


# ---------------------------------------------------------------- multi-tenant QoS


class TargetRef(Strict):
    """What a QoSPolicy binds: a whole Gateway, one Route or one Function."""

    kind: Literal["Gateway", "Route", "Function"]
    name: ObjectRef = Field(description='"name" (the policy\'s namespace) or "namespace/name"')


class GlobalRate(Strict):
    """The policy's rates counted once across every gateway it reaches, by the control plane's
    rate-limit service (Envoy's RLS protocol), instead of by each gateway alone."""

    onLimitServiceError: Literal["allow", "deny"] = Field(
        description="when the limit service cannot answer in time: `allow` admits the request "
        "(fail open), `deny` refuses it with 503 (fail closed)"
    )
    timeout: Duration = Field(
        timedelta(milliseconds=100),
        description="how long a gateway waits for the limit service (then onLimitServiceError)",
    )

    @model_validator(mode="after")
    def _sane(self) -> Self:
        if not timedelta(milliseconds=1) <= self.timeout <= timedelta(seconds=5):
            raise ValueError("timeout must be between 1ms and 5s: requests must never hang")
        return self


class QoSPolicySpec(TenantClasses):
    """Per-tenant limits and priorities for the requests of what `targetRefs` names. Tenants
    are told apart by a JWT claim the gateway verified (RequestAuthentication), never by a
    header. Rate limits hold at each gateway (Envoy's local rate limit), or with `global` across
    all bound gateways (the control plane's rate-limit service); concurrency limits and
    compute budgets are kept, and priorities order and shed requests, by the inference backend
    that serves the bound functions (per backend process)."""

    targetRefs: Annotated[list[TargetRef], Field(min_length=1, max_length=64)]
    global_: GlobalRate | None = Field(
        None,
        alias="global",
        description="count the rates across all gateways (the control plane's limit service); "
        "default: each gateway counts alone",
    )
    gatewayShedding: GatewayShedding | None = Field(
        None,
        description="shed the lower priorities at the gateway (Envoy route priorities and "
        "per-priority circuit breakers) before they reach the backend; default: the backend "
        "sheds them",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        # Replaces TenantClasses' check: the reference checks report each problem at its own
        # line (references._check_qos), not all at `spec:`.
        return self


class QoSPolicy(Strict):
    apiVersion: Literal["meshfn.io/v1alpha1"]
    kind: Literal["QoSPolicy"]
    metadata: ObjectMeta
    spec: QoSPolicySpec


PolicyObject = (
    Mesh
    | Gateway
    | Service
    | Route
    | PeerAuthentication
    | RequestAuthentication
    | AuthorizationPolicy
    | FallbackPolicy
    | Function
    | QoSPolicy
)

KINDS: dict[str, type[PolicyObject]] = {
    "Mesh": Mesh,
    "Gateway": Gateway,
    "Service": Service,
    "Route": Route,
    "PeerAuthentication": PeerAuthentication,
    "RequestAuthentication": RequestAuthentication,
    "AuthorizationPolicy": AuthorizationPolicy,
    "FallbackPolicy": FallbackPolicy,
    "Function": Function,
    "QoSPolicy": QoSPolicy,
}
