"""DestinationRule, ServiceEntry + WorkloadEntry, Gateway, VirtualService.

Where Istio's defaults differ from meshfn's, the value is written out: connect timeout (meshfn
1s, Istio 10s), route timeout (meshfn/Envoy 15s, Istio none), retries (meshfn none unless asked,
Istio 2), locality preference (meshfn only with `locality`, Istio whenever outlier detection is
on). Routes of one gateway listener and host go into ONE VirtualService in meshfn's precedence
order: Istio orders routes within an object, not across objects.
"""

from __future__ import annotations

import hashlib
import re
from ipaddress import ip_address

from meshfn import ir
from meshfn.contracts.plugins import ROUTING_HEADER
from meshfn.contracts.qos import ORCA_HEADERS
from meshfn.contracts.rollout import ROLLOUT_AUTHORITY, VERSION_HEADER
from meshfn.ir.routing import precedence
from meshfn.xds.names import degraded_route_name, route_name

from .core import (
    Context,
    Obj,
    Source,
    account,
    fallback_source,
    gateways,
    istio_duration,
    resource,
    rolled_out,
    route_source,
    service_source,
)
from .plugins import guarded

NETWORKING = "networking.istio.io/v1"
ENVOY_ROUTE_TIMEOUT = "15s"  # what an Envoy route without a timeout waits (meshfn's default)


def istio_cluster(ctx: Context, service: ir.Service, subset: str = "") -> str:
    """istiod's name for a service's outbound cluster (of one subset)."""
    return f"outbound|{service.port}|{subset}|{ctx.options.host(service.key)}"


def subset_name(version: str) -> str:
    """A Function version's DestinationRule subset: a DNS label naming it (with a digest of
    the version where the label had to change it, so two versions never share one)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", version.lower()).strip("-")[:40] or "x"
    name = f"version-{slug}"
    if slug != version:
        name += "-" + hashlib.sha256(version.encode()).hexdigest()[:6]
    return name


def rollout_source(rollout: ir.Rollout) -> Source:
    return Source("Rollout", rollout.namespace, rollout.name)


def _rollouts_served_by(ctx: Context, service: ir.Service) -> list[ir.Rollout]:
    """The rollouts of the Functions `service` serves (as their backend or in its chain)."""
    out = []
    for rollout in ctx.model.rollouts:
        function = ctx.model.function(rollout.function)
        assert function is not None
        backend = ctx.model.service(function.backend)
        if service.key in (backend.key, *backend.fallback):
            out.append(rollout)
    return out


def _subsets(ctx: Context, service: ir.Service) -> list[Obj]:
    """One subset per version of every rollout the service serves: all of its endpoints (each
    serves every version), under a name per version, so the gateway's clusters (and its
    access-log stream) tell the versions apart."""
    rollouts = _rollouts_served_by(ctx, service)
    versions = dict.fromkeys(v for r in rollouts for v in (r.stable, r.candidate))
    return [{"name": subset_name(v)} for v in versions]


def _mtls(service: ir.Service) -> str | None:
    modes = {e.mtls for e in service.endpoints if e.sidecar_port is not None}
    if not modes or len(modes) > 1:
        return None  # no sidecars (plaintext), or mixed: Istio's auto mTLS picks per endpoint
    return "DISABLE" if modes == {"DISABLE"} else "ISTIO_MUTUAL"


def destination_rules(ctx: Context) -> None:
    for service in ctx.model.services:
        connect = istio_duration(
            ctx, service.connect_timeout, service_source(service), ("spec", "connectTimeout")
        )
        policy: Obj = {"connectionPool": {"tcp": {"connectTimeout": connect}}}
        sources = [service_source(service)]
        traffic = service.traffic
        if traffic is not None:
            sources.append(fallback_source(service))
            _traffic(ctx, service, traffic, policy)
        if not service.external:
            for i, endpoint in enumerate(service.endpoints):
                if endpoint.weight != 1:
                    ctx.warn(
                        "endpoint-weight-ignored",
                        service_source(service),
                        ("spec", "endpoints", i, "weight"),
                        "a Kubernetes Service's endpoints are its pods, which Istio weighs "
                        "alike: the weight applies only to `external` endpoints (WorkloadEntry)",
                    )
        tls = _mtls(service)
        if tls is not None:
            policy["tls"] = {"mode": tls}
        _balancer(ctx, service, policy)
        _shedding(ctx, service)
        spec: Obj = {"host": ctx.options.host(service.key), "trafficPolicy": policy}
        # The Rollout is no owner of what it only adds to (subsets, weights): deleting it
        # would let the garbage collector edit the object's owners under meshfn's apply.
        subsets = _subsets(ctx, service)
        if subsets:
            spec["subsets"] = subsets
        ctx.emit(
            resource(NETWORKING, "DestinationRule", service.name, service.namespace, spec), *sources
        )


def _balancer(ctx: Context, service: ir.Service, policy: Obj) -> None:
    """Service.spec.loadBalancer: Istio's `simple`. Weighted round robin from ORCA reports has
    no Istio field: LEAST_REQUEST, the runner-up in bench/qos.py, stands in. That is a warning,
    except for a service that serves Functions, where weighted round robin is meshfn's default
    rather than the user's choice."""
    balancer = service.load_balancer
    if balancer is None:
        return
    if balancer == "weighted-round-robin" and not any(
        f.backend == service.key for f in ctx.model.functions
    ):
        ctx.warn(
            "load-balancer-wrr",
            service_source(service),
            ("spec", "loadBalancer"),
            "Istio's DestinationRule has no client-side weighted round robin (ORCA): rendered "
            "as LEAST_REQUEST",
        )
    simple = {
        "least-request": "LEAST_REQUEST",
        "weighted-round-robin": "LEAST_REQUEST",
        "round-robin": "ROUND_ROBIN",
    }[balancer]
    policy.setdefault("loadBalancer", {})["simple"] = simple


def _shedding(ctx: Context, service: ir.Service) -> None:
    """QoSPolicy.spec.gatewayShedding: a DestinationRule's connectionPool is one limit per
    cluster for every request, and a VirtualService route has no Envoy priority, so Istio cannot
    shed by class at the gateway: a warning; the backend still sheds by priority itself."""
    if service.shed is None:
        return
    for function in ctx.model.functions:
        if function.backend == service.key and function.qos is not None:
            namespace, name = function.qos.policy.split("/", 1)
            ctx.warn(
                "qos-gateway-shedding",
                Source("QoSPolicy", namespace, name),
                ("spec", "gatewayShedding"),
                f"Istio has no per-priority connection limits (a DestinationRule's connectionPool "
                f"holds one for every request to {service.key}) nor route priorities: the "
                "gateway does not shed by class; the inference backend sheds the lower "
                "priorities itself",
            )
            return


def _zero_ignored(ctx: Context, source: Source, path: tuple[str, ...], default: str) -> None:
    ctx.warn(
        "istio-ignores-zero",
        source,
        path,
        f"Istio applies this limit only above 0: 0 is left out, and Istio's default ({default}) "
        "holds",
    )


def _traffic(ctx: Context, service: ir.Service, traffic: ir.TrafficPolicy, policy: Obj) -> None:
    """FallbackPolicy: circuit breakers, retry budget, outlier detection, locality failover."""
    source = fallback_source(service)
    if traffic.breakers is not None:
        _breakers(ctx, source, traffic.breakers, policy)
    o = traffic.outlier
    if o is not None:
        at = ("spec", "outlierDetection")
        policy["outlierDetection"] = {
            "consecutive5xxErrors": o.consecutive_5xx,
            "consecutiveGatewayErrors": o.consecutive_gateway,
            "interval": istio_duration(ctx, o.interval, source, (*at, "interval")),
            "baseEjectionTime": istio_duration(
                ctx, o.base_ejection_time, source, (*at, "baseEjectionTime")
            ),
            "maxEjectionPercent": o.max_ejection_percent,
        }
    _locality_lb(ctx, source, traffic, policy)
    if traffic.health_check is not None:
        ctx.warn(
            "no-active-health-checks",
            source,
            ("spec", "healthCheck"),
            "Istio has no active upstream health checks; Kubernetes readiness probes (and "
            "outlierDetection) decide instead",
        )


def _breakers(ctx: Context, source: Source, b: ir.CircuitBreakers, policy: Obj) -> None:
    """Circuit breakers: the connection pool's limits, and the retry budget."""
    pool = policy["connectionPool"]
    if b.max_connections is not None:
        pool["tcp"]["maxConnections"] = b.max_connections
    http: Obj = {}
    if b.max_pending_requests is not None:
        http["http1MaxPendingRequests"] = b.max_pending_requests
    if b.max_requests is not None:
        http["http2MaxRequests"] = b.max_requests
    if b.max_retries:
        http["maxRetries"] = b.max_retries
    elif b.max_retries == 0:
        _zero_ignored(ctx, source, ("spec", "circuitBreakers", "maxRetries"), "unlimited")
    if http:
        pool["http"] = http
    if b.retry_budget_percent is not None:
        budget: Obj = {"percent": b.retry_budget_percent}
        if b.retry_budget_min_concurrency:
            budget["minRetryConcurrency"] = b.retry_budget_min_concurrency
        elif b.retry_budget_min_concurrency == 0:
            path = ("spec", "retryBudget", "minRetryConcurrency")
            _zero_ignored(ctx, source, path, "3")
        policy["retryBudget"] = budget


def _locality_lb(ctx: Context, source: Source, traffic: ir.TrafficPolicy, policy: Obj) -> None:
    """Locality failover, written out either way: Istio prefers localities whenever outlier
    detection is on, meshfn only when asked."""
    if traffic.locality_failover:
        setting: Obj = {"enabled": True}
        if traffic.failover_regions:
            setting["failover"] = [{"from": a, "to": b} for a, b in traffic.failover_regions]
        policy["loadBalancer"] = {"localityLbSetting": setting}
        if traffic.outlier is None:
            ctx.warn(
                "locality-needs-outlier-detection",
                source,
                ("spec", "locality"),
                "Istio applies locality failover only with outlierDetection; healthCheck alone "
                "does not enable it",
            )
    elif traffic.outlier is not None:
        policy["loadBalancer"] = {"localityLbSetting": {"enabled": False}}


# ---------------------------------------------------------------- outside Kubernetes


def _locality(loc: ir.Locality) -> str:
    return "/".join(p for p in (loc.region, loc.zone, loc.sub_zone) if p)


def service_entries(ctx: Context) -> None:
    """External services: a ServiceEntry selecting its WorkloadEntries (one per endpoint)."""
    for service in ctx.model.services:
        if not service.external:
            continue
        sidecars = service.has_sidecars
        port_name = service.protocol
        spec = {
            "hosts": [ctx.options.host(service.key)],
            "ports": [
                {"number": service.port, "name": port_name, "protocol": service.protocol.upper()}
            ],
            "location": "MESH_INTERNAL" if sidecars else "MESH_EXTERNAL",
            "resolution": "STATIC",
            "workloadSelector": {"labels": ctx.options.labels(service.name)},
        }
        ctx.emit(
            resource(NETWORKING, "ServiceEntry", service.name, service.namespace, spec),
            service_source(service),
        )


def workload_entries(ctx: Context) -> None:
    for service in ctx.model.services:
        if not service.external:
            continue
        for i, e in enumerate(service.endpoints):
            labels = ctx.options.labels(service.name)
            spec: Obj = {
                "address": e.address,
                "ports": {service.protocol: e.port},
                "weight": e.weight,
            }
            if e.sidecar_port is not None:
                # a sidecar (istio-proxy on the VM): mTLS to it, and its identity
                labels["security.istio.io/tlsMode"] = "istio"
                spec["serviceAccount"] = account(service.identity)
            spec["labels"] = labels
            if _locality(e.locality):
                spec["locality"] = _locality(e.locality)
            ctx.emit(
                resource(
                    NETWORKING, "WorkloadEntry", f"{service.name}-{i}", service.namespace, spec
                ),
                service_source(service),
            )


# ---------------------------------------------------------------- gateways and routes


def gateway_name(workload: ir.Workload, listener: ir.Listener) -> str:
    return f"{workload.name}-{listener.name}"


def gateway_resources(ctx: Context) -> None:
    """One Istio Gateway per meshfn gateway listener, so a Route bound to one listener binds to
    that listener only."""
    for gw in gateways(ctx.model):
        for listener in gw.listeners:
            hosts = sorted({h for r in listener.routes for h in r.hosts}) or ["*"]
            server: Obj = {
                "port": {"number": listener.port, "name": listener.name, "protocol": "HTTP"},
                "hosts": [f"./{h}" for h in hosts],
            }
            if not ip_address(listener.address).is_loopback:
                server["bind"] = listener.address
            spec = {"selector": ctx.options.labels(gw.name), "servers": [server]}
            ctx.emit(
                resource(NETWORKING, "Gateway", gateway_name(gw, listener), gw.namespace, spec),
                Source("Gateway", gw.namespace, gw.name),
            )


def _string(kind: str, value: str) -> Obj:
    return {kind: value}


def _match(match: ir.RouteMatch) -> Obj:
    out: Obj = {"uri": _string(match.path.kind, match.path.value)}
    headers: Obj = {}
    without: Obj = {}
    for h in match.headers:
        value = {} if h.kind == "present" else _string(h.kind, h.value)
        (without if h.invert else headers)[h.name] = value
    if headers:
        out["headers"] = headers
    if without:
        out["withoutHeaders"] = without
    if match.methods:
        methods = match.methods
        out["method"] = {"exact": methods[0]} if len(methods) == 1 else {"regex": "|".join(methods)}
    return out


def _retries(ctx: Context, route: ir.Route, target: ir.Service) -> Obj:
    if route.retries is None or route.retries.attempts == 0:
        # Nothing else beside it: istiod refuses a retry policy with attempts 0 (validateHTTPRetry)
        return {"attempts": 0}
    out: Obj = {"attempts": route.retries.attempts, "retryOn": ",".join(route.retries.retry_on)}
    if route.retries.per_try_timeout is not None:
        out["perTryTimeout"] = istio_duration(
            ctx,
            route.retries.per_try_timeout,
            route_source(ctx.model, route),
            ("spec", "retries", "perTryTimeout"),
        )
    if target.traffic is not None and target.traffic.locality_failover:
        out["retryRemoteLocalities"] = True
    return out


def _destination(
    ctx: Context,
    service: ir.Service,
    weight: int | None = None,
    grpc: bool = False,
    version: str | None = None,
) -> Obj:
    """A route destination; with `version`, that version's subset, and the header that tells
    the backend which version answers (contracts.rollout)."""
    port = (service.grpc_service_port if grpc else None) or service.port
    out: Obj = {"destination": {"host": ctx.options.host(service.key), "port": {"number": port}}}
    if version is not None:
        out["destination"]["subset"] = subset_name(version)
        out["headers"] = {"request": {"set": {VERSION_HEADER: version}}}
    if weight is not None:
        out["weight"] = weight
    return out


def _rollout_http(ctx: Context, route: ir.Route, index: int, rollout: ir.Rollout) -> list[Obj]:
    """A rolled-out Function's routes: its pinned tenants' (matched on the verified claim,
    which Istio's gateways read as `@request.auth.claims.<claim>`), then the split by weight,
    with the shadow step's mirror; every one with meshfn's authority (the backend's sign of a
    mirrored copy is its `-shadow` suffix)."""
    service = ctx.model.service(route.service)
    split = ctx.overlay.split(rollout)
    if service.fallback:
        ctx.warn(
            "rollout-fallback-chain",
            rollout_source(rollout),
            ("spec", "function"),
            f"in Istio the rollout's requests go to {service.key}'s versions only: its "
            "fallback chain (an EnvoyFilter aggregate of one cluster per service) and drift "
            "breaker take the Function's requests again once the Rollout is removed",
        )
    base = _http(ctx, route, index, twin=False)
    base["rewrite"] = {"authority": ROLLOUT_AUTHORITY}
    out = []
    pinning = rollout.pinning if split.pinned else None
    for tenants, version in (
        (pinning.stable if pinning else (), rollout.stable),
        (pinning.candidate if pinning else (), rollout.candidate),
    ):
        if not tenants:
            continue
        assert pinning is not None
        claim = f"@request.auth.claims.{pinning.claim}"
        matches = [
            {**_match(route.matches[index]), "headers": {claim: {"exact": tenant}}}
            for tenant in tenants
        ]
        destination = _destination(ctx, service, grpc=route.grpc, version=version)
        out.append({**base, "match": matches, "route": [destination]})
    split_route: Obj = {
        **base,
        "route": [
            _destination(ctx, service, 100 - split.weight, route.grpc, rollout.stable),
            _destination(ctx, service, split.weight, route.grpc, rollout.candidate),
        ],
    }
    if split.mirror:
        mirror = _destination(ctx, service, version=rollout.candidate)["destination"]
        split_route["mirror"] = mirror
        split_route["mirrorPercentage"] = {"value": float(split.mirror)}
    out.append(split_route)
    return out


def degraded_twin_in_vs(service: ir.Service) -> bool:
    """A degraded twin whose chain tail is one service is a plain weighted VirtualService route;
    a longer tail is an aggregate cluster Istio cannot name (an EnvoyFilter route)."""
    return len(service.fallback) == 1


def _http(ctx: Context, route: ir.Route, index: int, twin: bool) -> Obj:
    service = ctx.model.service(route.service)
    match = route.matches[index]
    out: Obj = {"name": route_name(route.key, index)}
    if twin:
        m = _match(match)
        m.setdefault("headers", {})[ROUTING_HEADER] = {"exact": route.key}
        out["name"] = degraded_route_name(route.key, index)
        out["match"] = [m]
        assert service.drift is not None
        probe = service.drift.probe_percent
        tail = ctx.model.service(service.fallback[0])
        out["route"] = [
            _destination(ctx, service, probe, route.grpc),
            _destination(ctx, tail, 100 - probe, route.grpc),
        ]
    else:
        out["match"] = [_match(match)]
        out["route"] = [_destination(ctx, service, grpc=route.grpc)]
    if route.rewrite is not None:  # OpenAI's operations, below the model the body names
        out["rewrite"] = {
            "uriRegexRewrite": {
                "match": route.rewrite.pattern,
                "rewrite": route.rewrite.substitution,
            }
        }
    timeout = _timeout(ctx, route)
    if timeout is not None:
        out["timeout"] = timeout
    out["retries"] = _retries(ctx, route, service)
    # As meshfn's own gateways: backends' ORCA load reports stay inside the mesh.
    out["headers"] = {"response": {"remove": list(ORCA_HEADERS)}}
    return out


def _timeout(ctx: Context, route: ir.Route) -> str | None:
    """The route's timeout; None for 0s, which means none in meshfn and Envoy: Istio's default
    is none, and istiod refuses `timeout: 0s` (under 1ms) with the whole VirtualService."""
    if route.timeout is None:
        return ENVOY_ROUTE_TIMEOUT
    if not route.timeout:
        return None
    source = route_source(ctx.model, route)
    path: tuple[str, ...] = ("spec", "timeout")
    if source.kind == "Function":  # a generative function's: its generation's deadline
        path = ("spec", "generation" if route.idle_timeout else "limits", "timeout")
    return istio_duration(ctx, route.timeout, source, path)


def virtual_services(ctx: Context) -> None:
    """Per gateway listener and host, the routes in meshfn's precedence order; a drift-guarded
    route's degraded twin (matching the internal routing header the degrade filter sets) right
    before it."""
    for gw in gateways(ctx.model):
        for listener in gw.listeners:
            guarded_routes = guarded(ctx.model, listener)
            by_host: dict[str, list[tuple[ir.Route, int]]] = {}
            for route in listener.routes:
                for host in route.hosts:
                    by_host.setdefault(host, []).extend(
                        (route, i) for i in range(len(route.matches))
                    )
            for host, entries in sorted(by_host.items()):
                http = []
                sources = {Source("Gateway", gw.namespace, gw.name)}
                for route, index in sorted(entries, key=lambda pair: precedence(*pair)):
                    sources.add(route_source(ctx.model, route))
                    rollout = rolled_out(ctx.model, route, index)
                    if rollout is not None:  # the Rollout is no owner (see destination_rules)
                        http += _rollout_http(ctx, route, index, rollout)
                        continue
                    service = ctx.model.service(route.service)
                    if route.key in guarded_routes and degraded_twin_in_vs(service):
                        http.append(_http(ctx, route, index, twin=True))
                    http.append(_http(ctx, route, index, twin=False))
                slug = "any" if host == "*" else host.replace("*", "wildcard")
                spec = {
                    "hosts": [host],
                    "gateways": [f"{gw.namespace}/{gateway_name(gw, listener)}"],
                    "http": http,
                }
                name = f"{gateway_name(gw, listener)}.{slug}"
                ctx.emit(
                    resource(NETWORKING, "VirtualService", name, gw.namespace, spec),
                    *sorted(sources),
                )
