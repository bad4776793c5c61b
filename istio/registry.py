"""The kinds meshfn renders, in output order: file name and renderer of each (Envoy Gateway's
translator keeps a registry like this; a new kind is one entry)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import envoyfilter, security, telemetry, traffic, wasm
from .core import Context


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str
    file: str
    render: Callable[[Context], None]


KINDS: tuple[Kind, ...] = (
    Kind(
        "PeerAuthentication",
        security.SECURITY,
        "peerauthentications.yaml",
        security.peer_authentications,
    ),
    Kind(
        "RequestAuthentication",
        security.SECURITY,
        "requestauthentications.yaml",
        security.request_authentications,
    ),
    Kind(
        "AuthorizationPolicy",
        security.SECURITY,
        "authorizationpolicies.yaml",
        security.authorization_policies,
    ),
    Kind("DestinationRule", traffic.NETWORKING, "destinationrules.yaml", traffic.destination_rules),
    Kind("ServiceEntry", traffic.NETWORKING, "serviceentries.yaml", traffic.service_entries),
    Kind("WorkloadEntry", traffic.NETWORKING, "workloadentries.yaml", traffic.workload_entries),
    Kind("Gateway", traffic.NETWORKING, "gateways.yaml", traffic.gateway_resources),
    Kind("VirtualService", traffic.NETWORKING, "virtualservices.yaml", traffic.virtual_services),
    Kind("WasmPlugin", wasm.EXTENSIONS, "wasmplugins.yaml", wasm.wasm_plugins),
    Kind("EnvoyFilter", envoyfilter.NETWORKING, "envoyfilters.yaml", envoyfilter.envoy_filters),
    Kind("Telemetry", telemetry.TELEMETRY, "telemetries.yaml", telemetry.telemetries),
)

BY_KIND = {k.kind: k for k in KINDS}
MESH_CONFIG_FILE = "mesh-config.yaml"
