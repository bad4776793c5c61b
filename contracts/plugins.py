"""The plugin configuration JSON of meshfn's proxy-wasm filters: the contract with the C filters.

The xDS translator (ECDS / listener filters) and the Istio renderer (WasmPlugin `pluginConfig`)
both build these models, so the filters receive the same JSON whichever way they are deployed.
They mirror exactly what the C filters accept (wasm_filters/README.md documents the JSON); the
filters validate again and fail closed, so a config that bypasses these models is still refused.
A leaf: pydantic only, nothing of Envoy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .qos import TENANT_HEADER

AUDIT_FILTER_STATE = "wasm.meshfn_audit"
ROUTING_HEADER = "x-meshfn-degrade-route"
# The mesh route (`namespace/name`) a gateway routed a request by, for the sidecars' audit
# records: gateways strip it from clients and set it per route; a sidecar believes it only from
# an mTLS peer that is a gateway identity (audit/record.py: mesh_route).
MESH_ROUTE_HEADER = "x-meshfn-route"
# Envoy route metadata: filter_metadata[ROUTE_METADATA][MESH_ROUTE_KEY] is a gateway route's mesh
# route, which its access log names (meshfn.xds.fragments.plugins.mesh_route_fields).
ROUTE_METADATA = "meshfn"
MESH_ROUTE_KEY = "route"
TRIGGER_HEADER = "x-meshfn-degrade"

_HEADER = r"^[a-z0-9_-]{1,64}$"
_NAME = r"^[!#-+\--\[\]-~]{1,256}$"  # visible ASCII except , " \


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


# What the C filters compare callers as: printable ASCII without space, '"', ',' and '\'
# (the filters' JSON strings carry no escapes). Policies that name trigger callers check this.
CALLER_PATTERN = r"^[!#-+\--\[\]-~]{1,2048}$"
_CALLER = Annotated[str, Field(pattern=CALLER_PATTERN)]
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


# The header a gateway's model router writes from the JSON body's `model` (OpenAI requests):
# stripped from client requests before Envoy picks a route, matched by the model routes.
MODEL_HEADER = "x-meshfn-model"
# The OpenAI operations a gateway routes by the body's model, in both spellings (OpenAI's /v1
# and KServe's /openai/v1), and where they go: below the model, so the path names it.
OPENAI_OPERATIONS = ("chat/completions", "completions", "embeddings")
OPENAI_PREFIXES = ("/v1/", "/openai/v1/")
MODEL_ROUTED_PATHS = tuple(p + op for p in OPENAI_PREFIXES for op in OPENAI_OPERATIONS)
# The KServe gRPC method a gateway that sheds by priority routes by the model its message names
# (unary: one message, one model; a stream may name several and is not routed).
GRPC_MODEL_ROUTED_PATHS = ("/inference.GRPCInferenceService/ModelInfer",)
_ModelName = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")]
_RoutedPath = Annotated[str, Field(pattern=r"^/[!-~]{1,127}$")]


class GrpcRouteSettings(_Strict):
    """The model router's KServe gRPC part (at a gateway that sheds by priority: each Function's
    calls reach its own circuit breakers): a unary call to one of `paths` is routed by the
    `model_name` its message names, one of `models`, written to the router's header. Nothing
    is refused: any other call (compressed, malformed, too large, another model) passes
    unrouted, to the backend's own gRPC route."""

    paths: Annotated[list[_RoutedPath], Field(min_length=1, max_length=16)] = Field(
        default_factory=lambda: list(GRPC_MODEL_ROUTED_PATHS),
        description="exact gRPC method paths whose request message names the model",
    )
    models: Annotated[list[_ModelName], Field(min_length=1, max_length=4096)] = Field(
        description="the models whose calls are routed by their name"
    )


class RouteSettings(_Strict):
    """Plugin configuration of the model router (part of the combined filter): POST requests to
    `paths` are routed by their JSON body's `model`, one of `models`, written to `header`; with
    `grpc`, KServe gRPC calls by the model their message names (`paths` and `models` may then
    be empty: no OpenAI routes)."""

    header: Annotated[str, Field(pattern=_HEADER)] = Field(
        MODEL_HEADER, description="where the model goes (the listener strips it from clients)"
    )
    paths: Annotated[list[_RoutedPath], Field(max_length=16)] = Field(
        default_factory=lambda: list(MODEL_ROUTED_PATHS),
        description="exact request paths (no query) whose body names the model",
    )
    models: Annotated[list[_ModelName], Field(max_length=4096)] = Field(
        description="the models this gateway serves; any other is a 404 (model_not_found)"
    )
    max_body_bytes: Annotated[int, Field(ge=1, le=64 << 20)] = Field(
        1 << 20,
        description="a longer body is refused (413) before it is parsed (a gRPC message: "
        "passes unrouted)",
    )
    grpc: GrpcRouteSettings | None = Field(
        None, description="KServe gRPC calls routed by their message's model_name"
    )

    @model_validator(mode="after")
    def _routes_something(self) -> RouteSettings:
        if bool(self.paths) != bool(self.models):
            raise ValueError("models must be empty exactly when paths is")
        if not self.paths and self.grpc is None:
            raise ValueError("needs paths and models, or grpc")
        return self


class MeshfnSettings(_Strict):
    """Plugin configuration of the combined filter (meshfn.wasm): the parts in one plugin."""

    audit: AuditSettings | None = None
    degrade: DegradeSettings | None = None
    route: RouteSettings | None = None

    @model_validator(mode="after")
    def _something(self) -> MeshfnSettings:
        if self.audit is None and self.degrade is None and self.route is None:
            raise ValueError("needs audit, degrade or route settings")
        return self


def plugin_json(settings: AuditSettings | DegradeSettings | MeshfnSettings) -> str:
    """The exact JSON the filter receives (defaults included, None omitted)."""
    return json.dumps(settings.model_dump(exclude_none=True), separators=(",", ":"))


@dataclass(frozen=True)
class SubjectSalt:
    """The HMAC key that turns a JWT `sub` into the hash audit records carry (a secret: never
    printed; the control plane keeps it in its state directory)."""

    hex: str = field(repr=False)

    @property
    def id(self) -> str:
        """Names the salt in every record without revealing it (rotation leaves a trace)."""
        return "s-" + hashlib.sha256(bytes.fromhex(self.hex)).hexdigest()[:12]


FilterKind = Literal["audit", "degrade", "meshfn"]
# Every build of the filters: audit, degrade and meshfn (both in one plugin), each also -lean.
BUILDS = tuple(f"{kind}{lean}" for lean in ("", "-lean") for kind in ("audit", "degrade", "meshfn"))


def build_name(kind: FilterKind, lean: bool) -> str:
    return f"{kind}{'-lean' if lean else ''}"


def needs_full_build(settings: AuditSettings | DegradeSettings | MeshfnSettings) -> bool:
    """Only body hashing and model routing need per-request state beyond the request headers;
    everything else runs on the -lean build (no per-request context: ~2.5 us less Envoy CPU
    per request)."""
    if isinstance(settings, MeshfnSettings) and settings.route is not None:
        return True
    audit = settings.audit if isinstance(settings, MeshfnSettings) else settings
    return isinstance(audit, AuditSettings) and audit.body_hash.enabled


def internal_headers(
    degrade: DegradeSettings | None = None,
    audit: AuditSettings | None = None,
    mesh_route: bool = False,
    tenant: bool = False,
    route: RouteSettings | None = None,
) -> list[str]:
    """Headers only Envoy itself may set: the routing header, the claim headers jwt_authn
    writes (audit in jwt_headers mode; a trigger naming request principals), on gateways of a
    mesh that audits the mesh-route header, with `tenant` the QoS tenant (which the gateway's
    rate limit and the inference backend read), and the model router's model header."""
    names = [degrade.routing_header] if degrade is not None else []
    if route is not None:
        names.append(route.header)
    if mesh_route:
        names.append(MESH_ROUTE_HEADER)
    if tenant:
        names.append(TENANT_HEADER)
    trigger = degrade.trigger if degrade is not None else None
    if trigger is not None and trigger.request_principals:
        names += [trigger.issuer_header, trigger.subject_header]
    if audit is not None and audit.subject_source == "jwt_headers":
        names.append(audit.sub_header)
        if audit.tenant_claim:
            names.append(audit.tenant_header)
    return list(dict.fromkeys(names))


def schemas() -> dict[str, Any]:
    """JSON Schema of the plugin configurations (documented in wasm_filters/README.md)."""
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
