"""What `meshfn up` prints once the mesh is up: the route table and commands to paste.

Every line must work when pasted into the shell `meshfn up` was started from: the meshfn
command is the one running now (`.venv/bin/meshfn` after `./dev.sh up`, where `meshfn` is not
on PATH), paths are relative to the caller's directory (`$MESHFN_CALLER_DIR`, set by dev.sh,
else the working directory) or absolute, and everything is shell-quoted. Table cells are rich
`Text`, never markup: a regex such as `^/debug/[a-z]+$` is shown as written.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshfn import ir
from meshfn.common import env

DEFAULT_STATE = Path(".meshfn")
SAMPLE_TEXT = "a service mesh for inference"


def caller_dir() -> Path:
    return env.CALLER_DIR.path() or Path(os.getcwd())


def shell_path(path: Path, base: Path | None = None) -> str:
    """`path` as the caller would type it: relative to their directory when inside it."""
    absolute = Path(os.path.abspath(path))
    base = Path(os.path.abspath(base or caller_dir()))
    try:
        return shlex.quote(str(absolute.relative_to(base)) or ".")
    except ValueError:
        return shlex.quote(str(absolute))


def meshfn_command(argv0: str | None = None, base: Path | None = None) -> str:
    """The command that runs this meshfn: plain `meshfn` only if PATH finds this same program."""
    program = Path(argv0 if argv0 is not None else sys.argv[0])
    found = shutil.which("meshfn")
    if found is not None and Path(found).resolve() == program.resolve():
        return "meshfn"
    text = shell_path(program, base)
    return text if "/" in text else f"./{text}"


def describe_match(match: ir.RouteMatch) -> Text:
    """`regex ^/debug/[a-z]+$ [GET] x-debug present`, as plain text."""
    parts = [f"{match.path.kind} {match.path.value}"]
    if match.methods:
        parts.append(f"[{','.join(match.methods)}]")
    for header in match.headers:
        operator = {"exact": "=", "prefix": "^=", "regex": "~"}.get(header.kind)
        condition = (
            f"{header.name} present"
            if header.kind == "present"
            else f"{header.name}{operator}{header.value}"
        )
        parts.append(("not " if header.invert else "") + condition)
    return Text(" ".join(parts))


def needs_token(model: ir.MeshModel, service_key: str) -> bool:
    return any(
        w.jwt_rules
        for w in model.workloads
        if w.inbound is not None and w.inbound.service == service_key
    )


def curl_example(
    base: str,
    route: ir.Route,
    match: ir.RouteMatch,
    with_token: bool = False,
    path: str | None = None,
    body: str | None = None,
) -> str:
    parts = ["curl", "-s"]
    if with_token:
        parts += ["-H", '"authorization: Bearer $TOKEN"']
    if body is not None:
        parts += ["-X", "POST"]
    elif match.methods and "GET" not in match.methods:
        parts += ["-X", match.methods[0]]
    for header in match.headers:
        if header.invert:
            continue
        value = header.value if header.kind in ("exact", "prefix") else "demo"
        parts += ["-H", shlex.quote(f"{header.name}: {value}")]
    host = next((h for h in route.hosts if h != "*"), None)
    if host is not None:
        parts += ["-H", shlex.quote(f"host: {host.replace('*', 'www')}")]
    parts.append(shlex.quote(base + (path or match.path.value)))
    if body is not None:
        parts += ["-d", shlex.quote(body)]
    return " ".join(parts)


def sample_request(metadata: Mapping[str, Any]) -> str | None:
    """A KServe v2 infer body for a model's declared inputs (from its metadata): every -1
    dimension 1, FP ones 0.5, integers 1, BYTES a short text. None if the inputs are unknown."""
    inputs = []
    for tensor in metadata.get("inputs") or []:
        try:
            name, datatype = str(tensor["name"]), str(tensor["datatype"])
            shape = [1 if int(d) < 0 else int(d) for d in tensor["shape"]]
        except (KeyError, TypeError, ValueError):
            return None
        count = 1
        for dim in shape:
            count *= dim
        if count > 1024:
            return None
        value: Any = 0.5 if datatype.startswith("FP") else 1
        if datatype == "BYTES":
            value = SAMPLE_TEXT
        elif datatype == "BOOL":
            value = True
        inputs.append({"name": name, "datatype": datatype, "shape": shape, "data": [value] * count})
    if not inputs:
        return None
    return json.dumps({"inputs": inputs}, separators=(",", ":"))


@dataclass(frozen=True)
class Hints:
    table: Table
    tries: list[str]


def _literal(match: ir.RouteMatch) -> bool:
    # Regexes have no literal path; "/v2/models/x/" duplicates its exact sibling.
    return match.path.kind != "regex" and not match.path.value.endswith("/")


def hints(
    model: ir.MeshModel,
    state_dir: Path,
    admin_url: str,
    samples: Mapping[str, str] | None = None,
    argv0: str | None = None,
) -> Hints:
    """The route table, and the lines to try: a token, each route with a literal path, an
    inference per function (`samples`: function name -> infer body), one request without the
    token, then status and the audit trail."""
    samples = samples or {}
    functions = {f"/v2/models/{f.name}": f for f in model.functions}
    table = Table(title="meshfn is up", title_justify="left")
    for column in ("gateway", "listener", "route", "match", "service"):
        table.add_column(column)
    tries: list[str] = []
    refused: list[str] = []
    has_function = False
    for workload in model.workloads:
        for listener in workload.listeners:
            host = "127.0.0.1" if listener.address in ("0.0.0.0", "::") else listener.address
            base = f"http://{host}:{listener.port}"
            for route in listener.routes:
                token = needs_token(model, route.service)
                for match in route.matches:
                    table.add_row(
                        Text(workload.key),
                        Text(f"{base} ({listener.name})"),
                        Text(route.key),
                        describe_match(match),
                        Text(route.service),
                    )
                    if not _literal(match):
                        continue
                    tries.append(curl_example(base, route, match, token))
                    function = functions.get(match.path.value)
                    if function is not None and function.name in samples:
                        infer = f"{match.path.value}/infer"
                        body = samples[function.name]
                        tries.append(curl_example(base, route, match, token, infer, body))
                    # One call without the token, preferably to a model (the examples' models
                    # want a tenant's token; other services may take anonymous calls).
                    if token and (not refused or (function is not None and not has_function)):
                        refused[:] = [f"{curl_example(base, route, match)}   # without the token"]
                        has_function = function is not None
    command = meshfn_command(argv0)
    prefix = []
    if any("$TOKEN" in line for line in tries):
        prefix.append(
            f"TOKEN=$({command} token issue{_state_option(state_dir)} --sub you --aud meshfn"
            " --claim tenant=acme)"
        )
    status = f"{command} status{state_option(state_dir)}"
    tail = [*refused, f"{status}   # every proxy: SYNCED / STALE / NACKED"]
    if model.audit is not None:
        store = (
            ""
            if _is_default(state_dir)
            else f" --store {shell_path(state_dir / 'audit' / 'audit.db')}"
        )
        tail.append(f"{command} audit query{store} --subject-raw you   # your requests' records")
        tail.append(
            f"{command} audit verify{store}   # every chain, the signed checkpoints, the witness"
        )
    return Hints(table, [*prefix, *tries, *tail])


def _is_default(state_dir: Path) -> bool:
    return Path(os.path.abspath(state_dir)) == Path(os.path.abspath(caller_dir() / DEFAULT_STATE))


def _state_option(state_dir: Path) -> str:
    return f" --state-dir {shell_path(state_dir)}"


def state_option(state_dir: Path) -> str:
    """` --state-dir DIR` for a command that reads the admin token there (none: the default)."""
    return "" if _is_default(state_dir) else _state_option(state_dir)


def print_hints(console: Console, found: Hints, footer: Iterable[str]) -> None:
    console.print(found.table)
    console.print("try:")
    for line in found.tries:
        console.print(f"  {line}", markup=False, highlight=False)
    for line in footer:
        console.print(line, markup=False, highlight=False)
