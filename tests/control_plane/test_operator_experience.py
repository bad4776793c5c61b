"""What a new user meets in the terminal: the lines `meshfn up` prints, help texts, dev.sh's log
lines, build progress. Each case here was a rough edge a new user hit."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer.main
from rich.console import Console
from typer.testing import CliRunner

from meshfn import ir
from meshfn.common.clihelp import reflow
from meshfn.common.progress import RichReporter
from meshfn.control_plane.cli import app
from meshfn.control_plane.runtime.hints import (
    describe_match,
    hints,
    meshfn_command,
    sample_request,
    shell_path,
)
from meshfn.policy import load_policies

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "policies" / "examples"
IRIS = '{"inputs":[{"name":"features","datatype":"FP32","shape":[1,4],"data":[0.5,0.5,0.5,0.5]}]}'


def _rendered(model: ir.MeshModel, state: Path, **kwargs: object) -> tuple[str, list[str]]:
    found = hints(model, state, "http://127.0.0.1:18001", **kwargs)  # type: ignore[arg-type]
    console = Console(record=True, width=250, file=io.StringIO())
    console.print(found.table)
    return console.export_text(), found.tries


def test_route_table_shows_regexes_as_written_with_headers(tmp_path: Path) -> None:
    text, _ = _rendered(load_policies(EXAMPLES), tmp_path / ".meshfn")
    assert "regex ^/debug/[a-z]+$ [GET] x-debug present" in text  # not "^/debug/+$"
    match = ir.RouteMatch(
        ir.PathMatch("regex", "^/[bold]x[/bold]$"),
        headers=(
            ir.HeaderMatch("x-a", "exact", "[red]v"),
            ir.HeaderMatch("x-b", "regex", "^a+$", invert=True),
        ),
    )
    assert describe_match(match).plain == "regex ^/[bold]x[/bold]$ x-a=[red]v not x-b~^a+$"


def test_try_lines_paste_as_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHFN_CALLER_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # meshfn is not on PATH (as after ./dev.sh up)
    program = tmp_path / ".venv" / "bin" / "meshfn"
    _, tries = _rendered(
        load_policies(EXAMPLES), tmp_path / ".meshfn", samples={"iris": IRIS}, argv0=str(program)
    )
    assert tries[0] == (
        "TOKEN=$(.venv/bin/meshfn token issue --state-dir .meshfn --sub you --aud meshfn"
        " --claim tenant=acme)"
    )
    assert (
        'curl -s -H "authorization: Bearer $TOKEN" -X POST'
        f" http://127.0.0.1:10000/v2/models/iris/infer -d '{IRIS}'" in tries
    )
    assert "curl -s http://127.0.0.1:10000/v2/models/cancer   # without the token" in tries
    assert any(t.startswith(".venv/bin/meshfn status   #") for t in tries)  # default state dir
    assert any(t.startswith(".venv/bin/meshfn audit query --subject-raw you") for t in tries)
    assert not any(t.startswith("meshfn ") or "$(meshfn " in t for t in tries)


def test_commands_and_paths_for_the_caller(tmp_path: Path) -> None:
    assert meshfn_command(str(tmp_path / "bin" / "meshfn"), base=tmp_path) == "bin/meshfn"
    assert meshfn_command("/opt/x y/meshfn", base=tmp_path) == "'/opt/x y/meshfn'"
    assert shell_path(tmp_path / "state", base=tmp_path) == "state"
    assert shell_path(Path("/elsewhere/s"), base=tmp_path) == "/elsewhere/s"


def test_sample_requests_follow_the_signature() -> None:
    body = sample_request(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]},
                    {"name": "n", "datatype": "INT32", "shape": [2]}]}
    )  # fmt: skip
    assert body == (
        '{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":["a service mesh for'
        ' inference"]},{"name":"n","datatype":"INT32","shape":[2],"data":[1,1]}]}'
    )
    assert sample_request({"inputs": [{"name": "x"}]}) is None
    assert sample_request({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4096]}]}) is None


def _commands(group: click.Command, prefix: str = "meshfn") -> list[tuple[str, click.Command]]:
    out = [(prefix, group)]
    if isinstance(group, click.Group) or hasattr(group, "commands"):  # typer has its own click
        for name, command in group.commands.items():
            out += _commands(command, f"{prefix} {name}")
    return out


def test_help_texts_never_break_mid_sentence() -> None:
    for name, command in _commands(typer.main.get_command(app)):
        for text in (command.help, command.short_help):
            if text:
                assert all("\n" not in p for p in text.split("\n\n")), (name, text)
    shown = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "250"}).output
    assert "to run an Envoy against meshfn yourself. It carries the workload's" in shown
    assert reflow("  a\n  b.\n\n  c\n  d") == "a b.\n\nc d"


def test_dev_sh_logs_plain_text_into_files(tmp_path: Path) -> None:
    piped = subprocess.run(
        [str(ROOT / "dev.sh"), "no-such-command"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert piped.returncode == 2
    assert "[meshfn] unknown command: no-such-command" in piped.stderr
    assert "\x1b" not in piped.stderr + piped.stdout
    # on a terminal the prefix is bold
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(
            [str(ROOT / "dev.sh"), "no-such-command"],
            stdout=subprocess.DEVNULL,
            check=False,
            stderr=follower,
            env={**os.environ, "TERM": "xterm"},
            timeout=30,
        )
        assert done.returncode == 2
        assert b"\x1b[1m[meshfn]" in os.read(leader, 65536)
    finally:
        os.close(leader)
        os.close(follower)


def test_progress_says_what_was_built_and_cached() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with RichReporter(console, "example functions") as progress:
        for item in ("iris", "digits"):
            progress.begin(item, 3)
        progress.step("iris", "componentize-py")
        progress.finish("iris", cached=False)
        progress.finish("digits", cached=True)
    lines = out.getvalue().splitlines()
    assert lines[0] == "example functions: iris: componentize-py"  # plain lines off a terminal
    assert lines[-1].startswith("example functions: built iris in ")
    assert lines[-1].endswith("s; cached: digits")
    out = io.StringIO()
    with RichReporter(Console(file=out, width=200), "filters") as progress:
        progress.begin("audit.wasm", 1)
        progress.finish("audit.wasm", cached=True)
    assert out.getvalue() == "filters: all 1 cached (audit.wasm)\n"


def test_hostile_policy_names_print_as_text(tmp_path: Path) -> None:
    hostile = "<b>[red]x[/red]</b>"
    (tmp_path / "route.yaml").write_text(
        f"apiVersion: meshfn.io/v1alpha1\nkind: Route\nmetadata: {{name: '{hostile}'}}\n"
        "spec:\n  destination: {service: nope}\n"
    )
    shown = CliRunner().invoke(app, ["validate", str(tmp_path)], env={"COLUMNS": "250"})
    assert shown.exit_code == 1
    assert hostile in shown.output and "route.yaml:3: metadata.name" in shown.output


_LONG = "started inference default/models-lite 127.0.0.1:9103 (pid 7111) " + "x" * 180
_WRITE_TO_A_FILE = f"""
import logging
from rich.table import Table
from meshfn.common.cli import console
from meshfn.common.logs import setup_logging

setup_logging("human", "info")
logging.getLogger("meshfn.process").info("{_LONG}", extra={{"node": "edge.default~0"}})
console(stderr=True).print("{_LONG}")
table = Table("route", "destination")
table.add_row("/v2/models/iris/infer", "{_LONG[:150]}")
console().print(table)
"""


def test_output_sent_to_a_file_never_wraps() -> None:
    """Issue 40: log lines wrapped at 80 columns in the middle of a value ("... (pid" / "7111)")
    when `meshfn up` wrote to a file. Off a terminal: one record a line, no padding."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run(
        [sys.executable, "-P", "-c", _WRITE_TO_A_FILE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    log, echoed = done.stderr.splitlines()
    assert re.fullmatch(rf"\d\d:\d\d:\d\d INFO     {re.escape(_LONG)}  node=edge.default~0", log)
    assert echoed == _LONG
    assert "\x1b" not in done.stderr + done.stdout
    table = done.stdout.splitlines()
    assert any(_LONG[:150] in line for line in table), done.stdout  # tables: WIDE, not 80
    assert all(line == line.rstrip() for line in done.stderr.splitlines())


def test_help_outside_a_terminal_keeps_option_names() -> None:
    """Issue 40: `meshfn up --help | less` cut option names (`--envoy-concurr…`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "meshfn"), "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    ).stdout
    assert "…" not in shown, shown
    for option in ("--envoy-concurrency", "--publish-examples", "--functions-registry"):
        assert option in shown


def _shell_functions(script: str) -> dict[str, str]:
    """name -> body of each `name() {` ... `}` function of a shell script."""
    found = re.finditer(r"^([a-z_]+)\(\) \{\n(.*?)^\}", script, re.M | re.S)
    return {m.group(1): m.group(2) for m in found}


def _reached(body: str, functions: dict[str, str]) -> str:
    """`body` with the bodies of the functions it calls, transitively."""
    seen: set[str] = set()
    todo = [body]
    text = ""
    while todo:
        part = todo.pop()
        text += part
        for name in set(re.findall(r"[a-z_]+", part)) & set(functions) - seen:
            seen.add(name)
            todo.append(functions[name])
    return text


def test_dev_sh_up_reports_the_filter_build_once() -> None:
    """Issue 40: `./dev.sh up` printed the filter status twice: `filters: all 6 cached` and six
    `sha256:` lines from setup's `meshfn filters build`, then `proxy-wasm filters: all 6
    cached` from `meshfn up`, which builds them itself. `up` now leaves them to `meshfn up`."""
    script = (ROOT / "dev.sh").read_text()
    functions = _shell_functions(script)
    branches = dict(re.findall(r"^  ([a-z| -]+)\)\s(.*?);;", script, re.M | re.S))
    up = _reached(branches["up"], functions)
    assert 'meshfn" up ' in up
    assert "filters build" not in up
    assert "ensure_venv" in up and "setup_host.sh" in up  # still installs what it needs
    for command in ("setup", "test"):  # the other commands still build them up front
        assert "filters build" in _reached(branches[command], functions)
