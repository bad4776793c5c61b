"""The console's HTTP surface on the admin port: `/ui` (the page, server-rendered), `/ui/events`
(server-sent events: a panel's new HTML when it changes, a tick every second), `/ui/static/*`,
and signing in: `/ui/login` (a one-time login link's code, or the login form's token),
`/ui/logout`, `/ui/links` (a new one-time link, for `meshfn console`).

Read-only. Every request but the login and the static files names a principal (the admin
guard, meshfn.common.adminauth: a bearer token or the session cookie a login sets), and what the
page shows depends on its role: a viewer sees everything but the audit trail's records; an
auditor also sees the records, may query them by subject (rate-limited per principal, and every
such query is itself recorded in the trail before its answer is shown), and sees who read
personal data. A query by subject is never live: the stream leaves its audit panel alone.
Every answer carries a strict Content-Security-Policy (scripts and styles only from /ui/static,
no inline code, no frames), so even an escaping mistake could not run a script.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from aiohttp import web
from markupsafe import Markup

from meshfn.audit.store import StoreError
from meshfn.common import peerjson
from meshfn.common.adminauth import (
    AUDITOR,
    FAILURE_FLOOR_S,
    PRINCIPAL,
    ROLES,
    SESSION_AUDIENCE,
    SESSION_TTL,
    AdminTokens,
    Authenticator,
    LoginLinks,
    LookupLimiter,
    Principal,
    principal_of,
    require,
    role_allows,
)

from ...service import ControlPlane
from ..traces import trace_filters
from . import render
from .sources import AuditQuery, ConsoleSources
from .view import ConsoleView, build, record_view

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
# What answers without a credential: the console's own script, style and icon (constant files,
# no data) and the login (a form, and the one-time link's code exchange).
OPEN_PATHS = {
    "/ui/login": "the login form and the one-time login link (answer 401 unless the token or"
    " code is good)",
    **{
        f"/ui/static/{name}": "the console's own script, style or icon (no data)" for name in STATIC
    },
}
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


@dataclass
class ConsoleAccess:
    """How the console signs people in: sessions (cookies) under the admin tokens' key, the
    authenticator a login form's token goes to, one-time login links, and the limit on lookups
    of personal data per principal."""

    tokens: AdminTokens
    authenticator: Authenticator
    links: LoginLinks = field(default_factory=LoginLinks)
    limiter: LookupLimiter = field(default_factory=LookupLimiter)

    def session(self, principal: Principal) -> str:
        assert principal.role is not None
        return self.tokens.issue(principal.name, principal.role, SESSION_TTL, SESSION_AUDIENCE)


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
        # per query and role, the panels rendered at most POLL_SECONDS ago: watchers of the same
        # query share one rendering per poll instead of one each
        self._rendered: dict[
            tuple[AuditQuery, bool], tuple[float, ConsoleView, dict[str, str]]
        ] = {}

    async def refresh(self) -> None:
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed < REFRESH_SECONDS:
                return
            try:
                await self.sources.refresh()
            except Exception:
                log.exception("refreshing the console's sources failed")
            self._refreshed = time.monotonic()

    def view(
        self,
        query: AuditQuery,
        reader: bool = False,
        found: list[dict[str, Any]] | None = None,
        principal: str = "",
    ) -> ConsoleView:
        return build(self.cp, self.sources, query, reader, found, principal)

    def panels(self, view: ConsoleView, skip: tuple[str, ...] = ()) -> dict[str, str]:
        return {name: render.panel(name, view) for name in render.PANELS if name not in skip}

    def current(self, query: AuditQuery, reader: bool) -> tuple[ConsoleView, dict[str, str]]:
        """The view and panels of a live stream. A query by subject's audit panel is not among
        them: it stays as the page rendered it (recorded once, never re-queried)."""
        now = time.monotonic()
        key = (query, reader)
        cached = self._rendered.get(key)
        if cached is not None and now - cached[0] < POLL_SECONDS:
            return cached[1], cached[2]
        live = AuditQuery(limit=query.limit) if query.by_subject else query
        view = self.view(live, reader)
        panels = self.panels(view, ("audit",) if query.by_subject else ())
        self._rendered = {
            k: entry for k, entry in self._rendered.items() if now - entry[0] < POLL_SECONDS
        }
        self._rendered[key] = (now, view, panels)
        return view, panels

    def forget(self) -> None:
        """Drop every cached rendering and answer (after an erasure)."""
        self._rendered.clear()
        if self.sources.audit is not None:
            self.sources.audit.forget()

    async def stream(
        self,
        query: AuditQuery,
        send: Callable[[bytes], Awaitable[None]],
        start: Callable[[], Awaitable[Any]] | None = None,
        reader: bool = False,
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
                view, panels = self.current(query, reader)
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


def html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def refusal(request: web.Request, status: int) -> web.StreamResponse:
    """How the admin guard refuses: the login page for the console's page, an error page for
    the rest of the console, JSON for the admin API."""
    if request.path in ("/ui", "/ui/") and request.method == "GET":
        if status == 401:
            return html(render.login_page(), 401)
        return html(render.error_page(403, _forbidden(request)), 403)
    if request.path.startswith("/ui/"):
        text = "sign in first" if status == 401 else _forbidden(request)
        return web.Response(text=text + "\n", status=status)
    message = "authentication required" if status == 401 else _forbidden(request)
    return web.json_response({"error": message}, status=status)


def _forbidden(request: web.Request) -> str:
    principal = request.get(PRINCIPAL)
    role = principal.role if isinstance(principal, Principal) else None
    if role is None:
        return "you are signed in, but hold no role here"
    return f"your role ({role}) does not allow this: it needs the auditor role"


def add_routes(app: web.Application, hub: ConsoleHub, access: ConsoleAccess) -> None:
    """Mount the console on an admin app (whose guard authenticates every request but the
    OPEN_PATHS, and security_headers adds the headers)."""
    pages, sign_in = _Pages(hub, access), _SignIn(access)
    app.router.add_get("/ui", pages.page)
    app.router.add_get("/ui/", pages.root)
    app.router.add_get("/ui/events", pages.events)
    app.router.add_get("/ui/static/{name}", pages.static)
    app.router.add_get("/ui/login", sign_in.login_link)
    app.router.add_post("/ui/login", sign_in.login_form)
    app.router.add_post("/ui/logout", sign_in.logout)
    app.router.add_post("/ui/links", sign_in.links)
    traces = _TracePages(hub)
    app.router.add_get("/ui/traces", traces.traces)
    app.router.add_get("/ui/traces/{trace_id}", traces.trace)


def _too_many(principal: Principal, wait: float) -> web.Response:
    message = f"Too many queries by subject from {principal.name}: try again in {wait:.0f} s."
    return web.Response(
        text=render.error_page(429, message),
        status=429,
        content_type="text/html",
        charset="utf-8",
        headers={"Retry-After": str(max(1, round(wait)))},
    )


@dataclass
class _Pages:
    """The page, its live stream and its static files."""

    hub: ConsoleHub
    access: ConsoleAccess

    async def lookup(
        self, principal: Principal, query: AuditQuery
    ) -> list[dict[str, Any]] | web.Response:
        """A query by subject (the auditor role was checked): within the principal's rate, and
        recorded in the trail before anything is shown. The rows, or a response that refuses."""
        wait = self.access.limiter.take(principal.name)
        if wait:
            return _too_many(principal, wait)
        audit, trail = self.hub.sources.audit, self.hub.sources.trail
        if audit is None or audit.path() is None:
            return []
        try:
            rows, pseudonyms = await asyncio.to_thread(audit.lookup, query)
            if trail is None:
                raise StoreError("this control plane keeps no audit trail to record it in")
            await trail.record_access(principal, "query", pseudonyms, len(rows))
        except (StoreError, OSError, ValueError) as exc:
            log.error("a query by subject by %s was refused: %s", principal.name, exc)
            message = f"The query was not answered: it could not be recorded ({exc})."
            return html(render.error_page(503, message), 503)
        return rows

    async def page(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        try:
            query = parse_query(request.query, len(request.query_string))
        except QueryError as exc:
            return html(render.error_page(400, str(exc)), 400)
        found: list[dict[str, Any]] | None = None
        if query.by_subject:
            require(request, AUDITOR)
            looked = await self.lookup(principal, query)
            if isinstance(looked, web.Response):
                return looked
            found = looked
        await self.hub.refresh()
        who = f"{principal.name} ({principal.role})"
        view = self.hub.view(query, principal.may(AUDITOR), found, who)
        panels = {k: Markup(v) for k, v in self.hub.panels(view).items()}  # rendered, escaped
        return html(render.page(view, panels))

    async def events(self, request: web.Request) -> web.StreamResponse:
        principal = principal_of(request)
        try:
            query = parse_query(request.query, len(request.query_string))
        except QueryError as exc:
            return web.Response(text=f"{exc}\n", status=400)
        if query.by_subject:
            require(request, AUDITOR)  # the stream itself reads no subject's records
        if not same_origin(request):
            return web.Response(text="the console's stream is for its own page\n", status=403)
        if self.hub.watchers >= MAX_STREAMS:
            return web.Response(
                text=f"too many live console streams (at most {MAX_STREAMS})\n",
                status=503,
                headers={"Retry-After": "5"},
            )
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "X-Accel-Buffering": "no",
                **SECURITY_HEADERS,
            }
        )
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            await self.hub.stream(
                query, response.write, lambda: response.prepare(request), principal.may(AUDITOR)
            )
        return response

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            return web.Response(text="not found\n", status=404)
        return web.Response(body=_static(name), content_type=STATIC[name], charset="utf-8")

    async def root(self, _: web.Request) -> web.Response:
        raise web.HTTPFound("/ui")


_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")


@dataclass
class _TracePages:
    """/ui/traces: the embedded collector's recent traces, filtered as /debug/traces is (a
    node's or an edge's of the service graph); /ui/traces/<id>: one trace's waterfall and, for
    the auditor role, its audit records. Behind the admin guard like every console page."""

    hub: ConsoleHub

    async def traces(self, request: web.Request) -> web.Response:
        store = self.hub.sources.traces
        filters = {k: v for k, v in request.query.items() if v.strip()}
        if store is None:
            return html(render.error_page(404, "no trace collector runs here"), 404)
        try:
            found = store.find(**trace_filters(filters))
        except ValueError as exc:
            return html(render.traces_page([], store.stats(), filters, str(exc)), 400)
        return html(render.traces_page([t.summary() for t in found], store.stats(), filters))

    async def trace(self, request: web.Request) -> web.Response:
        trace_id = request.match_info["trace_id"]
        store = self.hub.sources.traces
        found = store.get(trace_id) if store is not None and _TRACE_ID.match(trace_id) else None
        if found is None:
            message = f"no trace {trace_id} here: not sampled, not arrived yet, or evicted"
            return html(render.error_page(404, message), 404)
        reader = principal_of(request).may(AUDITOR)
        audit = self.hub.sources.audit
        records, error = None, None
        if audit is not None and reader:
            await self.hub.refresh()
            try:
                query = AuditQuery(trace=trace_id.lower())
                records = [record_view(row) for row in audit.records(query)]
            except (StoreError, OSError, ValueError) as exc:
                records, error = [], str(exc)
        return html(render.trace_page(found.document(), records, error, reader))


@dataclass
class _SignIn:
    """Signing in and out: a one-time login link, the login form's token, and new links."""

    access: ConsoleAccess

    def signed_in(self, principal: Principal) -> web.Response:
        response = web.Response(status=303, headers={"Location": "/ui"})
        response.set_cookie(
            COOKIE,
            self.access.session(principal),
            httponly=True,
            samesite="Strict",
            path="/",
            secure=False,
            max_age=int(SESSION_TTL.total_seconds()),
        )
        return response

    @staticmethod
    async def refused(started: float, message: str) -> web.Response:
        """The login page again, no sooner than the guard's floor (the timing says nothing)."""
        await asyncio.sleep(max(0.0, FAILURE_FLOOR_S - (time.monotonic() - started)))
        return html(render.login_page(message), 401)

    async def login_link(self, request: web.Request) -> web.Response:
        """GET /ui/login?code=...: a one-time login link (`meshfn up` prints one)."""
        started = time.monotonic()
        code = request.query.get("code", "")
        principal = self.access.links.redeem(code) if code else None
        if principal is None:
            message = (
                "That login link is not good (used already, expired, or from an earlier run"
                " of the control plane): `meshfn console` prints a new one."
                if code
                else ""
            )
            return await self.refused(started, message)
        log.info("console: %s (%s) signed in with a login link", principal.name, principal.role)
        return self.signed_in(principal)

    async def login_form(self, request: web.Request) -> web.Response:
        """POST /ui/login: an admin token typed into the login form."""
        started = time.monotonic()
        form = await request.post()
        offered = form.get("token")
        principal = None
        if isinstance(offered, str) and offered.strip():
            principal = await self.access.authenticator.authenticate(offered.strip())
        if principal is None or principal.role is None:
            return await self.refused(started, "That token is not good here.")
        log.info("console: %s (%s) signed in with a token", principal.name, principal.role)
        return self.signed_in(principal)

    async def logout(self, _: web.Request) -> web.Response:
        response = web.Response(status=303, headers={"Location": "/ui"})
        response.del_cookie(COOKIE, path="/")
        return response

    async def links(self, request: web.Request) -> web.Response:
        """POST /ui/links {"role": "viewer"}: a one-time login link for the caller (at most its
        own role), as a path to append to the admin URL."""
        principal = principal_of(request)
        role = principal.role
        if request.can_read_body:
            try:
                body = await request.json(loads=peerjson.loads)
            except ValueError:
                return web.json_response({"error": "the body is not JSON"}, status=400)
            role = body.get("role", role) if isinstance(body, dict) else role
        if role not in ROLES:
            return web.json_response({"error": f"role: one of {', '.join(ROLES)}"}, status=400)
        if not role_allows(principal.role, role):
            return web.json_response(
                {"error": f"your role ({principal.role}) cannot hand out {role}"}, status=403
            )
        code = self.access.links.mint(Principal(principal.name, role, "link"))
        return web.json_response({"path": f"/ui/login?code={code}"})


def is_console_open(request: web.Request) -> bool:
    """The console's requests that need no credential (OPEN_PATHS)."""
    if request.path == "/ui/login":
        return request.method in ("GET", "POST")
    return request.method in ("GET", "HEAD") and request.path in OPEN_PATHS


@web.middleware
async def security_headers(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The console's security headers on every console answer and every refusal."""
    response = await handler(request)
    if (
        request.path == "/ui" or request.path.startswith("/ui/") or response.status in (401, 403)
    ) and not response.prepared:
        response.headers.update(SECURITY_HEADERS)
    return response
