"""The console's HTTP surface on the admin port: `/ui` (the page, server-rendered), `/ui/events`
(server-sent events: a panel's new HTML when it changes, a tick every second), `/ui/static/*`.

Read-only. Every answer carries a strict Content-Security-Policy (scripts and styles only from
/ui/static, no inline code, no frames), so even an escaping mistake could not run a script. On
loopback without a token, the Host header must name a loopback address (a DNS-rebinding page
cannot read the console); with a token (required for a non-loopback listen) every request must
carry it: `Authorization: Bearer`, or the session cookie that POST /ui/login sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web
from markupsafe import Markup

from ...service import ControlPlane
from . import render
from .sources import AuditQuery, ConsoleSources
from .view import ConsoleView, build

log = logging.getLogger("meshfn.console")

TICK_SECONDS = 1.0
POLL_SECONDS = 0.25
REFRESH_SECONDS = 1.0
# Live streams at once: each browser tab holds one; a local process opening hundreds would
# otherwise take the control plane's one core from ADS, SDS and the access-log receiver.
MAX_STREAMS = 32
COOKIE = "meshfn_console"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
STATIC = {
    "console.js": "text/javascript",
    "console.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
QUERY_KEYS = ("subject", "subject_raw", "route", "status", "limit")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
_STATUS = re.compile(r"^(?:[1-5]\d\d|[1-5]xx)$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_PRINTABLE = re.compile(r"^[\x20-\x7e]+$")


class QueryError(ValueError):
    """A malformed console query: answered 400 with this message."""


def parse_query(query: Any, raw_length: int = 0) -> AuditQuery:
    """`request.query` -> AuditQuery. Empty fields count as absent (an HTML form sends them)."""
    values = _query_values(query, raw_length)
    subject = values.get("subject")
    if subject is not None and not _HEX64.match(subject):
        raise QueryError("subject: the salted subject is 64 hex digits (as in the records)")
    raw = values.get("subject_raw")
    if raw is not None and (len(raw) > 256 or not _PRINTABLE.match(raw)):
        raise QueryError("subject_raw: at most 256 printable ASCII characters")
    if subject is not None and raw is not None:
        raise QueryError("give subject or subject_raw, not both")
    route = values.get("route")
    if route is not None and (len(route) > 256 or not _PRINTABLE.match(route)):
        raise QueryError("route: at most 256 printable ASCII characters")
    status, status_class = _status(values.get("status"))
    limit = 50
    if "limit" in values:
        if not values["limit"].isdigit() or not 1 <= int(values["limit"]) <= 500:
            raise QueryError("limit: a whole number from 1 to 500")
        limit = int(values["limit"])
    return AuditQuery(
        subject=subject.lower() if subject else None,
        subject_raw=raw,
        route=route,
        status=status,
        status_class=status_class,
        limit=limit,
    )


def _query_values(query: Any, raw_length: int) -> dict[str, str]:
    """The known parameters, each given at most once; empty ones left out."""
    if raw_length > 4096:
        raise QueryError("the query string is longer than 4096 characters")
    values: dict[str, str] = {}
    for key in query:
        if key not in QUERY_KEYS:
            raise QueryError(f"unknown query parameter {key!r} (known: {', '.join(QUERY_KEYS)})")
        found = query.getall(key)
        if len(found) > 1:
            raise QueryError(f"query parameter {key!r} given {len(found)} times")
        if found[0].strip():
            values[key] = found[0].strip()
    return values


def _status(given: str | None) -> tuple[int | None, int | None]:
    """status=503 -> (503, None); status=5xx -> (None, 5)."""
    if given is None:
        return None, None
    text = given.lower()
    if not _STATUS.match(text):
        raise QueryError("status: a status code (503) or a class (5xx)")
    if text.endswith("xx"):
        return None, int(text[0])
    return int(text), None


def hostname(host: str) -> str:
    """The Host header without its port: "127.0.0.1:18001" -> "127.0.0.1", "[::1]:80" -> "[::1]"."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0].lower()


@dataclass(frozen=True)
class Access:
    """Who may read the admin port: anyone on loopback (token None), else token holders."""

    token: str | None = None

    def session(self) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), b"meshfn console session", hashlib.sha256).hexdigest()

    def allows(self, request: web.Request) -> bool:
        if self.token is None:
            return hostname(request.host or "") in LOOPBACK_HOSTS
        header = request.headers.get("Authorization", "")
        offered = header[7:] if header.startswith("Bearer ") else ""
        if offered and hmac.compare_digest(offered.encode(), self.token.encode()):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self.session().encode())

    def check_token(self, offered: str) -> bool:
        return self.token is not None and hmac.compare_digest(offered.encode(), self.token.encode())


class ConsoleHub:
    """Builds the console's view for every watcher, refreshing the remote sources at most once a
    second while anyone watches."""

    def __init__(self, cp: ControlPlane, sources: ConsoleSources) -> None:
        self.cp = cp
        self.sources = sources
        self.watchers = 0
        self.closing = asyncio.Event()
        self._refreshed = 0.0
        self._refresh_lock = asyncio.Lock()
        # per query, the panels rendered at most POLL_SECONDS ago: watchers of the same query
        # share one rendering per poll instead of one each
        self._rendered: dict[AuditQuery, tuple[float, ConsoleView, dict[str, str]]] = {}

    async def refresh(self) -> None:
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed < REFRESH_SECONDS:
                return
            try:
                await self.sources.refresh()
            except Exception:
                log.exception("refreshing the console's sources failed")
            self._refreshed = time.monotonic()

    def view(self, query: AuditQuery) -> ConsoleView:
        return build(self.cp, self.sources, query)

    def panels(self, view: ConsoleView) -> dict[str, str]:
        return {name: render.panel(name, view) for name in render.PANELS}

    def current(self, query: AuditQuery) -> tuple[ConsoleView, dict[str, str]]:
        now = time.monotonic()
        cached = self._rendered.get(query)
        if cached is not None and now - cached[0] < POLL_SECONDS:
            return cached[1], cached[2]
        view = self.view(query)
        panels = self.panels(view)
        self._rendered = {
            q: entry for q, entry in self._rendered.items() if now - entry[0] < POLL_SECONDS
        }
        self._rendered[query] = (now, view, panels)
        return view, panels

    async def stream(
        self,
        query: AuditQuery,
        send: Callable[[bytes], Awaitable[None]],
        start: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        """Every panel at once, then each panel again when its HTML changes; a tick a second.
        `start` (the response's headers) runs once this stream counts as a watcher."""
        sent: dict[str, str] = {}
        next_tick = 0.0
        self.watchers += 1  # before any wait: the stream limit counts it at once
        try:
            if start is not None:
                await start()
            await send(b"retry: 1000\n\n")
            while not self.closing.is_set():
                await self.refresh()
                view, panels = self.current(query)
                for name, html in panels.items():
                    if sent.get(name) != html:
                        await send(_event("panel", {"id": name, "html": html}))
                        sent[name] = html
                if time.monotonic() >= next_tick:
                    tick = {"at": view.now, "generation": view.policy.generation}
                    await send(_event("tick", tick))
                    next_tick = time.monotonic() + TICK_SECONDS
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.closing.wait(), POLL_SECONDS)
        finally:
            self.watchers -= 1


def same_origin(request: web.Request) -> bool:
    """A browser names the page that opens a stream in `Origin`: the console's own page only.
    (No Origin: not a cross-origin browser request; curl and meshfn's tests send none.)"""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    return origin in (f"http://{request.host}", f"https://{request.host}")


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _static(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()


def add_routes(app: web.Application, hub: ConsoleHub) -> None:
    """Mount the console on an admin app (the app's access middleware guards it)."""

    def html(text: str, status: int = 200) -> web.Response:
        return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")

    async def page(request: web.Request) -> web.Response:
        try:
            query = parse_query(request.query, len(request.query_string))
        except QueryError as exc:
            return html(render.error_page(400, str(exc)), 400)
        await hub.refresh()
        view = hub.view(query)
        panels = {k: Markup(v) for k, v in hub.panels(view).items()}  # rendered, escaped
        return html(render.page(view, panels))

    async def events(request: web.Request) -> web.StreamResponse:
        try:
            query = parse_query(request.query, len(request.query_string))
        except QueryError as exc:
            return web.Response(text=f"{exc}\n", status=400)
        if not same_origin(request):
            return web.Response(text="the console's stream is for its own page\n", status=403)
        if hub.watchers >= MAX_STREAMS:
            return web.Response(
                text=f"too many live console streams (at most {MAX_STREAMS})\n",
                status=503,
                headers={"Retry-After": "5"},
            )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"}
        )
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            await hub.stream(query, response.write, lambda: response.prepare(request))
        return response

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            return web.Response(text="not found\n", status=404)
        return web.Response(body=_static(name), content_type=STATIC[name], charset="utf-8")

    async def root(_: web.Request) -> web.Response:
        raise web.HTTPFound("/ui")

    app.router.add_get("/ui", page)
    app.router.add_get("/ui/", root)
    app.router.add_get("/ui/events", events)
    app.router.add_get("/ui/static/{name}", static)


def access_middleware(access: Access) -> Any:
    """Guards every admin route but the liveness probe and the public JWKS (Envoy fetches it),
    and puts the security headers on every console answer."""
    open_paths = {"/healthz", "/.well-known/jwks.json"}

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        console = request.path == "/ui" or request.path.startswith("/ui/")
        if request.path == "/ui/login" and request.method == "POST" and access.token:
            response: web.StreamResponse = await _login(request, access)
        elif (
            request.path in open_paths
            or request.path.startswith("/ui/static/")
            or access.allows(request)
        ):
            response = await handler(request)
        elif access.token is None:
            response = web.Response(
                text="the console answers only requests addressed to a loopback host\n",
                status=403,
            )
        elif console and request.method == "GET" and request.path == "/ui":
            response = web.Response(
                text=render.login_page(), status=401, content_type="text/html", charset="utf-8"
            )
        else:
            response = web.json_response({"error": "this admin port needs its token"}, status=401)
        if console or response.status in (401, 403):
            response.headers.update(SECURITY_HEADERS)
        return response

    return middleware


async def _login(request: web.Request, access: Access) -> web.Response:
    form = await request.post()
    offered = form.get("token")
    if not isinstance(offered, str) or not access.check_token(offered):
        return web.Response(
            text=render.login_page("That token is not this control plane's."),
            status=401,
            content_type="text/html",
            charset="utf-8",
        )
    response = web.Response(status=303, headers={"Location": "/ui"})
    response.set_cookie(
        COOKIE, access.session(), httponly=True, samesite="Strict", path="/", secure=False
    )
    return response
