"""Service -> ClusterLoadAssignment: endpoints grouped by locality, with EDS priorities by
proximity to the calling proxy when the service asks for locality failover."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import wrappers_pb2

from meshfn import ir

from ..names import cluster_name, tier_cluster_name
from .common import socket_address
from .security import tls_match_metadata


def priority(
    endpoint: ir.Locality, proxy: ir.Locality, failover: tuple[tuple[str, str], ...]
) -> int:
    """Istio's order: same node (sub-zone) 0, same zone 1, same region 2, the region a
    `failover` rule names for the proxy's region 3, anywhere else 4."""
    if endpoint.region == proxy.region and proxy.region:
        if endpoint.zone == proxy.zone and proxy.zone:
            if endpoint.sub_zone == proxy.sub_zone and proxy.sub_zone:
                return 0
            return 1
        return 2
    if (proxy.region, endpoint.region) in failover:
        return 3
    return 4


NOWHERE = ir.Locality()


def load_assignment(
    service: ir.Service, proxy: ir.Locality = NOWHERE
) -> endpoint_pb2.ClusterLoadAssignment:
    traffic = service.traffic
    if traffic is None or not traffic.locality_failover:
        return _load_assignment(service, None)
    # Memoised per proxy locality: every gateway in one locality shares the same assignment.
    return _load_assignment(service, proxy)


def _levels(
    service: ir.Service, proxy: ir.Locality | None
) -> tuple[dict[ir.Locality, list[ir.Endpoint]], dict[ir.Locality, int]]:
    """Endpoints by locality, and each locality's EDS priority for this proxy (contiguous
    from 0, as EDS requires)."""
    by_locality: dict[ir.Locality, list[ir.Endpoint]] = {}
    for endpoint in service.endpoints:
        by_locality.setdefault(endpoint.locality, []).append(endpoint)
    failover = service.traffic.failover_regions if service.traffic else ()
    ranked = {
        loc: (priority(loc, proxy, failover) if proxy is not None else 0) for loc in by_locality
    }
    renumber = {rank: i for i, rank in enumerate(sorted(set(ranked.values())))}
    return by_locality, {loc: renumber[rank] for loc, rank in ranked.items()}


def _group(
    locality: ir.Locality, endpoints: list[ir.Endpoint], level: int
) -> endpoint_components_pb2.LocalityLbEndpoints:
    return endpoint_components_pb2.LocalityLbEndpoints(
        locality=base_pb2.Locality(
            region=locality.region, zone=locality.zone, sub_zone=locality.sub_zone
        ),
        lb_endpoints=[_lb_endpoint(e) for e in endpoints],
        priority=level,
    )


def _ordered(
    by_locality: dict[ir.Locality, list[ir.Endpoint]], levels: dict[ir.Locality, int]
) -> list[ir.Locality]:
    return sorted(by_locality, key=lambda loc: (levels[loc], loc.region, loc.zone, loc.sub_zone))


@lru_cache(maxsize=65536)
def _load_assignment(
    service: ir.Service, proxy: ir.Locality | None
) -> endpoint_pb2.ClusterLoadAssignment:
    by_locality, levels = _levels(service, proxy)
    groups = [_group(loc, by_locality[loc], levels[loc]) for loc in _ordered(by_locality, levels)]
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster_name(service.key), endpoints=groups
    )


@lru_cache(maxsize=65536)
def tier_assignments(
    service: ir.Service, proxy: ir.Locality
) -> tuple[endpoint_pb2.ClusterLoadAssignment, ...]:
    """The service split into one assignment per priority level, each at priority 0.

    An aggregate cluster mishandles members that have several priority levels themselves
    (measured with Envoy 1.40: traffic skipped a healthy priority 1 for the next member), so a
    service with locality failover joins a fallback chain as one cluster per level, and the
    aggregate's member order carries the preference."""
    by_locality, levels = _levels(service, proxy)
    return tuple(
        endpoint_pb2.ClusterLoadAssignment(
            cluster_name=tier_cluster_name(service.key, level),
            endpoints=[
                _group(loc, by_locality[loc], 0)
                for loc in _ordered(by_locality, levels)
                if levels[loc] == level
            ],
        )
        for level in sorted(set(levels.values()))
    )


def _lb_endpoint(e: ir.Endpoint) -> endpoint_components_pb2.LbEndpoint:
    """Endpoints with a sidecar are reached through it (and over mTLS unless it is DISABLEd)."""
    out = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=socket_address(e.address, e.sidecar_port or e.port)
        ),
        load_balancing_weight=wrappers_pb2.UInt32Value(value=e.weight),
    )
    if e.sidecar_port is not None and e.mtls != "DISABLE":
        out.metadata.CopyFrom(tls_match_metadata())
    return out
