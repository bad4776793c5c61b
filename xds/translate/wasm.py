"""Envoy configuration for meshfn's proxy-wasm filters and the audit access log.

The plugin JSON comes from meshfn.contracts.plugins (shared with the Istio renderer); this module
wraps it in Envoy's wasm filter, picks the build that can run it, and writes the access-log and
early-header-mutation pieces the filters rely on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    base_pb2,
    config_source_pb2,
    extension_pb2,
    substitution_format_string_pb2,
)
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt_authn_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as http_wasm_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.wasm.v3 import wasm_pb2
from google.protobuf import any_pb2, struct_pb2, wrappers_pb2

from meshfn.contracts.plugins import (
    AuditSettings,
    DegradeSettings,
    FilterKind,
    MeshfnSettings,
    RouteSettings,
    build_name,
    internal_headers,
    needs_full_build,
    plugin_json,
)

from ..fragments.headers import early_header_removal
from ..fragments.plugins import access_log_format, claim_header_pairs
from .common import ads_source

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


def wasm_path(name: FilterKind, lean: bool, directory: Path) -> Path:
    return directory / f"{build_name(name, lean)}.wasm"


def wasm_http_filter(
    name: str,
    wasm: Path,
    configuration: str,
    *,
    fail_open: bool = False,
    vm_id: str | None = None,
    waits_for_body: bool = False,
) -> hcm_pb2.HttpFilter:
    """An `envoy.filters.http.wasm` entry. Fail closed by default: if the VM dies, requests get
    503 instead of passing unaudited (audit) or with a spoofable routing header (degrade).

    `waits_for_body`: the plugin pauses the headers until it has read the body (the model
    router). Envoy turns a plugin's paused headers into StopAllIteration unless told otherwise,
    and StopAllIteration holds the body back from the plugin itself: it would wait forever."""
    plugin = wasm_pb2.PluginConfig(
        name=name,
        root_id=name,
        vm_config=wasm_pb2.VmConfig(
            vm_id=vm_id or name,
            runtime="envoy.wasm.runtime.v8",
            code=base_pb2.AsyncDataSource(local=base_pb2.DataSource(filename=str(wasm))),
        ),
        failure_policy=wasm_pb2.FAIL_OPEN if fail_open else wasm_pb2.FAIL_CLOSED,
    )
    if waits_for_body:
        plugin.allow_on_headers_stop_iteration.value = True
    plugin.configuration.Pack(wrappers_pb2.StringValue(value=configuration))
    typed = any_pb2.Any()
    typed.Pack(http_wasm_pb2.Wasm(config=plugin))
    return hcm_pb2.HttpFilter(name=f"meshfn.{name}", typed_config=typed)


def plugin_filter(
    kind: FilterKind,
    settings: AuditSettings | DegradeSettings | MeshfnSettings,
    directory: Path,
) -> hcm_pb2.HttpFilter:
    """The filter for `settings` on the cheapest build that can run them. A -lean VM serves one
    configuration, so its vm_id carries a digest of the configuration: Envoy shares a VM only
    between plugins with the same vm_id and code, hence only between identical configurations.
    (A new configuration therefore starts a new VM; plugins are reconfigured rarely.)"""
    configuration = plugin_json(settings)
    name = "meshfn" if kind == "meshfn" else f"meshfn_{kind}"
    lean = not needs_full_build(settings)
    wasm = wasm_path(kind, lean, directory)
    vm_id = f"{name}.{hashlib.sha256(configuration.encode()).hexdigest()[:16]}" if lean else name
    waits = isinstance(settings, MeshfnSettings) and settings.route is not None
    return wasm_http_filter(name, wasm, configuration, vm_id=vm_id, waits_for_body=waits)


def audit_filter(settings: AuditSettings, directory: Path) -> hcm_pb2.HttpFilter:
    return plugin_filter("audit", settings, directory)


def degrade_filter(settings: DegradeSettings, directory: Path) -> hcm_pb2.HttpFilter:
    return plugin_filter("degrade", settings, directory)


def meshfn_filter(
    audit: AuditSettings | None,
    degrade: DegradeSettings | None,
    directory: Path,
    route: RouteSettings | None = None,
) -> hcm_pb2.HttpFilter:
    """Audit, the model router and degrade as ONE filter (meshfn.wasm): same behaviour as the
    filters in that order, but Envoy's fixed per-filter, per-request wasm cost is paid once.
    Place it after jwt_authn."""
    settings = MeshfnSettings(audit=audit, degrade=degrade, route=route)
    return plugin_filter("meshfn", settings, directory)


def ecds_slot(name: str) -> hcm_pb2.HttpFilter:
    """A wasm filter's place in the chain, its configuration sent over ECDS as `name` (Envoy
    pairs the two by name): Envoy fetches it over ADS and, while it has none, keeps the listener
    warming (never serves without it). A new configuration then changes only that resource."""
    return hcm_pb2.HttpFilter(
        name=name,
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=ads_source(), type_urls=[WASM_FILTER_TYPE]
        ),
    )


def ecds_config(name: str, built: hcm_pb2.HttpFilter) -> extension_pb2.TypedExtensionConfig:
    """The ECDS resource `name` holding the configuration of the filter `built`."""
    return extension_pb2.TypedExtensionConfig(name=name, typed_config=built.typed_config)


def early_header_mutation(
    degrade: DegradeSettings | None = None,
    audit: AuditSettings | None = None,
    mesh_route: bool = False,
    tenant: bool = False,
    route: RouteSettings | None = None,
) -> extension_pb2.TypedExtensionConfig:
    """For HttpConnectionManager.early_header_mutation_extensions: removes `internal_headers`
    from client requests BEFORE Envoy matches a route or runs a filter. Envoy picks the route
    before any HTTP filter runs, so without this a spoofed routing header would choose a fallback
    route first; the degrade filter then strips it and clears the route cache (routing ends up
    right), but it can only evaluate its rules against the route Envoy had picked. In jwt_headers
    mode it is what makes the claim headers trustworthy: only jwt_authn can have set them."""
    names = internal_headers(degrade, audit, mesh_route, tenant, route)
    if not names:
        raise ValueError("early_header_mutation needs degrade settings, jwt_headers audit or QoS")
    return early_header_removal(names)


def jwt_claim_headers(settings: AuditSettings) -> list[jwt_authn_pb2.JwtClaimToHeader]:
    """`claim_to_headers` entries for every jwt_authn provider, in jwt_headers mode."""
    return [
        jwt_authn_pb2.JwtClaimToHeader(header_name=header, claim_name=claim)
        for header, claim in claim_header_pairs(settings, None)
    ]


def access_log(
    journal: Path,
    settings: AuditSettings,
    trusted_gateways: tuple[str, ...] | None = (),
    split_trace: bool = False,
) -> accesslog_pb2.AccessLog:
    """The HttpConnectionManager access-log entry the collector reads (Envoy's file logger:
    written by Envoy whether or not the collector runs, hence loss-free), for the audit filter
    configured with `settings`. Start Envoy with `--file-flush-interval-msec 200` or so: the
    default (10 s) only delays records."""
    fields = struct_pb2.Struct()
    fields.update(access_log_format(settings, trusted_gateways, split_trace))
    logger = file_pb2.FileAccessLog(
        path=str(journal),
        log_format=substitution_format_string_pb2.SubstitutionFormatString(json_format=fields),
    )
    typed = any_pb2.Any()
    typed.Pack(logger)
    return accesslog_pb2.AccessLog(name="envoy.access_loggers.file", typed_config=typed)
