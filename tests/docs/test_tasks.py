"""The task pages are followable: every command block on them is run here, in order, in a
scratch directory (a copy of policies/ and functions/, the virtual environment first on PATH),
or marked `not-run` with the reason and the test that covers the same ground. Files the page
shows (`file:` directives) are written where it says before the commands that use them."""

from __future__ import annotations

import hmac
import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from meshfn.testing.docs import ROOT, Block, blocks, pages

TASKS = pages("tasks")
RUN = re.compile(r"^(?:exits (?P<code>\d+)|with (?P<fixture>[a-z-]+))?$")


def test_there_are_task_pages() -> None:
    names = {p.stem for p in TASKS}
    for wanted in (
        "secure-a-service", "add-a-fallback-chain", "publish-a-function", "bring-your-own-model",
        "rotate-the-ca", "verify-the-audit-trail", "render-for-istio", "install-on-kubernetes",
        "run-the-benchmarks",
    ):  # fmt: skip
        assert wanted in names, wanted


@pytest.mark.parametrize("page", TASKS, ids=lambda p: p.stem)
def test_every_command_block_is_run_or_says_why_not(page: Path) -> None:
    for block in blocks(page):
        if not block.is_shell:
            assert "run" not in block.directives, f"{block.where}: run is for sh blocks"
            continue
        run, skip = block.directives.get("run"), block.directives.get("not-run")
        assert (run is None) != (skip is None), f"{block.where}: mark it run or not-run: REASON"
        if skip is not None:
            assert len(skip) >= 30, f"{block.where}: say why it is not run, and what tests it"
        else:
            assert RUN.match(run or ""), f"{block.where}: unknown run directive {run!r}"


def _scratch(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "dist")
    for folder in ("policies", "functions"):
        shutil.copytree(ROOT / folder, work / folder, ignore=ignore)
    return work


def _environment(work: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    keep = {k: v for k, v in os.environ.items() if not k.startswith("MESHFN_")}
    # the build cache stays the user's (content-addressed), so a function built once is reused
    cache = {k: v for k, v in os.environ.items() if k == "MESHFN_CACHE"}
    return {
        **keep,
        **cache,
        "PATH": f"{bin_dir}{os.pathsep}{keep.get('PATH', '')}",
        "PYTHONSAFEPATH": "1",
        "MESHFN_CALLER_DIR": str(work),
        "NO_COLOR": "1",
    }


def _audit_trail(work: Path) -> None:
    """STATE/audit as `meshfn up` lays it out: a store with requests of `alice` and others in
    one journal, signed by the signer's key, the checkpoint in the witness, the subject salt."""
    from meshfn.testing.audit import Trail

    state = work / ".meshfn"
    salt = "5a" * 16
    (state / "audit").mkdir(parents=True)
    (state / "audit" / "subject.salt").write_text(salt + "\n")
    (state / "audit" / "subject.salt").chmod(0o600)

    def subject(raw: str) -> str:
        return hmac.new(bytes.fromhex(salt), raw.encode(), "sha256").hexdigest()

    start = datetime.now(UTC) - timedelta(minutes=20)
    trail = Trail(state / "audit" / "audit.db", state)
    trail.store.append(
        [
            {
                "v": 2,
                "time": (start + timedelta(seconds=i)).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                "method": "POST",
                "path": "/v2/models/iris/infer",
                "status": 503 if i % 7 == 0 else 200,
                "route": "default/function-iris",
                "subject": subject("alice" if i % 2 else "bob"),
                "salt_id": "s",
                "tenant": "acme",
                "duration_us": 900 + i,
            }
            for i in range(20)
        ],
        chain="models.default:15101",
    )
    trail.checkpoint()
    trail.close()


FIXTURES = {"audit-trail": _audit_trail}


def _run(block: Block, work: Path, env: dict[str, str]) -> None:
    match = RUN.match(block.directives["run"])
    assert match is not None
    expected = int(match.group("code") or 0)
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == expected, (
        f"{block.where}: exit {result.returncode}, expected {expected}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "page",
    [p for p in TASKS if any("run" in b.directives for b in blocks(p))],
    ids=lambda p: p.stem,
)
def test_task_commands_run(page: Path, tmp_path: Path) -> None:
    work = _scratch(tmp_path)
    env = _environment(work)
    prepared: set[str] = set()
    for block in blocks(page):
        if path := block.directives.get("file"):
            target = work / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
        if "run" not in block.directives:
            continue
        match = RUN.match(block.directives["run"])
        fixture = match.group("fixture") if match else None
        if fixture and fixture not in prepared:
            FIXTURES[fixture](work)
            prepared.add(fixture)
        _run(block, work, env)
