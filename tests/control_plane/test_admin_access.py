"""Who may use the admin port and its console (meshfn.common.adminauth), with a real
ControlPlane, a real aiohttp server, a real audit store and collector: every route but the open
ones refuses a request without a credential, the same way whatever was wrong with it; the viewer
role sees no personal data and cannot query by subject or erase; an auditor's query by subject
is rate-limited and recorded in the trail before it is answered; a one-time login link signs one
browser in, once."""

from __future__ import annotations

import asyncio
import hmac
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest

from meshfn.audit import layout
from meshfn.audit.access import accessed
from meshfn.audit.collector import AuditCollector
from meshfn.audit.salt import load_or_create
from meshfn.audit.sqlite import SqliteStore
from meshfn.audit.store import CONTROL_CHAIN
from meshfn.common.adminauth import (
    AUDITOR,
    SESSION_AUDIENCE,
    VIEWER,
    AdminTokens,
    LookupLimiter,
    admin_headers,
    key_path,
    local_principal,
    read_owner_token,
)
from meshfn.control_plane.runtime.admin import OPEN, AdminServer
from meshfn.control_plane.runtime.audit import AuditTrail
from meshfn.control_plane.runtime.console.sources import AuditView, ConsoleSources
from meshfn.control_plane.service import ControlPlane
from meshfn.testing import policies as p


@dataclass
class Admin:
    cp: ControlPlane
    server: AdminServer
    url: str
    state: Path
    store: SqliteStore
    tokens: AdminTokens

    def bearer(self, role: str, name: str = "someone", ttl: float = 600) -> dict[str, str]:
        token = self.tokens.issue(name, role, timedelta(seconds=ttl))
        return {"Authorization": f"Bearer {token}"}

    @property
    def owner(self) -> dict[str, str]:
        return admin_headers(self.state)

    def accesses(self) -> list[dict[str, Any]]:
        return accessed(self.store, None)


def _subject(state: Path, raw: str) -> str:
    return hmac.new(bytes.fromhex(load_or_create(state).hex), raw.encode(), "sha256").hexdigest()


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[Admin]:
    policies = p.Policies(tmp_path / "p")
    state = tmp_path / "state"
    cp = ControlPlane(policies.root, state)
    assert (await cp.reload()).ok
    await cp.start(xds_port=0)
    path = layout.store_path(state)
    store = SqliteStore(path)
    alice = _subject(state, "alice")
    store.append(
        [
            {"v": 2, "time": f"2026-01-01T00:00:{i:02d}.000000Z", "method": "GET",
             "path": f"/p{i}", "status": 200, "salt_id": "s", "tenant": "acme",
             "subject": alice if i % 2 else _subject(state, "bob")}
            for i in range(10)
        ],
        chain="edge.ingress",
    )  # fmt: skip
    trail = AuditTrail(state)  # the trail's writer, as `meshfn up` runs it (no proxies here)
    trail.store, trail.collector = store, AuditCollector(store)
    sources = ConsoleSources(audit=AuditView(lambda: path, state), trail=trail)
    server = AdminServer(cp, sources, limiter=LookupLimiter(burst=3, per_minute=1))
    port = await server.start()
    yield Admin(cp, server, f"http://127.0.0.1:{port}", state, store, AdminTokens(key_path(state)))
    await server.stop()
    await cp.stop()
    store.close()


# A body nested deeper than json.loads recurses: malformed JSON like any other (a 400).
DEEP = b"[" * 5000 + b"]" * 5000


async def _call(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, **kwargs: Any
) -> tuple[int, str, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, headers=headers, allow_redirects=False, **kwargs) as reply,
    ):
        if reply.headers.get("Content-Type", "").startswith("text/event-stream"):
            return reply.status, (await reply.content.readline()).decode(), dict(reply.headers)
        return reply.status, await reply.text(), dict(reply.headers)


def _routes(admin: Admin) -> list[tuple[str, str]]:
    """Every route the admin app serves (method, path), parameters filled in."""
    assert admin.server._runner is not None
    app = admin.server._runner.app
    found = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter", "").replace("{name}", "console.css")
        if route.method != "HEAD":
            found.append((route.method, path))
    return sorted(set(found))


async def test_every_route_but_the_open_ones_wants_a_credential(admin: Admin) -> None:
    routes = _routes(admin)
    assert ("GET", "/metrics") in routes and ("POST", "/audit/erase") in routes
    guarded = [(m, path) for m, path in routes if path not in OPEN]
    assert len(guarded) >= 10, guarded
    for method, path in guarded:
        status, body, headers = await _call(admin.url + path, method)
        assert status == 401, (method, path, status, body[:200])
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert "Content-Security-Policy" in headers  # refusals carry the console's headers
        status, _, _ = await _call(admin.url + path, method, admin.owner)
        assert status != 401, (method, path)
    # the open ones, and what they say
    assert (await _call(admin.url + "/healthz"))[:2] == (200, "ok\n")
    assert (await _call(admin.url + "/readyz"))[:2] == (200, "ok\n")
    assert "keys" in (await _call(admin.url + "/.well-known/jwks.json"))[1]
    status, body, _ = await _call(admin.url + "/ui")
    assert status == 401 and 'type="password"' in body and "alice" not in body


async def test_a_missing_wrong_or_expired_token_is_the_same_401(admin: Admin) -> None:
    """No detail about which, and no timing that tells them apart (each refusal waits for the
    same floor): medians of the three within a few milliseconds of each other."""
    valid = admin.tokens.issue("mallory", AUDITOR, timedelta(seconds=60), now=time.time() - 3600)
    forged = jwt.encode(
        {"sub": "mallory", "role": AUDITOR, "aud": "meshfn-admin", "iss": "meshfn-control-plane",
         "iat": int(time.time()), "exp": int(time.time()) + 60},
        "not-the-key-" * 4, algorithm="HS256",
    )  # fmt: skip
    session_as_bearer = admin.tokens.issue("x", AUDITOR, timedelta(hours=1), SESSION_AUDIENCE)
    cases: dict[str, dict[str, str]] = {
        "missing": {},
        "garbage": {"Authorization": "Bearer not-a-token"},
        "wrong signature": {"Authorization": f"Bearer {forged}"},
        "expired": {"Authorization": f"Bearer {valid}"},
        "a session, not a token": {"Authorization": f"Bearer {session_as_bearer}"},
        "not bearer": {"Authorization": "Basic YWRtaW46YWRtaW4="},
    }
    bodies = set()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(7):
        for name, headers in cases.items():
            started = time.perf_counter()
            status, body, _ = await _call(admin.url + "/debug/status", "GET", headers)
            times[name].append(time.perf_counter() - started)
            assert status == 401, name
            bodies.add(body)
    assert bodies == {'{"error": "authentication required"}'}
    medians = {name: statistics.median(t) for name, t in times.items()}
    assert min(medians.values()) >= 0.045, medians  # the floor, for every kind
    assert max(medians.values()) - min(medians.values()) < 0.02, medians


async def test_a_viewer_sees_no_personal_data(admin: Admin) -> None:
    viewer = admin.bearer(VIEWER, "vera")
    status, body, _ = await _call(admin.url + "/ui", "GET", viewer)
    assert status == 200 and "Signed in as vera (viewer)" in body
    assert "auditor</strong> role" in body and 'id="q-subject-raw"' not in body
    assert "/p3" not in body and "acme" not in body  # no record reaches a viewer
    for path in (
        "/ui?subject_raw=alice",
        "/ui/events?subject_raw=alice",
        "/ui?subject=" + "a" * 64,
    ):
        status, body, _ = await _call(admin.url + path, "GET", viewer)
        assert status == 403 and "auditor role" in body, (path, status, body[:300])
    status, body, _ = await _call(
        admin.url + "/audit/erase", "POST", viewer, json={"subject": "ab" * 32}
    )
    assert status == 403 and "auditor role" in body
    assert (await _call(admin.url + "/metrics", "GET", viewer))[0] == 200
    assert (await _call(admin.url + "/debug/status", "GET", viewer))[0] == 200
    assert admin.accesses() == []  # nothing was read, nothing recorded


async def test_an_auditors_query_by_subject_is_recorded_then_rate_limited(admin: Admin) -> None:
    auditor = admin.bearer(AUDITOR, "audrey")
    status, body, _ = await _call(admin.url + "/ui?subject_raw=alice", "GET", auditor)
    assert status == 200, body[:500]
    assert "5 record(s) matching the query" in body and "/p3" in body and "/p2" not in body
    (access,) = admin.accesses()
    pseudonym = admin.store.pseudonyms(_subject(admin.state, "alice"))
    assert access["event"] == "access" and access["action"] == "query"
    assert access["principal"] == "audrey" and access["role"] == AUDITOR
    assert access["pseudonyms"] == pseudonym and access["records"] == 5
    assert access["chain"] == CONTROL_CHAIN and "alice" not in str(access)
    assert _subject(admin.state, "alice") not in str(access)
    # the page lists it (auditors see who read personal data)
    status, body, _ = await _call(admin.url + "/ui", "GET", auditor)
    assert 'id="audit-accesses"' in body and "audrey" in body and pseudonym[0][:16] in body
    assert "@control" not in body  # the latest records are requests; accesses are listed apart
    # three lookups per principal at once (this test's limiter), then 429 with Retry-After
    for _ in range(2):
        assert (await _call(admin.url + "/ui?subject_raw=bob", "GET", auditor))[0] == 200
    status, body, headers = await _call(admin.url + "/ui?subject_raw=bob", "GET", auditor)
    assert status == 429 and int(headers["Retry-After"]) >= 1 and "Too many" in body
    assert len(admin.accesses()) == 3  # the refused one read nothing and is not recorded
    # another principal has a bucket of its own
    other = admin.bearer(AUDITOR, "otto")
    assert (await _call(admin.url + "/ui?subject_raw=bob", "GET", other))[0] == 200


async def test_erasure_through_the_admin_port(admin: Admin) -> None:
    auditor = admin.bearer(AUDITOR, "audrey")
    alice = _subject(admin.state, "alice")
    status, body, _ = await _call(
        admin.url + "/audit/erase", "POST", auditor, json={"subject": "x"}
    )
    assert status == 400 and "64 hex" in body
    status, body, _ = await _call(admin.url + "/audit/erase", "POST", auditor, data=DEEP)
    assert status == 400 and "64 hex" in body  # deeper than json.loads goes: still a 400
    status, body, _ = await _call(
        admin.url + "/audit/erase", "POST", auditor, json={"subject": "ee" * 32}
    )
    assert status == 200 and '"erased": false' in body
    status, body, _ = await _call(
        admin.url + "/audit/erase", "POST", auditor, json={"subject": alice}
    )
    assert status == 200 and '"erased": true' in body and '"records": 5' in body
    assert admin.store.pseudonyms(alice) == []
    nothing, erasure = reversed(admin.accesses())
    assert nothing["action"] == "erase" and nothing["records"] == 0 and nothing["pseudonyms"] == []
    assert erasure["event"] == "erasure" and erasure["principal"] == "audrey"
    assert erasure["records"] == 5 and len(erasure["pseudonyms"]) == 1 and alice not in str(erasure)


async def test_a_login_link_signs_in_once(admin: Admin) -> None:
    link = admin.server.login_link()
    jar = aiohttp.CookieJar(unsafe=True)  # as a browser keeps a cookie of 127.0.0.1
    async with aiohttp.ClientSession(cookie_jar=jar) as browser:
        async with browser.get(link, allow_redirects=False) as reply:
            assert reply.status == 303 and reply.headers["Location"] == "/ui"
            cookie = reply.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        async with browser.get(admin.url + "/ui") as reply:
            assert reply.status == 200
            assert f"Signed in as {local_principal()} (auditor)" in await reply.text()
        async with browser.post(admin.url + "/ui/logout", allow_redirects=False) as reply:
            assert reply.status == 303
        async with browser.get(admin.url + "/ui") as reply:
            assert reply.status == 401
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(admin.server.login_link(), allow_redirects=False) as reply:
            assert reply.status == 303
        async with browser.post(
            admin.url + "/audit/erase", json={"subject": "ab" * 32}
        ) as reply:  # an erasure never rides on a browser's session
            assert reply.status == 403
    async with aiohttp.ClientSession() as other:
        async with other.get(link, allow_redirects=False) as reply:  # used: worthless now
            assert reply.status == 401 and "not good" in await reply.text()
        async with other.get(admin.url + "/ui/login?code=guessed", allow_redirects=False) as reply:
            assert reply.status == 401


async def test_the_login_form_and_links_for_lesser_roles(admin: Admin) -> None:
    owner = read_owner_token(admin.state)
    assert owner is not None
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.post(admin.url + "/ui/login", data={"token": "wrong"}) as reply:
            assert reply.status == 401 and "not good here" in await reply.text()
        async with browser.post(
            admin.url + "/ui/login", data={"token": owner}, allow_redirects=False
        ) as reply:
            assert reply.status == 303 and owner not in reply.headers["Set-Cookie"]
        async with browser.get(admin.url + "/ui") as reply:
            assert reply.status == 200
    # an auditor may hand out a viewer's link, a viewer never an auditor's
    status, body, _ = await _call(
        admin.url + "/ui/links", "POST", admin.owner, json={"role": VIEWER}
    )
    assert status == 200 and body.startswith('{"path": "/ui/login?code=')
    viewer = admin.bearer(VIEWER)
    status, body, _ = await _call(admin.url + "/ui/links", "POST", viewer, json={"role": AUDITOR})
    assert status == 403 and "cannot hand out" in body
    status, body, _ = await _call(admin.url + "/ui/links", "POST", viewer, data=DEEP)
    assert status == 400 and "not JSON" in body


async def test_a_fixed_token_is_an_auditor(tmp_path: Path) -> None:
    policies = p.Policies(tmp_path / "p")
    cp = ControlPlane(policies.root, tmp_path / "state")
    assert (await cp.reload()).ok
    server = AdminServer(cp, token="s3cret-admin-token-0123456789")
    port = await server.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    try:
        good = {"Authorization": "Bearer s3cret-admin-token-0123456789"}
        bad = {"Authorization": "Bearer s3cret-admin-token-012345678x"}
        assert (await _call(url + "/debug/status", "GET", good))[0] == 200
        assert (await _call(url + "/debug/status", "GET", bad))[0] == 401
        assert (await _call(url + "/readyz"))[0] == 503  # ADS is not serving: not ready
    finally:
        await server.stop()
    # a viewer's signed token in $MESHFN_ADMIN_TOKEN where the control plane starts (the CLI
    # reads that variable too) stays a viewer's: never a fixed auditor's token
    viewer = AdminTokens(key_path(tmp_path / "state")).issue("vera", VIEWER, timedelta(hours=1))
    server = AdminServer(cp, token=viewer)
    port = await server.start("127.0.0.1", 0)
    try:
        bearer = {"Authorization": f"Bearer {viewer}"}
        url = f"http://127.0.0.1:{port}"
        assert (await _call(url + "/debug/status", "GET", bearer))[0] == 200
        assert (await _call(url + "/ui?subject_raw=x", "GET", bearer))[0] == 403
    finally:
        await server.stop()


async def test_many_refusals_do_not_hold_up_others(admin: Admin) -> None:
    """The floor is a sleep, not work: refused requests wait in parallel."""
    started = time.perf_counter()
    replies = await asyncio.gather(*(_call(admin.url + "/metrics") for _ in range(40)))
    assert {r[0] for r in replies} == {401}
    assert time.perf_counter() - started < 2.0


async def test_rollout_actions_need_an_auditors_token(admin: Admin) -> None:
    """Any role reads the rollouts; moving one (the admin port's one traffic change) takes the
    auditor role, with a token (never a console session), as JSON; the principal is recorded."""
    act = admin.url + "/rollouts/actions"
    body = {"rollout": "x", "action": "abort"}
    viewer = admin.bearer(VIEWER, "vera")
    assert (await _call(admin.url + "/rollouts", "GET", viewer))[0] == 200
    assert (await _call(act, "POST", None, json=body))[0] == 401
    assert (await _call(act, "POST", viewer, json=body))[0] == 403
    session = admin.tokens.issue("ann", AUDITOR, timedelta(hours=1), SESSION_AUDIENCE)
    cookie = {"Cookie": f"meshfn_console={session}"}
    assert (await _call(act, "POST", cookie, json=body))[0] == 403
    auditor = admin.bearer(AUDITOR, "ann")
    assert (await _call(act, "POST", auditor, data=body))[0] == 415  # a form: refused
    status, text, _ = await _call(act, "POST", auditor, json=body)
    assert status == 404 and "no rollout 'x'" in text
    json_type = {**auditor, "Content-Type": "application/json"}
    status, text, _ = await _call(act, "POST", json_type, data=DEEP)
    assert status == 400 and "not JSON" in text
