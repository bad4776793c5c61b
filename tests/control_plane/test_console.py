"""The web console's server side with a real ControlPlane and a real aiohttp server: query
validation, escaping of hostile policy content, the SSE stream, the drift chart. (Who may reach
it, and what each role sees: test_admin_access.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from multidict import MultiDict

from meshfn.common.adminauth import admin_headers
from meshfn.control_plane.runtime.admin import AdminServer
from meshfn.control_plane.runtime.console import web
from meshfn.control_plane.runtime.console.render import drift_chart
from meshfn.control_plane.runtime.console.web import QueryError, parse_query
from meshfn.control_plane.service import ControlPlane
from meshfn.health.drift import DriftPoint, RouteDrift, Transition
from meshfn.testing import policies as p

HOSTILE = "<img src=x id=pwned onerror=alert(1)>[red]x[/red]"
HOSTILE_REGEX = "^/x/<b>[red]+</b>$"


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"status": "abc"}, "status: a status code"),
        ({"status": "600"}, "status: a status code"),
        ({"limit": "0"}, "limit: a whole number"),
        ({"limit": "501"}, "limit: a whole number"),
        ({"limit": "-1"}, "limit: a whole number"),
        ({"subject": "zz"}, "64 hex digits"),
        ({"subject": "a" * 64, "subject_raw": "bob"}, "not both"),
        ({"route": "x\x00y"}, "printable"),
        ({"route": "r" * 300}, "at most 256"),
        ({"subject_raw": "\u00e9"}, "printable"),
        ({"bogus": "1"}, "unknown query parameter 'bogus'"),
    ],
)
def test_malformed_queries_are_refused(query: dict[str, str], message: str) -> None:
    with pytest.raises(QueryError, match=message.replace("(", r"\(")):
        parse_query(MultiDict(query))


def test_queries_parse() -> None:
    assert parse_query(MultiDict()).empty
    q = parse_query(MultiDict({"status": "5XX", "route": "default/main/0", "limit": "7"}))
    assert (q.status, q.status_class, q.route, q.limit) == (None, 5, "default/main/0", 7)
    assert parse_query(MultiDict({"status": "503", "subject": ""})).status == 503  # empty = absent
    assert parse_query(MultiDict({"subject": "AB" * 32})).subject == "ab" * 32
    with pytest.raises(QueryError, match="given 2 times"):
        parse_query(MultiDict([("route", "a"), ("route", "b")]))
    with pytest.raises(QueryError, match="longer than 4096"):
        parse_query(MultiDict(), raw_length=5000)


def _policies(root: Path) -> p.Policies:
    policies = p.Policies(root)
    policies.write(
        "hostile.yaml",
        p.doc("Route", "shown", {"matches": [{"path": {"regex": HOSTILE_REGEX}}],
                                 "destination": {"service": "beta"}}),
    )  # fmt: skip
    return policies


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[ControlPlane, str]]:
    policies = _policies(tmp_path / "p")
    cp = ControlPlane(policies.root, tmp_path / "state")
    assert (await cp.reload()).ok
    # a rejected change whose error text carries the hostile name
    policies.write("broken.yaml", p.doc("Route", HOSTILE, {"destination": {"service": "beta"}}))
    assert not (await cp.reload()).ok
    server = AdminServer(cp)
    port = await server.start()
    yield cp, f"http://127.0.0.1:{port}"
    await server.stop()


def _session(cp: ControlPlane) -> aiohttp.ClientSession:
    """As the owner (the token the control plane wrote into its state directory)."""
    return aiohttp.ClientSession(headers=admin_headers(cp.state_dir))


async def _get(cp: ControlPlane, url: str, **kwargs: object) -> tuple[int, str, dict[str, str]]:
    async with _session(cp) as session, session.get(url, **kwargs) as reply:  # type: ignore[arg-type]
        return reply.status, await reply.text(), dict(reply.headers)


async def test_page_escapes_hostile_policy_content(admin: tuple[ControlPlane, str]) -> None:
    cp, url = admin
    status, body, headers = await _get(cp, url + "/ui")
    assert status == 200
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY" and headers["Cache-Control"] == "no-store"
    assert "<img" not in body and "&lt;img src=x id=pwned" in body
    assert "^/x/&lt;b&gt;[red]+&lt;/b&gt;$" in body  # the regex, as written
    assert "broken.yaml:" in body and "metadata.name" in body
    assert " on" + "error=" not in body.replace("onerror=alert(1)&gt;", "")  # no live handler
    assert "<script>" not in body and "style=" not in body  # nothing inline for the CSP to allow


async def test_events_stream_every_panel_then_ticks(admin: tuple[ControlPlane, str]) -> None:
    cp, url = admin
    seen: dict[str, str] = {}
    ticks = 0
    async with _session(cp) as session, session.get(url + "/ui/events") as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        event = ""
        async for raw in reply.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "panel":
                data = json.loads(line[6:])
                seen[data["id"]] = data["html"]
            elif line.startswith("data: ") and event == "tick":
                ticks += 1
                if ticks == 2:
                    break
    assert set(seen) == {"topology", "proxies", "drift", "functions", "audit", "policy"}
    assert "&lt;img src=x" in seen["policy"] and "<img" not in seen["policy"]


async def test_streams_are_for_the_console_page_and_bounded(
    admin: tuple[ControlPlane, str],
) -> None:
    """A foreign page cannot open the live stream (its Origin is not the console's), and a
    process opening streams without end gets a 503 past MAX_STREAMS instead of the core."""
    cp, url = admin
    host = url.removeprefix("http://")
    foreign = await _get(
        cp,
        url + "/ui/events",
        headers={"Origin": "http://evil.example"},
        timeout=aiohttp.ClientTimeout(total=5),  # served, the stream would never end
    )
    assert foreign[0] == 403 and "its own page" in foreign[1]
    async with _session(cp) as session:
        held = []
        try:
            for _ in range(web.MAX_STREAMS):
                reply = await session.get(url + "/ui/events", headers={"Origin": f"http://{host}"})
                assert reply.status == 200
                await reply.content.readline()  # the stream has started: it counts
                held.append(reply)
            async with session.get(url + "/ui/events") as refused:
                assert refused.status == 503 and refused.headers["Retry-After"] == "5"
        finally:
            for reply in held:
                reply.close()
        # closed streams are let go (at their next poll), and a new one is served
        for _ in range(50):
            async with session.get(url + "/ui/events") as again:
                if again.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert again.status == 200


async def test_stop_ends_open_streams(admin: tuple[ControlPlane, str], tmp_path: Path) -> None:
    cp, _ = admin
    server = AdminServer(cp)
    port = await server.start()
    async with _session(cp) as session:
        reply = await session.get(f"http://127.0.0.1:{port}/ui/events")
        await reply.content.readline()
        started = asyncio.get_running_loop().time()
        await server.stop()
        assert asyncio.get_running_loop().time() - started < 1.5  # not the shutdown timeout
        reply.close()


def test_drift_chart_marks_trips_and_escapes() -> None:
    now = 1000.0
    history = tuple(
        DriftPoint(float(t), 5.0 if t < 50 else 80.0, 5.0, t >= 55) for t in range(0, 100, 5)
    )
    events = (Transition(HOSTILE, "degraded", 80.0, 5.0, 55.0),)
    route = RouteDrift(HOSTILE, True, 45.0, 80.0, 5.0, 7.5, 40, 1, history, events)
    chart = drift_chart(route, clock_offset=now - 100.0, now=now)
    svg = str(chart.svg)
    assert svg.count('class="trip"') == 1 and 'class="degraded"' in svg
    assert svg.count("<polyline") == 2 and 'class="limit"' in svg
    assert "<img" not in svg and "&lt;img" in svg
    assert "1 trip(s)" in chart.summary
