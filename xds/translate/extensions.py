"""meshfn's proxy-wasm filters and the audit journal in a proxy's configuration.

Audit: on the proxies `Mesh.spec.audit` names, the audit filter sits after jwt_authn (it reads the
verified payload) and before RBAC (so denied requests carry their subject too), and Envoy's file
access log writes each request as one journal line the control plane's collector stores. On a
proxy with jwt rules the filter reads the verified claims from headers jwt_authn writes
(subject_source jwt_headers, the cheapest mode): every provider gets the claim_to_headers entries,
the HTTP connection manager removes those headers from client requests before any filter runs
(early header mutation) and the route configuration removes them before the request goes
upstream, so only jwt_authn can set them and the backend never sees the raw subject. Proxies
without jwt rules keep jwt_authn mode (no verified token, no subject).

Degrade: on a gateway whose routes have a drift breaker, the degrade filter arrives over ECDS, not
inside the listener. Tripping or resetting the breaker then pushes only new plugin configuration:
the listener, its connections and the route table stay as they are (a listener update would drain
keep-alive connections slowly and leave them on the old configuration meanwhile). Where the same
listener also audits, both run as ONE plugin (meshfn.wasm, over ECDS, in the audit filter's
place): Envoy's fixed cost per wasm filter and request is then paid once, not twice.

Builds: the -lean builds (no per-request context) unless body hashing needs the full one; see
translate.wasm.plugin_filter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import config_source_pb2, extension_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)

from meshfn import ir
from meshfn.contracts.journal import journal_path
from meshfn.contracts.plugins import (
    AuditSettings,
    BodyHash,
    DegradeRule,
    DegradeSettings,
    SubjectSalt,
    Trigger,
    internal_headers,
)

from .common import ads_source
from .routes import route_name
from .security import JWT_PAYLOAD
from .wasm import (
    access_log,
    audit_filter,
    degrade_filter,
    early_header_mutation,
    jwt_claim_headers,
    meshfn_filter,
)

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


@dataclass(frozen=True)
class ProxyHost:
    """What the translator needs about the proxies' host that policies do not say: where the
    built filters are, where journals go, and the subject salt (a secret; see audit.salt)."""

    wasm_dir: Path
    state_dir: Path
    salt: SubjectSalt = field(repr=False)

    def journal(self, node_cluster: str) -> Path:
        return journal_path(self.state_dir, node_cluster)


# For offline rendering and golden files only: the control plane always passes its own host.
OFFLINE_HOST = ProxyHost(
    Path("/var/lib/meshfn/wasm"), Path("/var/lib/meshfn"), SubjectSalt("00" * 32)
)


@dataclass(frozen=True)
class Audit:
    """The audit pieces of one HTTP connection manager (hashable: listener builders memoise)."""

    settings: AuditSettings
    journal: Path
    wasm_dir: Path

    def http_filter(self) -> hcm.HttpFilter:
        return audit_filter(self.settings, self.wasm_dir)

    def access_log(self) -> accesslog_pb2.AccessLog:
        return access_log(self.journal, self.settings)

    def claim_headers(self) -> tuple[tuple[str, str], ...]:
        """(header, claim) pairs every jwt_authn provider of the proxy must write."""
        if self.settings.subject_source != "jwt_headers":
            return ()
        return tuple((c.header_name, c.claim_name) for c in jwt_claim_headers(self.settings))


def audit_for(model: ir.MeshModel, workload: ir.Workload, host: ProxyHost) -> Audit | None:
    audit = model.audit
    if audit is None or not audit.records(workload.kind):
        return None
    return Audit(
        _audit_settings(audit, host.salt, bool(workload.jwt_rules)),
        host.journal(workload.node_cluster),
        host.wasm_dir,
    )


@lru_cache(maxsize=64)
def _audit_settings(audit: ir.Audit, salt: SubjectSalt, jwt_headers: bool) -> AuditSettings:
    """jwt_headers mode where jwt_authn runs (the proxy has jwt rules), else jwt_authn mode."""
    return AuditSettings(
        subject_salt=salt.hex,
        salt_id=salt.id,
        subject_source="jwt_headers" if jwt_headers else "jwt_authn",
        jwt_metadata_key=JWT_PAYLOAD,
        tenant_claim=audit.tenant_claim,
        body_hash=BodyHash(enabled=audit.body_hash, max_bytes=audit.body_hash_max_bytes),
    )


def degrade_filter_name(listener: ir.Listener, audit: Audit | None) -> str:
    """The HTTP filter's name and its ECDS resource name (Envoy pairs them by name): the
    degrade filter, or the combined plugin where the listener audits too."""
    return f"meshfn.{'plugin' if audit is not None else 'degrade'}.{listener.name}"


def degrade_discovery(name: str) -> hcm.HttpFilter:
    """The filter slot: Envoy fetches its configuration over ADS and, while it has none, keeps
    the listener warming (never serves without it)."""
    return hcm.HttpFilter(
        name=name,
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=ads_source(), type_urls=[WASM_FILTER_TYPE]
        ),
    )


def drill_trigger(drill: ir.Drill | None) -> Trigger | None:
    """The degrade filter's trigger for the callers Mesh.spec.drill names."""
    if drill is None:
        return None
    return Trigger(header=drill.header, request_principals=list(drill.request_principals))


def _header_settings(
    audit: Audit | None, degrade: bool, drill: ir.Drill | None
) -> tuple[DegradeSettings | None, AuditSettings | None]:
    """What decides a listener's internal headers (see contracts.plugins.internal_headers)."""
    settings = DegradeSettings(rules=[], trigger=drill_trigger(drill)) if degrade else None
    return settings, audit.settings if audit is not None else None


def claim_headers(
    audit: Audit | None, degrade: bool, drill: ir.Drill | None
) -> tuple[tuple[str, str], ...]:
    """(header, claim) pairs every jwt_authn provider of the listener must write: the audit
    filter's (jwt_headers mode) and, where drills name request principals, iss and sub."""
    pairs = list(audit.claim_headers()) if audit is not None else []
    trigger = drill_trigger(drill) if degrade else None
    if trigger is not None and trigger.request_principals:
        pairs += [(trigger.issuer_header, "iss"), (trigger.subject_header, "sub")]
    return tuple(dict.fromkeys(pairs))


def early_mutations(
    audit: Audit | None, degrade: bool = False, drill: ir.Drill | None = None
) -> list[extension_pb2.TypedExtensionConfig]:
    """The HCM's early_header_mutation_extensions: the degrade filter's routing header (when it
    runs) and the claim headers (audit in jwt_headers mode, drills naming request principals)
    are removed from client requests before Envoy picks a route or runs a filter. Empty when
    nothing applies."""
    settings = _header_settings(audit, degrade, drill)
    return [early_header_mutation(*settings)] if internal_headers(*settings) else []


def strip_internal_headers(
    config: route_pb2.RouteConfiguration,
    audit: Audit | None,
    degrade: bool = False,
    drill: ir.Drill | None = None,
) -> route_pb2.RouteConfiguration:
    """`config` (unchanged, or a copy) removing the claim headers before any route's request
    goes upstream: the backend never sees the raw subject."""
    settings = _header_settings(audit, degrade, drill)
    routing = settings[0].routing_header if settings[0] is not None else None
    names = [n for n in internal_headers(*settings) if n != routing]
    if not names:
        return config
    out = route_pb2.RouteConfiguration()
    out.CopyFrom(config)
    out.request_headers_to_remove.extend(n for n in names if n not in out.request_headers_to_remove)
    return out


def degrade_settings(
    listener: ir.Listener,
    drift_routes: frozenset[str],
    degraded: frozenset[str],
    drill: ir.Drill | None = None,
) -> DegradeSettings:
    """One rule per drift-guarded route: depth 1 (reroute to the route's degraded twin) once the
    breaker has tripped it, else 0 (pass through). The listener strips the routing header from
    client requests (early_mutations), so the filter does not look for a spoofed one."""
    rules = [
        DegradeRule(
            name=route.key,
            routes=[route_name(route, i) for i in range(len(route.matches))],
            mode="reroute",
            fallbacks=[route.key],
            depth=1 if route.key in degraded else 0,
        )
        for route in listener.routes
        if route.key in drift_routes
    ]
    return DegradeSettings(
        rules=rules, listener_strips_routing_header=True, trigger=drill_trigger(drill)
    )


def degrade_extension(
    name: str, settings: DegradeSettings, audit: Audit | None, host: ProxyHost
) -> extension_pb2.TypedExtensionConfig:
    """The ECDS resource: the degrade filter, or both filters in one plugin with `audit`."""
    if audit is not None:
        built = meshfn_filter(audit.settings, settings, host.wasm_dir)
    else:
        built = degrade_filter(settings, host.wasm_dir)
    return extension_pb2.TypedExtensionConfig(name=name, typed_config=built.typed_config)
