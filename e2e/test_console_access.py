"""Who may read the audit trail, against a real `meshfn up`: a gateway and a service, every proxy
audited, the local issuer's JWTs (so the records name subjects). Checked as a new user would:

- the unprivileged user `nobody` gets a 401 from every admin path and the console, the same
  for a raw-subject query (the oracle the salt exists to prevent), and cannot read the token;
- the one-time login link `meshfn up` prints signs a real browser in (headless Chromium), once;
  a viewer sees no records and cannot open a query by subject; an auditor can, and the query
  shows up in the console's access list (screenshots in build/artifacts/console/);
- `meshfn audit erase` while another subject's requests keep flowing: afterwards no file under
  the state directory (store, WAL, journals, logs, keys...) holds the erased subject's HMAC or
  raw value, nobody else's record is lost, the chain verifies, and the erasure is listed as an
  access with who made it.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from meshfn_e2e import Processes, admin_get, http, world_searchable_tmp

from meshfn.audit.salt import load as load_salt
from meshfn.common.adminauth import local_principal, owner_token_path
from meshfn.control_plane.runtime.admin import OPEN
from meshfn.testing import policies as p
from meshfn.testing.browser import ARTIFACTS, Browser, chromium, sign_in
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import Proc, issue_token, meshfn, wait_for

# The subject the erasure test erases: distinctive, so finding its raw value in a file means
# it was written there (a short name could turn up by chance in keys or random bytes).
DAVE = "dave.erasure-7f3c@example.test"
UNAUTHORIZED = (
    "console.error: Failed to load resource: the server responded with a status of 401"
    " (Unauthorized)"
)
AS_NOBODY = os.geteuid() == 0 and shutil.which("runuser") and shutil.which("curl")


@dataclass
class Rig:
    tmp: Path
    state: Path
    ports: dict[str, int]
    up: Proc
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def store(self) -> str:
        return str(self.state / "audit" / "audit.db")

    def request(self, sub: str, path: str = "/v1/x") -> int:
        if sub not in self.tokens:
            self.tokens[sub] = issue_token(self.state, sub, "acme")
        token = self.tokens[sub]
        headers = {"authorization": f"Bearer {token}"}
        return http(f"http://127.0.0.1:{self.ports['listener']}{path}", headers=headers).status

    def subject(self, raw: str) -> str:
        salt = load_salt(self.state)
        assert salt is not None
        return hmac.new(bytes.fromhex(salt.hex), raw.encode(), "sha256").hexdigest()

    def records(self) -> list[dict[str, Any]]:
        """Every stored request record (no subject asked for: no access record either)."""
        done = meshfn("audit", "query", "--store", self.store, "--json", "--limit", "100000")
        assert done.returncode == 0, done.stderr
        rows = [json.loads(line) for line in done.stdout.splitlines()]
        return [r for r in rows if r["chain"] != "@control"]

    def accesses(self) -> list[dict[str, Any]]:
        done = meshfn("audit", "query", "--store", self.store, "--accessed", "--json")
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    # `nobody` may walk to the state directory, which meshfn keeps 0700
    tmp = world_searchable_tmp("meshfn-access-")
    procs = Processes(tmp)
    try:
        ports = named_ports("xds", "admin", "listener", "alpha")
        root = tmp / "policies"
        root.mkdir()
        (root / "mesh.yaml").write_text(
            p.documents(
                p.mesh("access", "access.local", ports["xds"], ports["admin"],
                       audit={"proxies": "all"}),
                p.gateway(None, ports["listener"]),
                p.service("alpha", ports["alpha"]),
                p.route("main", "alpha"),
                p.token_authentication(ports["admin"]),
            )
        )  # fmt: skip
        state = tmp / "state"
        found = Rig(tmp, state, ports, procs.up_at(root, state))
        wait_for("a first answer", lambda: found.request("warmup") == 200, 30)
        yield found
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(rig: Rig) -> Iterator[Browser]:
    with chromium() as found:
        yield found


def _stored(rig: Rig, sub: str, count: int) -> None:
    """`count` requests as `sub`, then wait until the collector has stored them."""
    before = len(rig.records())
    for _ in range(count):
        assert rig.request(sub) == 200
    wait_for(f"{sub}'s records", lambda: len(rig.records()) >= before + count, 20)


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@pytest.mark.skipif(not AS_NOBODY, reason="needs root, runuser and curl (to act as nobody)")
def test_nobody_gets_a_401_for_everything_but_the_probes(rig: Rig) -> None:
    _stored(rig, "alice", 3)

    def curl(path: str) -> tuple[str, str]:
        done = subprocess.run(
            ["runuser", "-u", "nobody", "--", "curl", "-s", "-m", "5", "-w", "\n%{http_code}",
             f"{rig.admin}{path}"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        body, _, code = done.stdout.rpartition("\n")
        return code, body

    for path in ("/ui?subject_raw=alice", "/ui/events?subject_raw=alice", "/debug/status",
                 "/metrics", "/debug/snapshots", "/debug/config_dump?node=edge.default",
                 "/debug/certs?node=edge.default", "/ui", "/ui/"):  # fmt: skip
        code, body = curl(path)
        assert code == "401", (path, code, body[:300])
        assert "/v1/x" not in body and "acme" not in body and "proxies" not in body, path
    for path, why in OPEN.items():  # what answers: probes, public keys, the login, static files
        code, body = curl(path)
        assert code in ("200", "401"), (path, code, why)
        assert "/v1/x" not in body and "acme" not in body, path
    assert curl("/healthz") == ("200", "ok\n") and curl("/readyz") == ("200", "ok\n")
    token = owner_token_path(rig.state)
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    read = subprocess.run(
        ["runuser", "-u", "nobody", "--", "cat", str(token)],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert read.returncode != 0 and not read.stdout
    assert rig.accesses() == []  # none of it read personal data


def test_the_printed_login_link_signs_a_browser_in_once(rig: Rig, browser: Browser) -> None:
    link = re.search(r"^console: (\S+)", rig.up.output(), re.M)
    assert link is not None and "/ui/login?code=" in link.group(1), rig.up.output()[-2000:]
    page = browser.page
    browser.context.clear_cookies()
    page.goto(link.group(1))
    page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
    assert f"Signed in as {local_principal()} (auditor)" in page.inner_text("header")
    assert browser.problems == [], browser.problems
    page.goto("about:blank")  # the console's live stream closed with it
    browser.context.clear_cookies()
    answer = page.goto(link.group(1))  # once only
    assert answer is not None and answer.status == 401
    assert "not good" in page.inner_text("main")
    assert page.is_visible("input#token")  # the login form instead
    # Chromium logs the refused page itself as a failed load: that one, nothing else
    assert browser.problems == [UNAUTHORIZED], browser.problems
    browser.problems.clear()


def test_a_viewer_cannot_query_by_subject_an_auditor_can_and_it_is_listed(
    rig: Rig, browser: Browser
) -> None:
    _stored(rig, "carol", 4)
    page = browser.page
    browser.context.clear_cookies()
    sign_in(browser, rig.admin, rig.state, role="viewer")
    page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
    audit = page.inner_text("#panel-audit")
    assert "auditor role" in audit and ("chains intact" in audit or "not verified" in audit), audit
    assert page.locator("#q-subject-raw").count() == 0  # no query form for a viewer
    assert "/v1/x" not in page.inner_text("main")  # no record reaches a viewer
    _shot(page, "console-viewer")
    page.goto("about:blank")
    answer = page.goto(rig.admin + "/ui?subject_raw=carol#audit")
    assert answer is not None and answer.status == 403
    assert "auditor role" in page.inner_text("body")
    assert rig.accesses() == []  # refused: nothing read, nothing recorded
    assert browser.problems == [UNAUTHORIZED.replace("401 (Unauthorized)", "403 (Forbidden)")]
    browser.problems.clear()

    browser.context.clear_cookies()
    sign_in(browser, rig.admin, rig.state, role="auditor")
    page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
    page.fill("#q-subject-raw", "carol")
    page.click("form.query button[type=submit]")
    page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
    caption = page.inner_text("#panel-audit caption")
    assert caption.startswith("4 record(s) matching the query"), caption
    accesses = page.inner_text("#audit-accesses")
    assert local_principal() in accesses and "query" in accesses and "console" in accesses
    (access,) = rig.accesses()
    assert access["principal"] == local_principal() and access["records"] == 4
    assert access["via"] == "console" and access["role"] == "auditor"
    assert rig.subject("carol") not in json.dumps(access) and "carol" not in json.dumps(access)
    time.sleep(2.5)  # the live stream leaves a query by subject alone: no second lookup
    assert len(rig.accesses()) == 1
    assert page.inner_text("#panel-audit caption").startswith("4 record(s)")
    _shot(page, "console-auditor-query")
    assert browser.problems == [], browser.problems


def _copies(state: Path, needles: list[bytes]) -> list[str]:
    """Every regular file under the state directory that holds one of `needles`."""
    found = []
    for path in state.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        for needle in needles:
            if needle in data:
                found.append(f"{path.relative_to(state)}: {needle[:16]!r}")
    return found


def test_an_erasure_reaches_every_copy_while_others_keep_writing(rig: Rig) -> None:
    _stored(rig, DAVE, 6)
    _stored(rig, "erin", 3)
    hashed = rig.subject(DAVE)
    needles = [hashed.encode(), hashed.upper().encode(), DAVE.encode()]
    assert _copies(rig.state, needles), "the test cannot see the copies it looks for"
    before = {r["id"] for r in rig.records()}
    stop = threading.Event()
    statuses: list[int] = []

    def erin() -> None:  # another subject's requests keep flowing through the erasure
        while not stop.wait(0.01):
            statuses.append(rig.request("erin"))

    writer = threading.Thread(target=erin)
    writer.start()
    try:
        time.sleep(0.3)
        done = meshfn("audit", "erase", "--store", rig.store, "--subject-raw", DAVE)
    finally:
        stop.set()
        writer.join()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "erased: 6 record(s)" in done.stdout and "warning" not in done.stdout, done.stdout
    assert int(re.search(r"(\d+) copy\(ies\)", done.stdout).group(1)) >= 6  # type: ignore[union-attr]
    assert _copies(rig.state, needles) == []
    time.sleep(3)  # what Envoy buffered, and the collector's next rounds: still nothing
    assert _copies(rig.state, needles) == []
    # nobody else's record is lost: everything stored before, and each of erin's requests
    wait_for(
        "erin's requests stored",
        lambda: len(rig.records()) >= len(before) + len(statuses),
        20,
    )
    records = rig.records()
    ids = [r["id"] for r in records if r.get("id")]
    assert before <= set(ids) and len(ids) == len(set(ids))
    assert all(s == 200 for s in statuses) and len(statuses) > 5
    erin_records = meshfn(
        "audit", "query", "--store", rig.store, "--subject-raw", "erin", "--json", "--limit",
        "100000",
    )  # fmt: skip
    assert len(erin_records.stdout.splitlines()) == 3 + len(statuses)
    gone = meshfn("audit", "query", "--store", rig.store, "--subject-raw", DAVE, "--json")
    assert gone.returncode == 0 and gone.stdout.strip() == ""
    verified = meshfn("audit", "verify", "--store", rig.store)
    assert verified.returncode == 0 and "chains intact" in verified.stdout, verified.stdout
    erasure = next(a for a in rig.accesses() if a["event"] == "erasure")
    assert erasure["principal"] == local_principal() and erasure["via"] == "api"
    assert erasure["records"] == 6 and len(erasure["pseudonyms"]) == 1
    # an erasure of someone the trail never saw: said, exit 0, and still recorded
    nobody = meshfn("audit", "erase", "--store", rig.store, "--subject-raw", "zed")
    assert nobody.returncode == 0 and "nothing to erase" in nobody.stdout, nobody.stdout
    assert rig.accesses()[0]["action"] == "erase" and rig.accesses()[0]["records"] == 0
    assert admin_get(rig.admin, "/debug/status", rig.state).status == 200
