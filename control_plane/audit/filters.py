"""Envoy configuration for the meshfn proxy-wasm filters and the audit access log.

The translator puts `audit_filter(...)` and `degrade_filter(...)` into a listener's HTTP filter
chain (audit AFTER jwt_authn, whose verified payload it reads; degrade before the router),
`access_log(journal)` into the HttpConnectionManager's `access_log`, and
`early_header_mutation(...)` into its `early_header_mutation_extensions`. The settings models
mirror exactly what the C filters accept (wasm_filters/README.md documents the JSON); the filters
validate again and fail closed, so a config built by hand that bypasses these models is still
refused by Envoy (a NACK).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2, substitution_format_string_pb2
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.filters.http.jwt_authn.v3 import config_pb2 as jwt_authn_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as http_wasm_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2,
)
from envoy.extensions.wasm.v3 import wasm_pb2
from google.protobuf import any_pb2, struct_pb2, wrappers_pb2
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

AUDIT_FILTER_STATE = "wasm.meshfn_audit"
ROUTING_HEADER = "x-meshfn-degrade-route"
TRIGGER_HEADER = "x-meshfn-degrade"

_HEADER = r"^[a-z0-9_-]{1,64}$"
_NAME = r"^[!#-+\--\[\]-~]{1,256}$"  # visible ASCII except , " \


class BuildError(RuntimeError):
    """The filters could not be built (toolchain missing or compile error); message says why."""


# ------------------------------------------------------------------ settings (plugin JSON)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BodyHash(_Strict):
    enabled: bool = Field(False, description="hash request bodies (SHA-256, hex)")
    max_bytes: Annotated[int, Field(ge=1, le=1 << 30)] = Field(
        1 << 20,
        description="bodies longer than this (declared or seen) are recorded as too_large;"
        " bodies without content-length (streams) are never hashed",
    )


class AuditSettings(_Strict):
    """Plugin configuration of the audit filter."""

    subject_salt: Annotated[str, Field(pattern=r"^([0-9a-fA-F]{2}){16,64}$", repr=False)] = Field(
        description="HMAC key for the subject, 16-64 bytes as hex; records carry"
        " HMAC-SHA256(salt, sub), never the sub"
    )
    salt_id: Annotated[str, Field(pattern=r"^[!-~]{1,64}$")] = Field(
        "default",
        description="names the salt in every record, so hashes from before and after"
        " a salt rotation are not compared blindly",
    )
    subject_source: Literal["jwt_authn", "jwt_headers", "header"] = Field(
        "jwt_authn",
        description="jwt_authn: verified payload from jwt_authn's dynamic metadata (filter after"
        " jwt_authn); jwt_headers: headers jwt_authn's claim_to_headers set (fastest; needs"
        " jwt_claim_headers + early_header_mutation); header: the bearer token, NOT verified",
    )
    jwt_metadata_key: Annotated[str, Field(pattern=r"^[!-~]{1,128}$")] = Field(
        "jwt_payload", description="jwt_authn payload_in_metadata name (jwt_authn mode)"
    )
    token_header: Annotated[str, Field(pattern=_HEADER)] = Field(
        "authorization", description="header with `Bearer <jwt>` (header mode)"
    )
    tenant_claim: Annotated[str, Field(pattern=r"^[!-~]{0,128}$")] = Field(
        "tenant", description="claim recorded as tenant (capped at 128 bytes); empty: none"
    )
    sub_header: Annotated[str, Field(pattern=_HEADER)] = Field(
        "x-meshfn-jwt-sub", description="claim header for sub (jwt_headers mode)"
    )
    tenant_header: Annotated[str, Field(pattern=_HEADER)] = Field(
        "x-meshfn-jwt-tenant", description="claim header for the tenant (jwt_headers mode)"
    )
    body_hash: BodyHash = Field(BodyHash(), description="request body hashing (off by default)")

    @model_validator(mode="after")
    def _loggable(self) -> AuditSettings:
        if bare_filter_state(self):
            for name in ("jwt_metadata_key", "tenant_claim"):
                if any(c in getattr(self, name) for c in _METADATA_PATH_SPECIALS):
                    raise ValueError(
                        f"{name} may not contain any of {_METADATA_PATH_SPECIALS!r} in"
                        " jwt_headers mode without body hashing (the access log reads the"
                        " tenant from jwt_authn's dynamic metadata by that path)"
                    )
        return self


# Characters that would break a %DYNAMIC_METADATA(namespace:key:claim)% command.
_METADATA_PATH_SPECIALS = ":()%"


def bare_filter_state(settings: AuditSettings) -> bool:
    """jwt_headers mode without body hashing: the filter state is the subject alone (64 hex
    digits, or `null` when the request has none) and `access_log(..., settings)` writes the
    rest: salt_id and subject_source as constants, the tenant from jwt_authn's verified payload
    in dynamic metadata (`jwt_metadata_key`). Saves the filter a header read and most of the
    filter state it builds. Any other configuration publishes one JSON object."""
    return settings.subject_source == "jwt_headers" and not settings.body_hash.enabled


class DegradeRule(_Strict):
    """Applies to a request whose route name is in `routes` or whose cluster is in `clusters`
    (first matching rule wins)."""

    name: Annotated[str, Field(pattern=_NAME)] = Field(description="in logs and reject bodies")
    routes: list[Annotated[str, Field(pattern=_NAME)]] = Field(
        default_factory=list, max_length=256, description="Envoy route names"
    )
    clusters: list[Annotated[str, Field(pattern=_NAME)]] = Field(
        default_factory=list, max_length=256, description="Envoy cluster names (services)"
    )
    mode: Literal["reroute", "reject"] = Field(
        description="reroute: set the routing header to a fallback and clear the route cache;"
        " reject: answer 503 with a JSON body"
    )
    fallbacks: list[Annotated[str, Field(pattern=_NAME)]] = Field(
        default_factory=list,
        max_length=8,
        description="reroute: routing header values, best first; the translator's fallback"
        " routes match them",
    )
    depth: Annotated[int, Field(ge=0, le=8)] = Field(
        0,
        description="0 = healthy; k = degraded: reroute to fallbacks[k-1], or reject. The drift"
        " breaker raises it by pushing new plugin config",
    )

    @model_validator(mode="after")
    def _consistent(self) -> DegradeRule:
        if not self.routes and not self.clusters:
            raise ValueError("a rule needs at least one entry in routes or clusters")
        if self.mode == "reroute" and not self.fallbacks:
            raise ValueError("mode reroute needs 1-8 fallbacks")
        if self.mode == "reject" and self.fallbacks:
            raise ValueError("mode reject takes no fallbacks")
        if self.mode == "reroute" and self.depth > len(self.fallbacks):
            raise ValueError("depth is deeper than the fallback list")
        return self


_CALLER = Annotated[str, Field(pattern=r"^[!#-+\--\[\]-~]{1,2048}$")]
ISSUER_HEADER = "x-meshfn-jwt-iss"
SUBJECT_HEADER = "x-meshfn-jwt-sub"


class Trigger(_Strict):
    """Per-request degradation for drills: `<header>: <depth 1-8>`, honoured only for a listed
    mTLS peer (URI SAN) or a listed verified JWT (`<iss>/<sub>`, `prefix*`); stripped from every
    request either way."""

    header: Annotated[str, Field(pattern=_HEADER)] = TRIGGER_HEADER
    principals: list[_CALLER] = Field(
        default_factory=list, max_length=256, description="SPIFFE IDs allowed to use the trigger"
    )
    request_principals: list[_CALLER] = Field(
        default_factory=list,
        max_length=256,
        description="`<iss>/<sub>` of verified JWTs allowed to use the trigger; a trailing `*`"
        " matches a prefix",
    )
    issuer_header: Annotated[str, Field(pattern=_HEADER)] = Field(
        ISSUER_HEADER, description="where jwt_authn writes the verified `iss` (claim_to_headers)"
    )
    subject_header: Annotated[str, Field(pattern=_HEADER)] = Field(
        SUBJECT_HEADER, description="where jwt_authn writes the verified `sub` (claim_to_headers)"
    )

    @model_validator(mode="after")
    def _someone(self) -> Trigger:
        if not self.principals and not self.request_principals:
            raise ValueError("principals or request_principals must name at least one caller")
        return self


class DegradeSettings(_Strict):
    """Plugin configuration of the degrade filter (what the drift breaker pushes)."""

    routing_header: Annotated[str, Field(pattern=_HEADER)] = Field(
        ROUTING_HEADER,
        description="internal header the fallback routes match; always stripped"
        " from client requests",
    )
    listener_strips_routing_header: bool = Field(
        False,
        description="the listener removes the routing header before Envoy picks a route (early"
        " header mutation, as the translator configures it), so the filter need not look for it",
    )
    trigger: Trigger | None = None
    rules: list[DegradeRule] = Field(max_length=256)

    @field_validator("trigger")
    @classmethod
    def _distinct(cls, trigger: Trigger | None, info: Any) -> Trigger | None:
        if trigger is not None and trigger.header == info.data.get("routing_header"):
            raise ValueError("trigger.header must differ from routing_header")
        return trigger


class MeshfnSettings(_Strict):
    """Plugin configuration of the combined filter (meshfn.wasm): both parts in one plugin."""

    audit: AuditSettings | None = None
    degrade: DegradeSettings | None = None

    @model_validator(mode="after")
    def _something(self) -> MeshfnSettings:
        if self.audit is None and self.degrade is None:
            raise ValueError("needs audit or degrade settings")
        return self


def plugin_json(settings: AuditSettings | DegradeSettings | MeshfnSettings) -> str:
    """The exact JSON the filter receives (defaults included, None omitted)."""
    return json.dumps(settings.model_dump(exclude_none=True), separators=(",", ":"))


# ------------------------------------------------------------------ building the .wasm


def source_dir() -> Path:
    return Path(
        os.environ.get("MESHFN_WASM_SRC", Path(__file__).resolve().parents[2] / "wasm_filters")
    )


FilterKind = Literal["audit", "degrade", "meshfn"]
BUILDS = tuple(f"{kind}{lean}" for lean in ("", "-lean") for kind in ("audit", "degrade", "meshfn"))


@cache
def wasm_dir(native: bool = False) -> Path:
    """Directory with the builds (audit, degrade, meshfn = both in one plugin; each also as
    -lean): $MESHFN_WASM_DIR if set (prebuilt), else built from wasm_filters/ by build.sh into
    ~/.cache/meshfn (content-addressed, < 1 s)."""
    prebuilt = os.environ.get("MESHFN_WASM_DIR")
    if prebuilt and not native:
        path = Path(prebuilt)
        for name in BUILDS:
            if not (path / f"{name}.wasm").is_file():
                raise BuildError(f"MESHFN_WASM_DIR={prebuilt} has no {name}.wasm")
        return path
    script = source_dir() / "build.sh"
    if not script.is_file():
        raise BuildError(f"{script} not found: set MESHFN_WASM_DIR to prebuilt filters")
    argv = ["bash", str(script), *(["--native"] if native else [])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"building the wasm filters failed: {exc}") from None
    if done.returncode != 0:
        raise BuildError(f"building the wasm filters failed:\n{done.stderr.strip()}")
    return Path(done.stdout.strip().splitlines()[-1])


@cache
def harness(name: Literal["fakehost", "envoy_static"]) -> ModuleType:
    """The filters' test harness (wasm_filters/harness/<name>.py: the fake ABI host's driver, or
    static Envoy configs for e2e tests and benchmarks). wasm_filters/ ships as source, not as a
    package, so it is loaded by path; each module is loaded once."""
    path = source_dir() / "harness" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"meshfn_harness_{name}", path)
    if spec is None or spec.loader is None:
        raise BuildError(f"{path} not found")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def wasm_path(name: FilterKind, lean: bool = False, directory: Path | None = None) -> Path:
    return (directory or wasm_dir()) / f"{name}{'-lean' if lean else ''}.wasm"


def needs_full_build(settings: AuditSettings | DegradeSettings | MeshfnSettings) -> bool:
    """Only body hashing needs per-request state beyond the request headers; everything else
    runs on the -lean build (no per-request context: ~2.5 us less Envoy CPU per request)."""
    audit = settings.audit if isinstance(settings, MeshfnSettings) else settings
    return isinstance(audit, AuditSettings) and audit.body_hash.enabled


# ------------------------------------------------------------------ Envoy config


def wasm_http_filter(
    name: str,
    wasm: Path,
    configuration: str,
    *,
    fail_open: bool = False,
    vm_id: str | None = None,
) -> hcm_pb2.HttpFilter:
    """An `envoy.filters.http.wasm` entry. Fail closed by default: if the VM dies, requests get
    503 instead of passing unaudited (audit) or with a spoofable routing header (degrade)."""
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
    plugin.configuration.Pack(wrappers_pb2.StringValue(value=configuration))
    typed = any_pb2.Any()
    typed.Pack(http_wasm_pb2.Wasm(config=plugin))
    return hcm_pb2.HttpFilter(name=f"meshfn.{name}", typed_config=typed)


def plugin_filter(
    kind: FilterKind,
    settings: AuditSettings | DegradeSettings | MeshfnSettings,
    directory: Path | None = None,
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
    return wasm_http_filter(name, wasm, configuration, vm_id=vm_id)


def audit_filter(settings: AuditSettings, directory: Path | None = None) -> hcm_pb2.HttpFilter:
    return plugin_filter("audit", settings, directory)


def degrade_filter(settings: DegradeSettings, directory: Path | None = None) -> hcm_pb2.HttpFilter:
    return plugin_filter("degrade", settings, directory)


def meshfn_filter(
    audit: AuditSettings | None = None,
    degrade: DegradeSettings | None = None,
    directory: Path | None = None,
) -> hcm_pb2.HttpFilter:
    """Audit and degrade as ONE filter (meshfn.wasm): same behaviour as the two filters in that
    order, but Envoy's fixed per-filter, per-request wasm cost is paid once. Place it after
    jwt_authn."""
    return plugin_filter("meshfn", MeshfnSettings(audit=audit, degrade=degrade), directory)


def internal_headers(
    degrade: DegradeSettings | None = None, audit: AuditSettings | None = None
) -> list[str]:
    """Headers only Envoy itself may set: the routing header, and the claim headers jwt_authn
    writes (audit in jwt_headers mode; a trigger naming request principals)."""
    names = [degrade.routing_header] if degrade is not None else []
    trigger = degrade.trigger if degrade is not None else None
    if trigger is not None and trigger.request_principals:
        names += [trigger.issuer_header, trigger.subject_header]
    if audit is not None and audit.subject_source == "jwt_headers":
        names.append(audit.sub_header)
        if audit.tenant_claim:
            names.append(audit.tenant_header)
    return list(dict.fromkeys(names))


def early_header_mutation(
    degrade: DegradeSettings | None = None, audit: AuditSettings | None = None
) -> extension_pb2.TypedExtensionConfig:
    """For HttpConnectionManager.early_header_mutation_extensions: removes `internal_headers`
    from client requests BEFORE Envoy matches a route or runs a filter. Envoy picks the route
    before any HTTP filter runs, so without this a spoofed routing header would choose a fallback
    route first; the degrade filter then strips it and clears the route cache (routing ends up
    right), but it can only evaluate its rules against the route Envoy had picked. In jwt_headers
    mode it is what makes the claim headers trustworthy: only jwt_authn can have set them."""
    names = internal_headers(degrade, audit)
    if not names:
        raise ValueError("early_header_mutation needs degrade settings or jwt_headers audit")
    mutation = header_mutation_pb2.HeaderMutation(
        mutations=[mutation_rules_pb2.HeaderMutation(remove=name) for name in names]
    )
    typed = any_pb2.Any()
    typed.Pack(mutation)
    return extension_pb2.TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation", typed_config=typed
    )


def jwt_claim_headers(settings: AuditSettings) -> list[jwt_authn_pb2.JwtClaimToHeader]:
    """`claim_to_headers` entries for every jwt_authn provider, in jwt_headers mode."""
    entries = [jwt_authn_pb2.JwtClaimToHeader(header_name=settings.sub_header, claim_name="sub")]
    # a bare filter state leaves the tenant to the access log (jwt_authn's metadata)
    if settings.tenant_claim and not bare_filter_state(settings):
        entries.append(
            jwt_authn_pb2.JwtClaimToHeader(
                header_name=settings.tenant_header, claim_name=settings.tenant_claim
            )
        )
    return entries


# One JSON object per line; `record.from_log_line` reads exactly these keys (plus those of
# `access_log_format(settings)` for a bare filter state).
ACCESS_LOG_FORMAT: dict[str, str] = {
    "id": "%REQ(X-REQUEST-ID)%",
    "time": "%START_TIME(%Y-%m-%dT%H:%M:%S.%6fZ)%",
    "method": "%REQ(:METHOD)%",
    "authority": "%REQ(:AUTHORITY)%",
    "path": "%PATH(NQ)%",  # never the query string: tokens travel there
    "status": "%RESPONSE_CODE%",
    "duration_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
    "duration_ms": "%DURATION%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "route": "%ROUTE_NAME%",
    "principal": "%DOWNSTREAM_PEER_URI_SAN%",
    "flags": "%RESPONSE_FLAGS%",
    "traceparent": "%REQ(TRACEPARENT):128%",
    "b3_trace_id": "%REQ(X-B3-TRACEID):64%",
    "audit": f"%FILTER_STATE({AUDIT_FILTER_STATE}:PLAIN)%",
}


AUDIT_STATE_VERSION = "1"


def _literal(text: str) -> str:
    """`text` verbatim in an Envoy format string."""
    return text.replace("%", "%%")


def access_log_format(settings: AuditSettings) -> dict[str, str]:
    """ACCESS_LOG_FORMAT, and for a bare filter state (`bare_filter_state`) what the filter no
    longer publishes: the audit record version, salt_id and subject_source (constants of this
    configuration) and the tenant from jwt_authn's verified payload. The tenant is not capped
    here: Envoy cuts bytes, and a cut through a UTF-8 character makes its JSON writer escape the
    whole value byte by byte; record.from_log_line caps it at 128 characters (flagged
    `truncated`). It uses these fields only when the filter state is present."""
    fields = dict(ACCESS_LOG_FORMAT)
    if bare_filter_state(settings):
        fields["audit_v"] = AUDIT_STATE_VERSION
        fields["salt_id"] = _literal(settings.salt_id)
        fields["subject_source"] = settings.subject_source
        if settings.tenant_claim:
            fields["tenant"] = (
                "%DYNAMIC_METADATA(envoy.filters.http.jwt_authn:"
                f"{settings.jwt_metadata_key}:{settings.tenant_claim})%"
            )
    return fields


def access_log(journal: Path, settings: AuditSettings) -> accesslog_pb2.AccessLog:
    """The HttpConnectionManager access-log entry the collector reads (Envoy's file logger:
    written by Envoy whether or not the collector runs, hence loss-free), for the audit filter
    configured with `settings`. Start Envoy with `--file-flush-interval-msec 200` or so: the
    default (10 s) only delays records."""
    fields = struct_pb2.Struct()
    fields.update(access_log_format(settings))
    logger = file_pb2.FileAccessLog(
        path=str(journal),
        log_format=substitution_format_string_pb2.SubstitutionFormatString(json_format=fields),
    )
    typed = any_pb2.Any()
    typed.Pack(logger)
    return accesslog_pb2.AccessLog(name="envoy.access_loggers.file", typed_config=typed)


def schemas() -> dict[str, Any]:
    """JSON Schema of both plugin configurations (documented in wasm_filters/README.md)."""
    return {
        "audit": AuditSettings.model_json_schema(),
        "degrade": DegradeSettings.model_json_schema(),
        "meshfn": MeshfnSettings.model_json_schema(),
    }


def write_schemas(directory: Path) -> list[Path]:
    """wasm_filters/schema/{audit,degrade,meshfn}.schema.json (a test fails when stale)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in schemas().items():
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
