"""A real browser for the console's tests and benchmark: Debian's chromium, driven by Playwright.

Playwright never downloads a browser here: it is pointed at /usr/bin/chromium (`./dev.sh`
installs Debian's package). Each session gets a fresh profile directory; every console message
and page error is collected so a test can assert there were none.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfn.common import env

# Screenshots the console's tests save (build/ is not committed).
ARTIFACTS = Path(__file__).resolve().parents[1] / "build" / "artifacts" / "console"
CHROMIUM = env.CHROMIUM.get_or("/usr/bin/chromium")
# Headless Chromium as root, with nothing that phones home (FACTS.md).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Browser:
    context: Any  # playwright BrowserContext
    page: Any  # playwright Page
    problems: list[str] = field(default_factory=list)  # console errors and page errors

    def watch(self, page: Any) -> Any:
        page.on(
            "console",
            lambda m: (
                self.problems.append(f"console.{m.type}: {m.text}")
                if m.type in ("error", "warning")
                else None
            ),
        )
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        return page

    def new_page(self) -> Any:
        return self.watch(self.context.new_page())


def require_chromium() -> str:
    """The browser's path, or an AssertionError that says how to get it (never a skip)."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        found = shutil.which("chromium")
        if found is None:
            raise AssertionError(
                f"no chromium at {CHROMIUM}: install Debian's (apt-get install chromium;"
                " ./dev.sh does)"
            )
        return found
    return CHROMIUM


@contextmanager
def chromium(viewport: tuple[int, int] = (1280, 900)) -> Iterator[Browser]:
    """A headless Chromium with a fresh profile; closed (and the profile removed) after."""
    from playwright.sync_api import sync_playwright

    executable = require_chromium()
    profile = Path(tempfile.mkdtemp(prefix="meshfn-chromium-"))
    try:
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                str(profile),
                executable_path=executable,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": viewport[0], "height": viewport[1]},
                offline=False,
            )
            try:
                page = context.pages[0] if context.pages else context.new_page()
                browser = Browser(context, page)
                browser.watch(page)
                yield browser
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def wait_panel_text(page: Any, panel: str, text: str, timeout: float = 10) -> None:
    """Wait until the console's panel `panel` shows `text` (a function, not a string: the
    console's CSP forbids eval, and Playwright evaluates string predicates with it)."""
    page.wait_for_function(
        "([id, text]) => document.getElementById(`panel-${id}`).innerText.includes(text)",
        arg=[panel, text],
        timeout=timeout * 1000,
    )


def sign_in(
    browser: Browser, admin: str, state: Path, role: str = "auditor", page: Any = None
) -> str:
    """Sign the browser in to the console of the control plane at `admin` (state directory
    `state`) as `meshfn console` would: a one-time login link asked for with the owner's admin
    token, opened once. Returns the link (used: worth nothing now)."""
    from meshfn.common.adminauth import call_admin, read_owner_token

    answer = call_admin(f"{admin}/ui/links", read_owner_token(state), "POST", {"role": role})
    link = f"{admin}{answer['path']}"
    target = page if page is not None else browser.page
    target.goto(link)
    target.wait_for_url(f"{admin}/ui", timeout=15_000)
    return link
