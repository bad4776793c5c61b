"""Real Envoy in tests and benchmarks: its command line, `--mode validate`, admin probes.

The command line is meshfn's own (`runtime.envoy.envoy_argv`), with the defaults a test wants:
one worker thread (the machine is small and shared) and warnings only.

An admin interface is a TCP port on loopback (static configs of tests, a Gateway's explicit
`adminPort`) or a unix socket (a Path: what every Envoy of `meshfn up` serves, `admin_socket`).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import tempfile
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshfn.common.files import write_private
from meshfn.common.processes import pinned
from meshfn.common.unix import unix_request
from meshfn.control_plane.identity.ca import CertificateAuthority
from meshfn.control_plane.identity.spiffe import SpiffeId
from meshfn.control_plane.runtime.bootstrap import RUNTIME, admin_socket_path
from meshfn.control_plane.runtime.envoy import envoy_argv, envoy_binary
from meshfn.xds.translate.security import TLS_SOCKET

from .ports import free_ports
from .processes import Proc, Processes, wait_for


def argv(
    config: Path,
    *,
    concurrency: int = 1,
    log_level: str = "warning",
    file_flush_interval_ms: int | None = None,
    wasm: bool = False,
) -> list[str]:
    """Envoy on a static or bootstrap config written by the caller. `wasm`: for tests of the
    proxy-wasm filters, whose own log lines (wasm, info) then show, with access logs (the
    audit journals) flushed every 100 ms."""
    return envoy_argv(
        config,
        concurrency=concurrency,
        log_level=log_level,
        component_log_level="wasm:info" if wasm else None,
        file_flush_interval_ms=100 if wasm else file_flush_interval_ms,
    )


def validate(
    config: Path | Mapping[str, Any], log_level: str = "error", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate`: Envoy checks a config offline as far as it can without running
    it (types, fields, regexes, references; a wasm plugin's configure runs too). A mapping is
    written to a temporary JSON file first. The caller checks returncode and output."""
    with tempfile.TemporaryDirectory(prefix="meshfn-validate-") as tmp:
        if not isinstance(config, Path):
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps(config))
            config = path
        command = [str(envoy_binary()), "--mode", "validate", "-c", str(config)]
        return subprocess.run(
            [*command, "--log-level", log_level],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


Admin = int | Path  # a TCP port on 127.0.0.1, or a unix socket


def admin_socket(state_dir: Path, node_cluster: str, instance: int = 0) -> Path:
    """The admin socket of the Envoy `meshfn up` runs for a workload (e.g. "edge.ingress")."""
    return admin_socket_path(state_dir, f"{node_cluster}~{instance}")


def admin_request(admin: Admin, path: str, timeout: float = 5.0, method: str = "GET") -> bytes:
    """An admin answer's body; OSError (urllib's HTTPError, or one saying the status) unless
    Envoy answered 200."""
    if isinstance(admin, int):
        request = urllib.request.Request(f"http://127.0.0.1:{admin}{path}", method=method)
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return bytes(reply.read())
    status, body = unix_request(admin, path, timeout, method)
    if status != 200:
        raise OSError(f"{admin}: {method} {path} answered {status}: {body[:200]!r}")
    return body


def live(admin: Admin, timeout: float = 2.0) -> bool:
    """Envoy's admin /ready says LIVE: listeners are up and the initial config is applied."""
    return admin_request(admin, "/ready", timeout).strip() == b"LIVE"


def admin_json(admin: Admin, path: str, timeout: float = 10.0) -> Any:
    """One of Envoy's admin answers in JSON (`path` with `format=json`, e.g. /clusters)."""
    return json.loads(admin_request(admin, path, timeout))


def active_cluster(admin: Admin, name: str) -> dict[str, Any]:
    """The cluster `name` as Envoy runs it (its config dump: active, not warming)."""
    dump = admin_json(admin, "/config_dump?resource=dynamic_active_clusters")
    clusters: list[dict[str, Any]] = [c["cluster"] for c in dump["configs"]]
    (found,) = [c for c in clusters if c["name"] == name]
    return found


def stat(admin: Admin, name: str) -> int:
    """One Envoy counter or gauge from its admin interface (0 while Envoy has not created it)."""
    text = admin_request(admin, f"/stats?filter=^{name}$").decode()
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


def start(
    procs: Processes,
    name: str,
    argv: list[str],
    admin_port: int,
    timeout: float = 30,
    cpus: frozenset[int] | None = None,
) -> Proc:
    """Start Envoy (on `cpus`: None, any) and wait until it is LIVE. Raises PortInUse when
    Envoy could not bind one of its ports (for `ports.retry_on_port_clash`), AssertionError
    when it exited otherwise."""
    proc = procs.start(name, argv, preexec=pinned(cpus))
    wait_for(f"{name} to be live", lambda: live(admin_port), timeout=timeout, proc=proc)
    return proc


API = "type.googleapis.com/envoy.extensions"


def loopback(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def bare_proxy(
    name: str,
    listen: int,
    admin: int,
    upstreams: list[dict[str, Any]] | None,
    tracing: Mapping[str, Any] | None = None,
    clusters: list[dict[str, Any]] | None = None,
    *,
    route_timeout: str | None = "0s",
    requests_per_connection: int | None = None,
) -> dict[str, Any]:
    """A static Envoy with nothing but the router, HTTP/1.1 both ways, to `upstreams` (Envoy
    addresses, round robin; None: a 200 of its own): what any proxy costs on this machine, the
    floor a benchmark sets meshfn's proxies against. `tracing`: a connection manager's tracing
    block, whose provider's cluster is among `clusters`, exporting as meshfn's proxies do (their
    runtime's batches, bootstrap.RUNTIME: at Envoy's default of 5 spans an export, a proxy
    tracing every request spends twice as much). `route_timeout` None: Envoy's default (15 s);
    `requests_per_connection`: close upstream connections after that many requests."""
    if upstreams is None:
        route: dict[str, Any] = {
            "direct_response": {"status": 200, "body": {"inline_string": "{}"}}
        }
    else:
        action: dict[str, Any] = {"cluster": "upstream"}
        if route_timeout is not None:
            action["timeout"] = route_timeout
        route = {"route": action}
    router = {"@type": f"{API}.filters.http.router.v3.Router"}
    hcm: dict[str, Any] = {
        "@type": f"{API}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {
            "virtual_hosts": [
                {"name": "any", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, **route}]}
            ]
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": router}],
    }
    if tracing is not None:
        hcm["tracing"] = dict(tracing)
    own = list(clusters or [])
    if upstreams is not None:
        endpoints = [{"endpoint": {"address": a}} for a in upstreams]
        cluster: dict[str, Any] = {
            "name": "upstream",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "upstream", "endpoints": [{"lb_endpoints": endpoints}]},
        }  # fmt: skip
        if requests_per_connection is not None:
            options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
            cluster["typed_extension_protocol_options"] = {
                options: {
                    "@type": f"{API}.upstreams.http.v3.HttpProtocolOptions",
                    "common_http_protocol_options": {
                        "max_requests_per_connection": requests_per_connection
                    },
                    "explicit_http_config": {"http_protocol_options": {}},
                }
            }
        own.append(cluster)
    manager = {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
    listener = {
        "name": name,
        "address": loopback(listen),
        "filter_chains": [{"filters": [manager]}],
    }
    config: dict[str, Any] = {
        "admin": {"address": loopback(admin)},
        "static_resources": {"listeners": [listener], "clusters": own},
    }
    if tracing is not None:
        config["layered_runtime"] = {"layers": [{"name": "meshfn", "static_layer": RUNTIME}]}
    return config


def mtls_hop(client: dict[str, Any], server: dict[str, Any], pki: Path) -> None:
    """Make the hop from bare proxy `client` to bare proxy `server` mutual TLS, as meshfn's
    gateway reaches a sidecar (`xds.translate.security`): certificates of meshfn's own CA
    (written to `pki`), TLS 1.2 at least, the server requiring a client certificate, the client
    accepting only the server's SPIFFE ID; the protocol stays the downstream's (HTTP/1.1)."""
    ca = CertificateAuthority(pki, "floor.local")
    (pki / "bundle.pem").write_text(ca.trust_bundle_pem())
    ids = {role: SpiffeId("floor.local", "floor", role) for role in ("client", "server")}
    for role, spiffe in ids.items():
        issued = ca.issue(spiffe, dt.timedelta(days=1))
        write_private(pki / f"{role}.key", issued.private_key_pem.encode())
        (pki / f"{role}.pem").write_text(issued.certificate_pem)

    def context(role: str, peer: str | None) -> dict[str, Any]:
        validation: dict[str, Any] = {"trusted_ca": {"filename": str(pki / "bundle.pem")}}
        if peer is not None:
            validation["match_typed_subject_alt_names"] = [
                {"san_type": "URI", "matcher": {"exact": peer}}
            ]
        return {
            "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
            "tls_certificates": [
                {
                    "certificate_chain": {"filename": str(pki / f"{role}.pem")},
                    "private_key": {"filename": str(pki / f"{role}.key")},
                }
            ],
            "validation_context": validation,
        }

    upstream = next(c for c in client["static_resources"]["clusters"] if c["name"] == "upstream")
    upstream["transport_socket"] = {
        "name": TLS_SOCKET,
        "typed_config": {
            "@type": f"{API}.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": context("client", str(ids["server"])),
        },
    }
    server["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"] = {
        "name": TLS_SOCKET,
        "typed_config": {
            "@type": f"{API}.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": True,
            "common_tls_context": context("server", None),
        },
    }


def start_bare_chain(
    procs: Processes,
    work: Path,
    name: str,
    upstreams: list[dict[str, Any]] | None,
    tracing: Mapping[str, Any] | None = None,
    clusters: list[dict[str, Any]] | None = None,
    *,
    mtls: bool = False,
    cpus: frozenset[int] | None = None,
) -> tuple[int, list[Proc]]:
    """Two bare proxies in a row (`bare_proxy`), as a gateway and a sidecar stand between a
    client and a backend: the first one's port, and both processes. The first one traces with
    `tracing`; the second one forwards what the first one sends. `mtls`: the hop between them
    is mutual TLS as a gateway reaches a sidecar (`mtls_hop`), so a floor under a zero-trust
    mesh pays for what zero trust itself costs. `cpus`: where both run (None: anywhere), as
    `meshfn up --proxy-cpus` places the mesh's."""
    first, second, first_admin, second_admin = free_ports(4)
    configs = {
        f"{name}-1": bare_proxy(f"{name}-1", first, first_admin, [loopback(second)], tracing, clusters),
        f"{name}-2": bare_proxy(f"{name}-2", second, second_admin, upstreams),
    }  # fmt: skip
    if mtls:
        mtls_hop(configs[f"{name}-1"], configs[f"{name}-2"], work / f"{name}-pki")
    started: list[Proc] = []
    for (proxy, config), admin in zip(configs.items(), (first_admin, second_admin), strict=True):
        path = work / f"{proxy}.json"
        path.write_text(json.dumps(config))
        started.append(start(procs, proxy, argv(path), admin, cpus=cpus))
    return first, started
