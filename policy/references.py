"""Checks across documents: one Mesh, unique names, references that resolve, no port clashes.

Each error points at the document that is wrong and names where its counterpart lives, so a user
with fifty files can fix it without grepping.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from meshfn import ir

from .errors import PolicyError
from .fallback import find_cycle, policies_by_service
from .model import (
    AuthorizationPolicy,
    FallbackPolicy,
    Function,
    Gateway,
    LocalityLb,
    Mesh,
    PeerAuthentication,
    RequestAuthentication,
    Route,
    Service,
)
from .source import Loc
from .validate import Loaded, where


def check_references(items: list[Loaded]) -> list[PolicyError]:
    errors: list[PolicyError] = []
    errors += _check_unique(items)
    errors += _check_routes(items)
    errors += _check_ports(items)
    errors += _check_security(items)
    errors += _check_fallback(items)
    return errors


def _check_unique(items: list[Loaded]) -> list[PolicyError]:
    errors: list[PolicyError] = []
    first: dict[tuple[str, str, str], Loaded] = {}
    first_mesh: Loaded | None = None
    for item in items:
        if isinstance(item.obj, Mesh):
            if first_mesh is not None:
                errors.append(
                    item.error(
                        ("kind",),
                        f"a second Mesh; there is one per policy set "
                        f"(Mesh {first_mesh.name} at {where(first_mesh)})",
                    )
                )
            else:
                first_mesh = item
        key = (item.kind, item.namespace, item.name)
        if key in first:
            errors.append(
                item.error(
                    ("metadata", "name"),
                    f"duplicate {item.ref} (first defined at {where(first[key], ('metadata', 'name'))})",
                )
            )
        else:
            first[key] = item
    return errors


def resolve_gateway(route: Loaded, gateways: dict[str, Loaded]) -> Loaded | PolicyError:
    """The Gateway a Route or Function attaches to."""
    assert isinstance(route.obj, Route | Function)
    ref = route.obj.spec.gateway
    if ref is None:
        if len(gateways) == 1:
            return next(iter(gateways.values()))
        if not gateways:
            return route.error(("spec",), "no Gateway is defined for this route to attach to")
        names = ", ".join(sorted(gateways))
        return route.error(("spec",), f"several Gateways exist ({names}): set spec.gateway")
    key = ref if "/" in ref else f"{route.namespace}/{ref}"
    found = gateways.get(key)
    if found is None:
        return route.error(
            ("spec", "gateway"), f"unknown Gateway {key}{_did_you_mean(key, gateways)}"
        )
    return found


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    hint = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {hint[0]}?)" if hint else ""


def _check_routes(items: list[Loaded]) -> list[PolicyError]:
    errors: list[PolicyError] = []
    services = {f"{i.namespace}/{i.name}": i for i in items if isinstance(i.obj, Service)}
    gateways = {f"{i.namespace}/{i.name}": i for i in items if isinstance(i.obj, Gateway)}
    for item in items:
        if isinstance(item.obj, Function):
            gateway = resolve_gateway(item, gateways)
            if isinstance(gateway, PolicyError):
                errors.append(gateway)
            key = f"{item.namespace}/{item.obj.spec.backend}"
            backend = services.get(key)
            if backend is None:
                errors.append(
                    item.error(
                        ("spec", "backend"),
                        f"unknown Service {key}{_did_you_mean(key, services)}",
                    )
                )
            elif isinstance(backend.obj, Service) and backend.obj.spec.protocol != "http":
                errors.append(
                    item.error(
                        ("spec", "backend"),
                        f"Service {key} speaks {backend.obj.spec.protocol}; the inference "
                        "backend speaks KServe v2 over HTTP",
                    )
                )
            errors += _check_egress(item, services)
            continue
        if not isinstance(item.obj, Route):
            continue
        spec = item.obj.spec
        gateway = resolve_gateway(item, gateways)
        if isinstance(gateway, PolicyError):
            errors.append(gateway)
        elif spec.listener is not None:
            assert isinstance(gateway.obj, Gateway)
            names = [listener.name for listener in gateway.obj.spec.listeners]
            if spec.listener not in names:
                errors.append(
                    item.error(
                        ("spec", "listener"),
                        f"Gateway {gateway.namespace}/{gateway.name} has no listener "
                        f"{spec.listener!r} (it has: {', '.join(names)})",
                    )
                )
        namespace = spec.destination.namespace or item.namespace
        key = f"{namespace}/{spec.destination.service}"
        if key not in services:
            errors.append(
                item.error(
                    ("spec", "destination", "service"),
                    f"unknown Service {key}{_did_you_mean(key, services)}",
                )
            )
    return errors


def _check_egress(item: Loaded, services: dict[str, Loaded]) -> list[PolicyError]:
    """A Function's egress peers are Services of the mesh."""
    assert isinstance(item.obj, Function)
    errors = []
    for index, peer in enumerate(item.obj.spec.egress):
        ref = peer.service
        key = ref if "/" in ref else f"{item.namespace}/{ref}"
        if key not in services:
            errors.append(
                item.error(
                    ("spec", "egress", index, "service"),
                    f"unknown Service {key}: an egress peer must be a Service of the mesh"
                    f"{_did_you_mean(key, services)}",
                )
            )
    return errors


@dataclass(frozen=True)
class _Bind:
    address: str
    port: int
    what: str
    item: Loaded
    loc: Loc

    def clashes(self, other: _Bind) -> bool:
        if self.port != other.port:
            return False
        unspecified = {"0.0.0.0", "::"}
        return (
            self.address == other.address
            or self.address in unspecified
            or other.address in unspecified
        )


def _check_ports(items: list[Loaded]) -> list[PolicyError]:
    """Everything meshfn binds must be distinct, and no endpoint may point back into meshfn."""
    binds = [bind for item in items for bind in _binds(item)]
    return _bind_clashes(binds) + _endpoint_clashes(items, binds)


def _binds(item: Loaded) -> list[_Bind]:
    """What one document makes meshfn bind: the Mesh's xds and admin ports, a Gateway's admin
    port and listeners, a Service's sidecars."""
    obj = item.obj
    if isinstance(obj, Mesh):
        ports = obj.spec.ports
        return [
            _Bind("127.0.0.1", ports.xds, "the Mesh xds port", item, ("spec", "ports", "xds")),
            _Bind(
                "127.0.0.1", ports.admin, "the Mesh admin port", item, ("spec", "ports", "admin")
            ),
        ]
    if isinstance(obj, Gateway):
        return _gateway_binds(item, obj)
    if isinstance(obj, Service):
        return [
            _Bind(
                declared.address,
                declared.sidecar.port,
                f"the sidecar of {item.ref} endpoint {i}",
                item,
                ("spec", "endpoints", i, "sidecar", "port"),
            )
            for i, declared in enumerate(obj.spec.endpoints)
            if declared.sidecar is not None
        ]
    return []


def _gateway_binds(item: Loaded, obj: Gateway) -> list[_Bind]:
    gateway = f"Gateway {item.namespace}/{item.name}"
    binds = []
    if obj.spec.adminPort is not None:
        binds.append(
            _Bind(
                "127.0.0.1",
                obj.spec.adminPort,
                f"the admin port of {gateway}",
                item,
                ("spec", "adminPort"),
            )
        )
    for i, listener in enumerate(obj.spec.listeners):
        binds.append(
            _Bind(
                listener.address,
                listener.port,
                f"listener {listener.name} of {gateway}",
                item,
                ("spec", "listeners", i, "port"),
            )
        )
    return binds


def _bind_clashes(binds: list[_Bind]) -> list[PolicyError]:
    """Each bind that clashes with an earlier one (named once, with the first it meets)."""
    errors: list[PolicyError] = []
    for i, bind in enumerate(binds):
        for earlier in binds[:i]:
            if bind.clashes(earlier):
                errors.append(
                    bind.item.error(
                        bind.loc,
                        f"port {bind.port} clashes with {earlier.what} "
                        f"({where(earlier.item, earlier.loc)})",
                    )
                )
                break
    return errors


# Endpoint targets seen so far: (address, port) -> the first document and place that has it.
_Seen = dict[tuple[str, int], tuple[Loaded, Loc]]


def _endpoint_clashes(items: list[Loaded], binds: list[_Bind]) -> list[PolicyError]:
    """An endpoint target (address and port, the gRPC port too) belongs to one Service, and none
    is a loopback port meshfn binds itself."""
    errors: list[PolicyError] = []
    seen: _Seen = {}
    loopback_binds = {b.port: b for b in reversed(binds)}
    for item in items:
        service = item.lowered
        if not isinstance(service, ir.Service):
            continue
        for i, endpoint in enumerate(service.endpoints):
            errors += _endpoint_errors(item, i, endpoint, seen, loopback_binds)
    return errors


def _endpoint_errors(
    item: Loaded, i: int, endpoint: ir.Endpoint, seen: _Seen, loopback_binds: dict[int, _Bind]
) -> list[PolicyError]:
    at: Loc = ("spec", "endpoints", i)
    found: list[PolicyError | None] = []
    if endpoint.grpc_port:  # the gRPC port is an endpoint target like the port
        port = endpoint.grpc_port
        found.append(_taken(item, (endpoint.address, port), (*at, "grpcPort"), seen))
        found.append(
            _loops(
                item, endpoint.address, port, (*at, "grpcPort"), f"grpcPort {port}", loopback_binds
            )
        )
    target = (endpoint.address, endpoint.port)
    taken = _taken(item, target, at, seen)
    if taken is not None:
        found.append(taken)
    else:
        subject = f"endpoint {_hostport(*target)}"
        found.append(_loops(item, endpoint.address, endpoint.port, at, subject, loopback_binds))
    return [error for error in found if error is not None]


def _taken(item: Loaded, target: tuple[str, int], loc: Loc, seen: _Seen) -> PolicyError | None:
    """The target is another endpoint's already (the first one keeps it), or it is noted."""
    other = seen.get(target)
    if other is None:
        seen[target] = (item, loc)
        return None
    return item.error(
        loc,
        f"endpoint {_hostport(*target)} is also an endpoint of {other[0].ref} ({where(*other)})",
    )


def _loops(
    item: Loaded,
    address: str,
    port: int,
    loc: Loc,
    subject: str,
    loopback_binds: dict[int, _Bind],
) -> PolicyError | None:
    """A loopback target on a port meshfn binds: traffic would come back into meshfn."""
    hit = loopback_binds.get(port)
    if hit is None or not _is_loopback(address):
        return None
    return item.error(
        loc,
        f"{subject} points at {hit.what} ({where(hit.item, hit.loc)}): traffic would loop into "
        "meshfn",
    )


@lru_cache(maxsize=65536)
def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _check_security(items: list[Loaded]) -> list[PolicyError]:
    """Selectors must name real workloads; PeerAuthentications must not contradict each other
    and must select services that have sidecars (an mTLS mode without a sidecar enforces
    nothing, and a silently unenforced STRICT is exactly what zero trust must not allow)."""
    errors: list[PolicyError] = []
    services = {(i.namespace, i.name): i.obj for i in items if isinstance(i.obj, Service)}
    gateways = {(i.namespace, i.name) for i in items if isinstance(i.obj, Gateway)}
    claimed: dict[tuple[str, str | None], Loaded] = {}
    for item in items:
        obj = item.obj
        if not isinstance(obj, PeerAuthentication | RequestAuthentication | AuthorizationPolicy):
            continue
        selector = obj.spec.selector
        if selector is not None:
            if selector.service is not None and (item.namespace, selector.service) not in services:
                errors.append(
                    item.error(
                        ("spec", "selector", "service"),
                        f"no Service {item.namespace}/{selector.service}",
                    )
                )
                continue
            if selector.gateway is not None and (item.namespace, selector.gateway) not in gateways:
                errors.append(
                    item.error(
                        ("spec", "selector", "gateway"),
                        f"no Gateway {item.namespace}/{selector.gateway}",
                    )
                )
                continue
        if not isinstance(obj, PeerAuthentication):
            continue
        target = (item.namespace, selector.service if selector is not None else None)
        if target in claimed:
            first = claimed[target]
            what = f"Service {target[0]}/{target[1]}" if target[1] else f"namespace {target[0]}"
            errors.append(
                item.error(
                    ("spec", "selector") if selector is not None else ("metadata", "name"),
                    f"a second PeerAuthentication for {what} "
                    f"({first.ref} at {where(first)}): merge them",
                )
            )
            continue
        claimed[target] = item
        if selector is None or selector.service is None:
            continue
        service = services[(item.namespace, selector.service)]
        assert isinstance(service, Service)
        ports = {e.port or service.spec.port for e in service.spec.endpoints}
        for port in obj.spec.portLevelMtls:
            if int(port) not in ports:
                errors.append(
                    item.error(
                        ("spec", "portLevelMtls", port),
                        f"Service {item.namespace}/{selector.service} has no endpoint on port "
                        f"{port} (its endpoint ports: {', '.join(map(str, sorted(ports)))})",
                    )
                )
        modes = [obj.spec.mtls.mode] if obj.spec.mtls is not None else []
        modes += [m.mode for m in obj.spec.portLevelMtls.values()]
        has_sidecars = any(e.sidecar is not None for e in service.spec.endpoints)
        if not has_sidecars and any(mode != "DISABLE" for mode in modes):
            errors.append(
                item.error(
                    ("spec", "selector", "service"),
                    f"Service {item.namespace}/{selector.service} has no sidecars, so no mTLS "
                    "mode can be enforced for it: give its endpoints a sidecar",
                )
            )
    return errors


def _check_fallback(items: list[Loaded]) -> list[PolicyError]:
    """Fallback chains must name real services, must not loop, and locality settings must
    match localities that endpoints actually have."""
    errors: list[PolicyError] = []
    services = {f"{i.namespace}/{i.name}": i.obj for i in items if isinstance(i.obj, Service)}
    seen: dict[str, Loaded] = {}
    for item in items:
        if isinstance(item.obj, FallbackPolicy):
            errors += _check_fallback_policy(item, item.obj, services, seen)
    return errors or _fallback_cycles(items)


def _check_fallback_policy(
    item: Loaded,
    policy: FallbackPolicy,
    services: dict[str, Service],
    seen: dict[str, Loaded],
) -> list[PolicyError]:
    """One FallbackPolicy: its service exists and has no other policy, its chain's services
    exist, its locality settings match the service's endpoints."""
    spec = policy.spec
    key = f"{item.namespace}/{spec.service}"
    service = services.get(key)
    if service is None:
        return [
            item.error(("spec", "service"), f"unknown Service {key}{_did_you_mean(key, services)}")
        ]
    if key in seen:
        return [
            item.error(
                ("spec", "service"),
                f"a second FallbackPolicy for Service {key} ({seen[key].ref} at {where(seen[key])})",
            )
        ]
    seen[key] = item
    errors = [
        item.error(("spec", "chain", i), f"unknown Service {item.namespace}/{name}")
        for i, name in enumerate(spec.chain)
        if f"{item.namespace}/{name}" not in services
    ]
    return errors + _check_fallback_locality(item, key, spec.locality, service)


def _check_fallback_locality(
    item: Loaded, key: str, locality: LocalityLb | None, service: Service
) -> list[PolicyError]:
    """Locality preference needs endpoints with a region, and failover goes to regions the
    service's endpoints are in."""
    if locality is None:
        return []
    regions = {
        e.locality.region for e in service.spec.endpoints if e.locality and e.locality.region
    }
    errors: list[PolicyError] = []
    if locality.enabled and not regions:
        errors.append(
            item.error(
                ("spec", "locality"),
                f"no endpoint of Service {key} declares a locality, so there is nothing to prefer",
            )
        )
    for i, rule in enumerate(locality.failover):
        if rule.to not in regions:
            errors.append(
                item.error(
                    ("spec", "locality", "failover", i, "to"),
                    f"no endpoint of Service {key} is in region {rule.to!r} "
                    f"(its regions: {', '.join(sorted(regions)) or 'none'})",
                )
            )
    return errors


def _fallback_cycles(items: list[Loaded]) -> list[PolicyError]:
    """Each cycle of fallback chains, once."""
    errors: list[PolicyError] = []
    policies = policies_by_service(items)
    reported: set[frozenset[str]] = set()
    for key, item in policies.items():
        cycle = find_cycle(key, policies)
        if cycle and frozenset(cycle) not in reported:
            reported.add(frozenset(cycle))
            errors.append(
                item.error(("spec", "chain"), "fallback chains form a cycle: " + " -> ".join(cycle))
            )
    return errors
