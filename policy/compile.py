"""Validated policy objects -> MeshModel. Runs only after the reference checks passed."""

from __future__ import annotations

import dataclasses

from meshfn import ir
from meshfn.contracts.function import FunctionSettings
from meshfn.contracts.qos import FUNCTION_BACKEND_BALANCER

from . import fallback, kserve, qos
from .errors import PolicyError
from .model import Audit, Drill, Function, Gateway, Locality, Mesh, Route, Service
from .references import resolve_gateway, where
from .security import Security, spiffe_id
from .validate import Loaded

_NO_LOCALITY = ir.Locality()


def _locality(value: Locality | None) -> ir.Locality:
    if value is None:
        return _NO_LOCALITY
    return ir.Locality(value.region or "", value.zone or "", value.node or "")


def lower(item: Loaded) -> ir.Service | ir.Route | ir.Function | None:
    """The IR of one object on its own (no cross-references), cached on the loaded item."""
    if isinstance(item.obj, Service):
        return _service(item)
    if isinstance(item.obj, Route):
        return _route(item)
    if isinstance(item.obj, Function):
        return _function(item)
    return None


def _function(item: Loaded) -> ir.Function:
    assert isinstance(item.obj, Function)
    spec = item.obj.spec
    # The spec IS the settings plus backend and gateway: take the settings' fields as they are
    # (validated already), no mapping.
    settings = FunctionSettings.model_construct(
        **{field: getattr(spec, field) for field in FunctionSettings.model_fields}
    )
    return ir.Function(
        name=item.name,
        namespace=item.namespace,
        backend=f"{item.namespace}/{spec.backend}",
        settings=settings,
        egress=tuple(sorted({_qualified(p.service, item.namespace) for p in spec.egress})),
    )


def _qualified(ref: str, namespace: str) -> str:
    return ref if "/" in ref else f"{namespace}/{ref}"


def function_route(function: ir.Function) -> ir.Route | None:
    """KServe v2 REST paths of a function (and its Triton repository load/unload), to its
    backend; None when the function is not served over REST. Only retries that cannot repeat
    an inference (the request never reached the backend) are on."""
    if not function.settings.protocols.rest:
        return None
    base = f"/v2/models/{function.name}"
    return ir.Route(
        name=f"function-{function.name}",
        namespace=function.namespace,
        hosts=("*",),
        matches=(
            ir.RouteMatch(ir.PathMatch("exact", base)),
            ir.RouteMatch(ir.PathMatch("prefix", base + "/")),
            ir.RouteMatch(ir.PathMatch("prefix", f"{kserve.REPOSITORY_MODELS}{function.name}/")),
        ),
        service=function.backend,
        timeout=kserve.function_timeout(function),
        retries=kserve.SAFE_RETRIES,
        function=function.name,
    )


def _service(item: Loaded) -> ir.Service:
    assert isinstance(item.obj, Service)
    spec = item.obj.spec
    return ir.Service(
        name=item.name,
        namespace=item.namespace,
        port=spec.port,
        protocol=spec.protocol,
        connect_timeout=spec.connectTimeout,
        endpoints=tuple(
            ir.Endpoint(
                address=e.address,
                port=e.port or spec.port,
                weight=e.weight,
                locality=_locality(e.locality),
                sidecar_port=e.sidecar.port if e.sidecar is not None else None,
                grpc_port=e.grpcPort,
            )
            for e in spec.endpoints
        ),
        external=spec.external,
        load_balancer=spec.loadBalancer,
    )


def _route(item: Loaded) -> ir.Route:
    assert isinstance(item.obj, Route)
    spec = item.obj.spec
    matches = []
    for m in spec.matches:
        path = m.path
        if path.exact is not None:
            path_match = ir.PathMatch("exact", path.exact)
        elif path.regex is not None:
            path_match = ir.PathMatch("regex", path.regex)
        else:
            assert path.prefix is not None
            path_match = ir.PathMatch("prefix", path.prefix)
        headers = []
        for h in m.headers:
            if h.present:
                headers.append(ir.HeaderMatch(h.name.lower(), "present", "", h.invert))
            elif h.exact is not None:
                headers.append(ir.HeaderMatch(h.name.lower(), "exact", h.exact, h.invert))
            elif h.prefix is not None:
                headers.append(ir.HeaderMatch(h.name.lower(), "prefix", h.prefix, h.invert))
            else:
                assert h.regex is not None
                headers.append(ir.HeaderMatch(h.name.lower(), "regex", h.regex, h.invert))
        matches.append(
            ir.RouteMatch(
                path=path_match, headers=tuple(headers), methods=tuple(sorted(set(m.methods)))
            )
        )
    retries = None
    if spec.retries is not None:
        retries = ir.Retry(
            attempts=spec.retries.attempts,
            retry_on=tuple(dict.fromkeys(spec.retries.retryOn)),
            per_try_timeout=spec.retries.perTryTimeout,
        )
    return ir.Route(
        name=item.name,
        namespace=item.namespace,
        hosts=tuple(sorted(set(spec.hosts))),
        matches=tuple(matches),
        service=f"{spec.destination.namespace or item.namespace}/{spec.destination.service}",
        timeout=spec.timeout,
        retries=retries,
    )


def compile_model(items: list[Loaded]) -> ir.MeshModel | list[PolicyError]:
    """Build the IR; also refuses two routes that claim the exact same requests."""
    mesh = next(i for i in items if isinstance(i.obj, Mesh))
    assert isinstance(mesh.obj, Mesh)
    gateways = {f"{i.namespace}/{i.name}": i for i in items if isinstance(i.obj, Gateway)}
    attached: dict[str, list[tuple[Loaded, ir.Route, str | None]]] = {k: [] for k in gateways}
    functions = []
    hosted: dict[str, list[Loaded]] = {}  # gateway key -> its Functions
    bindings = qos.Bindings(items)
    qos_policies = {i.ref: qos.lower(i, mesh.obj) for i in bindings.policies}
    for item in items:
        if isinstance(item.obj, Route | Function):
            gateway = resolve_gateway(item, gateways)
            assert not isinstance(gateway, PolicyError)
            gateway_key = f"{gateway.namespace}/{gateway.name}"
            own = bindings.of(item.kind, f"{item.namespace}/{item.name}")
            own_qos = qos_policies[own.ref] if own is not None else None
            if isinstance(item.lowered, ir.Function):
                function = item.lowered
                served_qos = bindings.for_function(item)
                if served_qos is not None:
                    function = dataclasses.replace(
                        function, qos=qos.function_qos(served_qos, mesh.obj)
                    )
                functions.append(function)
                hosted.setdefault(gateway_key, []).append(item)
                route, only = function_route(function), None
                if route is None:
                    continue
            else:
                assert isinstance(item.lowered, ir.Route) and isinstance(item.obj, Route)
                route, only = item.lowered, item.obj.spec.listener
            if own_qos is not None:
                route = dataclasses.replace(route, qos=own_qos)
            attached[gateway_key].append((item, route, only))
    lowered_services = {
        i.lowered.key: i.lowered for i in items if isinstance(i.lowered, ir.Service)
    }
    errors: list[PolicyError] = []
    for gateway_key, function_items in hosted.items():
        server = _server_routes(gateway_key, function_items, lowered_services)
        if isinstance(server, PolicyError):
            errors.append(server)
            continue
        attached[gateway_key].extend((function_items[0], route, None) for route in server)

    security = Security(items)
    fallback_policies = fallback.policies_by_service(items)
    workloads = []
    guards: list[ir.AuthzObject] = []
    for key, gw_item in sorted(gateways.items()):
        assert isinstance(gw_item.obj, Gateway)
        spec = gw_item.obj.spec
        gateway_guarded = _gateway_guarded(hosted.get(key, []), lowered_services)
        gateway_qos = bindings.of("Gateway", key)
        listeners = []
        for listener in spec.listeners:
            routes = sorted(
                (
                    (item, route)
                    for item, route, only in attached[key]
                    if only in (None, listener.name)
                ),
                key=lambda pair: pair[1].key,
            )
            errors += _shadowed(routes)
            listeners.append(
                ir.Listener(
                    name=listener.name,
                    address=listener.address,
                    port=listener.port,
                    routes=tuple(route for _, route in routes),
                )
            )
        workloads.append(
            ir.Workload(
                name=gw_item.name,
                namespace=gw_item.namespace,
                kind="gateway",
                admin_port=spec.adminPort or 0,
                xds_protocol=spec.xdsProtocol,
                locality=_locality(spec.locality),
                listeners=tuple(listeners),
                identity=spiffe_id(
                    security.trust_domain, gw_item.namespace, spec.serviceAccount or gw_item.name
                ),
                jwt_rules=security.jwt_rules("gateway", gw_item.namespace, gw_item.name),
                authz=security.policies("gateway", gw_item.namespace, gw_item.name)
                + _guard(gw_item.namespace, gateway_guarded),
                qos=qos_policies[gateway_qos.ref] if gateway_qos is not None else None,
            )
        )
        if gateway_guarded:
            guards.append(
                kserve.guard_object(
                    gw_item.namespace, ir.Selector("gateway", gw_item.name), gateway_guarded
                )
            )
    if errors:
        return sorted(set(errors))
    services = []
    for item in sorted(
        (i for i in items if isinstance(i.lowered, ir.Service)), key=lambda i: (i.namespace, i.name)
    ):
        assert isinstance(item.obj, Service) and isinstance(item.lowered, ir.Service)
        service = security.secure_service(item.lowered, item.obj.spec.serviceAccount or item.name)
        services.append(fallback.apply(service, fallback_policies))
    reach: dict[str, int] = {}
    for gateway_routes in attached.values():
        for key in {route.service for _, route, _ in gateway_routes}:
            reach[key] = reach.get(key, 0) + 1
    shed = qos.shed_limits(bindings, services, reach)
    if isinstance(shed, list):
        return sorted(set(shed))
    services = [
        dataclasses.replace(s, shed=shed[s.key][0], function_shed=shed[s.key][1])
        if s.key in shed
        else s
        for s in services
    ]
    served = served_functions(functions, {s.key: s for s in services})
    services = [
        dataclasses.replace(s, load_balancer=FUNCTION_BACKEND_BALANCER)
        if s.key in served and s.load_balancer is None
        else s
        for s in services
    ]
    for service in services:
        guard = served.get(service.key)
        claim = next((f.qos.tenantClaim for f in guard or [] if f.qos is not None), None)
        workloads.extend(
            _sidecars(service, security, _guard(service.namespace, guard or []), claim)
        )
        if guard and any(e.sidecar_port for e in service.endpoints):
            guards.append(
                kserve.guard_object(service.namespace, ir.Selector("service", service.name), guard)
            )
    return ir.MeshModel(
        name=mesh.name,
        trust_domain=mesh.obj.spec.trustDomain,
        xds_port=mesh.obj.spec.ports.xds,
        admin_port=mesh.obj.spec.ports.admin,
        services=tuple(services),
        workloads=tuple(workloads),
        certificate_ttl=mesh.obj.spec.identity.certificateTTL,
        functions=tuple(sorted(functions, key=lambda f: (f.namespace, f.name))),
        acceleration=mesh.obj.spec.acceleration,
        sandbox=ir.Sandbox(**mesh.obj.spec.sandbox.model_dump()),
        audit=_audit(mesh.obj.spec.audit),
        drill=_drill(mesh.obj.spec.drill),
        policies=_with_guards(security.as_written(), guards),
        qos=tuple(qos_policies.values()),
    )


def _drill(spec: Drill | None) -> ir.Drill | None:
    if spec is None:
        return None
    return ir.Drill(header=spec.header, request_principals=tuple(spec.requestPrincipals))


def _audit(spec: Audit | None) -> ir.Audit | None:
    if spec is None:
        return None
    return ir.Audit(
        proxies=spec.proxies,
        retention_days=spec.retentionDays,
        tenant_claim=spec.tenantClaim,
        body_hash=spec.bodyHash.enabled,
        body_hash_max_bytes=spec.bodyHash.maxBytes,
    )


def served_functions(
    functions: list[ir.Function], services: dict[str, ir.Service]
) -> dict[str, list[ir.Function]]:
    """Service key -> the functions its endpoints serve: those it backs, and those whose
    backend's fallback chain reaches it (a fallback answers the same /v2/models/{name})."""
    out: dict[str, list[ir.Function]] = {}
    for function in sorted(functions, key=lambda f: (f.namespace, f.name)):
        backend = services[function.backend]
        for key in (backend.key, *backend.fallback):
            out.setdefault(key, []).append(function)
    return out


def _server_routes(
    gateway: str, items: list[Loaded], services: dict[str, ir.Service]
) -> tuple[ir.Route, ...] | PolicyError:
    """The gateway's KServe server and gRPC routes; its functions must share one backend."""
    functions = [i.lowered for i in items if isinstance(i.lowered, ir.Function)]
    first = functions[0]
    for item, function in zip(items, functions, strict=True):
        if function.backend != first.backend:
            return item.error(
                ("spec", "backend"),
                f"the Functions on Gateway {gateway} must share one backend: {first.name} is "
                f"served by {first.backend}, {function.name} by {function.backend}. KServe's "
                "server endpoints (/v2, health, the model list) and gRPC (which names the model "
                "inside the message) reach one backend per gateway; attach this Function to "
                "another Gateway",
            )
    return kserve.server_routes(functions, services[first.backend])


def _gateway_guarded(items: list[Loaded], services: dict[str, ir.Service]) -> list[ir.Function]:
    """A gateway's functions whose backend has no sidecars to hold the repository guard."""
    return [
        i.lowered
        for i in items
        if isinstance(i.lowered, ir.Function)
        and not any(e.sidecar_port for e in services[i.lowered.backend].endpoints)
    ]


def _guard(namespace: str, functions: list[ir.Function]) -> tuple[ir.AuthzPolicy, ...]:
    return (kserve.repository_guard(namespace, functions),) if functions else ()


def _with_guards(policies: ir.Policies, guards: list[ir.AuthzObject]) -> ir.Policies:
    """The policies as written plus the repository guards meshfn writes itself, so the Istio
    renderer guards load/unload where the xDS translator does."""
    if not guards:
        return policies
    authz = sorted((*policies.authz, *guards), key=lambda p: (p.namespace, p.name))
    return dataclasses.replace(policies, authz=tuple(authz))


def _sidecars(
    service: ir.Service,
    security: Security,
    extra_authz: tuple[ir.AuthzPolicy, ...] = (),
    tenant_claim: str | None = None,
) -> list[ir.Workload]:
    """One sidecar workload per endpoint that declares one, each with its own node cluster;
    `extra_authz` are policies meshfn adds (the repository guard of the functions it serves);
    `tenant_claim`: the functions it serves have QoS, whose backend reads the verified tenant."""
    jwt_rules = security.jwt_rules("service", service.namespace, service.name)
    authz = security.policies("service", service.namespace, service.name) + extra_authz
    return [
        ir.Workload(
            name=service.name,
            namespace=service.namespace,
            kind="sidecar",
            admin_port=0,
            xds_protocol="delta",
            locality=endpoint.locality,
            listeners=(),
            identity=service.identity,
            jwt_rules=jwt_rules,
            authz=authz,
            inbound=ir.Inbound(
                service=service.key,
                address=endpoint.address,
                port=endpoint.sidecar_port,
                app_port=endpoint.port,
                protocol=service.protocol,
                mtls=endpoint.mtls,
                grpc_app_port=endpoint.grpc_port,
                tenant_claim=tenant_claim,
            ),
        )
        for endpoint in service.endpoints
        if endpoint.sidecar_port is not None
    ]


def _shadowed(routes: list[tuple[Loaded, ir.Route]]) -> list[PolicyError]:
    """Two routes with an identical match on the same host: one would never be used."""
    errors = []
    claimed: dict[tuple[str, ir.RouteMatch], tuple[Loaded, int]] = {}
    for item, route in routes:
        for index, match in enumerate(route.matches):
            for host in route.hosts:
                key = (host, match)
                if key in claimed and claimed[key][0] is not item:
                    other, other_index = claimed[key]
                    errors.append(
                        item.error(
                            ("spec", "matches", index),
                            f"identical match to {other.ref} on host {host!r} "
                            f"({where(other, ('spec', 'matches', other_index))}): "
                            "one of the two routes could never be used",
                        )
                    )
                else:
                    claimed.setdefault(key, (item, index))
    return errors
