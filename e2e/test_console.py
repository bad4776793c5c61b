"""The web console in a real browser (Debian's chromium, driven by Playwright) against a running
`meshfn up`: no console errors, live updates without a reload (a policy change, a NACK with its
error, a tripped drift breaker), hostile names escaped, a dead control plane shown as lost and
then reconnected. Screenshots land in build/artifacts/console/."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from meshfn_e2e import Processes, admin_get, http, wait_for_synced

from meshfn.testing import policies as p
from meshfn.testing.browser import ARTIFACTS, Browser, chromium, sign_in, wait_panel_text
from meshfn.testing.processes import Proc, wait_for

# RE2 accepts this, but its program is far above Envoy's default size limit: Envoy NACKs it.
HUGE_REGEX = "^/(" + "|".join(f"model-{i}-[a-z]+" for i in range(40)) + ")$"
# Markup for HTML and for rich: must show as text everywhere, never become an element or style.
HOSTILE = "<img src=x id=pwned onerror=alert(1)>[red]x[/red]"
HOSTILE_REGEX = "^/x/<b>[red]+</b>$"


@dataclass
class Mesh:
    policies: p.Policies
    procs: Processes
    state: Path
    up: Proc

    @property
    def console(self) -> str:
        return self.policies.admin + "/ui"

    def delay(self, ms: float) -> None:
        path = self.state / "delay" / f"127.0.0.1-{self.policies.ports['alpha']}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(ms))

    def start(self) -> Proc:
        self.up = self.procs.up(self.policies)  # state in TMP/state
        return self.up


def _fallback() -> str:
    return p.fallback_policy("alpha", ["beta"], "1s", ("1s", "500ms"), "30s")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("console")
    procs = Processes(tmp)
    policies = p.Policies(tmp / "policies", protocol="delta")
    policies.write("fallback.yaml", _fallback())
    state = tmp / "state"
    found = Mesh(policies, procs, state, None)  # type: ignore[arg-type]
    found.start()
    yield found
    procs.stop_all()


@pytest.fixture(scope="module")
def browser(mesh: Mesh) -> Iterator[Browser]:
    with chromium() as found:
        sign_in(found, mesh.policies.admin, mesh.state)  # the session outlives restarts
        yield found


def _open(browser: Browser, url: str) -> Any:
    page = browser.page
    page.goto(url)
    page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
    page.evaluate("window.__notReloaded = true")
    return page


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _panel(page: Any, name: str) -> str:
    return str(page.inner_text(f"#panel-{name}"))


def test_panels_render_without_console_errors(mesh: Mesh, browser: Browser) -> None:
    page = _open(browser, mesh.console)
    for name in ("topology", "proxies", "drift", "rollouts", "functions", "audit", "policy"):
        assert page.is_visible(f"section#{name} h2"), name
    wait_panel_text(page, "proxies", "SYNCED")
    topology = _panel(page, "topology")
    assert "default/main" in topology and "prefix /v1" in topology
    # the gateway's own view of its endpoints: healthy, and the primary serving
    wait_panel_text(page, "topology", "default/alpha, priority 0")
    assert "healthy" in topology
    assert "default/main" in _panel(page, "drift")
    # keyboard: the skip link comes first, then the panel navigation (the service graph first)
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.getAttribute('href')") == "#graph"
    _shot(page, "console-small-mesh")
    assert browser.problems == []


def test_policy_change_shows_without_reload(mesh: Mesh, browser: Browser) -> None:
    page = _open(browser, mesh.console)
    generation = int(page.inner_text("#policy strong"))
    mesh.policies.write(
        "route.yaml", p.route("main", "alpha", "/v1") + "---\n" + p.route("more", "beta", "/v2")
    )
    wait_panel_text(page, "topology", "prefix /v2")
    assert f"configuration {generation + 1}" in _panel(page, "policy")
    assert page.evaluate("window.__notReloaded") is True
    assert browser.problems == []


def test_nack_shows_its_error(mesh: Mesh, browser: Browser) -> None:
    page = _open(browser, mesh.console)
    mesh.policies.write(
        "route.yaml",
        p.route("main", "alpha", "/v1")
        + "---\n"
        + p.doc(
            "Route",
            "huge",
            {"matches": [{"path": {"regex": HUGE_REGEX}}], "destination": {"service": "beta"}},
        ),
    )
    wait_panel_text(page, "proxies", "NACK")
    error = page.inner_text("#panel-proxies pre.error-text")
    assert "program size" in error.lower(), error
    assert "NACKED" in _panel(page, "proxies")
    _shot(page, "console-nack")
    mesh.policies.route("/v1", "alpha")  # back to a configuration Envoy takes
    wait_panel_text(page, "proxies", "SYNCED")
    assert page.evaluate("window.__notReloaded") is True
    assert browser.problems == []


def test_hostile_names_are_text(mesh: Mesh, browser: Browser) -> None:
    page = _open(browser, mesh.console)
    mesh.policies.write(
        "hostile.yaml",
        p.doc("Route", "shown", {"matches": [{"path": {"regex": HOSTILE_REGEX}}],
                                 "destination": {"service": "beta"}}),
    )  # fmt: skip
    wait_panel_text(page, "topology", HOSTILE_REGEX)
    mesh.policies.write(
        "broken.yaml", p.doc("Route", HOSTILE, {"destination": {"service": "beta"}})
    )
    wait_panel_text(page, "policy", "rejected")
    policy = _panel(page, "policy")
    assert HOSTILE in policy and "broken.yaml:" in policy, policy
    assert page.query_selector("#pwned") is None  # never an element
    assert page.query_selector("#panel-policy img") is None
    (mesh.policies.root / "broken.yaml").unlink()
    (mesh.policies.root / "hostile.yaml").unlink()
    wait_panel_text(page, "policy", "in force")
    assert browser.problems == []


def test_tripped_breaker_appears(mesh: Mesh, browser: Browser) -> None:
    page = _open(browser, mesh.console)
    url = mesh.policies.gateway + "/v1/x"
    for _ in range(60):  # a baseline of fast requests
        assert http(url).status == 200
        time.sleep(0.02)
    mesh.delay(150)

    def tripped() -> bool:
        return "TRIPPED" in _panel(page, "drift")

    with ThreadPoolExecutor(6) as pool:
        deadline = time.monotonic() + 30
        while not tripped() and time.monotonic() < deadline:
            list(pool.map(lambda _: http(url, timeout=10).status, range(12)))
    mesh.delay(0)
    assert tripped(), _panel(page, "drift")
    assert page.query_selector("#panel-drift svg .trip") is not None  # marked on the chart
    wait_panel_text(page, "topology", "drift breaker tripped")
    _shot(page, "console-breaker-tripped")
    assert page.evaluate("window.__notReloaded") is True
    assert browser.problems == []


def test_malformed_queries_get_400(mesh: Mesh) -> None:
    for query, message in [
        ("status=abc", "status: a status code"),
        ("limit=0", "limit: a whole number"),
        ("subject=zz", "64 hex digits"),
        ("route=a&route=b", "given 2 times"),
        ("bogus=1", "unknown query parameter"),
        ("route=%00", "printable"),
    ]:
        for path in ("/ui", "/ui/events"):
            reply = admin_get(mesh.policies, f"{path}?{query}")
            assert reply.status == 400, (path, query, reply.status)
            assert message in reply.body.decode(), (path, query, reply.body)
    assert "Content-Security-Policy" in admin_get(mesh.policies, "/ui").headers


def test_dead_control_plane_is_shown_lost_then_reconnects(mesh: Mesh, browser: Browser) -> None:
    page = _open(browser, mesh.console)
    assert mesh.up.stop() == 0
    page.wait_for_selector('#connection[data-state="lost"]', timeout=10_000)
    assert "retrying" in page.inner_text("#connection")
    stale = page.eval_on_selector_all(
        "section.panel", "els => els.map(e => e.classList.contains('stale'))"
    )
    assert stale and all(stale)  # every panel says it is not current
    assert page.is_visible("#policy .stale-note")
    _shot(page, "console-lost")
    mesh.start()
    wait_for_synced(mesh.policies)
    page.wait_for_selector('#connection[data-state="live"]', timeout=20_000)
    wait_for(
        "fresh panels",
        lambda: (
            not any(
                page.eval_on_selector_all(
                    "section.panel", "els => els.map(e => e.classList.contains('stale'))"
                )
            )
        ),
    )
    assert page.evaluate("window.__notReloaded") is True
    # the connection losses are the only errors the page logged (EventSource reports them)
    assert all("events" in problem or "ERR_" in problem for problem in browser.problems), (
        browser.problems
    )
