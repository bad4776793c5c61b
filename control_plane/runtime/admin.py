"""The control plane's admin port: /metrics, /debug/status, /debug/snapshots, /debug/config_dump,
/rollouts, and the web console at /ui (console/).

Loopback only by default; a non-loopback listen needs a token, which every request but the
liveness probe and the public JWKS must then carry (compared in constant time). Nothing here can
change configuration but the rollout actions (POST /rollouts/actions: promote, abort, pause,
resume, each an audit record), which take JSON only: a browser page on another origin cannot
send that without a CORS preflight, which this port never grants. Private keys never appear
(the snapshots hold only what Envoy is sent, and secrets are redacted before they are dumped).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from meshfn.rollout.http import add_routes as rollout_routes
from meshfn.xds.dump import resources_to_plain, to_yaml

from ..service import ControlPlane
from .console.sources import ConsoleSources
from .console.web import Access, ConsoleHub, access_middleware, add_routes

log = logging.getLogger("meshfn.admin")


def status_document(cp: ControlPlane) -> dict[str, Any]:
    model = cp.model
    return {
        "policies": str(cp.policies),
        "generation": cp.state.generation,
        "loaded_at": cp.state.loaded_at,
        "policy_errors": [str(e) for e in cp.state.errors],
        "policy_failed_at": cp.state.failed_at if cp.state.errors else None,
        "workloads": [w.node_cluster for w in model.workloads] if model else [],
        "proxies": cp.ads.proxies(),
        "routes": cp.drift.snapshot(time.monotonic()),
        "rollouts": cp.rollouts.document(),
        **{name: provider() for name, provider in cp.status_providers.items()},
        "now": time.time(),
    }


def snapshots_document(cp: ControlPlane) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group in cp.cache.groups():
        snapshot = cp.cache.get(group)
        assert snapshot is not None
        out[group] = {
            "version": snapshot.version,
            "types": {
                type_url.rsplit(".", 1)[-1]: {
                    "version": ts.version,
                    "resources": {name: r.version for name, r in ts.resources.items()},
                }
                for type_url, ts in snapshot.types.items()
            },
        }
    return out


def resolve_group(cp: ControlPlane, node: str) -> str | None:
    """A node id ("edge.default~0") or workload ("edge.default") -> the snapshot group."""
    if cp.cache.get(node) is not None:
        return node
    for proxy in cp.ads.proxies():
        if proxy["node"] == node:
            return str(proxy["workload"])
    head = node.split("~", 1)[0]
    return head if cp.cache.get(head) is not None else None


def config_dump(cp: ControlPlane, node: str) -> dict[str, Any] | None:
    group = resolve_group(cp, node)
    snapshot = cp.cache.get(group) if group else None
    if snapshot is None:
        return None
    resources = {
        type_url: {name: r.message for name, r in ts.resources.items()}
        for type_url, ts in snapshot.types.items()
    }
    return {"workload": group, "version": snapshot.version, **resources_to_plain(resources)}


def certificates_document(cp: ControlPlane, node: str) -> dict[str, Any] | None:
    """The certificate a workload holds: chain, SANs, validity, issuer. Never the key."""
    group = resolve_group(cp, node)
    model, identity = cp.model, cp.identity
    if group is None or model is None or identity is None:
        return None
    workload = model.workload(group)
    if workload is None:
        return None
    cert = identity.certificate(workload.identity)
    if cert is None:
        return None
    return {
        "workload": group,
        "spiffe_id": cert.spiffe_id,
        "serial": format(cert.serial, "x"),
        "not_before": cert.not_before.isoformat(),
        "not_after": cert.not_after.isoformat(),
        "renew_at": cert.renew_at().isoformat(),
        "issuer_root": cert.issuer_fingerprint,
        "trusted_roots": identity.bundle_roots(),
        "signing_root": identity.signing_root,
        "rolling_out": identity.rolling_out(),
        "certificate_pem": cert.certificate_pem,
        "trust_bundle_pem": identity.trust_bundle_pem(),
    }


class AdminAccessError(ValueError):
    """The admin port would listen beyond loopback without a token."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_app(
    cp: ControlPlane, hub: ConsoleHub | None = None, access: Access | None = None
) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(cp.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def status(_: web.Request) -> web.Response:
        return web.json_response(status_document(cp))

    async def snapshots(_: web.Request) -> web.Response:
        return web.json_response(snapshots_document(cp))

    async def dump(request: web.Request) -> web.Response:
        node = request.query.get("node", "")
        document = config_dump(cp, node)
        if document is None:
            known = ", ".join(cp.cache.groups()) or "none"
            return web.json_response(
                {"error": f"no configuration for node {node!r}; workloads: {known}"}, status=404
            )
        if request.query.get("format") == "yaml":
            return web.Response(text=to_yaml(document), content_type="application/yaml")
        return web.json_response(document)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def jwks(_: web.Request) -> web.Response:
        # Public keys of the local issuer (`meshfn token issue`), fetched by Envoy through a
        # cluster when a RequestAuthentication names this URI.
        return web.json_response(cp.issuer.jwks(), headers={"Cache-Control": "max-age=60"})

    async def certs(request: web.Request) -> web.Response:
        document = certificates_document(cp, request.query.get("node", ""))
        if document is None:
            return web.json_response({"error": "no such node or workload"}, status=404)
        return web.json_response(document)

    app = web.Application(middlewares=[access_middleware(access or Access())])
    add_routes(app, hub or ConsoleHub(cp, ConsoleSources()))
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/status", status)
    app.router.add_get("/debug/snapshots", snapshots)
    app.router.add_get("/debug/config_dump", dump)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/.well-known/jwks.json", jwks)
    app.router.add_get("/debug/certs", certs)
    rollout_routes(app, cp.rollouts.document, cp.rollout_action)
    return app


class AdminServer:
    """`console`: what the web console shows beyond the ControlPlane (meshfn up's processes);
    `token`: required of every request (and required for a non-loopback listen)."""

    def __init__(
        self, cp: ControlPlane, console: ConsoleSources | None = None, token: str | None = None
    ) -> None:
        self.cp = cp
        self.hub = ConsoleHub(cp, console or ConsoleSources())
        self.access = Access(token or None)
        self._runner: web.AppRunner | None = None
        self.host = "127.0.0.1"
        self.port = 0

    @property
    def url(self) -> str:
        """Where a local client reaches the admin port."""
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        if not is_loopback(host) and self.access.token is None:
            raise AdminAccessError(
                f"the admin port would listen on {host}, beyond loopback, without a token: set"
                " MESHFN_ADMIN_TOKEN (or --admin-token-file) or listen on 127.0.0.1"
            )
        runner = web.AppRunner(
            make_app(self.cp, self.hub, self.access), access_log=None, shutdown_timeout=2.0
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        self.host = host
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        return self.port

    async def stop(self) -> None:
        self.hub.closing.set()  # live console streams end now, not at the shutdown timeout
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.hub.sources.close()
