"""e2e helpers. Real processes on loopback: `meshfn up`/`meshfn serve` as subprocesses, real Envoy, real
upstreams. Every process started here is tracked by PID and stopped, also when a test fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

BIN = Path(sys.executable).parent
MESHFN = str(BIN / "meshfn")
T = TypeVar("T")


def meshfn(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the meshfn CLI; the caller checks returncode and output."""
    return subprocess.run(
        [MESHFN, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


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


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for(
    what: str, probe: Callable[[], T | None], timeout: float = 15.0, every: float = 0.02
) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            result = probe()
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last = exc
            result = None
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


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


def envoy_stat(admin_port: int, name: str) -> int:
    """One Envoy counter or gauge from its admin interface (0 while Envoy has not created it)."""
    text = http(f"http://127.0.0.1:{admin_port}/stats?filter=^{name}$").body.decode()
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


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


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


MESH = """\
apiVersion: meshfn.io/v1alpha1
kind: Mesh
metadata: {{name: e2e}}
spec: {{trustDomain: e2e.local, ports: {{xds: {xds}, admin: {admin}}}}}
---
apiVersion: meshfn.io/v1alpha1
kind: Gateway
metadata: {{name: edge}}
spec:
  adminPort: {envoy_admin}
  xdsProtocol: {protocol}
  listeners: [{{name: http, port: {listener}}}]
"""
SERVICES = """\
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {{name: alpha}}
spec: {{port: {alpha}, endpoints: [{{address: 127.0.0.1}}]}}
---
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {{name: beta}}
spec: {{port: {beta}, endpoints: [{{address: 127.0.0.1}}]}}
"""
ROUTE = """\
apiVersion: meshfn.io/v1alpha1
kind: Route
metadata: {{name: main}}
spec:
  matches: [{{path: {{prefix: {prefix}}}}}]
  destination: {{service: {service}}}
"""


@dataclass
class Policies:
    root: Path
    protocol: str = "delta"
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ["xds", "admin", "envoy_admin", "listener", "alpha", "beta"]
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.root.mkdir(parents=True, exist_ok=True)
        self.write("mesh.yaml", MESH.format(protocol=self.protocol, **self.ports))
        self.write("services.yaml", SERVICES.format(**self.ports))
        self.route("/v1", "alpha")

    def write(self, name: str, text: str) -> None:
        """Atomic replace, as editors and `kubectl`-style tools do."""
        tmp = self.root / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(self.root / name)

    def route(self, prefix: str, service: str) -> None:
        self.write("route.yaml", ROUTE.format(prefix=prefix, service=service))

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['listener']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"


@dataclass
class Proc:
    """A subprocess we own; `stop()` is idempotent and verifies the process is gone."""

    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def send(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def wait(self, timeout: float = 20.0) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"{self.argv[:2]} ignored signal {sig}; killed") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Processes:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[Proc] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(argv, self.tmp / "logs" / f"{name}.log", env).start()
        self.started.append(proc)
        return proc

    def upstream(self, name: str, service: str, port: int, *extra: str) -> Proc:
        """meshfn's echo upstream (answers with its service, endpoint and locality)."""
        argv = [sys.executable, "-P", "-m", "meshfn.control_plane.runtime.upstream"]
        return self.start(name, [*argv, "--service", service, "--port", str(port), *extra])

    def up(self, policies: Policies, *extra: str) -> Proc:
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
        )
        wait_for_synced(policies, proc)
        wait_for("meshfn up to finish starting", lambda: "Ctrl-C stops everything" in proc.output())
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop()


def proxies(policies: Policies | str) -> list[dict[str, Any]]:
    """Connected proxies, from a Policies or an admin URL."""
    admin = policies if isinstance(policies, str) else policies.admin
    result: list[dict[str, Any]] = http(admin + "/debug/status").json()["proxies"]
    return result


def wait_for_synced(
    policies: Policies | str, proc: Proc | None = None, count: int = 1
) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        if proc is not None and proc.popen is not None and proc.popen.poll() is not None:
            raise AssertionError(f"process exited {proc.popen.returncode}:\n{proc.output()}")
        found = proxies(policies)
        synced = [
            p
            for p in found
            if len(p["types"]) >= 4 and all(t["in_sync"] for t in p["types"].values())
        ]
        return synced if len(synced) >= count else None

    return wait_for("proxies to be in sync", probe, timeout=20)


def served_by(policies: Policies, path: str) -> str | None:
    reply = http(policies.gateway + path)
    return reply.json()["service"] if reply.status == 200 else None


def envoy_pids(up: Proc) -> list[int]:
    return [p for p in children_of(up.pid) if command_name(p) == "envoy"]


os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
