"""meshfn.io/v1alpha1: the policy kinds users write.

Kubernetes-shaped (apiVersion, kind, metadata, spec) so the same models back the CRDs. Strict:
unknown fields and wrong types are errors, never coerced, because a typo that silently falls back to
a default is how meshes get opened up.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from meshfn.contracts.durations import MAX_DURATION, Duration
from meshfn.contracts.function import FUNCTION_VERSION, FunctionSettings, LayerMode
from meshfn.contracts.plugins import CALLER_PATTERN
from meshfn.contracts.principals import RequestPrincipal
from meshfn.contracts.qos import Claim, GatewayShedding, LoadBalancer, Tenant, TenantClasses
from meshfn.contracts.tracing import ALL_TAGS, ClientContext, TagName
from meshfn.contracts.words import OFF

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
    """The base of every policy model: unknown fields and wrong types are errors, never
    coerced, and a loaded object is frozen."""

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

API_VERSION_DOC = "The schema version of the document: always `meshfn.io/v1alpha1`."
METADATA_DOC = (
    "The object's name and namespace, and labels and annotations as on any Kubernetes object."
)


def _kept(what: str) -> Any:
    """Labels and annotations: kept as written on every kind, never acted on."""
    return Field(
        default_factory=dict,
        description=f"{what}, as on any Kubernetes object; meshfn keeps them and does not act on them.",
    )


class ObjectMeta(Strict):
    """Metadata of a namespaced policy object, as in Kubernetes."""

    name: Name = Field(
        description=(
            "The object's name, unique per kind in its namespace: a DNS label (lowercase letters,"
            " digits and '-', at most 63 characters)."
        )
    )
    namespace: Name = Field(
        "default",
        description=(
            "The namespace the object belongs to. A policy without a selector applies to the "
            "workloads of its own namespace, and references without a namespace resolve in it."
        ),
    )
    labels: dict[str, str] = _kept("Labels")
    annotations: dict[str, str] = _kept("Annotations")


class ClusterMeta(Strict):
    """Metadata of cluster-scoped kinds (Mesh): no namespace."""

    name: Name = Field(
        description=(
            "The mesh's name: a DNS label. It names the mesh-wide objects rendered for Istio "
            "(e.g. PeerAuthentication meshfn-<name>)."
        )
    )
    labels: dict[str, str] = _kept("Labels")
    annotations: dict[str, str] = _kept("Annotations")


class Locality(Strict):
    """Where an endpoint or proxy runs; `node` maps to Envoy's sub_zone."""

    region: LocalityName | None = Field(None, description="The region (Envoy's locality region).")
    zone: LocalityName | None = Field(None, description="The zone within the region; needs region.")
    node: LocalityName | None = Field(
        None, description="The node within the zone (Envoy's sub_zone); needs zone."
    )

    @model_validator(mode="after")
    def _nested(self) -> Self:
        if self.node is not None and self.zone is None:
            raise ValueError("locality.node needs locality.zone")
        if self.zone is not None and self.region is None:
            raise ValueError("locality.zone needs locality.region")
        return self


# ---------------------------------------------------------------- Mesh


class MeshPorts(Strict):
    """The control plane's listening ports. The ADS port also carries the SDS secrets, the
    access-log stream of the drift breaker and the rate-limit service of global QoS rates."""

    xds: Port = Field(18000, description="ADS (gRPC) port of the control plane, on loopback")
    admin: Port = Field(18001, description="control plane admin: /metrics, /debug/*")


MtlsMode = Literal["STRICT", "PERMISSIVE", "DISABLE"]


class MtlsSetting(Strict):
    """An mTLS mode."""

    mode: MtlsMode = Field(
        description=(
            "STRICT: only mTLS from a mesh identity is accepted; PERMISSIVE: mTLS or plaintext "
            "(while clients migrate); DISABLE: plaintext only, so authorization sees no caller "
            "identity (meshfn analyze reports it as MF0101)."
        )
    )


class Identity(Strict):
    """Workload certificates (SPIFFE X.509 SVIDs) issued by the mesh CA."""

    certificateTTL: Duration = Field(timedelta(hours=1), description="re-issued at half-life")


class BodyHashing(Strict):
    """Whether audit records carry a SHA-256 digest of each request body (never the body)."""

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
    bodyHash: BodyHashing = Field(
        default_factory=BodyHashing,
        description="Record a SHA-256 of request bodies (off by default).",
    )


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


Percent = Annotated[float, Field(ge=0, le=100)]
CollectorHost = Annotated[
    str,
    Field(
        pattern=r"^([a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*"
        r"|\[[0-9a-fA-F:.]+\])$",
        max_length=253,
    ),
]


class TracingCollector(Strict):
    """An OpenTelemetry collector that takes OTLP traces: Jaeger, Tempo, an OpenTelemetry
    Collector. Without one, `meshfn up` collects the spans itself."""

    protocol: Literal["grpc", "http"] = Field(
        "grpc",
        description="OTLP over gRPC (the TraceService), or OTLP over HTTP (protobuf POSTed to"
        " `path`)",
    )
    host: CollectorHost = Field(
        description="The collector's DNS name or IP address (an IPv6 address in brackets)."
    )
    port: Port = Field(description="Its OTLP port (conventionally 4317 for gRPC, 4318 for HTTP).")
    path: HttpPath = Field(
        "/v1/traces", description="OTLP over HTTP only: the path spans are POSTed to"
    )
    timeout: Duration = Field(
        timedelta(seconds=1),
        description="how long one export may take; a slow collector loses spans, never delays"
        " a request",
    )

    @model_validator(mode="after")
    def _timeout(self) -> Self:
        if not timedelta(milliseconds=10) <= self.timeout <= timedelta(seconds=60):
            raise ValueError("timeout must be between 10ms and 60s")
        return self


class Tracing(Strict):
    """Distributed tracing (OpenTelemetry): gateways, sidecars and inference backends report
    spans, W3C `traceparent` carries the trace from hop to hop."""

    sampling: Percent = Field(
        1.0,
        description="percent of requests that start a trace, in steps of 0.01 (a request that"
        " carries a parent's decision follows it; see clientContext)",
    )
    collector: TracingCollector | None = Field(
        None,
        description="where spans go; absent: meshfn up's embedded collector (on Kubernetes the"
        " Helm value tracing.collector)",
    )
    tags: Annotated[list[TagName], Field(max_length=4)] = Field(
        default_factory=lambda: list(ALL_TAGS),
        description="span attributes to add, each from verified data only, never a client"
        " header: tenant (the verified JWT claim tenantClaim), model (the function a route"
        " serves), route (the mesh route), principal (the caller's mTLS SPIFFE ID, at sidecars)",
    )
    tenantClaim: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")] = Field(
        "tenant", description="the verified JWT claim the tenant tag reads"
    )
    clientContext: ClientContext = Field(
        "restart",
        description="what a gateway does with a client's trace context (traceparent,"
        " tracestate, x-request-id and Envoy's force-trace headers): restart drops it and"
        " starts a new trace under the gateway's own sampling, so an untrusted client can"
        " neither force sampling nor join our trace to its own; honor continues the client's"
        " trace and keeps its sampled flag (a traced proxy you trust in front of the gateway)",
    )

    @model_validator(mode="after")
    def _unique_tags(self) -> Self:
        if len(set(self.tags)) != len(self.tags):
            raise ValueError("tags must not repeat")
        return self


class GatewayTracing(Strict):
    """One gateway's tracing, where it differs from the Mesh's."""

    sampling: Percent | None = Field(
        None, description="percent of this gateway's requests that start a trace"
    )
    clientContext: ClientContext | None = Field(
        None,
        description="restart or honor a client's trace context at this gateway (see the Mesh's"
        " tracing.clientContext)",
    )


class RouteTracing(Strict):
    """One route's tracing, where it differs from its gateway's."""

    sampling: Percent = Field(
        description="percent of this route's requests that start a trace (not on a gateway that"
        " honors client context: its sampler decides there)"
    )


class Sandbox(Strict):
    """How the kernel confines the inference backends `meshfn up` runs (docs/concepts/sandbox.md).
    Each layer: `auto` (on where the kernel allows it, otherwise off with the reason at start and
    in `meshfn status`), `required` (refuse to start without it) or `off`."""

    landlock: LayerMode = Field(
        "auto",
        description="filesystem (and, with Landlock ABI 4+, TCP ports): read the registry, keys, "
        "config and code only, write the backend's state directory only, execute nothing",
    )
    seccomp: LayerMode = Field(
        "auto",
        description="after start-up, a syscall allow-list; exec, ptrace, mount, bpf, keyring, "
        "process_vm_* and anonymous executable memory kill the process",
    )
    egress: LayerMode = Field(
        "auto",
        description="eBPF on the backend's cgroup: no outbound connection or datagram except to "
        "the peers its Functions name in spec.egress (needs root and bcc)",
    )


class MeshSpec(Strict):
    """Settings that hold for every workload of the mesh."""

    trustDomain: TrustDomain = Field(
        description=(
            "The SPIFFE trust domain: every workload's identity is "
            "spiffe://<trustDomain>/ns/<namespace>/sa/<serviceAccount>, and the mesh CA is kept "
            "per trust domain in the state directory (ca/<trustDomain>/)."
        )
    )
    ports: MeshPorts = Field(
        default_factory=MeshPorts,
        description="The control plane's ports on loopback (meshfn up and meshfn serve).",
    )
    mtls: MtlsSetting = Field(
        default_factory=lambda: MtlsSetting(mode="STRICT"),
        description="mesh-wide default for sidecars (Istio defaults to PERMISSIVE)",
    )
    identity: Identity = Field(
        default_factory=Identity, description="The workload certificates the mesh CA issues."
    )
    acceleration: Annotated[Literal["ebpf", "off", "auto"], OFF] = Field(
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
    tracing: Tracing | None = Field(
        None, description="distributed tracing (OpenTelemetry); absent: off"
    )

    @model_validator(mode="after")
    def _ttl(self) -> Self:
        ttl = self.identity.certificateTTL
        if not timedelta(seconds=10) <= ttl <= timedelta(days=30):
            raise ValueError("identity.certificateTTL must be between 10s and 30 days")
        return self


class Mesh(Strict):
    """Settings that hold for the whole mesh: the trust domain of its identities, the control
    plane's ports, the default mTLS mode, certificate lifetime, eBPF acceleration, the
    request audit trail, who may run degrade drills, and distributed tracing. One per mesh;
    cluster-scoped (no namespace)."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["Mesh"] = Field(description="The kind of policy document: always `Mesh`.")
    metadata: ClusterMeta = Field(
        description="The mesh's name (Meshes have no namespace), labels and annotations."
    )
    spec: MeshSpec = Field(description="The mesh-wide settings.")


# ---------------------------------------------------------------- Gateway


class GatewayListener(Strict):
    """One address and port a gateway accepts client requests on."""

    name: Name = Field(
        description="The listener's name: a Route can bind to it alone (spec.listener)."
    )
    port: Port = Field(description="The TCP port.")
    address: IPAddress = Field(
        "127.0.0.1",
        description="The IP address to bind; 127.0.0.1 accepts clients on this host only.",
    )
    protocol: Literal["http"] = Field(
        "http", description="Always http: HTTP/1.1, and HTTP/2 cleartext (gRPC) on the same port."
    )


class GatewaySpec(Strict):
    """An Envoy the mesh runs and configures: the entry point that clients call."""

    listeners: Annotated[list[GatewayListener], Field(min_length=1, max_length=64)] = Field(
        description=(
            "The addresses and ports the gateway accepts client requests on (1-64; names and "
            "ports unique)."
        )
    )
    adminPort: Port | None = Field(
        None,
        description=(
            "also serve the gateway Envoy's admin interface on this port of 127.0.0.1 (without"
            " it, only on a unix socket in the state directory). Unauthenticated: every local"
            " user can read its configuration, including its ADS token, and drain or stop it"
        ),
    )
    serviceAccount: Name | None = Field(None, description="identity; defaults to the name")
    locality: Locality | None = Field(
        None,
        description=(
            "Where the gateway runs: with FallbackPolicy.locality, endpoints near it are preferred."
        ),
    )
    xdsProtocol: Literal["delta", "sotw"] = Field(
        "delta", description="incremental (delta) or state-of-the-world ADS"
    )
    tracing: GatewayTracing | None = Field(
        None, description="this gateway's tracing, where it differs from the Mesh's"
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
    """An Envoy that the mesh runs for clients: the entry point whose listeners accept their
    requests and whose routes send them to services (rendered for Istio as a Gateway and
    VirtualServices)."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["Gateway"] = Field(description="The kind of policy document: always `Gateway`.")
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: GatewaySpec = Field(
        description="The gateway's listeners, locality and how it receives its configuration."
    )


# ---------------------------------------------------------------- Service


class Sidecar(Strict):
    """A server-side Envoy meshfn runs in front of this endpoint: mTLS, JWT and authorization
    are enforced there, and the gateways reach the endpoint only through it."""

    port: Port = Field(
        description=(
            "The port the sidecar listens on; gateways and other workloads reach the endpoint "
            "only through it."
        )
    )


class Endpoint(Strict):
    """One instance of a service."""

    address: IPAddress = Field(description="Its IPv4 or IPv6 address.")
    port: Port | None = Field(None, description="defaults to the service port")
    grpcPort: Port | None = Field(
        None,
        description="where the endpoint also speaks gRPC (HTTP/2), e.g. the inference backend's "
        "KServe GRPCInferenceService; its sidecar sends gRPC requests there",
    )
    weight: Annotated[int, Field(ge=1, le=10_000)] = Field(
        1,
        description=(
            "Its share of requests relative to the other endpoints of the same priority (1-10,000)."
        ),
    )
    locality: Locality | None = Field(
        None,
        description=(
            "Where it runs: with FallbackPolicy.locality, gateways prefer endpoints near them."
        ),
    )
    sidecar: Sidecar | None = Field(
        None,
        description=(
            "A sidecar Envoy that meshfn runs in front of this endpoint; either every endpoint of"
            " a service has one or none does."
        ),
    )


class ServiceSpec(Strict):
    """A service's port, protocol, endpoints and load balancing."""

    port: Port = Field(description="service port; endpoints without a port use it")
    protocol: Literal["http", "grpc"] = Field(
        "http",
        description=(
            "What the endpoints speak on their port: http (HTTP/1.1; add grpcPort for gRPC beside"
            " it) or grpc (HTTP/2)."
        ),
    )
    serviceAccount: Name | None = Field(None, description="identity; defaults to the name")
    connectTimeout: Duration = Field(
        timedelta(seconds=1), description="How long a proxy waits for a connection to an endpoint."
    )
    loadBalancer: LoadBalancer | None = Field(
        None,
        description="how a gateway picks an endpoint. weighted-round-robin: Envoy's "
        "client_side_weighted_round_robin, weighted by the load each endpoint reports (ORCA "
        "endpoint-load-metrics; the inference backend does); least-request; round-robin. "
        "Default: weighted-round-robin for a service that serves Functions (bench/qos.py: "
        "with a slow endpoint it beat least-request), else round-robin",
    )
    endpoints: Annotated[list[Endpoint], Field(max_length=10_000)] = Field(
        default_factory=list,
        description=(
            "The service's instances (at most 10,000). An empty list is allowed (in Kubernetes "
            "the Service of this name provides them), except for an external service."
        ),
    )
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
    """A set of endpoints that routes and fallback chains send requests to: their addresses,
    locality and weights, whether a sidecar Envoy guards each of them, and how a gateway
    balances load among them."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["Service"] = Field(description="The kind of policy document: always `Service`.")
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: ServiceSpec = Field(
        description="The service's port, protocol, endpoints and load balancing."
    )


# ---------------------------------------------------------------- Route


class PathMatch(Strict):
    """A condition on the request path (without the query string): exactly one of prefix, exact
    or regex. Paths are normalised before matching (percent-decoding, dot segments, merged
    slashes)."""

    prefix: HttpPath | None = Field(None, description="The path starts with this.")
    exact: HttpPath | None = Field(None, description="The path is exactly this.")
    regex: Regex | None = Field(
        None, description="An RE2 regular expression the whole path matches."
    )

    @model_validator(mode="after")
    def _one(self) -> Self:
        _exactly_one(self, ("prefix", "exact", "regex"))
        return self


class HeaderMatch(Strict):
    """A condition on one request header: exactly one of exact, prefix, regex or present."""

    name: HeaderName = Field(
        description=(
            "The header's name (pseudo-headers such as :authority allowed; match methods with "
            "`methods`, not :method)."
        )
    )
    exact: Annotated[str, Field(max_length=4096)] | None = Field(
        None, description="The header's value is exactly this."
    )
    prefix: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(
        None, description="The header's value starts with this."
    )
    regex: Regex | None = Field(
        None, description="An RE2 regular expression the whole value matches."
    )
    present: bool | None = Field(
        None,
        description=(
            "true: the header is present, with any value (absent is `present: true` with `invert:"
            " true`)."
        ),
    )
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
    """One way a request matches: its path, and every header condition and method given."""

    path: PathMatch = Field(
        default_factory=lambda: PathMatch(prefix="/"),
        description="The path condition; default: any path (prefix /).",
    )
    headers: Annotated[list[HeaderMatch], Field(max_length=32)] = Field(
        default_factory=list, description="Header conditions, all of which must hold (at most 32)."
    )
    methods: Annotated[list[Method], Field(max_length=9)] = Field(
        default_factory=list, description="HTTP methods, any of which matches; empty: any method."
    )


class Destination(Strict):
    """The service a route sends its requests to."""

    service: Name = Field(description="The Service's name.")
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
    """How a gateway retries a request that failed."""

    attempts: Annotated[int, Field(ge=0, le=10)] = Field(
        description="Retries after the first try (0-10)."
    )
    perTryTimeout: Duration | None = Field(
        None,
        description=(
            "The timeout of each try; without it one hung try uses up the route's whole timeout "
            "(meshfn analyze: MF0204)."
        ),
    )
    retryOn: Annotated[list[RetryOn], Field(min_length=1)] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_ON),
        description="The failures that are retried (Envoy's retry_on conditions).",
    )

    @model_validator(mode="after")
    def _positive(self) -> Self:
        if self.perTryTimeout is not None and self.perTryTimeout <= timedelta(0):
            raise ValueError("perTryTimeout must be positive")
        return self


class RouteSpec(Strict):
    """Which requests of which gateway go to which service, and how."""

    gateway: ObjectRef | None = Field(
        None,
        description='"name" or "namespace/name" of a Gateway; may be omitted when there is one',
    )
    listener: Name | None = Field(None, description="one listener of the gateway; default all")
    hosts: Annotated[list[Host], Field(min_length=1, max_length=64)] = Field(
        default_factory=lambda: ["*"],
        description=(
            "The host names (authority) the route answers: `*` any, `*.example.com` a suffix "
            "(1-64)."
        ),
    )
    matches: Annotated[list[RouteMatch], Field(min_length=1, max_length=64)] = Field(
        default_factory=lambda: [RouteMatch()],
        description=(
            "The ways a request can match; the route takes a request that any one of them matches"
            " (1-64)."
        ),
    )
    destination: Destination = Field(description="The service the requests go to.")
    timeout: Duration | None = Field(None, description='upstream timeout; "0s" disables it')
    retries: Retries | None = Field(
        None, description="How failed requests are retried; default: no retries."
    )
    tracing: RouteTracing | None = Field(
        None, description="this route's tracing, where it differs from its gateway's"
    )

    @model_validator(mode="after")
    def _timeouts(self) -> Self:
        if self.timeout is not None and self.timeout < timedelta(0):
            raise ValueError("timeout must not be negative")
        return self


class Route(Strict):
    """Which requests a gateway sends to a service: the gateway and listener, the hosts and
    matches that select requests, the destination, the timeout and the retries."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["Route"] = Field(description="The kind of policy document: always `Route`.")
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: RouteSpec = Field(description="What the route matches and where it sends requests.")


# ---------------------------------------------------------------- zero trust


class WorkloadSelector(Strict):
    """Selects one Service (its sidecars) or one Gateway in the policy's namespace; without a
    selector a policy applies to every such workload of its namespace."""

    service: Name | None = Field(
        None, description="A Service (its sidecars) in the policy's namespace."
    )
    gateway: Name | None = Field(None, description="A Gateway in the policy's namespace.")

    @model_validator(mode="after")
    def _one(self) -> Self:
        _exactly_one(self, ("service", "gateway"))
        return self


class PeerAuthenticationSpec(Strict):
    """The workloads selected and the mTLS mode they accept."""

    selector: WorkloadSelector | None = Field(
        None,
        description=(
            "The service whose sidecars the policy applies to; without it, every service of the "
            "namespace (a gateway cannot be selected)."
        ),
    )
    mtls: MtlsSetting | None = Field(
        None,
        description=(
            "The mode on every port not in portLevelMtls; without it the namespace's or the "
            "mesh's mode holds."
        ),
    )
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
    """Which mTLS mode the sidecars of a namespace's services, one service, or one of its ports
    accept (Istio's PeerAuthentication; meshfn defaults to STRICT)."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["PeerAuthentication"] = Field(
        description="The kind of policy document: always `PeerAuthentication`."
    )
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: PeerAuthenticationSpec = Field(
        description="The workloads selected and the mTLS mode they accept."
    )


class JwtHeader(Strict):
    """A request header that may carry the token."""

    name: HeaderName = Field(description="The header's name.")
    prefix: Annotated[str, Field(max_length=64)] = Field(
        "", description="The text before the token in its value, e.g. `Bearer `."
    )


class ClaimToHeader(Strict):
    # letters, digits and '-' (what Istio's validateJwtRule takes): every proxy drops headers
    # with underscores (contracts.proxy.REQUEST_HYGIENE), so such a claim header never arrives
    """A claim of the verified token copied into a request header."""

    header: Annotated[str, Field(pattern=r"^[-A-Za-z0-9]+$", min_length=1, max_length=256)] = Field(
        description=(
            "The header to write (letters, digits and '-': every proxy drops headers with "
            "underscores)."
        )
    )
    claim: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]+$", max_length=128)] = Field(
        description="The claim to copy."
    )


class JwtRule(Strict):
    """One trusted token issuer: its keys, the audiences accepted, where the token is found and
    which claims are passed on."""

    issuer: Annotated[str, Field(min_length=1, max_length=512)] = Field(
        description="The issuer (`iss` claim) whose tokens this rule verifies."
    )
    audiences: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(
        default_factory=list, description="accepted `aud` values; empty accepts any"
    )
    jwks: Jwks | None = Field(None, description="inline JWKS (JSON text)")
    jwksUri: JwksUri | None = Field(None, description="fetched by Envoy through a cluster")
    fromHeaders: list[JwtHeader] = Field(
        default_factory=lambda: [JwtHeader(name="authorization", prefix="Bearer ")],
        description="Headers the token may be in, each with the prefix before it.",
    )
    fromParams: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")]] = Field(
        default_factory=list, description="Query parameters the token may be in."
    )
    outputClaimToHeaders: list[ClaimToHeader] = Field(
        default_factory=list,
        description="Claims of a verified token copied into request headers for the upstream.",
    )
    forwardOriginalToken: bool = Field(
        False,
        description=(
            "Keep the token in the request sent upstream; default: it is removed once verified."
        ),
    )
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
    """The workloads selected and the token issuers they trust."""

    selector: WorkloadSelector | None = Field(
        None,
        description=(
            "The service (its sidecars) or gateway the policy applies to; without it, every "
            "workload of the namespace, gateways included."
        ),
    )
    jwtRules: Annotated[list[JwtRule], Field(min_length=1, max_length=16)] = Field(
        description=("The trusted issuers (1-16): a token is verified by the rule of its issuer.")
    )


class RequestAuthentication(Strict):
    """Which JWTs the selected workloads accept (Istio's RequestAuthentication): a request with
    an invalid token is refused (401), a request without a token is passed on for
    authorization to decide."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["RequestAuthentication"] = Field(
        description="The kind of policy document: always `RequestAuthentication`."
    )
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: RequestAuthenticationSpec = Field(
        description="The workloads selected and the token issuers they trust."
    )


class Source(Strict):
    """Caller identities: each non-empty field must match."""

    principals: list[Principal] = Field(
        default_factory=list,
        description=(
            "The mTLS peer's identity, any of: <trust-domain>/ns/<namespace>/sa/<account>, `*` "
            "(any authenticated peer), or a prefix* or *suffix."
        ),
    )
    notPrincipals: list[Principal] = Field(
        default_factory=list, description="The mTLS peer's identity is none of these."
    )
    namespaces: list[NamespaceMatch] = Field(
        default_factory=list,
        description=("The mTLS peer's namespace, any of these (`*` and a trailing `*` allowed)."),
    )
    notNamespaces: list[NamespaceMatch] = Field(
        default_factory=list, description="The mTLS peer's namespace is none of these."
    )
    requestPrincipals: list[RequestPrincipal] = Field(
        default_factory=list,
        description=(
            "The verified JWT's <iss>/<sub> (split at the last '/'), any of these; <iss>/* or * "
            "allowed."
        ),
    )
    notRequestPrincipals: list[RequestPrincipal] = Field(
        default_factory=list, description="The verified JWT's <iss>/<sub> is none of these."
    )


class From(Strict):
    """One caller condition of a rule."""

    source: Source = Field(description="The caller's identities.")


class Operation(Strict):
    """Request operations: each non-empty field must match."""

    paths: list[PathPattern] = Field(
        default_factory=list,
        description="The normalised request path, any of: exact, prefix*, *suffix or `*`.",
    )
    notPaths: list[PathPattern] = Field(
        default_factory=list, description="The path is none of these."
    )
    methods: list[Method] = Field(
        default_factory=list, description="The HTTP method, any of these."
    )
    notMethods: list[Method] = Field(
        default_factory=list, description="The HTTP method is none of these."
    )


class To(Strict):
    """One operation condition of a rule."""

    operation: Operation = Field(description="What is requested.")


class Condition(Strict):
    """A condition on one request attribute (Istio's `when`)."""

    key: ConditionKey = Field(
        description=(
            "The attribute: request.auth.claims[<claim>], request.auth.principal, "
            "request.auth.audiences, source.principal, source.namespace or "
            "request.headers[<name>]."
        )
    )
    values: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, description="The attribute has one of these values."
    )
    notValues: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, description="The attribute has none of these values."
    )

    @model_validator(mode="after")
    def _some(self) -> Self:
        if not self.values and not self.notValues:
            raise ValueError("set values or notValues")
        return self


class Rule(Strict):
    """Matches a request when each of its non-empty lists holds: one `from` entry, one `to`
    entry and every `when` condition."""

    from_: list[From] = Field(
        default_factory=list,
        alias="from",
        description=("Who the caller is (any entry matches); empty: any caller. Written `from`."),
    )
    to: list[To] = Field(
        default_factory=list,
        description="What is requested (any entry matches); empty: any request.",
    )
    when: list[Condition] = Field(
        default_factory=list,
        description="Conditions on request attributes, all of which must hold.",
    )


class AuthorizationPolicySpec(Strict):
    """The workloads selected, the action and the rules."""

    selector: WorkloadSelector | None = Field(
        None,
        description=(
            "The service (its sidecars) or gateway the policy applies to; without it, every "
            "workload of the namespace, gateways included."
        ),
    )
    action: Literal["ALLOW", "DENY"] = Field(
        "ALLOW", description="ALLOW or DENY the requests a rule matches."
    )
    rules: list[Rule] = Field(
        default_factory=list,
        description="ALLOW with no rules allows nothing; a rule with no fields matches anything",
    )


class AuthorizationPolicy(Strict):
    """Who may call the selected workloads and how (Istio's AuthorizationPolicy): DENY policies
    are evaluated first; once an ALLOW policy selects a workload, a request that no ALLOW
    rule matches gets 403."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["AuthorizationPolicy"] = Field(
        description="The kind of policy document: always `AuthorizationPolicy`."
    )
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: AuthorizationPolicySpec = Field(
        description="The workloads selected, the action and the rules."
    )


# ---------------------------------------------------------------- topology fallback


class OutlierDetection(Strict):
    """Passive health: eject an endpoint after consecutive failures (connection failures count
    as gateway errors and 5xx), like Istio's DestinationRule.outlierDetection."""

    consecutive5xxErrors: Annotated[int, Field(ge=0, le=1000)] = Field(
        5,
        description=(
            "5xx answers in a row (connection failures included) that eject an endpoint; 0: off."
        ),
    )
    consecutiveGatewayErrors: Annotated[int, Field(ge=0, le=1000)] = Field(
        0,
        description=(
            "502, 503 and 504 answers and connection failures in a row that eject an endpoint; 0:"
            " off."
        ),
    )
    interval: Duration = Field(
        timedelta(seconds=1), description="How often ejections are evaluated."
    )
    baseEjectionTime: Duration = Field(
        timedelta(seconds=30),
        description=(
            "How long an endpoint stays ejected the first time; each further ejection lasts longer."
        ),
    )
    maxEjectionPercent: Annotated[int, Field(ge=0, le=100)] = Field(
        100, description="The most endpoints ejected at once, in percent."
    )

    @model_validator(mode="after")
    def _sane(self) -> Self:
        if self.interval <= timedelta(0) or self.baseEjectionTime <= timedelta(0):
            raise ValueError("interval and baseEjectionTime must be positive")
        if self.consecutive5xxErrors == 0 and self.consecutiveGatewayErrors == 0:
            raise ValueError("set consecutive5xxErrors or consecutiveGatewayErrors above 0")
        return self


class CircuitBreakers(Strict):
    """Limits on what each proxy sends the service at once (Envoy's circuit breakers); beyond
    them requests fail at once with 503."""

    maxConnections: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        None, description="Connections to the service's endpoints."
    )
    maxPendingRequests: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        None, description="Requests waiting for a connection."
    )
    maxRequests: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        None, description="Requests in flight."
    )
    maxRetries: Annotated[int, Field(ge=0, le=1_000_000)] | None = Field(
        None, description="Retries in flight."
    )


class RetryBudget(Strict):
    """Retries may add at most `percent` of active requests (Envoy's retry budget)."""

    percent: Annotated[float, Field(gt=0, le=100)] = Field(
        20.0, description="Retries in flight, as a percent of the requests in flight."
    )
    minRetryConcurrency: Annotated[int, Field(ge=0, le=10_000)] = Field(
        3, description="Retries allowed in flight whatever the percent."
    )


class HealthCheck(Strict):
    """Active HTTP health checks."""

    path: HttpPath = Field(
        "/",
        description=(
            "The path each check requests (it crosses the sidecar's authorization like any "
            "request)."
        ),
    )
    interval: Duration = Field(timedelta(seconds=1), description="Time between checks.")
    timeout: Duration = Field(
        timedelta(milliseconds=500), description="How long one check may take."
    )
    unhealthyThreshold: Annotated[int, Field(ge=1, le=100)] = Field(
        2, description="Failed checks in a row that mark an endpoint unhealthy."
    )
    healthyThreshold: Annotated[int, Field(ge=1, le=100)] = Field(
        1, description="Passed checks in a row that mark it healthy again."
    )

    @model_validator(mode="after")
    def _sane(self) -> Self:
        if self.interval <= timedelta(0) or self.timeout <= timedelta(0):
            raise ValueError("interval and timeout must be positive")
        return self


class RegionFailover(Strict):
    """The region a region's requests fail over to."""

    from_: LocalityName = Field(
        alias="from", description="The region whose endpoints failed. Written `from`."
    )
    to: LocalityName = Field(description="The region tried next.")

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

    enabled: bool = Field(
        True, description="Prefer near endpoints; false turns the preference off."
    )
    failover: list[RegionFailover] = Field(
        default_factory=list,
        description=(
            "Where a region's requests go when its endpoints fail, before any other region."
        ),
    )


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
    minSamples: Annotated[int, Field(ge=5, le=100_000)] = Field(
        20,
        description=(
            "Answers a window needs before the breaker judges it (meshfn analyze checks it "
            "against live traffic: MF0202)."
        ),
    )
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
    streams: Literal["ttft", "itl"] = Field(
        "ttft",
        description="what drifts on the routes of generative Functions, whose whole duration "
        "measures how long an answer was, not how its backend does: ttft (time to the first "
        "byte from upstream: a stream's first token) or itl (inter-token latency: a stream's "
        "tokens after the first over the time they took, from the backend's usage record). "
        "Other routes drift on their duration",
    )

    @model_validator(mode="after")
    def _windows(self) -> Self:
        if self.window <= timedelta(0) or self.recoverAfter <= timedelta(0):
            raise ValueError("window and recoverAfter must be positive")
        if self.baselineWindow < self.window:
            raise ValueError("baselineWindow must not be shorter than window")
        return self


class FallbackPolicySpec(Strict):
    """The service this policy protects and how its requests fail over."""

    service: Name = Field(description="the primary service, in this namespace")
    locality: LocalityLb | None = Field(
        None,
        description=(
            "Prefer endpoints near the gateway and fail over by locality (needs outlierDetection "
            "or healthCheck to see endpoints fail)."
        ),
    )
    outlierDetection: OutlierDetection | None = Field(
        None, description="Eject endpoints that fail repeatedly (passive health)."
    )
    circuitBreakers: CircuitBreakers | None = Field(
        None, description="Caps on connections and requests in flight to the service."
    )
    retryBudget: RetryBudget | None = Field(
        None, description="Caps retries to a share of the requests in flight."
    )
    healthCheck: HealthCheck | None = Field(
        None, description="Active HTTP health checks of the endpoints."
    )
    chain: Annotated[list[Name], Field(max_length=16)] = Field(
        default_factory=list,
        description="services tried in order when the primary has no healthy endpoint",
    )
    maxFallbackDepth: Annotated[int, Field(ge=1, le=16)] = Field(
        3, description="How many services of the chain may be tried (1-16)."
    )
    driftBreaker: DriftBreaker | None = Field(
        None,
        description=(
            "Send the routes to this service down the chain while their latency drifts above its "
            "baseline (needs a chain)."
        ),
    )

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
    """How requests to a service survive failures: locality-aware failover, outlier detection,
    circuit breakers, a retry budget, active health checks, a chain of fallback services and
    the latency-drift breaker."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["FallbackPolicy"] = Field(
        description="The kind of policy document: always `FallbackPolicy`."
    )
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: FallbackPolicySpec = Field(
        description="The service this policy protects and how it fails over."
    )


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
    """A model function compiled to WebAssembly and served over the KServe v2 inference protocol
    (REST at /v2/models/{name}, and gRPC) by the inference backends running on a Service's
    endpoints."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["Function"] = Field(description="The kind of policy document: always `Function`.")
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: FunctionSpec = Field(
        description=(
            "Where the function is served and how (artifact, instances, limits, batching)."
        )
    )


# ---------------------------------------------------------------- multi-tenant QoS


class TargetRef(Strict):
    """What a QoSPolicy binds: a whole Gateway, one Route or one Function."""

    kind: Literal["Gateway", "Route", "Function"] = Field(
        description="The kind of object: Gateway, Route or Function."
    )
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

    targetRefs: Annotated[list[TargetRef], Field(min_length=1, max_length=64)] = Field(
        description=(
            "What the policy binds (1-64): Gateways, Routes or Functions. The most specific wins:"
            " a Route's or a Function's own policy replaces its gateway's for its requests."
        )
    )
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
    """Multi-tenant quality of service for the Gateways, Routes or Functions it targets:
    per-tenant request rates, concurrency, compute budgets and priorities, tenants told apart
    by a verified JWT claim."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["QoSPolicy"] = Field(
        description="The kind of policy document: always `QoSPolicy`."
    )
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: QoSPolicySpec = Field(
        description="What the policy targets, its tenant classes and their limits."
    )


# ---------------------------------------------------------------- rollouts

VersionName = Annotated[str, Field(pattern=FUNCTION_VERSION)]


def _percent(value: int) -> int:
    if value > 100:
        raise ValueError(f"{value} is over 100: a weight is a percentage of the requests")
    return value


# a share of a Function's requests, whole percent (tracing's sampling Percent is finer)
TrafficPercent = Annotated[int, Field(ge=1), AfterValidator(_percent)]


class RolloutStepSpec(Strict):
    """One canary step: the candidate's share of the Function's requests, held until enough
    of them were answered, long enough, with every SLO check passing."""

    weight: TrafficPercent = Field(
        description="percent of the requests answered by the candidate (1-100)"
    )
    minRequests: Annotated[int, Field(ge=1, le=100_000_000)] | None = Field(
        None, description="candidate answers the step needs; default: the strategy's minRequests"
    )
    minTime: Duration | None = Field(
        None, description="how long the step lasts at least; default: the strategy's minTime"
    )


class CanarySpec(Strict):
    """Weighted steps: a growing share of real requests answered by the candidate."""

    steps: Annotated[list[RolloutStepSpec], Field(min_length=1, max_length=32)] = Field(
        description="the steps, each a larger weight than the one before (e.g. 1, 5, 25, 50, "
        "100); after the last the candidate takes every request"
    )
    minRequests: Annotated[int, Field(ge=1, le=100_000_000)] = Field(
        100, description="candidate answers each step needs before it may pass"
    )
    minTime: Duration = Field(
        timedelta(seconds=30), description="how long each step lasts at least"
    )


class ShadowSpec(Strict):
    """A first step that takes no real traffic: a share of the requests is copied to the
    candidate, whose answers are compared with the stable version's and then discarded."""

    percent: TrafficPercent = Field(
        description="percent of the requests copied to the candidate (1-100)"
    )
    minRequests: Annotated[int, Field(ge=1, le=100_000_000)] = Field(
        100, description="compared answers the step needs before it may pass"
    )
    minTime: Duration = Field(timedelta(seconds=30), description="how long the step lasts at least")


class ErrorRatioSlo(Strict):
    """The candidate's share of failed answers (5xx, resets, timeouts)."""

    max: Annotated[float, Field(ge=0, le=1)] = Field(
        0.01, description="the most it may be (0.01: 1 in 100)"
    )
    maxIncrease: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None,
        description="and at most this much above the stable version's in the same window; "
        "default: no relative check",
    )


class LatencySlo(Strict):
    """A latency percentile of the candidate: below a ceiling, or within a ratio of the
    stable version's over the same window."""

    percentile: Literal[95, 99] = Field(description="95 or 99")
    max: Duration | None = Field(None, description="the ceiling (set max or maxRatio)")
    maxRatio: Annotated[float, Field(ge=1, le=1000)] | None = Field(
        None, description="the most it may be as a multiple of the stable version's"
    )
    minIncrease: Duration = Field(
        timedelta(milliseconds=5),
        description="with maxRatio: a rise smaller than this is never a breach (at 2 ms, "
        "x1.5 is noise)",
    )

    @model_validator(mode="after")
    def _one(self) -> Self:
        _exactly_one(self, ("max", "maxRatio"))
        return self


class AgreementSlo(Strict):
    """Shadow steps: the candidate's answers compared with the stable version's on the same
    input. Labels (integers, strings, booleans) must be equal; numbers may differ by
    `tolerance`."""

    minRatio: Annotated[float, Field(gt=0, le=1)] = Field(
        0.99, description="the share of compared answers that must agree"
    )
    tolerance: Annotated[float, Field(ge=0, le=1e9)] = Field(
        0.0, description="the largest absolute difference between two numbers that agree"
    )


class RolloutSloSpec(Strict):
    """What each step checks, the candidate against the stable version over the same window."""

    errorRatio: ErrorRatioSlo = Field(
        default_factory=ErrorRatioSlo, description="The candidate's failed answers."
    )
    latency: Annotated[list[LatencySlo], Field(max_length=8)] = Field(
        default_factory=list, description="Latency percentiles, absolute or against stable."
    )
    agreement: AgreementSlo | None = Field(
        None, description="shadow steps: answers that must agree with the stable version's"
    )
    minSamples: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        20,
        description="candidate answers a check is judged on (it breaches sooner when the "
        "answers so far already break it)",
    )


class PinningSpec(Strict):
    """Tenants kept on one version for the whole rollout, told apart by a verified JWT claim
    (the gateway's RequestAuthentication), never by a header a client sends."""

    claim: Claim = Field("tenant", description="the verified claim naming the tenant")
    stable: Annotated[list[Tenant], Field(max_length=1000)] = Field(
        default_factory=list, description="tenants answered by the stable version throughout"
    )
    candidate: Annotated[list[Tenant], Field(max_length=1000)] = Field(
        default_factory=list, description="tenants answered by the candidate throughout"
    )


class RolloutSpec(Strict):
    """A Function's next version taking over from the one in service, step by step (a shadow
    step, then canary steps), each step judged against SLOs on what the gateways and the
    backend measure, rolled back or paused on a breach."""

    function: Name = Field(description="the Function (this namespace) rolled out")
    stable: VersionName = Field(
        description="the version in service (the Function's spec.version, if it sets one)"
    )
    candidate: VersionName = Field(description="the new version, published in the registry")
    shadow: ShadowSpec | None = Field(
        None, description="first mirror requests to the candidate; its answers are discarded"
    )
    canary: CanarySpec | None = Field(
        None, description="then weighted steps; without them a passed shadow step promotes"
    )
    slo: RolloutSloSpec = Field(
        default_factory=RolloutSloSpec, description="The checks of every step."
    )
    onBreach: Literal["rollback", "pause"] = Field(
        "rollback",
        description="rollback: every request back to the stable version at once; pause: hold "
        "the step as it is until a person decides (meshfn rollout promote|abort|resume)",
    )
    interval: Duration = Field(
        timedelta(seconds=10), description="how often the checks run (a breach acts at once)"
    )
    window: Duration = Field(
        timedelta(seconds=60),
        description="the most recent span of a step the checks look at",
    )
    noDataTimeout: Duration = Field(
        timedelta(minutes=5),
        description="a step without enough answers for this long follows onBreach (a step "
        "never passes without data)",
    )
    pinning: PinningSpec | None = Field(
        None, description="tenants kept on one version while the rollout runs"
    )

    @model_validator(mode="after")
    def _strategy(self) -> Self:
        if self.shadow is None and self.canary is None:
            raise ValueError("set shadow, canary or both (shadow runs first)")
        for name in ("interval", "window", "noDataTimeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        return self


class Rollout(Strict):
    """A new version of a Function rolled out on its SLOs: shadow traffic and canary steps,
    promoted when every step passes, rolled back (or paused) on a breach. The rollout
    controller of the control plane moves it; `meshfn rollout` shows and steers it."""

    apiVersion: Literal["meshfn.io/v1alpha1"] = Field(description=API_VERSION_DOC)
    kind: Literal["Rollout"] = Field(description="The kind of policy document: always `Rollout`.")
    metadata: ObjectMeta = Field(description=METADATA_DOC)
    spec: RolloutSpec = Field(description="The Function, its two versions, the steps and SLOs.")


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
    | Rollout
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
    "Rollout": Rollout,
}
