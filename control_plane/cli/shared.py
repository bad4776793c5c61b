"""What the command modules of `meshfn` share: the options several commands take, loading
policies (errors printed one way: file:line: field: problem), and reaching a running control
plane's admin port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from meshfn.common import env
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
        "--admin", help="control plane admin URL (default: $MESHFN_ADMIN, .meshfn/state.json)"
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
        help="address of the admin port and its web console (beyond loopback it needs a token)",
    ),
]
AdminTokenOpt = Annotated[
    Path | None,
    typer.Option(
        "--admin-token-file",
        help="file holding the admin token (default: $MESHFN_ADMIN_TOKEN); every admin request"
        " and the console must then present it",
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


def admin_json(url: str, timeout: float = 5, body: Any = None) -> Any:
    """GET a JSON document from the admin port (with $MESHFN_ADMIN_TOKEN when set); with
    `body`, POST it as JSON instead."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token := env.ADMIN_TOKEN.get():  # an admin port beyond loopback
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            detail = exc.reason
        raise AdminUnreachable(str(detail)) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdminUnreachable(
            f"cannot reach the control plane at {url}: {reason} (is meshfn up running?)"
        ) from None


def get_json(url: str) -> Any:
    """`admin_json`, or the reason printed and exit 1."""
    try:
        return admin_json(url)
    except AdminUnreachable as exc:
        fail(exc)


def post_json(url: str, body: Any) -> Any:
    """POST `body` to the admin port (`admin_json`), or the reason printed and exit 1."""
    try:
        return admin_json(url, body=body)
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
