"""MeshModel: the intermediate representation between policies and every output (xDS, Istio).

Frozen and hashable all the way down, so downstream stages can memoise on IR objects: an unchanged
Service yields the identical Cluster message, whose serialised bytes the snapshot cache then reuses.
No policy-file details (lines, defaults, shorthands) survive into the IR.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal


def cluster_name(service_key: str) -> str:
    """Envoy cluster name of a Service ("namespace/name" -> "name.namespace")."""
    namespace, name = service_key.split("/", 1)
    return f"{name}.{namespace}"


@dataclass(frozen=True, slots=True)
class Locality:
    region: str = ""
    zone: str = ""
    sub_zone: str = ""


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str
    port: int
    weight: int = 1
    locality: Locality = Locality()


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    namespace: str
    port: int
    protocol: Literal["http", "grpc"]
    connect_timeout: timedelta
    endpoints: tuple[Endpoint, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def cluster_name(self) -> str:
        return cluster_name(self.key)


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
class Route:
    name: str
    namespace: str
    hosts: tuple[str, ...]
    matches: tuple[RouteMatch, ...]
    service: str  # Service.key of the destination
    timeout: timedelta | None = None
    retries: Retry | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def cluster(self) -> str:
        return cluster_name(self.service)


@dataclass(frozen=True, slots=True)
class Listener:
    name: str
    address: str
    port: int
    routes: tuple[Route, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    """One kind of proxy the mesh configures; every Envoy whose node.cluster equals `node_cluster`
    receives the same configuration."""

    name: str
    namespace: str
    kind: Literal["gateway"]
    admin_port: int
    xds_protocol: Literal["delta", "sotw"]
    locality: Locality
    listeners: tuple[Listener, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def node_cluster(self) -> str:
        return f"{self.name}.{self.namespace}"


@dataclass(frozen=True)
class MeshModel:
    name: str
    trust_domain: str
    xds_port: int
    admin_port: int
    services: tuple[Service, ...]
    workloads: tuple[Workload, ...]
    _services: dict[str, Service] = field(init=False, repr=False, compare=False, hash=False)
    _workloads: dict[str, Workload] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_services", {s.key: s for s in self.services})
        object.__setattr__(self, "_workloads", {w.node_cluster: w for w in self.workloads})

    def service(self, key: str) -> Service:
        return self._services[key]

    def workload(self, node_cluster: str) -> Workload | None:
        return self._workloads.get(node_cluster)
