"""`meshfn rollout status|promote|abort|pause|resume NAME`: a running control plane's rollouts,
from its admin port (and the actions a person takes on them, each an audit record naming the
principal of the admin token: the owner's, from the state directory, unless
$MESHFN_ADMIN_TOKEN names another; the actions need the auditor role)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from meshfn.common.cli import command_app, fail, out

from .shared import DEFAULT_STATE, AdminOpt, ClientStateOpt, admin_url, get_json, post_json

rollout_app = command_app(
    "rollout",
    "Rollouts of new Function versions: where each is, its checks and history; promote, "
    "abort, pause or resume one.",
)

NameArg = Annotated[str, typer.Argument(help="the Rollout: name, or namespace/name")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the admin port's JSON document")]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def _value(unit: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} ms" if unit == "ms" else _percent(value)


_VERDICT = {"pass": "green", "breach": "red", "pending": "yellow"}
_PHASE = {"Progressing": "cyan", "Paused": "yellow", "Promoted": "green"}


def _where(doc: dict[str, Any]) -> str:
    steps = doc["steps"]
    step = steps[doc["step"] - 1]
    where = f"step {doc['step']}/{len(steps)} ({step['kind']} {step['percent']}%)"
    split = f"candidate {doc['weight']}%"
    if doc["mirror"]:
        split += f", mirrored {doc['mirror']}%"
    progress = (
        f"{doc['requests']}/{doc['min_requests']} answers, "
        f"{doc['step_elapsed_s']:.0f}/{doc['min_time_s']:.0f} s"
    )
    return f"{where}: {split}; {progress}"


def _print(doc: dict[str, Any]) -> None:
    phase = doc["phase"]
    out.print(
        Text.assemble(
            (doc["rollout"], "bold"),
            f"  {doc['function']} {doc['stable']} -> {doc['candidate']}  ",
            (phase, _PHASE.get(phase, "red")),
        )
    )
    out.print(Text(f"  {_where(doc)}"))
    if doc["reason"]:
        out.print(Text(f"  {doc['reason']}"))
    if doc["pinning"] and doc["pinned"]:
        pin = doc["pinning"]
        out.print(
            Text(
                f"  pinned ({pin['claim']}): stable {', '.join(pin['stable']) or '-'}; "
                f"candidate {', '.join(pin['candidate']) or '-'}"
            )
        )
    table = Table(title="checks (the last evaluation)", title_justify="left")
    for column in ("check", "candidate", "limit", "stable", "answers", "verdict"):
        table.add_column(column)
    for check in doc["checks"]:
        unit = check["unit"]
        verdict = check["verdict"]
        table.add_row(
            Text(check["name"]),
            _value(unit, check["candidate"]),
            _value(unit, check["limit"]),
            _value(unit, check["stable"]),
            str(check["samples"]),
            Text(verdict, style=_VERDICT.get(verdict, "")),
        )
    out.print(table)
    history = Table(title="history", title_justify="left")
    for column in ("when", "event", "step", "weight", "mirror", "by", "why"):
        history.add_column(column)
    for entry in doc["history"][-15:]:
        when = dt.datetime.fromtimestamp(entry["at"]).strftime("%H:%M:%S")
        history.add_row(
            when, Text(entry["event"]), str(entry["step"] + 1), f"{entry['weight']}%",
            f"{entry['mirror']}%", Text(entry["by"]), Text(entry["reason"]),
        )  # fmt: skip
    out.print(history)


@rollout_app.command()
def status(
    name: Annotated[str | None, typer.Argument(help="one Rollout (default: every one)")] = None,
    admin: AdminOpt = None,
    state_dir: ClientStateOpt = DEFAULT_STATE,
    as_json: JsonOpt = False,
) -> None:
    """Where each rollout is: step, weights, each SLO check against its limit, history."""
    docs = get_json(admin_url(admin, state_dir) + "/rollouts", state_dir)["rollouts"]
    if name is not None:
        docs = [d for d in docs if name in (d["rollout"], d["rollout"].split("/", 1)[1])]
        if not docs:
            fail(f"no rollout {name!r}")
    if as_json:
        out.print_json(json.dumps(docs))
        return
    if not docs:
        out.print("no rollouts (a Rollout policy starts one)")
    for doc in docs:
        _print(doc)


def _act(action: str, name: str, admin: str | None, state_dir: Path) -> None:
    """One action, as the principal of the admin token (the owner's, in `state_dir`)."""
    body = {"rollout": name, "action": action}
    answer = post_json(admin_url(admin, state_dir) + "/rollouts/actions", body, state_dir)
    out.print(Text(f"{answer['rollout']['rollout']}: {answer['event']}"))


@rollout_app.command()
def promote(
    name: NameArg, admin: AdminOpt = None, state_dir: ClientStateOpt = DEFAULT_STATE
) -> None:
    """Send every request to the candidate now, skipping the steps left."""
    _act("promote", name, admin, state_dir)


@rollout_app.command()
def abort(name: NameArg, admin: AdminOpt = None, state_dir: ClientStateOpt = DEFAULT_STATE) -> None:
    """Send every request back to the stable version now."""
    _act("abort", name, admin, state_dir)


@rollout_app.command()
def pause(name: NameArg, admin: AdminOpt = None, state_dir: ClientStateOpt = DEFAULT_STATE) -> None:
    """Hold the rollout where it is (its split stays) until resumed, promoted or aborted."""
    _act("pause", name, admin, state_dir)


@rollout_app.command()
def resume(
    name: NameArg, admin: AdminOpt = None, state_dir: ClientStateOpt = DEFAULT_STATE
) -> None:
    """Go on from a pause: the current step starts over with a fresh window."""
    _act("resume", name, admin, state_dir)
