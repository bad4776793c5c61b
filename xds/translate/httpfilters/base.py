"""The HTTP filter unit and what it is given: the context of one HTTP connection manager."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from meshfn import ir
from meshfn.contracts.plugins import AuditSettings, DegradeSettings, RouteSettings, Trigger

from ...fragments.plugins import degrade_rules, drill_trigger
from ..resources import Resources


@dataclass(frozen=True)
class AuditConfig:
    """The audit filter of one proxy: its plugin settings, its journal, where the builds are."""

    settings: AuditSettings
    journal: Path
    wasm_dir: Path
    # None on a gateway (it names the mesh route from its own routes); on a sidecar the SPIFFE
    # IDs of the gateways whose x-meshfn-route header its records believe
    # (meshfn.xds.fragments.plugins.mesh_route_fields)
    trusted_gateways: tuple[str, ...] | None = ()


@dataclass(frozen=True)
class DegradeConfig:
    """The degrade filter of one gateway listener. `routes`: each drift-guarded route's key and
    its Envoy route names, in listener order (what the filter's rules name)."""

    listener: str
    routes: tuple[tuple[str, tuple[str, ...]], ...]
    drill: ir.Drill | None
    wasm_dir: Path

    @property
    def trigger(self) -> Trigger | None:
        """The filter's trigger for the callers Mesh.spec.drill names."""
        return drill_trigger(self.drill)

    def settings(self, degraded: frozenset[str]) -> DegradeSettings:
        """The filter's plugin settings, with the routes in `degraded` rerouted (their drift
        breaker has tripped): fragments.plugins.degrade_rules, shared with Istio."""
        return degrade_rules(self.routes, degraded, self.trigger)


@dataclass(frozen=True)
class QoSContext:
    """Multi-tenant QoS on one connection manager. `claim`: the verified JWT claim naming the
    tenant (jwt_authn writes it as contracts.qos.TENANT_HEADER for the inference backend);
    `gateway`: the QoSPolicy bound to the whole gateway; `rate_limited`: a policy governing some
    route of this listener limits the rate (the local rate limit filter runs);
    `limit_service_metadata`: what the gateway's calls to the limit service carry to prove
    which gateway asks (a global rate; empty offline); `shed`: a policy governing some route
    sheds the lower priorities at this gateway (routes by priority, its local reply)."""

    claim: str
    gateway: ir.QoSPolicy | None = None
    rate_limited: bool = False
    limit_service_metadata: tuple[tuple[str, str], ...] = ()
    shed: bool = False


@dataclass(frozen=True)
class TracingContext:
    """Tracing on one connection manager: the mesh's setting, the collector the run mode
    chose, which proxy this is (`service`: its spans' service.name), the gateway's effective
    settings (for a sidecar: the mesh's sampling; sidecars follow their callers' decisions)."""

    tracing: ir.Tracing
    collector: ir.TraceCollector
    kind: Literal["gateway", "sidecar"]
    service: str
    settings: ir.GatewayTracing
    verified_tokens: bool = False  # jwt_authn runs here: the tenant tag has a source
    # every caller samples little (ir.Tracing.split): the proxy's tracer sits on an internal
    # listener that only the requests it traces take (translate.httpfilters.tracing), not on
    # every request, and a request it does not trace carries no trace context
    split: bool = False

    @property
    def restarts(self) -> bool:
        return self.kind == "gateway" and self.settings.client_context == "restart"

    @property
    def honors(self) -> bool:
        return self.kind == "gateway" and self.settings.client_context == "honor"


@dataclass(frozen=True)
class RouteConfig:
    """The model router of one gateway listener (part of the meshfn plugin): its settings
    (fragments.plugins.route_settings, shared with Istio)."""

    listener: str
    settings_json: str  # RouteSettings, as JSON: hashable, as the FilterContext must be
    wasm_dir: Path

    @staticmethod
    def of(listener: str, settings: RouteSettings, wasm_dir: Path) -> RouteConfig:
        return RouteConfig(listener, settings.model_dump_json(exclude_none=True), wasm_dir)

    def settings(self) -> RouteSettings:
        return RouteSettings.model_validate_json(self.settings_json)

    @property
    def openai(self) -> bool:
        """It routes OpenAI's requests (not only KServe gRPC calls)."""
        return bool(self.settings().models)


@dataclass(frozen=True)
class FilterContext:
    """Everything the HTTP filters of one HTTP connection manager depend on. Hashable, so the
    listener and route builders memoise on it, and free of runtime state (the drift breaker's
    overlay reaches `HttpFilter.resources` only): tripping a route never rebuilds a listener."""

    jwt_rules: tuple[ir.JwtRule, ...] = ()
    authz: tuple[ir.AuthzPolicy, ...] = ()
    audit: AuditConfig | None = None
    degrade: DegradeConfig | None = None  # gateways only
    mesh_route: bool = False  # a gateway of a mesh that audits: it sets x-meshfn-route
    qos: QoSContext | None = None
    tracing: TracingContext | None = None
    route: RouteConfig | None = None  # gateways with OpenAI model routes: the model router
    # OpenAI's API passes here (a gateway routing it, a sidecar in front of a backend serving
    # functions): Envoy's own replies on its paths are OpenAI's error objects
    openai: bool = False

    @property
    def combined(self) -> bool:
        """The filters run as ONE plugin (meshfn.wasm, httpfilters.plugin) in the audit
        filter's place: audit and degrade together (Envoy's fixed cost per wasm filter and
        request is then paid once), and the model router with whichever of them there is."""
        return (self.audit is not None and self.degrade is not None) or self.route is not None


C = TypeVar("C")


class HttpFilter(ABC, Generic[C]):
    """One filter of the chain (its place is its position in `httpfilters.HTTP_FILTERS`).
    `config` says whether it applies to a connection manager and with what; the hooks, called
    only where it applies, say what it adds. Each hook's contributions land in registry order;
    the defaults add nothing."""

    @abstractmethod
    def config(self, ctx: FilterContext) -> C | None:
        """What this filter runs with on `ctx`'s connection manager, or None: not there."""

    def http_filters(self, ctx: FilterContext, config: C) -> Iterable[hcm.HttpFilter]:
        """Entries of the HTTP connection manager's filter chain."""
        return ()

    def connection_manager(self, ctx: FilterContext, config: C) -> hcm.HttpConnectionManager | None:
        """Settings of the connection manager itself (its tracing), merged into it."""
        return None

    def access_logs(self, ctx: FilterContext, config: C) -> Iterable[accesslog_pb2.AccessLog]:
        """The connection manager's access logs."""
        return ()

    def early_headers_to_remove(self, ctx: FilterContext, config: C) -> Iterable[str]:
        """Headers the connection manager removes before Envoy picks a route or runs any
        filter (one extension for every unit's: fragments.headers)."""
        return ()

    def local_reply_mappers(
        self, ctx: FilterContext, config: C, header: bool = False
    ) -> Iterable[hcm.ResponseMapper]:
        """How the connection manager rewrites the local replies this filter makes. `header`:
        for a connection manager behind the one where jwt_authn ran (a split gateway's
        internal listener), which reads a verified claim from the header jwt_authn wrote it
        into, having no payload of its own."""
        return ()

    def request_headers_to_remove(self, ctx: FilterContext, config: C) -> Iterable[str]:
        """Headers the route configuration removes before a request goes upstream."""
        return ()

    def resources(self, ctx: FilterContext, config: C, overlay: ir.Overlay) -> Resources:
        """Resources the filter's configuration refers to (clusters, ECDS configurations)."""
        return {}
