"""The backend confined by the kernel (docs/concepts/sandbox.md): a compromised process inside a
real backend under `meshfn up` (the test-only hook, sandbox_hook/sitecustomize.py) tries what an
escaped model function would, and each attempt must be refused by the layer meant to stop it.

Every configuration is its own `meshfn up`: every layer on; each layer off alone (where two
layers cover one attempt, the other must still stop it); and no layer at all, where every
attempt succeeds (so none of these checks could pass with the hook doing nothing). Which layer
refused is told by what the kernel answered: Landlock says EACCES, the eBPF egress control
EPERM (and counts it under its reason), seccomp kills the process with SIGSYS.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from meshfn_e2e import http
from sandbox_rig import KILLED, Mesh, Ports, Remote, remote, start_mesh

from meshfn.common.adminauth import admin_headers
from meshfn.testing.processes import Processes, wait_for

CONFIGS = {
    "every-layer": {},
    "landlock-off": {"landlock": "off"},
    "seccomp-off": {"seccomp": "off"},
    "egress-off": {"egress": "off"},
    "no-layer": {"landlock": "off", "seccomp": "off", "egress": "off"},
}
ALLOWED, EACCES, EPERM = "allowed", "EACCES", "EPERM"
# attempt -> outcome in every-layer, landlock-off, seccomp-off, egress-off, no-layer
EXPECTED = {
    "read /etc/shadow": (EACCES, ALLOWED, EACCES, EACCES, ALLOWED),
    "read the CA key": (EACCES, ALLOWED, EACCES, EACCES, ALLOWED),
    "write outside its state dir": (EACCES, ALLOWED, EACCES, EACCES, ALLOWED),
    "write inside its state dir": (ALLOWED,) * 5,
    "connect to another workload's port": (EACCES, EPERM, EACCES, EACCES, ALLOWED),
    "connect to another workload's unix socket": (EPERM, EPERM, EPERM, ALLOWED, ALLOWED),
    "connect to the peer its policy names": (ALLOWED,) * 5,
    "connect to a non-loopback address on the named port": (EPERM, EPERM, EPERM, ALLOWED, ALLOWED),
    "connect to a non-loopback address on another port": (EACCES, EPERM, EACCES, EACCES, ALLOWED),
    "send UDP to a non-loopback address": (EPERM, EPERM, EPERM, ALLOWED, ALLOWED),
    "map anonymous RWX memory": (KILLED, KILLED, ALLOWED, KILLED, ALLOWED),
    "execve a shell": (KILLED, KILLED, EACCES, KILLED, "exited 0"),
}
# The egress control's reason for each attempt it refuses.
REASON = {
    "connect to another workload's port": "tcp_loopback",
    "connect to another workload's unix socket": "unix",
    "connect to a non-loopback address on the named port": "tcp_remote",
    "connect to a non-loopback address on another port": "tcp_remote",
    "send UDP to a non-loopback address": "udp_remote",
}


@pytest.fixture(scope="module")
def rig(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Processes, Path, Ports, Remote]]:
    tmp = tmp_path_factory.mktemp("sandbox")
    procs = Processes(tmp)
    ports = Ports.pick()
    try:
        with remote(procs, [ports.peer_sidecar, ports.remote_other], ports.udp) as far:
            yield procs, tmp, ports, far
    finally:
        procs.stop_all()


def attempts(mesh: Mesh, tmp: Path, far: Remote) -> dict[str, dict[str, Any]]:
    """Every attempt's request; the fatal ones (a kill replaces the process) last."""
    ports = mesh.ports
    state = mesh.backend_dir
    return {
        "read /etc/shadow": {"attempt": "read", "path": "/etc/shadow"},
        "read the CA key": {"attempt": "read", "path": str(mesh.ca_key())},
        "write outside its state dir": {"attempt": "write", "path": str(tmp / "outside.txt")},
        "write inside its state dir": {"attempt": "write", "path": str(state / "inside.txt")},
        "connect to another workload's port": {
            "attempt": "connect", "host": "127.0.0.1", "port": ports.echo_sidecar,
        },
        "connect to another workload's unix socket": {
            "attempt": "connect_unix", "path": str(mesh.echo_socket),
        },
        "connect to the peer its policy names": {
            "attempt": "connect", "host": "127.0.0.1", "port": ports.peer_sidecar,
        },
        "connect to a non-loopback address on the named port": {
            "attempt": "connect", "host": far.address, "port": ports.peer_sidecar,
        },
        "connect to a non-loopback address on another port": {
            "attempt": "connect", "host": far.address, "port": ports.remote_other,
        },
        "send UDP to a non-loopback address": {
            "attempt": "sendto", "host": far.address, "port": ports.udp,
        },
        "map anonymous RWX memory": {"attempt": "mmap_rwx"},
        "execve a shell": {
            "attempt": "exec", "argv": ["/bin/sh", "-c", f"echo pwned > {tmp / 'pwned'}"],
        },
    }  # fmt: skip


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sandbox_attacks_from_inside_the_backend(
    rig: tuple[Processes, Path, Ports, Remote], config: str
) -> None:
    procs, base, ports, far = rig
    column = list(CONFIGS).index(config)
    tmp = base / config
    tmp.mkdir()
    mesh = start_mesh(
        procs, base, tmp.parent / "functions", CONFIGS[config], f"mesh-{config}", ports
    )
    try:
        _check_status(mesh, CONFIGS[config])
        got: dict[str, str] = {}
        for name, spec in attempts(mesh, tmp, far).items():
            before = {r: mesh.denied(r) for r in set(REASON.values())}
            seen_before = len(far.seen())
            got[name] = mesh.outcome(**spec)
            _check_attribution(mesh, name, got[name], before, far, seen_before)
        expected = {name: outcomes[column] for name, outcomes in EXPECTED.items()}
        assert got == expected
        assert (tmp / "outside.txt").exists() == (
            expected["write outside its state dir"] == ALLOWED
        )
        assert (tmp / "pwned").exists() == (config == "no-layer")
    finally:
        mesh.up.stop()


def _check_status(mesh: Mesh, modes: dict[str, str]) -> None:
    """`meshfn status` names each layer as configured, from what the kernel shows."""
    text = mesh.status_text()
    states = ", ".join(
        f"{layer} {'off' if modes.get(layer) == 'off' else 'on'}"
        for layer in ("landlock", "seccomp", "egress")
    )
    assert f"sandbox {mesh.backend_name}: {states}" in text, text
    for layer in modes:
        assert f"  {layer}: disabled by policy" in text
    assert f"sandbox {mesh.backend_name}: {states}" in mesh.log()  # the line at start


def _check_attribution(
    mesh: Mesh, name: str, outcome: str, before: dict[str, int], far: Remote, seen: int
) -> None:
    """The layer that refused is the one meant to: EPERM on a connection is the egress
    control's (its counter for that reason moved), EACCES is Landlock's (the egress programs
    never ran: Landlock's check comes first in connect()); and what was allowed got there."""
    reason = REASON.get(name)
    if reason is not None:
        moved = wait_for_count(mesh, reason, before[reason]) if outcome == EPERM else 0
        assert moved == (1 if outcome == EPERM else 0), (name, outcome, moved)
        if outcome != EPERM:
            assert mesh.denied(reason) == before[reason], (name, outcome)
    if "non-loopback" in name:
        arrived = len(far.seen()) > seen or _arrives(far, seen)
        assert arrived == (outcome == ALLOWED), (name, outcome, far.seen())


def wait_for_count(mesh: Mesh, reason: str, before: int) -> int:
    return wait_for(f"the {reason} counter", lambda: mesh.denied(reason) - before, timeout=5)


def _arrives(far: Remote, seen: int) -> bool:
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if len(far.seen()) > seen:
            return True
        time.sleep(0.05)
    return False


def test_sandbox_egress_denials_are_counted_and_logged_with_a_rate_limit(
    rig: tuple[Processes, Path, Ports, Remote],
) -> None:
    procs, base, ports, far = rig
    mesh = start_mesh(procs, base, base / "functions", {}, "mesh-rate", ports)
    try:
        for _ in range(5):
            result = mesh.attack(attempt="connect", host=far.address, port=ports.peer_sidecar)
            assert result is not None and result["errno"] == "EPERM"
        wait_for("5 denials in the map", lambda: mesh.denied("tcp_remote") == 5)
        metrics = http(mesh.admin + "/metrics", headers=admin_headers(mesh.state)).body
        line = (
            f'meshfn_egress_denied_total{{backend="{mesh.backend_name}",reason="tcp_remote"}} 5.0'
        )
        assert line in metrics.decode()
        logged = re.compile(rf"egress denied: {re.escape(mesh.backend_name)}: \d+ tcp_remote")
        wait_for("the denial logged", lambda: logged.search(mesh.log()))
        time.sleep(2.5)  # two more polls: the five attempts still make one line (rate limit)
        assert len(logged.findall(mesh.log())) == 1
        assert f"the last to {far.address}:{ports.peer_sidecar}" in mesh.log()
    finally:
        mesh.up.stop()
