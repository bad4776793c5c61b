"""What meshfn's command-line modules share (the main CLI, `meshfn audit`, `meshfn fn` and the
backend's own entry point): how consoles are built, how a command fails, how help is sized.

One rule for every console: on a terminal rich measures the terminal; anywhere else (a log
file, a pipe, a test runner) a line is as long as what it says. Text never wraps there
(soft wrap), tables and help get WIDE columns, and log lines are plain, one record a line
(meshfn.common.logs), so nothing breaks in the middle of a value
(`started inference default/models-lite 127.0.0.1:9103 (pid` / `7111)`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn, TextIO

import typer
import typer.rich_utils
from rich.console import Console

# Columns of tables and help written to anything but a terminal.
WIDE = 200


def command_app(name: str, help: str) -> typer.Typer:
    """A CLI's typer app as meshfn's CLIs all are: help when called without a command, no
    shell-completion options, and errors printed by the commands (no rich tracebacks)."""
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def console(stderr: bool = False, **options: Any) -> Console:
    """A console for a command's output (stdout) or its messages (stderr); `options` go to
    rich (e.g. `markup=False`)."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if is_terminal(stream) else WIDE
    return Console(stderr=stderr, soft_wrap=True, width=width, **options)


# The consoles of the main CLI and `meshfn audit` (the backend's CLI builds its own, without
# markup: it prints what functions are named).
out = console()
err = console(stderr=True)


def fail(message: object, code: int = 1) -> NoReturn:
    """Print `error: message` on stderr (the message as text, never markup) and exit `code`."""
    err.print("[red]error:[/red] ", end="", highlight=False)
    err.print(str(message), markup=False, highlight=False)
    raise typer.Exit(code)


def print_errors(errors: list[Any], console: Console = err) -> None:
    """Errors that each name where they are (file:line: field: problem), one a line as text,
    then how many."""
    for error in errors:
        console.print(str(error), highlight=False, markup=False)
    console.print(f"[red]{len(errors)} error(s)[/red]")


def wide_help() -> None:
    """Help written to anything but a terminal gets WIDE columns, so typer's option table
    never cuts an option name (`--envoy-concurr…`). $TERMINAL_WIDTH and $COLUMNS still win."""
    wanted = typer.rich_utils.MAX_WIDTH is None and "COLUMNS" not in os.environ
    if wanted and not is_terminal(sys.stdout):
        typer.rich_utils.MAX_WIDTH = WIDE


def run_cli(app: typer.Typer) -> NoReturn:
    """A CLI's entry point: run `app`; Ctrl-C exits 130 without a traceback."""
    wide_help()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)  # typer exits itself; this is for the type checker
