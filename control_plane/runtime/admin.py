"""The control plane's admin port: /metrics, /debug/status, /debug/snapshots, /debug/config_dump,
/debug/certs, /debug/traces (meshfn up's embedded trace collector), POST /audit/erase, /rollouts
and POST /rollouts/actions, and the web console at /ui (console/).

Every request names a principal (meshfn.common.adminauth: an admin token, or the console's
session cookie), on every listen address, loopback included: loopback is shared by every user
of a host. Open without a credential: only `/healthz`, `/readyz`, the public JWKS (Envoy fetches
it) and the console's login and static files (OPEN). The viewer role reads everything here but
the audit trail's personal data; the auditor role also queries by subject and erases, and each
such read is recorded in the trail itself; the auditor role also acts on rollouts (promote,
abort, pause, resume: each an audit record). Nothing else here can change configuration; private
keys never appear (the snapshots hold only what Envoy is sent, and secrets are redacted before
they are dumped).

Why a token on TCP, not a unix socket for the API and a token only for the console: the console
must be on TCP for a browser, and Envoy fetches the JWKS over TCP, so a socket would be a second
listener with a second rule; a token file that only the owner can read (STATE/admin/token, 0600)
gives the CLI what an owner-only socket would, and tokens carry the roles a socket cannot.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from meshfn.audit.store import StoreError
from meshfn.common import peerjson
from meshfn.common.adminauth import (
    AUDITOR,
    AdminTokens,
    Forbidden,
    Guard,
    LocalAuthenticator,
    LoginLinks,
    LookupLimiter,
    Principal,
    ensure_owner_token,
    guard_middleware,
    key_path,
    local_principal,
    require,
)
from meshfn.rollout.http import add_routes as rollout_routes
from meshfn.xds.dump import resources_to_plain, to_yaml

from ..service import ControlPlane
from .console.sources import ConsoleSources
from .console.web import (
    OPEN_PATHS,
    ConsoleAccess,
    ConsoleHub,
    add_routes,
    is_console_open,
    refusal,
    security_headers,
)
from .traces import TraceStore, trace_filters

log = logging.getLogger("meshfn.admin")

# Everything that answers without a credential, and why (the listener test lists these).
OPEN = {
    "/healthz": "liveness: 'ok'",
    "/readyz": "readiness: 'ok' once the policies are loaded and ADS serves",
    "/.well-known/jwks.json": "the local issuer's public keys (Envoy fetches them)",
    **OPEN_PATHS,
}
_SUBJECT = re.compile(r"^(?:[0-9a-fA-F]{64}|[0-9a-fA-F]{32})$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")


def traces_document(store: TraceStore | None, query: Mapping[str, str]) -> dict[str, Any]:
    if store is None:
        raise LookupError(
            "no trace collector runs here: meshfn up runs one while the Mesh traces without"
            " naming a collector (spec.tracing); otherwise ask your collector"
        )
    found = store.find(**trace_filters(query))
    return {"traces": [t.summary() for t in found], "store": store.stats()}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_trace_routes(app: web.Application, hub: ConsoleHub) -> None:
    """/debug/traces (filtered summaries, newest first) and /debug/traces/<id> (every span)."""

    async def traces(request: web.Request) -> web.Response:
        try:
            return web.json_response(traces_document(hub.sources.traces, request.query))
        except LookupError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)

    async def trace(request: web.Request) -> web.Response:
        store, trace_id = hub.sources.traces, request.match_info["trace_id"]
        if not _TRACE_ID.match(trace_id):
            return web.json_response({"error": "a trace id is 32 hex digits"}, status=400)
        found = store.get(trace_id) if store is not None else None
        if found is None:
            return web.json_response(
                {"error": f"no trace {trace_id} here (not sampled, not arrived yet, or evicted)"},
                status=404,
            )
        return web.json_response(found.document())

    app.router.add_get("/debug/traces", traces)
    app.router.add_get("/debug/traces/{trace_id}", trace)


def is_open(request: web.Request) -> bool:
    if request.path in ("/healthz", "/readyz", "/.well-known/jwks.json"):
        return request.method in ("GET", "HEAD")
    return is_console_open(request)


async def _subject_of(request: web.Request) -> str | None:
    """The subject of an erasure request's JSON body (an HMAC or a pseudonym), or None."""
    try:
        body = await request.json(loads=peerjson.loads)
    except ValueError:
        return None
    subject = body.get("subject") if isinstance(body, dict) else None
    return subject.lower() if isinstance(subject, str) and _SUBJECT.match(subject) else None


def erasure(hub: ConsoleHub, access: ConsoleAccess) -> Handler:
    """POST /audit/erase {"subject": HMAC or pseudonym}: what `meshfn audit erase` asks of a
    running control plane (it owns the journals). The auditor role, within the principal's
    rate of lookups."""

    async def erase(request: web.Request) -> web.Response:
        principal = require(request, AUDITOR)
        if principal.via == "session":  # a browser's cookie: never the way to erase
            raise Forbidden("erasures take a token (meshfn audit erase), not a console session")
        subject = await _subject_of(request)
        if subject is None:
            return web.json_response(
                {"error": "a JSON body {\"subject\": the filter's HMAC (64 hex digits) or a"
                 " pseudonym (32)}"},
                status=400,
            )  # fmt: skip
        wait = access.limiter.take(principal.name)
        trail = hub.sources.trail
        if wait or trail is None:
            why = f"too many lookups by {principal.name}: try again in {wait:.0f} s"
            return web.json_response(
                {"error": why if wait else "this control plane keeps no audit trail"},
                status=429 if wait else 409,
                headers={"Retry-After": str(max(1, round(wait)))} if wait else None,
            )
        try:
            answer = await trail.erase(subject, principal)
        except (StoreError, OSError) as exc:
            log.error("erasure by %s failed: %s", principal.name, exc)
            return web.json_response({"error": f"the erasure failed: {exc}"}, status=503)
        hub.forget()
        return web.json_response(answer)

    return erase


def readiness(cp: ControlPlane) -> Handler:
    """/readyz: ok once the policies are loaded and ADS serves (no credential needed)."""

    async def readyz(_: web.Request) -> web.Response:
        if cp.model is None or not cp.xds_port:
            return web.Response(status=503, text="not serving yet\n")
        return web.Response(text="ok\n")

    return readyz


def make_app(
    cp: ControlPlane,
    hub: ConsoleHub,
    access: ConsoleAccess,
) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        await hub.refresh()  # the proxies' figures (their tracers'), at most once a second
        return web.Response(
            body=generate_latest(cp.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def status(_: web.Request) -> web.Response:
        await hub.refresh()  # the proxies' and backends' own figures, at most once a second
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

    app = web.Application(
        middlewares=[
            security_headers,
            guard_middleware(Guard(access.authenticator, is_open, access.tokens, refusal=refusal)),
        ]
    )
    add_routes(app, hub, access)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/status", status)
    app.router.add_get("/debug/snapshots", snapshots)
    app.router.add_get("/debug/config_dump", dump)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readiness(cp))
    app.router.add_get("/.well-known/jwks.json", jwks)
    app.router.add_get("/debug/certs", certs)
    app.router.add_post("/audit/erase", erasure(hub, access))
    add_trace_routes(app, hub)
    rollout_routes(app, cp.rollouts.document, cp.rollout_action)
    return app


class AdminServer:
    """`console`: what the web console shows beyond the ControlPlane (meshfn up's processes);
    `token`: a fixed token accepted besides the signed ones (the auditor role); `limiter`: how
    many lookups of personal data a principal may make. Writes the owner's admin token to
    STATE/admin/token (adminauth.ensure_owner_token) on creation."""

    def __init__(
        self,
        cp: ControlPlane,
        console: ConsoleSources | None = None,
        token: str | None = None,
        limiter: LookupLimiter | None = None,
    ) -> None:
        self.cp = cp
        self.hub = ConsoleHub(cp, console or ConsoleSources())
        tokens = AdminTokens(key_path(cp.state_dir))
        self.owner_token = ensure_owner_token(cp.state_dir)
        if token and tokens.verify(token) is not None:
            # $MESHFN_ADMIN_TOKEN is also what the CLI sends: a signed token found there must
            # not become a fixed token with the auditor role (a viewer's would be raised)
            log.warning(
                "the fixed admin token given is one of this control plane's signed tokens:"
                " ignored as a fixed token (it keeps its own role)"
            )
            token = None
        self.access = ConsoleAccess(
            tokens,
            LocalAuthenticator(tokens, token or None),
            LoginLinks(),
            limiter or LookupLimiter(),
        )
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

    def login_link(self, role: str = AUDITOR) -> str:
        """A one-time link that signs the owner in to the console (what `meshfn up` prints)."""
        code = self.access.links.mint(Principal(local_principal(), role, "link"))
        return f"{self.url}/ui/login?code={code}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        if not is_loopback(host):
            log.warning(
                "the admin port and its console listen on %s, beyond loopback, over plain HTTP:"
                " admin tokens and console cookies cross the network in clear there (put it"
                " behind TLS, or keep it on loopback)",
                host,
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
