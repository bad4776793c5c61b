"""What only e2e tests need: `meshfn up` and the control plane's view of its proxies, bench
smoke runs, plain HTTP, /proc lookups. The rest of the rig (processes, ports, Envoy, policies)
is meshfn.testing, shared with tests/ and bench/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from meshfn.common.adminauth import admin_headers
from meshfn.inference.examples import publish_examples
from meshfn.testing import processes
from meshfn.testing.policies import Policies, remap
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import MESHFN, Proc, wait_for

EXAMPLES = Path(__file__).resolve().parents[1] / "policies" / "examples"


def remap_examples(target: Path, *extra: Path) -> dict[int, int]:
    """policies/examples (and `extra` files beside them) on free ports (policies.remap)."""
    return remap(EXAMPLES, target, *extra)


def run_bench(script: str, args: list[str], tmp: Path, timeout: float = 300) -> tuple[str, Any]:
    """Run bench/<script> (tiny sizes in `args`) with its JSON written under `tmp`; it must
    succeed and print exactly one line. Returns that summary line and the JSON."""
    out = tmp / f"{Path(script).stem}.json"
    bench = Path(__file__).resolve().parents[1] / "bench" / script
    result = subprocess.run(
        [sys.executable, "-P", str(bench), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    return line, json.loads(out.read_text())


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    url: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    timeout: float = 5.0,
) -> Reply:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, response.read(), dict(response.headers))
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read(), dict(exc.headers))


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def world_searchable_tmp(prefix: str) -> Path:
    """A new directory under /tmp (not pytest's base directory, 0700 itself, which would hide
    everything anyway), world-searchable as a home or project directory usually is: what the
    user `nobody` may walk into is up to meshfn's own modes. Remove it when done."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    tmp.chmod(0o755)
    return tmp


class Processes(processes.Processes):
    """The process rig, plus `meshfn up` started the way e2e tests want it."""

    def up_at(self, root: Path, state: Path, timeout: float = 120) -> Proc:
        """`meshfn up` on the policies in `root` (their own ports), until it is up."""
        proc = self.start(
            "up",
            [MESHFN, "up", "--policies", str(root), "--state-dir", str(state),
             "--envoy-concurrency", "1"],
        )  # fmt: skip
        wait_for(
            "meshfn up", lambda: "Ctrl-C stops everything" in proc.output(), timeout, proc=proc
        )
        return proc

    def backend(self, functions: list[dict[str, Any]], **config: Any) -> tuple[str, str]:
        """An inference backend serving `functions` from the examples (the testing ones too,
        published to TMP/registry) with the rest of its `config`, on free ports, until it is
        ready: its (HTTP, gRPC) host:port."""
        _, key = publish_examples(self.tmp / "registry", include_testing=True)
        path = self.tmp / "backend.yaml"
        path.write_text(
            yaml.safe_dump(
                {"registry": str(self.tmp / "registry"), "trustedKeys": [str(key)],
                 "functions": functions, **config}
            )
        )  # fmt: skip
        port, grpc_port = free_ports(2)
        proc = self.start(
            "backend",
            [sys.executable, "-P", "-m", "meshfn.inference", "serve", "--config", str(path),
             "--port", str(port), "--grpc-port", str(grpc_port)],
        )  # fmt: skip
        ready = f"http://127.0.0.1:{port}/v2/health/ready"
        wait_for("backend ready", lambda: http(ready).status == 200, timeout=60, proc=proc)
        return f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"

    def up(self, policies: Policies, *extra: str, env: dict[str, str] | None = None) -> Proc:
        policies.state = self.tmp / "state"
        proc = self.start(
            "up",
            [
                MESHFN,
                "up",
                "--policies",
                str(policies.root),
                "--state-dir",
                str(self.tmp / "state"),
                "--envoy-concurrency",
                "1",
                *extra,
            ],
            env={**os.environ, **env} if env else None,
        )
        wait_for_synced(policies, proc)
        wait_for("meshfn up to finish starting", lambda: "Ctrl-C stops everything" in proc.output())
        return proc


def admin_get(where: Policies | str, path: str, state: Path | None = None) -> Reply:
    """GET a control plane's admin port as its owner: with the admin token the control plane
    wrote into its state directory (`state`, or the Policies' own)."""
    admin = where if isinstance(where, str) else where.admin
    state = state if state is not None or isinstance(where, str) else where.state
    assert state is not None, "which state directory holds this control plane's admin token?"
    return http(admin + path, headers=admin_headers(state))


def proxies(policies: Policies | str, state: Path | None = None) -> list[dict[str, Any]]:
    """Connected proxies, from a Policies or an admin URL (and the control plane's state)."""
    reply = admin_get(policies, "/debug/status", state)
    if reply.status != 200:  # a ValueError: `wait_for` tries again
        raise ValueError(f"/debug/status answered {reply.status}: {reply.body[:300]!r}")
    result: list[dict[str, Any]] = reply.json()["proxies"]
    return result


def wait_for_synced(
    policies: Policies | str, proc: Proc | None = None, count: int = 1, state: Path | None = None
) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        found = proxies(policies, state)
        synced = [
            p
            for p in found
            if len(p["types"]) >= 4 and all(t["in_sync"] for t in p["types"].values())
        ]
        return synced if len(synced) >= count else None

    return wait_for("proxies to be in sync", probe, timeout=20, proc=proc)


def served_by(policies: Policies, path: str) -> str | None:
    reply = http(policies.gateway + path)
    return reply.json()["service"] if reply.status == 200 else None


def envoy_pids(up: Proc) -> list[int]:
    return [p for p in children_of(up.pid) if command_name(p) == "envoy"]


os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
