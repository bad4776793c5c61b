"""The console's view of the mesh: typed, plain data built from the ControlPlane's read APIs
and the console sources. Templates see only these objects (no ControlPlane, no dicts from
internals), so what a panel can show is decided here, in one place.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshfn import ir
from meshfn.audit.store import StoreError
from meshfn.health.drift import RouteDrift
from meshfn.xds.names import SHORT_NAMES, cluster_name, primary_clusters
from meshfn.xds.status import ProxyStatus, TypeStatus

from ...service import ControlPlane, ReloadEvent
from ..hints import describe_match
from .graph import ProxyStats, ServiceGraph, build_graph
from .sources import AuditQuery, ConsoleSources, HostHealth

XDS_TYPES = ("clusters", "endpoints", "listeners", "routes", "secrets", "extension_configs")


# ------------------------------------------------------------------ topology


@dataclass(frozen=True)
class EndpointView:
    address: str
    port: int  # where the gateway sends traffic (the sidecar's port when there is one)
    app_port: int
    locality: str
    weight: int
    health: str  # healthy | unhealthy | unknown
    detail: str  # why: Envoy's health flags, or why health is unknown
    priority: int | None


@dataclass(frozen=True)
class ServiceView:
    key: str
    protocol: str
    endpoints: tuple[EndpointView, ...]
    chain: tuple[str, ...]  # the service, then its fallback chain
    serving: str  # which tier serves now, in words
    serving_key: str | None  # the chain member that serves now (None: unknown or nothing)
    guarded: bool  # has a drift breaker


@dataclass(frozen=True)
class RouteView:
    key: str
    listener: str
    matches: tuple[str, ...]
    service: ServiceView
    degraded: bool


@dataclass(frozen=True)
class GatewayView:
    key: str
    node: str
    locality: str
    routes: tuple[RouteView, ...]
    services: tuple[ServiceView, ...]  # each service its routes reach, once
    health_error: str | None


@dataclass(frozen=True)
class AccelerationView:
    mode: str
    attached: bool
    reason: str
    counters: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class TopologyView:
    gateways: tuple[GatewayView, ...]
    acceleration: AccelerationView | None


def _locality(loc: ir.Locality) -> str:
    return "/".join(p for p in (loc.region, loc.zone, loc.sub_zone) if p) or "-"


def _hosts(
    clusters: Mapping[str, list[HostHealth]] | None, service: ir.Service
) -> dict[tuple[str, int], HostHealth]:
    """A service's hosts at a gateway: from its priority-tier clusters where it has them (they
    carry a fallback chain's traffic, with their own outlier state), else its own cluster; a
    host unhealthy in any of them counts as unhealthy."""
    if clusters is None:
        return {}
    out: dict[tuple[str, int], HostHealth] = {}
    for name in sorted(primary_clusters(service.key)):
        for host in clusters.get(name, []):
            priority = host.priority
            if name != cluster_name(service.key):
                priority = int(name.rsplit("|p", 1)[1])
            seen = out.get((host.address, host.port))
            if seen is None or (seen.healthy and not host.healthy):
                out[(host.address, host.port)] = HostHealth(
                    host.address, host.port, host.healthy, host.flags, priority
                )
    return out


def _service_view(
    model: ir.MeshModel,
    service: ir.Service,
    clusters: Mapping[str, list[HostHealth]] | None,
    why_unknown: str | None,
    degraded: bool,
) -> ServiceView:
    hosts = _hosts(clusters, service)
    endpoints = []
    for e in service.endpoints:
        port = e.sidecar_port or e.port
        host = hosts.get((e.address, port))
        if host is None:
            health, detail, priority = (
                "unknown",
                why_unknown or "not in the gateway's clusters",
                None,
            )
        else:
            health = "healthy" if host.healthy else "unhealthy"
            detail, priority = ", ".join(host.flags), host.priority
        endpoints.append(
            EndpointView(
                e.address, port, e.port, _locality(e.locality), e.weight, health, detail, priority
            )
        )
    chain = (service.key, *service.fallback)
    serving, serving_key = _serving(model, service, clusters, why_unknown, degraded, endpoints)
    return ServiceView(
        service.key,
        service.protocol,
        tuple(endpoints),
        chain,
        serving,
        serving_key,
        service.drift is not None,
    )


def _serving(
    model: ir.MeshModel,
    service: ir.Service,
    clusters: Mapping[str, list[HostHealth]] | None,
    why_unknown: str | None,
    degraded: bool,
    endpoints: Sequence[EndpointView],
) -> tuple[str, str | None]:
    """Which member of the chain (and which priority tier of it) takes requests now."""
    if clusters is None:
        return f"unknown ({why_unknown or 'no health data'})", None
    healthy = [e for e in endpoints if e.health == "healthy"]
    fallbacks = [model.service(key) for key in service.fallback]
    if not degraded and healthy:
        tier = min(e.priority or 0 for e in healthy)
        return f"{service.key}, priority {tier}", service.key
    for member in fallbacks:
        if any(h.healthy for h in _hosts(clusters, member).values()):
            why = "drift breaker tripped" if degraded else "no healthy endpoint"
            return f"fallback {member.key} ({why})", member.key
    if degraded and healthy:  # nothing to fall back to: the breaker's probes keep it
        return f"{service.key} (degraded, no healthy fallback)", service.key
    return "nothing healthy: the gateway answers 503", None


def topology(cp: ControlPlane, sources: ConsoleSources) -> TopologyView:
    model = cp.model
    if model is None:
        return TopologyView((), None)
    degraded = cp.drift.degraded()
    gateways = []
    for workload in model.workloads:
        if workload.kind != "gateway":
            continue
        clusters: dict[str, list[HostHealth]] | None = None
        why: str | None = "gateway health is not polled here"
        if sources.health is not None:
            clusters, why = sources.health.clusters(workload.node_cluster)
        services: dict[str, ServiceView] = {}
        routes = []
        for listener in workload.listeners:
            for route in listener.routes:
                service = model.service(route.service)
                is_degraded = route.key in degraded
                view = services.get(service.key + str(is_degraded))
                if view is None:
                    view = _service_view(model, service, clusters, why, is_degraded)
                    services[service.key + str(is_degraded)] = view
                routes.append(
                    RouteView(
                        route.key,
                        f"{listener.name} :{listener.port}",
                        tuple(describe_match(m).plain for m in route.matches),
                        view,
                        is_degraded,
                    )
                )
        gateways.append(
            GatewayView(
                workload.key,
                workload.node_cluster,
                _locality(workload.locality),
                tuple(routes),
                tuple(services.values()),
                why if clusters is None else None,
            )
        )
    acceleration = None
    if sources.acceleration is not None:
        doc = sources.acceleration()
        counters = doc.get("counters") or {}
        acceleration = AccelerationView(
            str(doc.get("mode", "off")),
            bool(doc.get("attached")),
            str(doc.get("reason", "")),
            tuple(sorted((str(k), int(v)) for k, v in counters.items())),
        )
    elif model.acceleration != "off":
        acceleration = AccelerationView(model.acceleration, False, "not run by this process", ())
    return TopologyView(tuple(gateways), acceleration)


# ------------------------------------------------------------------ proxies


@dataclass(frozen=True)
class TypeView:
    name: str
    state: str  # SYNCED | STALE | NACKED | NOT SENT
    acked: str
    sent: str
    resources: int


@dataclass(frozen=True)
class NackView:
    type_name: str
    version: str
    error: str
    at: float
    current: bool  # the version sent now is the one refused (else a later one was taken)


@dataclass(frozen=True)
class ProxyView:
    node: str
    workload: str
    known: bool
    protocol: str
    connected_at: float
    types: tuple[TypeView, ...]
    nacks: tuple[NackView, ...]
    cert_expires: dt.datetime | None

    @property
    def cert_left(self) -> str:
        if self.cert_expires is None:
            return "-"
        left = (self.cert_expires - dt.datetime.now(dt.UTC)).total_seconds()
        if left <= 0:
            return "expired"
        return f"{int(left // 60)} min" if left < 7200 else f"{left / 3600:.1f} h"


def type_state(status: TypeStatus | None) -> str:
    """The word `meshfn status` shows for one type (a NACK of the version sent wins)."""
    if status is None or not status.sent_version:
        return "NOT SENT"
    nack = status.last_nack
    if nack is not None and nack.version == status.sent_version:
        return "NACKED"
    return "SYNCED" if status.sent_version == status.acked_version else "STALE"


def _by_name(status: ProxyStatus) -> dict[str, TypeStatus]:
    return {SHORT_NAMES.get(t, t): s for t, s in status.types.items()}


def _proxy_view(cp: ControlPlane, status: ProxyStatus, columns: Sequence[str]) -> ProxyView:
    by_name = _by_name(status)
    types = tuple(
        TypeView(
            name,
            type_state(s),
            s.acked_version[:8] if s else "",
            s.sent_version[:8] if s else "",
            s.resources if s else 0,
        )
        for name in columns
        for s in [by_name.get(name)]
    )
    nacks = tuple(
        NackView(
            name,
            s.last_nack.version[:8],
            s.last_nack.error,
            s.last_nack.at,
            s.last_nack.version == s.sent_version,
        )
        for name, s in sorted(by_name.items())
        if s.last_nack is not None
    )
    return ProxyView(
        status.node_id,
        status.group,
        cp.cache.get(status.group) is not None,
        status.protocol,
        status.connected_at,
        types,
        nacks,
        cp.certificate_expiry(status.group),
    )


def proxies(cp: ControlPlane) -> tuple[ProxyView, ...]:
    """Every proxy, with one column per xDS type any of them uses (the same for all rows)."""
    statuses = cp.ads.statuses()
    used = {name for s in statuses for name in _by_name(s)}
    columns = [t for t in XDS_TYPES if t in used or t in XDS_TYPES[:4]]
    columns += sorted(used - set(columns))
    return tuple(_proxy_view(cp, s, columns) for s in statuses)


# ------------------------------------------------------------------ drift


def drift(cp: ControlPlane) -> tuple[RouteDrift, ...]:
    return tuple(cp.drift.views(time.monotonic()))


# ------------------------------------------------------------------ functions


@dataclass(frozen=True)
class FunctionView:
    name: str
    version: str
    kind: str
    state: str
    signature: str  # verified (key ...) | refused: reason
    signature_ok: bool
    pool: str  # idle/min..max
    inflight: int
    cold_starts: int
    code_cache_hits: int  # of cold_starts: code still deserialized (the backend's code cache)
    p50_ms: float | None
    p99_ms: float | None
    recent: int
    memory: str
    generation: GenerationView | None = None


@dataclass(frozen=True)
class GenerationView:
    """A generative function's recent streams (the backend's measures, OpenTelemetry GenAI
    names from contracts.genai)."""

    streams: int
    finished: str  # "12 stop, 3 length"
    prompt_tokens: int
    completion_tokens: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    streams_per_step: float | None


def _generation_view(doc: Mapping[str, Any] | None) -> GenerationView | None:
    if not doc:
        return None
    finished = doc.get("finished") or {}
    return GenerationView(
        streams=int(doc.get("active_streams") or 0),
        finished=", ".join(f"{n} {r}" for r, n in sorted(finished.items())) or "none yet",
        prompt_tokens=int(doc.get("prompt_tokens") or 0),
        completion_tokens=int(doc.get("completion_tokens") or 0),
        ttft_p50_ms=doc.get("ttft_p50_ms"),
        ttft_p99_ms=doc.get("ttft_p99_ms"),
        tpot_p50_ms=doc.get("tpot_p50_ms"),
        tpot_p99_ms=doc.get("tpot_p99_ms"),
        streams_per_step=doc.get("batched_tokens_ratio"),
    )


@dataclass(frozen=True)
class BackendView:
    service: str
    endpoint: str
    error: str | None
    rss_mib: float | None
    functions: tuple[FunctionView, ...]


def _function_view(doc: Mapping[str, Any]) -> FunctionView:
    signature = doc.get("signature") or {}
    pool = doc.get("pool") or {}
    ok = bool(signature.get("verified"))
    limit = int(doc.get("memory_limit_bytes") or 0) >> 20
    instances = int(doc.get("instances") or 0)
    return FunctionView(
        name=str(doc.get("name", "?")),
        version=str(doc.get("version", "?")),
        kind=str(doc.get("kind") or "-"),
        state=str(doc.get("state", "?")),
        signature=f"verified (key {signature.get('key_id')})"
        if ok
        else f"refused: {signature.get('error') or 'not verified'}",
        signature_ok=ok,
        pool=f"{pool.get('idle', 0)} idle (min {pool.get('min_idle', 0)}, max {pool.get('max_idle', 0)})",
        inflight=int(doc.get("inflight") or 0),
        cold_starts=int(doc.get("cold_starts") or 0),
        code_cache_hits=int(doc.get("code_cache_hits") or 0),
        p50_ms=doc.get("p50_ms"),
        p99_ms=doc.get("p99_ms"),
        recent=int(doc.get("recent_requests") or 0),
        memory=f"{instances} instance(s) x {limit} MiB max",
        generation=_generation_view(doc.get("generation")),
    )


def functions(sources: ConsoleSources) -> tuple[BackendView, ...] | None:
    if sources.functions is None:
        return None
    out = []
    for backend, fetched in sorted(
        sources.functions.latest.items(), key=lambda kv: (kv[0].service, kv[0].port)
    ):
        rss = fetched.document.get("rss_bytes")
        out.append(
            BackendView(
                backend.service,
                f"{backend.address}:{backend.port}",
                fetched.error,
                round(rss / (1 << 20), 1) if isinstance(rss, int) else None,
                tuple(_function_view(f) for f in fetched.document.get("functions") or []),
            )
        )
    return tuple(out)


# ------------------------------------------------------------------ audit


@dataclass(frozen=True)
class AuditRecordView:
    seq: int  # within its chain (one per journal)
    chain: str
    time: str
    method: str
    path: str
    status: str
    route: str
    principal: str
    subject: str
    tenant: str


@dataclass(frozen=True)
class AccessView:
    """One access to personal data (an access or erasure record of the control chain)."""

    seq: int
    time: str
    principal: str
    via: str
    action: str
    pseudonyms: str
    records: str


@dataclass(frozen=True)
class AuditView:
    enabled: bool
    store: str
    query: AuditQuery
    records: tuple[AuditRecordView, ...] = ()
    verified: str = ""  # one line: the chain's verification state
    verified_ok: bool | None = None
    problems: tuple[str, ...] = ()
    error: str | None = None
    reader: bool = False  # the viewer may see records (the auditor role)
    accesses: tuple[AccessView, ...] = ()  # who read personal data (auditors only)


def record_view(row: Mapping[str, Any]) -> AuditRecordView:
    def text(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else str(value)

    return AuditRecordView(
        seq=int(row.get("seq", 0)),
        chain=text("chain"),
        time=text("time"),
        method=text("method"),
        path=text("path"),
        status=text("status"),
        route=text("route"),
        principal=text("principal"),
        subject=(row.get("subject") or "-")[:16],
        tenant=text("tenant"),
    )


def _access(row: Mapping[str, Any]) -> AccessView:
    return AccessView(
        seq=int(row.get("seq", 0)),
        time=str(row.get("time") or "-"),
        principal=str(row.get("principal") or "-"),
        via=str(row.get("via") or "-"),
        action=str(row.get("action") or row.get("event") or "-"),
        pseudonyms=", ".join(str(p)[:16] for p in row.get("pseudonyms") or []) or "-",
        records=str(row.get("records", 0)),
    )


def audit(
    sources: ConsoleSources,
    query: AuditQuery,
    reader: bool = False,
    found: list[dict[str, Any]] | None = None,
) -> AuditView:
    """`reader`: records and the access list are shown (the auditor role); `found`: the rows
    of a query by subject, already looked up (and recorded) by the page's handler."""
    view = sources.audit
    path = view.path() if view is not None else None
    if view is None or path is None:
        return AuditView(False, "", query, reader=reader)
    error = view.error
    rows: list[dict[str, Any]] = []
    accesses: list[dict[str, Any]] = []
    try:
        if reader:
            rows = (found or []) if query.by_subject else view.records(query)
            accesses = view.accessed()
    except (StoreError, OSError, ValueError) as exc:
        rows, error = [], str(exc)
    check = view.verification
    problems: tuple[str, ...] = ()
    ok: bool | None = None
    if check is None:
        verified = "not verified yet"
    else:
        when = time.strftime("%H:%M:%S", time.localtime(check.at))
        verified = (
            f"chains intact: {check.records} record(s) in {check.chains} chain(s),"
            f" {check.checkpoints} signed checkpoint(s), {check.unsigned_tail} not yet signed,"
            f" witness agrees (verified {when})"
            if check.ok
            else f"TAMPERED: {len(check.problems)} problem(s) in {check.records} record(s)"
            f" (verified {when})"
        )
        ok, problems = check.ok, tuple(check.problems)
    return AuditView(
        True,
        str(path),
        query,
        tuple(record_view(r) for r in rows),
        verified,
        ok,
        problems,
        error,
        reader,
        tuple(_access(a) for a in accesses),
    )


# ------------------------------------------------------------------ rollouts


@dataclass(frozen=True)
class CheckView:
    name: str
    candidate: str
    limit: str
    stable: str
    samples: int
    verdict: str  # pass | breach | pending


@dataclass(frozen=True)
class RolloutView:
    """One rollout: where it is, each SLO check of its last evaluation against its limit, its
    history (newest first)."""

    key: str
    function: str
    stable: str
    candidate: str
    phase: str
    step: str  # "2 of 4: canary 25%"
    weights: str  # "stable 75%, candidate 25%" (and what is mirrored)
    progress: str  # answers and time against the step's minimums
    reason: str
    pinning: str
    checks: tuple[CheckView, ...]
    history: tuple[dict[str, Any], ...]


def _figure(unit: str, value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.2f} ms" if unit == "ms" else f"{value:.2%}"


def _rollout_view(doc: Mapping[str, Any]) -> RolloutView:
    steps = doc["steps"]
    step = steps[doc["step"] - 1]
    weights = f"stable {100 - doc['weight']}%, candidate {doc['weight']}%"
    if doc["mirror"]:
        weights += f"; {doc['mirror']}% mirrored to the candidate"
    pinning = doc.get("pinning") if doc.get("pinned") else None
    return RolloutView(
        key=doc["rollout"],
        function=doc["function"],
        stable=doc["stable"],
        candidate=doc["candidate"],
        phase=doc["phase"],
        step=f"{doc['step']} of {len(steps)}: {step['kind']} {step['percent']}%",
        weights=weights,
        progress=f"{doc['requests']} of {doc['min_requests']} answers, "
        f"{doc['step_elapsed_s']:.0f} of {doc['min_time_s']:.0f} s",
        reason=doc["reason"],
        pinning=f"{pinning['claim']}: stable {', '.join(pinning['stable']) or '-'}, candidate "
        f"{', '.join(pinning['candidate']) or '-'}"
        if pinning
        else "",
        checks=tuple(
            CheckView(
                c["name"],
                _figure(c["unit"], c["candidate"]),
                _figure(c["unit"], c["limit"]),
                _figure(c["unit"], c["stable"]),
                int(c["samples"]),
                c["verdict"],
            )
            for c in doc["checks"]
        ),
        history=tuple(reversed(doc["history"])),
    )


def rollouts(cp: ControlPlane) -> tuple[RolloutView, ...]:
    return tuple(_rollout_view(doc) for doc in cp.rollouts.document())


# ------------------------------------------------------------------ policy


@dataclass(frozen=True)
class PolicyView:
    source: str
    generation: int
    loaded_at: float
    errors: tuple[str, ...]  # the last change's errors while it stays rejected
    failed_at: float | None
    history: tuple[ReloadEvent, ...]


def policy(cp: ControlPlane) -> PolicyView:
    state = cp.state
    return PolicyView(
        str(cp.policies),
        state.generation,
        state.loaded_at,
        tuple(str(e) for e in state.errors),
        state.failed_at if state.errors else None,
        tuple(reversed(state.history)),
    )


# ------------------------------------------------------------------ all


@dataclass(frozen=True)
class ConsoleView:
    mesh: str
    now: float
    topology: TopologyView
    proxies: tuple[ProxyView, ...]
    drift: tuple[RouteDrift, ...]
    rollouts: tuple[RolloutView, ...]
    functions: tuple[BackendView, ...] | None
    audit: AuditView
    policy: PolicyView
    clock_offset: float = field(default=0.0)  # time.time() - time.monotonic()
    principal: str = ""  # who is signed in, with the role ("local:alice (auditor)")
    graph: ServiceGraph | None = None


def service_graph(
    cp: ControlPlane, sources: ConsoleSources, view: TopologyView
) -> ServiceGraph | None:
    """The service graph, where the proxies' statistics are read (meshfn up)."""
    model = cp.model
    if model is None or not isinstance(sources.proxies, ProxyStats):
        return None
    serving = {s.key: s.serving_key for g in view.gateways for s in g.services}
    return build_graph(
        model, sources.proxies.rates, sources.functions, cp.drift.degraded(), serving
    )


def build(
    cp: ControlPlane,
    sources: ConsoleSources,
    query: AuditQuery,
    reader: bool = False,
    found: list[dict[str, Any]] | None = None,
    principal: str = "",
) -> ConsoleView:
    """The whole view for one viewer: `reader` (the auditor role) sees the audit records,
    `found` are a query by subject's rows, `principal` names who is signed in."""
    seen = topology(cp, sources)
    return ConsoleView(
        mesh=cp.model.name if cp.model is not None else "",
        now=time.time(),
        topology=seen,
        proxies=proxies(cp),
        drift=drift(cp),
        rollouts=rollouts(cp),
        functions=functions(sources),
        audit=audit(sources, query, reader, found),
        policy=policy(cp),
        clock_offset=time.time() - time.monotonic(),
        principal=principal,
        graph=service_graph(cp, sources, seen),
    )
