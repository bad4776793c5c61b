"""The sandbox tests' rig: a small mesh under `meshfn up` whose inference backend carries the
test-only attack hook (sandbox_hook/sitecustomize.py), a network namespace with listeners on a
non-loopback address, and a unix socket standing for another workload's.

The mesh: the backend `models` serves iris, whose Function names `feature-store` as its egress
peer; `echo` is another workload. Everything is on loopback except the namespace, which the
rig creates and removes (traffic to it never leaves the machine).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any

from meshfn_e2e import http

from meshfn.common.adminauth import admin_headers
from meshfn.common.unix import unix_request
from meshfn.control_plane.runtime.upstreams import app_socket, backend_socket, backend_state_dir
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import MESHFN, Proc, Processes, wait_for

HOOK = Path(__file__).resolve().parent / "sandbox_hook"
KILLED = "killed"  # a seccomp kill: the request got no answer, the process died of SIGSYS
LAYERS = ("landlock", "seccomp", "egress")


@dataclass(frozen=True)
class Ports:
    admin: int
    xds: int
    gateway: int
    models: int
    models_sidecar: int
    echo: int
    echo_sidecar: int
    peer: int
    peer_sidecar: int  # the egress peer's way in: what the policy lets the backend reach
    remote_other: int  # a port no policy names (listened on in the namespace)
    udp: int

    @classmethod
    def pick(cls) -> Ports:
        return cls(*free_ports(11))


def policies(ports: Ports, modes: dict[str, str], egress_peer: str = "feature-store") -> str:
    sandbox = ", ".join(f"{layer}: {modes.get(layer, 'auto')}" for layer in LAYERS)
    p = ports
    return f"""\
apiVersion: meshfn.io/v1alpha1
kind: Mesh
metadata: {{name: sandbox}}
spec:
  trustDomain: sandbox.test
  ports: {{xds: {p.xds}, admin: {p.admin}}}
  sandbox: {{{sandbox}}}
---
apiVersion: meshfn.io/v1alpha1
kind: Gateway
metadata: {{name: edge, namespace: ingress}}
spec:
  listeners: [{{name: http, port: {p.gateway}}}]
---
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {{name: models}}
spec:
  port: {p.models}
  endpoints: [{{address: 127.0.0.1, sidecar: {{port: {p.models_sidecar}}}}}]
---
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {{name: echo}}
spec:
  port: {p.echo}
  endpoints: [{{address: 127.0.0.1, sidecar: {{port: {p.echo_sidecar}}}}}]
---
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {{name: feature-store}}
spec:
  port: {p.peer}
  endpoints: [{{address: 127.0.0.1, sidecar: {{port: {p.peer_sidecar}}}}}]
---
apiVersion: meshfn.io/v1alpha1
kind: Function
metadata: {{name: iris}}
spec:
  backend: models
  gateway: ingress/edge
  egress:
    - service: {egress_peer}
"""


@dataclass
class Mesh:
    up: Proc
    state: Path
    ports: Ports

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports.admin}"

    @property
    def backend_name(self) -> str:
        return f"default/models 127.0.0.1:{self.ports.models}"

    @property
    def backend_dir(self) -> Path:
        """The backend's own directory (its only writable place), with its sockets."""
        return backend_state_dir(self.state, "127.0.0.1", self.ports.models)

    @property
    def backend_socket(self) -> Path:
        """Where its sidecar reaches it (and the hook's route is): `meshfn up` serves a backend
        behind a sidecar on a unix socket only."""
        return backend_socket(self.state, "127.0.0.1", self.ports.models)

    @property
    def echo_socket(self) -> Path:
        """Another workload's unix socket: the echo placeholder's, behind its sidecar."""
        return app_socket(self.state, "127.0.0.1", self.ports.echo)

    def report(self) -> dict[str, Any]:
        """What the backend says confines it (its sandbox.json)."""
        result: dict[str, Any] = json.loads((self.backend_dir / "sandbox.json").read_text())
        return result

    def log(self) -> str:
        """`meshfn up`'s output, each run of white space one space (rich may wrap lines)."""
        return re.sub(r"\s+", " ", self.up.output())

    def backend_pid(self) -> int:
        return int(self.report()["pid"])

    def sandbox(self) -> dict[str, Any]:
        """The backend's entry of /debug/status's sandbox document."""
        reply = http(self.admin + "/debug/status", headers=admin_headers(self.state))
        (backend,) = reply.json()["sandbox"]["backends"]
        result: dict[str, Any] = backend
        return result

    def denied(self, reason: str) -> int:
        entry = self.sandbox()["denied"].get(reason)
        return int(entry["count"]) if entry else 0

    def ca_key(self) -> Path:
        return sorted((self.state / "ca").glob("*/*.key"))[0]

    def attack(self, **spec: Any) -> dict[str, Any] | None:
        """Run one attempt inside the backend; None if the process died answering it."""
        try:
            status, body = unix_request(
                self.backend_socket, "/meshfn-test/attack", 10, "POST", json.dumps(spec).encode()
            )
        except (HTTPException, OSError):  # the process died answering (a seccomp kill)
            return None
        assert status == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def outcome(self, **spec: Any) -> str:
        """ "allowed", the errno name the kernel answered, or KILLED (then the backend is
        waited for until it is back)."""
        pid = self.backend_pid()
        result = self.attack(**spec)
        if result is not None:
            return "allowed" if result["allowed"] else str(result["errno"])
        wait_for(
            f"the backend (pid {pid}) to be reported dead",
            lambda: f"(pid {pid}) exited with code" in self.log(),
            timeout=10,
        )
        code = self.log().split(f"(pid {pid}) exited with code ", 1)[1].split(";")[0]
        self.wait_back(pid)
        return KILLED if code == "-31" else f"exited {code}"

    def wait_back(self, old_pid: int) -> None:
        """Until a new backend process has started, confined itself and reported it."""

        def back() -> bool:
            if self.backend_pid() == old_pid:
                return False
            return unix_request(self.backend_socket, "/v2/health/ready", 2)[0] == 200

        wait_for("the backend to be restarted", back, timeout=30)

    def status_text(self) -> str:
        out = subprocess.run(
            [MESHFN, "status", "--admin", self.admin, "--state-dir", str(self.state)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout


def start_mesh(
    procs: Processes,
    tmp: Path,
    registry: Path,
    modes: dict[str, str],
    name: str,
    ports: Ports | None = None,
    kernel_without: str = "",
    wrap: list[str] | None = None,
) -> Mesh:
    """`meshfn up` on the rig's policies (layers per `modes`), the backends with the hook."""
    ports = ports or Ports.pick()
    root = tmp / name
    (root / "policies").mkdir(parents=True)
    (root / "policies" / "mesh.yaml").write_text(policies(ports, modes))
    state = root / "state"
    env = {
        **os.environ,
        "PYTHONPATH": str(HOOK),
        "MESHFN_TEST_SANDBOX_HOOK": "1",
        "MESHFN_TEST_KERNEL_WITHOUT": kernel_without,
        "COLUMNS": "400",  # rich's log lines unwrapped, so a line can be matched whole
    }
    argv = [
        MESHFN, "up", "--policies", str(root / "policies"), "--state-dir", str(state),
        "--functions-registry", str(registry), "--publish-examples", "--envoy-concurrency", "1",
    ]  # fmt: skip
    up = procs.start(f"up-{name}", [*(wrap or []), *argv], env=env)
    wait_for(
        "meshfn up to finish starting",
        lambda: "Ctrl-C stops everything" in up.output(),
        timeout=180,
        proc=up,
    )
    return Mesh(up, state, ports)


# --- a network namespace with listeners on a non-loopback address -------------------------------


@dataclass
class Remote:
    """Listeners on `address` (198.18.0.0/15, the benchmarking range) inside a namespace of
    the test's own, reached from the host over a veth pair."""

    address: str
    listener: Proc

    def seen(self) -> list[str]:
        return [line for line in self.listener.output().splitlines() if line.startswith("got ")]


_LISTENER = """
import socket, sys, threading
host, ports, udp = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], int(sys.argv[3])
def tcp(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(16)
    while True:
        c, _ = s.accept(); print("got tcp", port, flush=True); c.close()
for port in ports:
    threading.Thread(target=tcp, args=(port,), daemon=True).start()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((host, udp))
print("listening", flush=True)
while True:
    data, _ = u.recvfrom(2048); print("got udp", udp, data.decode(), flush=True)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def remote(procs: Processes, ports: list[int], udp: int) -> Iterator[Remote]:
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"mfsbx{tag}", f"mfh{tag}", f"mfn{tag}"
    net = f"198.18.{secrets.randbelow(256)}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{net}.1/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        argv = ["ip", "netns", "exec", ns, sys.executable, "-c", _LISTENER, f"{net}.2",
                ",".join(map(str, ports)), str(udp)]  # fmt: skip
        listener = procs.start(f"remote-{tag}", argv)
        wait_for(
            "the namespace's listeners", lambda: "listening" in listener.output(), proc=listener
        )
        yield Remote(f"{net}.2", listener)
        listener.stop()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30, check=False)
