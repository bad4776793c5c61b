"""`meshfn console | admin token`: who may use the admin port and its console
(meshfn.common.adminauth: roles, tokens, one-time login links)."""

from __future__ import annotations

from typing import Annotated

import typer

from meshfn.common.adminauth import (
    ROLES,
    AdminCallError,
    AdminTokens,
    AuthError,
    call_admin,
    key_path,
)
from meshfn.common.cli import command_app, fail, out
from meshfn.contracts.durations import parse_duration

from .shared import DEFAULT_STATE, AdminOpt, ClientStateOpt, StateOpt, admin_url, client_token

admin_app = command_app("admin", "Who may use the admin port and console: tokens and their roles.")


def console(
    admin: AdminOpt = None,
    state_dir: ClientStateOpt = DEFAULT_STATE,
    role: Annotated[
        str | None, typer.Option(help="viewer | auditor (default: your token's role)")
    ] = None,
) -> None:
    """Print a one-time login link to the web console, asked of the running control plane with
    your admin token (it signs one browser in, once, as you, with at most your role)."""
    url = admin_url(admin, state_dir)
    body = {"role": role} if role else {}
    try:
        answer = call_admin(f"{url}/ui/links", client_token(state_dir), "POST", body)
    except AdminCallError as exc:
        fail(exc if exc.status != 401 else f"the control plane refused the admin token: {exc}")
    out.print(f"{url}{answer['path']}", markup=False, highlight=False, soft_wrap=True)


@admin_app.command("token")
def admin_token(
    name: Annotated[str, typer.Option("--name", help="who holds it (access records name it)")],
    role: Annotated[str, typer.Option(help="viewer | auditor")] = "viewer",
    ttl: Annotated[str, typer.Option(help='lifetime, e.g. "8h", "7d" (at most 366d)')] = "8h",
    state_dir: StateOpt = DEFAULT_STATE,
) -> None:
    """Issue an admin token for someone else, signed with the state directory's admin key (so
    only its owner can): `Authorization: Bearer TOKEN`, the console's login form, or
    $MESHFN_ADMIN_TOKEN for `meshfn status` and `meshfn console`. Prints the token."""
    if role not in ROLES:
        fail(f"--role must be one of {', '.join(ROLES)}")
    try:
        token = AdminTokens(key_path(state_dir)).issue(name, role, parse_duration(ttl))
    except (AuthError, ValueError) as exc:
        fail(exc)
    except OSError as exc:
        fail(f"cannot read the admin key in {state_dir}: {exc.strerror or exc}")
    out.print(token, markup=False, highlight=False, soft_wrap=True)
