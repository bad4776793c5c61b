"""What the command modules of `meshfn` share: the options several commands take, loading
policies (errors printed one way: file:line: field: problem), and reaching a running control
plane's admin port."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from meshfn.common import env
from meshfn.common.adminauth import AdminCallError, call_admin, owner_token_path, read_owner_token
from meshfn.common.cli import err, fail, print_errors
from meshfn.ir import MeshModel
from meshfn.policy import PolicyErrors, PolicyLoader

T = TypeVar("T")

DEFAULT_POLICIES = Path("policies/examples")
DEFAULT_STATE = Path(".meshfn")
DEFAULT_ADMIN = "http://127.0.0.1:18001"

PoliciesOpt = Annotated[Path, typer.Option("--policies", "-p", help="policy file or directory")]
AdminOpt = Annotated[
    str | None,
    typer.Option(
        "--admin", help="control plane admin URL (default: $MESHFN_ADMIN, STATE_DIR/state.json)"
    ),
]
LogFormatOpt = Annotated[str, typer.Option("--log-format", help="human | json")]
StateOpt = Annotated[
    Path, typer.Option("--state-dir", help="CA, token keys, logs, bootstraps (keep private)")
]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error")]
AdminListenOpt = Annotated[
    str,
    typer.Option(
        "--admin-listen",
        help="address of the admin port and its web console (every request needs a token;"
        " beyond loopback, put TLS in front)",
    ),
]
AdminTokenOpt = Annotated[
    Path | None,
    typer.Option(
        "--admin-token-file",
        help="file holding a fixed admin token accepted besides the signed ones, with the"
        " auditor role (default: $MESHFN_ADMIN_TOKEN)",
    ),
]
ClientStateOpt = Annotated[
    Path,
    typer.Option(
        "--state-dir",
        help="the control plane's state directory: its admin URL (state.json) and the admin"
        " token (admin/token), unless --admin / $MESHFN_ADMIN_TOKEN say otherwise",
    ),
]


# ------------------------------------------------------------------ policies


def policy_errors_exit(exc: PolicyErrors) -> NoReturn:
    """Every error of a policy set that does not load, then exit 1."""
    print_errors(exc.errors, err)
    raise typer.Exit(1) from None


def loaded(load: Callable[[], T]) -> T:
    """`load()` (a policy loader's), or its errors printed and exit 1."""
    try:
        return load()
    except PolicyErrors as exc:
        policy_errors_exit(exc)


def load_model(path: Path) -> MeshModel:
    """The compiled model of the policies at `path`, or their errors printed and exit 1."""
    return loaded(PolicyLoader(path).load)


def known_workloads(model: MeshModel) -> str:
    return ", ".join(w.node_cluster for w in model.workloads)


# ------------------------------------------------------------------ the admin port


class AdminUnreachable(Exception):
    """The admin port did not answer, or answered with an error (the message says which)."""


def recorded_admin(state_dir: Path) -> str | None:
    """The admin URL a running `meshfn up` wrote into STATE/state.json, if any."""
    try:
        return str(json.loads((state_dir / "state.json").read_text())["admin"]).rstrip("/")
    except (OSError, ValueError, KeyError):
        return None


def admin_url(given: str | None, state_dir: Path = DEFAULT_STATE) -> str:
    """--admin, else $MESHFN_ADMIN, else what `meshfn up` recorded, else the default port."""
    if given:
        return given.rstrip("/")
    if from_env := env.ADMIN.get():
        return from_env.rstrip("/")
    return recorded_admin(state_dir) or DEFAULT_ADMIN


def client_token(state_dir: Path = DEFAULT_STATE) -> str | None:
    """What the CLI presents to the admin port: $MESHFN_ADMIN_TOKEN, else the owner's token
    that the control plane wrote into its state directory (adminauth)."""
    if token := env.ADMIN_TOKEN.get():
        return token
    try:
        return read_owner_token(state_dir)
    except OSError as exc:
        fail(f"cannot read the admin token in {state_dir}: {exc.strerror or exc}")


def admin_json(url: str, timeout: float = 5, state_dir: Path = DEFAULT_STATE) -> Any:
    """GET a JSON document from the admin port, with the admin token (`client_token`)."""
    token = client_token(state_dir)
    try:
        return call_admin(url, token, timeout=timeout)
    except AdminCallError as exc:
        if exc.status == 0:
            raise AdminUnreachable(f"{exc} (is meshfn up running?)") from None
        if exc.status == 401:
            raise AdminUnreachable(
                f"the control plane refused the admin token ({'none' if token is None else 'given'};"
                f" the owner's is in {owner_token_path(state_dir)}): give the --state-dir of the"
                f" control plane at {url.split('/', 3)[2]}, or set $MESHFN_ADMIN_TOKEN"
            ) from None
        raise AdminUnreachable(str(exc)) from None


def get_json(url: str, state_dir: Path = DEFAULT_STATE) -> Any:
    """`admin_json`, or the reason printed and exit 1."""
    try:
        return admin_json(url, state_dir=state_dir)
    except AdminUnreachable as exc:
        fail(exc)


def admin_token(path: Path | None) -> str | None:
    """The admin token from --admin-token-file or $MESHFN_ADMIN_TOKEN (at least 16 characters)."""
    try:
        token = path.read_text().strip() if path else env.ADMIN_TOKEN.get_or("")
    except OSError as exc:
        fail(f"--admin-token-file {path}: {exc.strerror or exc}")
    if token and len(token) < 16:
        fail("the admin token must have at least 16 characters")
    return token or None
