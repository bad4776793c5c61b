"""Policy documents for tests and benchmarks, and the small mesh most e2e tests run.

Builders return YAML text (one document each; `documents` joins them) so callers can write a
policy file, edit it, or break it on purpose. Specs are rendered with PyYAML, so values need
no quoting by hand.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .ports import free_ports, named_ports

API_VERSION = "meshfn.io/v1alpha1"
_DUMPER: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def flow(value: Any) -> str:
    """`value` as one line of flow-style YAML: {port: 1, endpoints: [{address: 127.0.0.1}]}."""
    text: str = yaml.dump(
        value, Dumper=_DUMPER, default_flow_style=True, sort_keys=False, width=1 << 20
    )
    return text.removesuffix("\n...\n").rstrip("\n")


def doc(kind: str, name: str, spec: dict[str, Any], namespace: str | None = None) -> str:
    metadata = {"name": name} if namespace is None else {"name": name, "namespace": namespace}
    return (
        f"apiVersion: {API_VERSION}\nkind: {kind}\nmetadata: {flow(metadata)}\nspec: {flow(spec)}\n"
    )


def documents(*docs: str) -> str:
    return "---\n".join(docs)


def mesh(
    name: str, trust_domain: str, xds: int | None = None, admin: int | None = None, **spec: Any
) -> str:
    """A Mesh with its control-plane ports (the defaults if not given: for tests that only
    load policies); `spec` adds fields (audit, drill, identity, ...)."""
    ports = {} if xds is None or admin is None else {"ports": {"xds": xds, "admin": admin}}
    return doc("Mesh", name, {"trustDomain": trust_domain, **ports, **spec})


def gateway(
    admin_port: int | None,
    listener: int,
    name: str = "edge",
    namespace: str | None = None,
    **spec: Any,
) -> str:
    """A Gateway with one HTTP listener; `spec` adds fields (xdsProtocol, locality, ...).
    `admin_port`: its Envoy's admin also on that loopback TCP port (None: on its unix socket
    only, as policies/examples)."""
    listeners = [{"name": "http", "port": listener}]
    admin = {} if admin_port is None else {"adminPort": admin_port}
    return doc("Gateway", name, {**admin, "listeners": listeners, **spec}, namespace)


def service(
    name: str,
    port: int,
    endpoints: list[dict[str, Any]] | None = None,
    namespace: str | None = None,
    **spec: Any,
) -> str:
    """A Service; by default one endpoint on 127.0.0.1 at the service port."""
    endpoints = [{"address": "127.0.0.1"}] if endpoints is None else endpoints
    return doc("Service", name, {"port": port, "endpoints": endpoints, **spec}, namespace)


def route(
    name: str, service: str, prefix: str | None = None, namespace: str | None = None, **spec: Any
) -> str:
    """A Route to `service`, for every path or (with `prefix`) one path prefix."""
    matches = {} if prefix is None else {"matches": [{"path": {"prefix": prefix}}]}
    return doc("Route", name, {**matches, "destination": {"service": service}, **spec}, namespace)


def locality(text: str) -> dict[str, str]:
    """ "eu-west/eu-west-1a/n1" -> {region: eu-west, zone: eu-west-1a, node: n1}."""
    region, zone, node = text.split("/")
    return {"region": region, "zone": zone, "node": node}


def endpoint(
    port: int | None = None, where: str | None = None, sidecar: int | None = None
) -> dict[str, Any]:
    """An endpoint on 127.0.0.1 (at the service's port unless `port`), in locality `where`
    ("region/zone/node"), behind a sidecar Envoy listening on `sidecar`."""
    found: dict[str, Any] = {"address": "127.0.0.1"}
    if port is not None:
        found["port"] = port
    if where is not None:
        found["locality"] = locality(where)
    if sidecar is not None:
        found["sidecar"] = {"port": sidecar}
    return found


def fallback_policy(
    service: str,
    chain: list[str],
    interval: str,
    health: tuple[str, str],
    recover_after: str,
    **spec: Any,
) -> str:
    """The FallbackPolicy of the failover e2e tests and benchmark: an endpoint is ejected after
    one gateway error or three 5xx (checked every `interval`), /health probes (`health`:
    interval, timeout) let a revived one back, `chain` takes over when none is left, and a
    drift breaker (40 ms over the 10 s baseline, from 10 samples in 1 s) reroutes a slow route
    until it has been fast for `recover_after`. `spec` adds fields (locality, ...)."""
    return doc("FallbackPolicy", service, {
        "service": service,
        "outlierDetection": {"consecutiveGatewayErrors": 1, "consecutive5xxErrors": 3,
                             "interval": interval, "baseEjectionTime": "30s"},
        "healthCheck": {"path": "/health", "interval": health[0], "timeout": health[1],
                        "unhealthyThreshold": 2},
        "chain": chain,
        "driftBreaker": {"threshold": 40, "minSamples": 10, "window": "1s",
                         "baselineWindow": "10s", "recoverAfter": recover_after,
                         "probePercent": 10},
        **spec,
    })  # fmt: skip


RETRY_ON = ["connect-failure", "refused-stream", "reset"]


def jwt_authentication(name: str, selector: dict[str, str], issuer: str, **rule: Any) -> str:
    """A RequestAuthentication with one JWT rule (`rule`: jwks or jwksUri, audiences, ...)."""
    jwt_rules = [{"issuer": issuer, **rule}]
    return doc("RequestAuthentication", name, {"selector": selector, "jwtRules": jwt_rules})


ISSUER = "https://issuer.meshfn.local"  # `meshfn token issue`'s


def token_authentication(admin_port: int) -> str:
    """A RequestAuthentication for every proxy: tokens of `meshfn token issue` (audience
    meshfn), keys from the control plane's admin port."""
    jwks = f"http://127.0.0.1:{admin_port}/.well-known/jwks.json"
    rules = [{"issuer": ISSUER, "audiences": ["meshfn"], "jwksUri": jwks}]
    return doc("RequestAuthentication", "tokens", {"jwtRules": rules})


def gateways_mesh(
    name: str,
    ports: dict[str, int],
    gateways: dict[str, str],
    *more: str,
    prefix: str | None = None,
) -> str:
    """A mesh of several gateways (key -> Gateway name; ports KEY and KEY_admin) with a Route
    each to one Service `alpha` (port "alpha"), verifying `meshfn token issue`'s tokens, and
    `more` documents."""
    return documents(
        mesh(name, f"{name}.local", ports["xds"], ports["admin"]),
        *(gateway(ports[f"{k}_admin"], ports[k], name=g) for k, g in gateways.items()),
        service("alpha", ports["alpha"]),
        *(route(f"main-{k}", "alpha", prefix, gateway=g) for k, g in gateways.items()),
        token_authentication(ports["admin"]),
        *more,
    )


def qos_policy(
    name: str,
    gateways: list[str],
    rate: dict[str, object],
    on_error: str | None = None,
    timeout: str = "200ms",
) -> str:
    """A QoSPolicy on whole gateways: one class `standard` with `rate` for every tenant (acme
    listed, so it has a status row of its own); with `on_error` a global rate."""
    spec: dict[str, Any] = {"targetRefs": [{"kind": "Gateway", "name": g} for g in gateways]}
    if on_error is not None:
        spec["global"] = {"onLimitServiceError": on_error, "timeout": timeout}
    spec |= {
        "defaultClass": "standard",
        "classes": [{"name": "standard", "rate": rate}],
        "tenants": [{"name": "acme", "class": "standard"}],
    }
    return doc("QoSPolicy", name, spec)


def authorization(
    name: str, selector: dict[str, str], rules: list[dict[str, Any]], **spec: Any
) -> str:
    """An AuthorizationPolicy (ALLOW unless `spec` says action: DENY)."""
    return doc("AuthorizationPolicy", name, {"selector": selector, **spec, "rules": rules})


def write(path: Path, text: str) -> None:
    """Atomic replace, as editors and `kubectl`-style tools do: a watcher never reads half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass
class Policies:
    """The standard small mesh on free ports: gateway `edge` (listener `http`), services `alpha`
    and `beta` (one endpoint each on their own port), one Route `main` (first /v1 -> alpha)."""

    root: Path
    protocol: str = "delta"
    ports: dict[str, int] = field(default_factory=dict)
    # The state directory of the control plane serving these policies (where its admin token
    # is: adminauth.admin_headers); by default ROOT/../state, the rig's own.
    state: Path | None = None

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = self.root.parent / "state"
        self.ports = named_ports("xds", "admin", "envoy_admin", "listener", "alpha", "beta")
        p = self.ports
        self.root.mkdir(parents=True, exist_ok=True)
        self.write(
            "mesh.yaml",
            documents(
                mesh("e2e", "e2e.local", p["xds"], p["admin"]),
                gateway(p["envoy_admin"], p["listener"], xdsProtocol=self.protocol),
            ),
        )
        self.write(
            "services.yaml", documents(service("alpha", p["alpha"]), service("beta", p["beta"]))
        )
        self.route("/v1", "alpha")

    def write(self, name: str, text: str) -> None:
        write(self.root / name, text)

    def route(self, prefix: str, service: str) -> None:
        self.write("route.yaml", route("main", service, prefix))

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['listener']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"


def remap(source: Path, target: Path, *extra: Path) -> dict[int, int]:
    """Copy the policy directory `source` (and `extra` policy files beside it) with every port
    replaced by a free one (tests must not rely on fixed ports being free); returns old port ->
    new port."""
    shutil.copytree(source, target)
    for path in extra:
        shutil.copy(path, target / path.name)
    ports: set[int] = set()
    for path in target.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            _collect_ports(doc, ports)
    mapping = dict(zip(sorted(ports), free_ports(len(ports)), strict=True))
    for path in target.glob("*.yaml"):
        text = path.read_text()
        text = re.sub(
            r"\b(\d{4,5})\b", lambda m: str(mapping.get(int(m.group(1)), m.group(1))), text
        )
        path.write_text(text)
    return mapping


def _collect_ports(node: object, ports: set[int]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, int) and ("port" in key.lower() or key in ("xds", "admin")):
                ports.add(value)
            _collect_ports(value, ports)
    elif isinstance(node, list):
        for item in node:
            _collect_ports(item, ports)


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if old not in text:
        raise ValueError(f"{path}: no {old!r} to replace")
    path.write_text(text.replace(old, new))


GATEWAY_SHEDDING = "gatewayShedding: {}"  # as policies/qos/tenants.yaml turns it on


def qos_examples(
    examples: Path,
    tenants: Path,
    target: Path,
    audit_gateway: bool = False,
    gateway_shedding: bool = True,
) -> dict[int, int]:
    """policies/examples with policies/qos/tenants.yaml beside them on free ports (`remap`), for
    the QoS e2e tests and bench/qos.py: tenant initech (class batch) may call the models too;
    with `audit_gateway` the gateway's refusals are audited as well as the sidecars'; without
    `gateway_shedding` the backend alone sheds by priority (set_gateway_shedding turns it on)."""
    mapping = remap(examples, target, tenants)
    allowed = "notValues: [acme, globex]"
    _replace(target / "security.yaml", allowed, "notValues: [acme, globex, initech]")
    if audit_gateway:
        _replace(target / "mesh.yaml", "proxies: sidecars", "proxies: all")
    if not gateway_shedding:
        set_gateway_shedding(target / tenants.name, False)
    return mapping


def set_gateway_shedding(tenants: Path, on: bool) -> None:
    """Turn the example QoSPolicy's gateway shedding on or off (a running mesh reloads it);
    nothing to do if it already is."""
    off = "# " + GATEWAY_SHEDDING
    text = tenants.read_text()
    if GATEWAY_SHEDDING not in text:
        raise ValueError(f"{tenants}: no {GATEWAY_SHEDDING!r}, on or off")
    if (off not in text) == on:
        return
    if on:
        _replace(tenants, off, GATEWAY_SHEDDING)
    else:
        _replace(tenants, GATEWAY_SHEDDING, off)
