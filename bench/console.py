"""Console benchmark: how long a policy change takes to show in a browser that has the console
open (headless Debian chromium via Playwright, `meshfn serve` on a small mesh).

Each round rewrites the route file (a new prefix) and times, from the atomic rename:
  reload_ms:  until the control plane's /debug/status reports the new configuration (baseline:
              what the console cannot beat, measured in the same run by polling);
  console_ms: until the page's DOM shows the new route (a MutationObserver stamps the moment).
Both clocks are the machine's wall clock. The goal is console_ms <= 1000. Prints one line:
  console: visible_p50_ms=… visible_max_ms=… reload_p50_ms=… over_reload_p50_ms=… rounds=…
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from meshfn.common.adminauth import call_admin, read_owner_token
from meshfn.testing import policies as p
from meshfn.testing.browser import chromium, sign_in
from meshfn.testing.processes import MESHFN, Processes, wait_for

HERE = Path(__file__).resolve().parent
OBSERVE = """(text) => {
  window.__seenAt = null;
  const target = document.getElementById("panel-topology");
  new MutationObserver((_, observer) => {
    if (target.innerText.includes(text)) { observer.disconnect(); window.__seenAt = Date.now(); }
  }).observe(target, {childList: true, subtree: true, characterData: true});
}"""


def generation(admin: str, state: Path) -> int:
    """The configuration generation, from /debug/status (as the control plane's owner)."""
    return int(
        call_admin(admin + "/debug/status", read_owner_token(state), timeout=2)["generation"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "console.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshfn-bench-console-") as tmp_dir:
        tmp = Path(tmp_dir)
        procs = Processes(tmp)
        try:
            policies = p.Policies(tmp / "policies")
            serve = procs.start(
                "serve",
                [MESHFN, "serve", "--policies", str(policies.root), "--state-dir", str(tmp / "s")],
            )
            wait_for("the control plane", lambda: "control plane ready" in serve.output(), 120)
            visible, reload = [], []
            with chromium() as browser:
                page = browser.page
                wait_for("the admin token", lambda: read_owner_token(tmp / "s"), 30)
                sign_in(browser, policies.admin, tmp / "s")
                page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
                for n in range(args.rounds):
                    prefix = f"/round-{n}"
                    before = generation(policies.admin, tmp / "s")
                    page.evaluate(OBSERVE, f"prefix {prefix}")
                    started = time.time()
                    policies.route(prefix, "alpha")
                    wait_for(
                        "the reload",
                        lambda b=before: generation(policies.admin, tmp / "s") > b,
                        every=0.002,
                    )
                    reload.append((time.time() - started) * 1000)
                    page.wait_for_function("() => window.__seenAt !== null", timeout=10_000)
                    shown_at = page.evaluate("() => window.__seenAt")
                    visible.append(shown_at - started * 1000)
                    # settle, and land each change at a random phase of the console's poll
                    time.sleep(0.2 + random.random() * 0.25)
                problems = list(browser.problems)
        finally:
            procs.stop_all()
    result = {
        "rounds": args.rounds,
        "visible_ms": visible,
        "reload_ms": reload,
        "visible_p50_ms": statistics.median(visible),
        "visible_max_ms": max(visible),
        "reload_p50_ms": statistics.median(reload),
        "goal_ms": 1000,
        "browser_problems": problems,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(
        f"console: visible_p50_ms={result['visible_p50_ms']:.0f}"
        f" visible_max_ms={result['visible_max_ms']:.0f}"
        f" reload_p50_ms={result['reload_p50_ms']:.0f}"
        f" over_reload_p50_ms={statistics.median(v - r for v, r in zip(visible, reload, strict=True)):.0f}"
        f" rounds={args.rounds}"
    )


if __name__ == "__main__":
    main()
