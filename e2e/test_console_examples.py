"""The README's mesh (`./dev.sh up`: policies/examples with the example functions) as a new user
meets it: the lines `meshfn up` prints work when pasted into a shell where `meshfn` is not on
PATH, and the console's Functions, Audit and Topology panels show the running mesh in a real
browser. Writes the README's screenshot to build/artifacts/console/console-examples.png."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from meshfn_e2e import Processes, http, remap_examples

from meshfn.control_plane.runtime.hints import meshfn_command
from meshfn.testing.browser import ARTIFACTS, Browser, chromium, sign_in, wait_panel_text
from meshfn.testing.processes import MESHFN, Proc, wait_for


@dataclass
class Example:
    tmp: Path
    up: Proc
    admin: str
    listener: int

    def tries(self) -> list[str]:
        """The lines under "try:" that meshfn up printed."""
        text = self.up.output()
        block = text.split("\ntry:\n", 1)[1].split("\nconsole: ", 1)[0]
        return [line.strip() for line in block.splitlines() if line.startswith("  ")]

    def paste(self, *lines: str) -> str:
        """Run lines as a person pasting them would: in the directory meshfn up was started
        from, with a PATH that has no meshfn on it."""
        done = subprocess.run(
            ["bash", "-c", "\n".join(lines)],
            cwd=self.tmp,
            env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Example]:
    tmp = tmp_path_factory.mktemp("examples")
    mapping = remap_examples(tmp / "examples")
    procs = Processes(tmp)
    up = procs.start(
        "up",
        [MESHFN, "up", "--policies", str(tmp / "examples"), "--state-dir", str(tmp / "state"),
         "--functions-registry", str(tmp / "functions"), "--publish-examples"],
        env={**os.environ, "MESHFN_CALLER_DIR": str(tmp)},
    )  # fmt: skip
    try:
        # The first build of the example functions takes a minute; later runs use the cache.
        wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
        yield Example(tmp, up, f"http://127.0.0.1:{mapping[18001]}", mapping[10000])
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as found:
        yield found


def test_printed_lines_work_when_pasted(example: Example) -> None:
    tries = example.tries()
    token_line = tries[0]
    command = meshfn_command(MESHFN, base=example.tmp)  # the caller's directory
    assert token_line.startswith(f"TOKEN=$({command} token issue --state-dir state "), token_line
    base = f"http://127.0.0.1:{example.listener}"
    infer = next(line for line in tries if f"{base}/v2/models/iris/infer" in line)
    assert "-X POST" in infer and '"inputs"' in infer
    answer = json.loads(example.paste(token_line, infer))
    assert answer["model_name"] == "iris" and answer["outputs"], answer
    metadata = next(line for line in tries if line.endswith(f"{base}/v2/models/iris"))
    assert json.loads(example.paste(token_line, metadata))["name"] == "iris"
    refused = next(line for line in tries if "without the token" in line)
    assert refused.startswith(f"curl -s {base}/v2/models/")
    assert "RBAC: access denied" in example.paste(refused)  # the models want a tenant's token
    embed = next(line for line in tries if "/v2/models/embedder/infer" in line)
    assert json.loads(example.paste(token_line, embed))["outputs"]
    status = next(line for line in tries if " status" in line and "SYNCED" in line)
    shown = example.paste(status)
    assert "edge.ingress~0" in shown and shown.count("SYNCED") >= 5, shown
    query = next(line for line in tries if " audit query" in line)
    wait_for("the audit records", lambda: "POST" in example.paste(query), timeout=30)
    verify = next(line for line in tries if " audit verify" in line)
    assert "chains intact" in example.paste(verify)
    output = example.up.output()
    # The route table shows the regex as written, with its header condition.
    assert "regex ^/debug/[a-z]+$ [GET] x-debug present" in output
    # Builds say what was cached, and nothing claims a build that did not happen.
    assert "example functions: " in output and "proxy-wasm filters: " in output
    if "example functions: all 3 cached" in output:
        assert "first build" not in output


def test_console_shows_functions_audit_and_acceleration(example: Example, browser: Browser) -> None:
    page = browser.page
    sign_in(browser, example.admin, example.tmp / "state")  # the owner: an auditor
    page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
    token = subprocess.run(
        [MESHFN, "token", "issue", "--state-dir", str(example.tmp / "state"), "--sub", "carol",
         "--aud", "meshfn", "--claim", "tenant=acme"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    flower = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4],
                          "data": [5.1, 3.5, 1.4, 0.2]}]}  # fmt: skip
    # seqs count per chain (one per journal): the newest seq shown of the first row's chain
    rows = "[...document.querySelectorAll('#panel-audit tbody tr')].filter(r => r.cells.length > 2)"
    newest = (
        f"{rows}.filter(r => r.cells[1].innerText === chain)"
        ".reduce((n, r) => Math.max(n, Number(r.cells[0].innerText)), 0)"
    )
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    sent = [0]  # carol's requests

    def infer() -> None:
        sent[0] += 1
        reply = http(
            f"http://127.0.0.1:{example.listener}/v2/models/iris/infer",
            "POST",
            headers,
            json.dumps(flower).encode(),
        )
        assert reply.status == 200, reply.body

    # a chain to follow: the first row's, once there is one (alone, this test starts with none)
    if not page.evaluate(f"() => {rows}.length"):
        infer()
        page.wait_for_function(f"() => {rows}.length > 0", timeout=30_000)
    chain = page.evaluate(f"() => {rows}[0]?.cells[1].innerText ?? ''")
    before = page.evaluate(f"(chain) => {newest}", chain)
    for _ in range(5):
        infer()
    # Functions: iris loaded, verified, with request latencies; embedder has no warm pool
    wait_panel_text(page, "functions", "iris@1", timeout=20)
    functions = page.inner_text("#panel-functions")
    assert "verified (key" in functions and "default/models" in functions, functions
    assert "Cached code" in functions, functions  # the backend's code cache, per function

    def served() -> list[str] | None:  # the iris row of the endpoint that took the requests
        rows = page.locator("#panel-functions tbody tr", has_text="iris@1").all_inner_texts()
        cells = [r.split("\t") for r in rows]
        return next(
            (
                c
                for c in cells
                if len(c) > 5 and c[1] == "loaded" and int(c[4]) >= 1 and "ms" in c[5]
            ),
            None,
        )

    cells = wait_for("iris loaded with a cold start and latencies", served, timeout=20)
    assert cells[2].startswith("1 idle (min 1"), cells  # its warm pool, refilled
    # Audit: the records of these requests, the chain verified, a query by raw subject
    wait_panel_text(page, "audit", "/v2/models/iris/infer", timeout=20)
    wait_panel_text(page, "audit", "chains intact", timeout=30)
    # live: the newest record shown moves on as the collector stores these requests
    page.wait_for_function(
        f"([chain, n]) => {newest} >= n", arg=[chain, before + 5], timeout=30_000
    )
    # Topology: eBPF on (root, a kernel with sockmap), endpoints with localities, the chain
    topology = page.inner_text("#panel-topology")
    assert "eBPF acceleration: on" in topology, topology
    assert "default/models-lite" in topology and "eu-west/eu-west-1b" in topology
    wait_panel_text(page, "topology", "default/models, priority 0", timeout=20)
    wait_panel_text(page, "proxies", "SYNCED", timeout=20)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console-examples.png"), full_page=True)
    page.screenshot(path=str(ARTIFACTS / "console-examples-top.png"))  # docs/console.png
    page.fill("#q-subject-raw", "carol")
    page.fill("#q-status", "2xx")
    page.click("form.query button[type=submit]")
    page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
    caption = page.inner_text("#panel-audit caption")
    assert re.match(rf"{sent[0]} record\(s\) matching the query", caption), caption
    assert page.input_value("#q-subject-raw") == "carol"
    assert browser.problems == []
