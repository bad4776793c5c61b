"""EnvoyFilter, only where Istio has no first-class API. Every patch names its context and match;
every EnvoyFilter has a non-zero priority (Istio's analyzer warns on relative operations
without one). Patch values are Envoy protobuf JSON (typed_config with its @type); the tests parse
each with xds-protos' json_format and run the smallest Envoy config holding it.

On a gateway:
- the fallback chain as an aggregate cluster of istiod's clusters (primary, then the chain up to
  maxFallbackDepth), and each route of the service pointed at it (with the chain as route
  metadata for the 503 body);
- a drift-guarded route whose chain tail has several services: its degraded twin (weighted
  between the primary's probe share and the tail's aggregate), inserted before the route;
- on the HTTP connection manager: the JSON 503 when no upstream is healthy, and the early header
  mutation that removes the routing and claim headers from client requests before Envoy picks a
  route (clients can never pick the degraded twin);
- the claim headers removed before requests go upstream;
- the model router (OpenAI's requests routed by their body's model): an extension config and
  the filter first in the chain, since a WasmPlugin cannot let a plugin hold the headers for the
  body; a generative route's idle timeout; Envoy's own replies on OpenAI's paths as OpenAI's
  error objects.
On sidecars that audit from claim headers, the same early removal and upstream removal.
Mesh-wide (root namespace), on every gateway and inbound sidecar: meshfn's request hygiene
(contracts.proxy), part of which (dropping underscore headers, the headers timeout, the HTTP/2
stream limit) has no Istio API.
"""

from __future__ import annotations

import copy

from meshfn import ir
from meshfn.contracts.plugins import ROUTE_METADATA, ROUTING_HEADER, plugin_json
from meshfn.contracts.proxy import REQUEST_HYGIENE, WHOLE_SMALL_BODIES
from meshfn.contracts.qos import TENANT_HEADER, has_token_budgets
from meshfn.xds.fragments import qos as envoy_qos
from meshfn.xds.fragments.headers import early_header_removal
from meshfn.xds.fragments.messages import envoy_json, seconds
from meshfn.xds.fragments.openai import openai_replies
from meshfn.xds.fragments.routes import degraded_clusters, degraded_match, retry_policy
from meshfn.xds.names import degraded_route_name, fallback_cluster_name, route_name

from .core import Context, Obj, Source, gateways, resource, rolled_out, sidecar_services
from .plugins import guarded, logged_headers, plugins_of, routers_of, stripped_headers
from .traffic import ENVOY_ROUTE_TIMEOUT, degraded_twin_in_vs, istio_cluster
from .wasm import module_source

NETWORKING = "networking.istio.io/v1alpha3"
PRIORITY = 10  # after EnvoyFilters at the default 0 that replace what we merge into
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
AGGREGATE_TYPE = "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_TYPE = "type.googleapis.com/google.protobuf.StringValue"
UNLIMITED = 0xFFFFFFFF


def no_upstream_reply() -> Obj:
    """The translator's JSON 503: which route and which fallback chain ran out."""
    return {
        "mappers": [
            {
                "filter": {"response_flag_filter": {"flags": ["UH", "UF", "URX"]}},
                "status_code": 503,
                "body_format_override": {
                    "json_format": {
                        "error": "no healthy upstream",
                        "route": "%ROUTE_NAME%",
                        "exhausted_chain": "%METADATA(ROUTE:meshfn:chain)%",
                        "response_flags": "%RESPONSE_FLAGS%",
                    },
                    "content_type": "application/json",
                },
            }
        ]
    }


def aggregate_cluster(members: list[str], breakers: ir.CircuitBreakers | None) -> Obj:
    """Routes target the aggregate, so the service's retry limits live here (translator)."""
    thresholds: Obj = {"priority": "DEFAULT"}
    if breakers is not None:
        for key, value in (
            ("max_connections", breakers.max_connections),
            ("max_pending_requests", breakers.max_pending_requests),
            ("max_requests", breakers.max_requests),
        ):
            if value is not None:
                thresholds[key] = value
        if breakers.retry_budget_percent is not None:
            budget: Obj = {"budget_percent": {"value": breakers.retry_budget_percent}}
            if breakers.retry_budget_min_concurrency is not None:
                budget["min_retry_concurrency"] = breakers.retry_budget_min_concurrency
            thresholds["retry_budget"] = budget
    max_retries = breakers.max_retries if breakers and breakers.max_retries is not None else None
    thresholds["max_retries"] = UNLIMITED if max_retries is None else max_retries
    return {
        "name": fallback_cluster_name(tuple(members)),
        "connect_timeout": "1s",
        "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": {"@type": AGGREGATE_TYPE, "clusters": members},
        },
        "circuit_breakers": {"thresholds": [thresholds]},
    }


def _chain_names(model: ir.MeshModel, service: ir.Service) -> str:
    """The chain as the translator's 503 body names it (meshfn cluster names)."""
    return " > ".join(
        f"{s.split('/')[1]}.{s.split('/')[0]}" for s in (service.key, *service.fallback)
    )


def _route_match(name: str) -> Obj:
    return {"context": "GATEWAY", "routeConfiguration": {"vhost": {"route": {"name": name}}}}


def degraded_twin(ctx: Context, route: ir.Route, index: int, tail_cluster: str) -> Obj:
    """The twin the VirtualService cannot hold: weighted between the primary (probe share) and
    the aggregate of the chain's tail; its match and retries are the translator's."""
    service = ctx.model.service(route.service)
    assert service.drift is not None
    split = degraded_clusters(
        istio_cluster(ctx, service), tail_cluster, service.drift.probe_percent
    )
    action: Obj = {
        "weighted_clusters": envoy_json(split),
        "timeout": seconds(route.timeout) if route.timeout is not None else ENVOY_ROUTE_TIMEOUT,
    }
    if route.retries is not None:
        action["retry_policy"] = envoy_json(retry_policy(route.retries))
    return {
        "name": degraded_route_name(route.key, index),
        "match": envoy_json(degraded_match(route, index)),
        "route": action,
        "metadata": {
            "filter_metadata": {ROUTE_METADATA: {"chain": _chain_names(ctx.model, service)}}
        },
    }


def _gateway_patches(ctx: Context, gw: ir.Workload) -> tuple[list[Obj], set[Source]]:
    """A gateway's patches: the fallback chains' clusters, its connection manager, its rate
    limits, the routes that use the chains, and the headers kept from upstreams."""
    cluster_patches, route_patches, sources = _fallback_patches(ctx, gw)
    sources.add(Source("Gateway", gw.namespace, gw.name))
    qos_patches, qos_sources = _qos_patches(ctx, gw)
    if gw.qos is not None and gw.qos.global_rate is not None:
        ctx.warn(
            "qos-global-rate-needs-meshfn-rls",
            Source("QoSPolicy", gw.qos.namespace, gw.qos.name),
            ("spec", "global"),
            "a global rate is counted by meshfn's own rate-limit service, which Istio's "
            "gateways cannot reach: rendered as each gateway's local rate limit, counted per "
            "gateway pod, so with N pods (replicas, or gateways it binds) a tenant is admitted "
            "up to N times the rate and N times the burst",
        )
    sources |= qos_sources
    stripped = stripped_headers(ctx, gw)
    return [
        *router_patches(ctx, gw),
        *cluster_patches,
        _manager_patch(gw, bool(qos_patches), stripped),
        *qos_patches,
        *route_patches,
        *_stream_patches(gw),
        *_upstream_header_patches(ctx, gw, stripped),
    ], sources


def _fallback_patches(ctx: Context, gw: ir.Workload) -> tuple[list[Obj], list[Obj], set[Source]]:
    """For each route of the gateway whose service has a fallback chain (by route key): the
    chain's aggregate cluster (and its tail's, where the drift breaker's twin is ours), the
    route patches that use them, and the FallbackPolicies they came from."""
    model = ctx.model
    routes: dict[str, tuple[ir.Route, ir.Service]] = {}
    for listener in gw.listeners:
        for route in listener.routes:
            service = model.service(route.service)
            if service.fallback:
                routes[route.key] = (route, service)
    sources: set[Source] = set()
    clusters: dict[str, Obj] = {}
    patches: list[Obj] = []
    for key in sorted(routes):
        route, service = routes[key]
        assert service.traffic is not None
        sources.add(Source("FallbackPolicy", service.namespace, service.traffic.policy))
        members = [istio_cluster(ctx, model.service(k)) for k in (service.key, *service.fallback)]
        chain = aggregate_cluster(members, service.traffic.breakers)
        clusters[chain["name"]] = chain
        tail_cluster = None
        if service.drift is not None and not degraded_twin_in_vs(service):
            tail = aggregate_cluster(members[1:], None)
            clusters[tail["name"]] = tail
            tail_cluster = tail["name"]
        patches += _chain_route_patches(ctx, route, service, chain["name"], tail_cluster)
    cluster_patches = [
        {
            "applyTo": "CLUSTER",
            "match": {"context": "GATEWAY"},
            "patch": {"operation": "ADD", "value": clusters[name]},
        }
        for name in sorted(clusters)
    ]
    return cluster_patches, patches, sources


def _chain_route_patches(
    ctx: Context, route: ir.Route, service: ir.Service, chain: str, tail_cluster: str | None
) -> list[Obj]:
    """Each match of the route goes to the chain's aggregate; with a drift breaker, its degraded
    twin is inserted before it (`tail_cluster`: ours) or, where the VirtualService holds the
    twin, given the chain's metadata for its 503 body."""
    metadata = {"filter_metadata": {ROUTE_METADATA: {"chain": _chain_names(ctx.model, service)}}}
    patches: list[Obj] = []
    for index in range(len(route.matches)):
        if rolled_out(ctx.model, route, index) is not None:
            continue  # the rollout's split to the primary's versions (traffic._rollout_http)
        name = route_name(route.key, index)
        patches.append(
            {
                "applyTo": "HTTP_ROUTE",
                "match": _route_match(name),
                "patch": {
                    "operation": "MERGE",
                    "value": {"route": {"cluster": chain}, "metadata": metadata},
                },
            }
        )
        if tail_cluster is not None:
            patches.append(
                {
                    "applyTo": "HTTP_ROUTE",
                    "match": _route_match(name),
                    "patch": {
                        "operation": "INSERT_BEFORE",
                        "value": degraded_twin(ctx, route, index, tail_cluster),
                    },
                }
            )
        elif service.drift is not None:
            # the VirtualService's twin: the chain's metadata for its 503 body
            patches.append(
                {
                    "applyTo": "HTTP_ROUTE",
                    "match": _route_match(degraded_route_name(route.key, index)),
                    "patch": {"operation": "MERGE", "value": {"metadata": metadata}},
                }
            )
    return patches


def router_patches(ctx: Context, gw: ir.Workload) -> list[Obj]:
    """The model router (OpenAI's requests routed by the model their body names) as Istio's own
    documented pattern for a wasm filter WasmPlugin cannot describe: an extension config (ECDS;
    istio-agent fetches the module as for a WasmPlugin) with allow_on_headers_stop_iteration,
    and the filter first in the listener's chain (it reads only the body, so it needs no claim,
    and the WasmPlugins after it see the route it chose)."""
    patches: list[Obj] = []
    for plugin in routers_of(ctx, gw):
        assert plugin.listener is not None
        name = f"meshfn-router-{gw.name}-{plugin.listener.name}"
        build, url, digest = module_source(ctx, plugin)
        remote: Obj = {"http_uri": {"uri": url, "cluster": "meshfn-wasm", "timeout": "30s"}}
        if digest is not None:
            remote["sha256"] = digest
        config = {
            "name": name,
            "root_id": "meshfn",
            "vm_config": {
                "vm_id": name,
                "runtime": "envoy.wasm.runtime.v8",
                "code": {"remote": remote},
                "environment_variables": {"key_values": {"MESHFN_FILTER_BUILD": build}},
            },
            "configuration": {"@type": STRING_TYPE, "value": plugin_json(plugin.settings)},
            "failure_policy": "FAIL_CLOSED",
            "allow_on_headers_stop_iteration": True,
        }
        listener = {"portNumber": plugin.listener.port, "filterChain": {"filter": {"name": HCM}}}
        discovery = {
            "config_source": {"ads": {}, "initial_fetch_timeout": "0s"},
            "type_urls": [WASM_TYPE],
        }
        patches += [
            {
                "applyTo": "EXTENSION_CONFIG",
                "match": {"context": "GATEWAY"},
                "patch": {
                    "operation": "ADD",
                    "value": {"name": name, "typed_config": {"@type": WASM_TYPE, "config": config}},
                },
            },
            {
                "applyTo": "HTTP_FILTER",
                "match": {"context": "GATEWAY", "listener": listener},
                "patch": {
                    "operation": "INSERT_FIRST",
                    "value": {"name": name, "config_discovery": discovery},
                },
            },
        ]
    return patches


def _manager_patch(gw: ir.Workload, rate_limited: bool, stripped: list[str]) -> Obj:
    """The gateway's HTTP connection manager: local replies (a 429's body when rate limits
    apply) and the headers stripped from every request before routing."""
    manager: Obj = {"@type": HCM_TYPE, "local_reply_config": no_upstream_reply()}
    if rate_limited:
        claim = envoy_qos.governing(gw)[0].claim
        manager["local_reply_config"]["mappers"].append(envoy_qos.limited_reply(claim, True))
    if any(r.model for listener in gw.listeners for r in listener.routes):  # OpenAI's errors
        mappers = manager["local_reply_config"]["mappers"]
        manager["local_reply_config"]["mappers"] = openai_replies(mappers)
    if stripped:
        manager["early_header_mutation_extensions"] = [envoy_json(early_header_removal(stripped))]
    return {
        "applyTo": "NETWORK_FILTER",
        "match": {"context": "GATEWAY", "listener": {"filterChain": {"filter": {"name": HCM}}}},
        "patch": {"operation": "MERGE", "value": {"name": HCM, "typed_config": manager}},
    }


def _stream_patches(gw: ir.Workload) -> list[Obj]:
    """A generative function's routes: its stream idle timeout, which a VirtualService cannot
    say (its `timeout` is the whole request's)."""
    return [
        {
            "applyTo": "HTTP_ROUTE",
            "match": _route_match(route_name(route.key, index)),
            "patch": {
                "operation": "MERGE",
                "value": {"route": {"idle_timeout": seconds(route.idle_timeout)}},
            },
        }
        for listener in gw.listeners
        for route in listener.routes
        if route.idle_timeout is not None
        for index in range(len(route.matches))
    ]


def _upstream_header_patches(ctx: Context, gw: ir.Workload, stripped: list[str]) -> list[Obj]:
    """Stripped headers the gateway itself does not read are removed again before upstreams."""
    kept = {ROUTING_HEADER, TENANT_HEADER, *logged_headers(ctx, gw)}
    upstream = [n for n in stripped if n not in kept]
    if not upstream:
        return []
    return [
        {
            "applyTo": "ROUTE_CONFIGURATION",
            "match": {"context": "GATEWAY"},
            "patch": {"operation": "MERGE", "value": {"request_headers_to_remove": upstream}},
        }
    ]


def _qos_patches(ctx: Context, gw: ir.Workload) -> tuple[list[Obj], set[Source]]:
    """Per-tenant rate limits (fragments.qos, descriptors from the tenant header jwt_authn writes):
    Envoy's local rate limit before the router, the gateway's policy in it, a route's own policy
    per route (and its degraded twin, which serves the route's requests while the drift breaker
    has tripped: as the translator's), and every governed route naming its policy (the 429's
    JSON body)."""
    policies = envoy_qos.governing(gw)
    if not any(p.rate_limited for p in policies):
        return [], set()
    gateway = gw.qos
    config = envoy_qos.local_rate_limit(gateway, True) if gateway else envoy_qos.disabled()
    patches: list[Obj] = [
        {
            "applyTo": "HTTP_FILTER",
            "match": {
                "context": "GATEWAY",
                "listener": {
                    "filterChain": {
                        "filter": {"name": HCM, "subFilter": {"name": "envoy.filters.http.router"}}
                    }
                },
            },
            "patch": {
                "operation": "INSERT_BEFORE",
                "value": {"name": envoy_qos.LOCAL_RATE_LIMIT, "typed_config": config},
            },
        }
    ]
    for listener in gw.listeners:
        twins = guarded(ctx.model, listener)
        for route in listener.routes:
            policy = route.qos or gateway
            if policy is None:
                continue
            value: Obj = {
                "metadata": {
                    "filter_metadata": {
                        # Istio's gateways count every rate themselves (no limit service).
                        ROUTE_METADATA: {
                            envoy_qos.QOS_KEY: policy.key,
                            envoy_qos.QOS_SCOPE_KEY: "gateway",
                        }
                    }
                }
            }
            if route.qos is not None:
                own = envoy_qos.local_rate_limit(route.qos, True)
                value["typed_per_filter_config"] = {envoy_qos.LOCAL_RATE_LIMIT: own}
            names = [route_name(route.key, i) for i in range(len(route.matches))]
            if route.key in twins:
                names += [degraded_route_name(route.key, i) for i in range(len(route.matches))]
            patches += [
                {
                    "applyTo": "HTTP_ROUTE",
                    "match": _route_match(name),
                    "patch": {"operation": "MERGE", "value": value},
                }
                for name in names
            ]
    return patches, {Source("QoSPolicy", p.namespace, p.name) for p in policies}


def request_hygiene() -> Obj:
    """The spec of the mesh-wide EnvoyFilter (root namespace, every gateway and inbound sidecar)
    that gives istiod's connection managers what meshfn's own have (contracts.proxy): the path
    clean-up the meshConfig's DECODE_AND_MERGE_SLASHES also asks for (here it holds even where
    that snippet was not merged), and what Istio has no setting for: dropping headers with
    underscores, the headers timeout, the HTTP/2 stream limit; and small bodies read whole
    first, so that a refusal (Istio's own rate limits and authorization too) keeps the
    connection."""
    patches: list[Obj] = []
    for context in ("GATEWAY", "SIDECAR_INBOUND"):
        listener = {"filterChain": {"filter": {"name": HCM}}}
        patches.append(
            {
                "applyTo": "NETWORK_FILTER",
                "match": {"context": context, "listener": listener},
                "patch": {
                    "operation": "MERGE",
                    "value": {
                        "name": HCM,
                        "typed_config": {"@type": HCM_TYPE, **copy.deepcopy(REQUEST_HYGIENE)},
                    },
                },
            }
        )
        patches.append(
            {
                "applyTo": "HTTP_FILTER",
                "match": {"context": context, "listener": copy.deepcopy(listener)},
                "patch": {"operation": "INSERT_FIRST", "value": copy.deepcopy(WHOLE_SMALL_BODIES)},
            }
        )
    return {"priority": PRIORITY, "configPatches": patches}


def _token_budget_warnings(ctx: Context) -> None:
    """Token budgets (QoSPolicy `tokens`) are the backends' to keep; the mesh's one book is the
    meshfn control plane's ledger (xds/ledger.py), which Istio's data plane has no counterpart
    for: each backend process keeps its own."""
    budgeted = {f.qos.policy for f in ctx.model.functions if f.qos and has_token_budgets(f.qos)}
    for policy in sorted(budgeted):
        namespace, _, name = policy.partition("/")
        ctx.warn(
            "qos-token-budgets-per-backend-process",
            Source("QoSPolicy", namespace, name),
            ("spec", "classes"),
            "token budgets are kept by each inference backend process under Istio: the mesh's "
            "one book is meshfn's control-plane ledger, and no Istio API counts a tenant's "
            "tokens; with N backend processes a tenant may use up to N times its budget",
        )


def envoy_filters(ctx: Context) -> None:
    _token_budget_warnings(ctx)
    ctx.emit(
        resource(
            NETWORKING,
            "EnvoyFilter",
            "meshfn-request-hygiene",
            ctx.options.root_namespace,
            request_hygiene(),
        ),
        Source("Mesh", "", ctx.model.name),
    )
    for gw in gateways(ctx.model):
        patches, sources = _gateway_patches(ctx, gw)
        spec = {
            "workloadSelector": {"labels": ctx.options.labels(gw.name)},
            "priority": PRIORITY,
            "configPatches": patches,
        }
        ctx.emit(
            resource(NETWORKING, "EnvoyFilter", f"meshfn-{gw.name}", gw.namespace, spec),
            *sorted(sources),
        )
    for service in sidecar_services(ctx.model):
        sidecar = next(
            w for w in ctx.model.workloads if w.inbound and w.inbound.service == service.key
        )
        if not plugins_of(ctx, sidecar) and envoy_qos.claim_of(sidecar) is None:
            continue
        stripped = stripped_headers(ctx, sidecar)
        if not stripped:
            continue
        logged = logged_headers(ctx, sidecar)
        spec = {
            "workloadSelector": {"labels": ctx.options.labels(service.name)},
            "priority": PRIORITY,
            "configPatches": [
                {
                    "applyTo": "NETWORK_FILTER",
                    "match": {
                        "context": "SIDECAR_INBOUND",
                        "listener": {"filterChain": {"filter": {"name": HCM}}},
                    },
                    "patch": {
                        "operation": "MERGE",
                        "value": {
                            "name": HCM,
                            "typed_config": {
                                "@type": HCM_TYPE,
                                "early_header_mutation_extensions": [
                                    envoy_json(early_header_removal(stripped))
                                ],
                            },
                        },
                    },
                },
                {
                    "applyTo": "ROUTE_CONFIGURATION",
                    "match": {"context": "SIDECAR_INBOUND"},
                    "patch": {
                        "operation": "MERGE",
                        "value": {
                            # the QoS tenant goes on (the backend sheds and meters by it),
                            # and what the access log reads after the route
                            "request_headers_to_remove": [
                                n for n in stripped if n not in {TENANT_HEADER, *logged}
                            ]
                        },
                    },
                },
            ],
        }
        ctx.emit(
            resource(NETWORKING, "EnvoyFilter", f"meshfn-{service.name}", service.namespace, spec),
            Source("Mesh", "", ctx.model.name),
            Source("Service", service.namespace, service.name),
        )
