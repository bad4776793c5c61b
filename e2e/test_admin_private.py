"""On a shared host, other local users get nothing from a running `meshfn up`: no Envoy admin
interface on loopback TCP (it is a unix socket in the state directory), and the state
directory (bootstraps with ADS tokens, logs, the audit store and its salt) is the owner's
alone. Checked as the unprivileged user `nobody` against the example mesh; meshfn itself still
reaches every Envoy (readiness, the console's endpoint health, `meshfn status`)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from meshfn_e2e import Processes, children_of, command_name, http, remap_examples

from meshfn.testing import policies as p
from meshfn.testing.envoy import admin_request, admin_socket, live
from meshfn.testing.policies import Policies
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import listening_tcp_ports, meshfn, up_with_functions, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None or shutil.which("curl") is None,
    reason="needs root, runuser and curl (to act as the user nobody)",
)


def as_nobody(*argv: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", "nobody", "--", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@contextmanager
def searchable(*directories: Path) -> Iterator[None]:
    """The directories searchable by everyone (o+x, not o+r) for a while, then as they were:
    a probe inside reaches each file and socket by name, so only the entry's own mode can
    refuse it (the state directory's 0700 otherwise refuses everything first)."""
    modes = {d: stat.S_IMODE(d.stat().st_mode) for d in directories}
    try:
        for directory, mode in modes.items():
            directory.chmod(mode | 0o011)
        yield
    finally:
        for directory, mode in modes.items():
            directory.chmod(mode)


def reachable_by_name(path: Path) -> None:
    """`nobody` can look `path` up (stat): the directories above let it through."""
    found = as_nobody("stat", "-c", "%a", str(path))
    assert found.returncode == 0, (path, found.stderr)


@dataclass
class Mesh:
    up_output: str
    state: Path
    admin: str
    mapping: dict[int, int]
    envoys: list[int]


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    # Not under pytest's base directory (0700 itself, which would hide everything anyway): a
    # world-searchable directory, as a home or project directory usually is, with a state
    # directory that starts out world-readable too (meshfn up must tighten it).
    tmp = Path(tempfile.mkdtemp(prefix="meshfn-private-", dir="/tmp"))
    tmp.chmod(0o755)
    procs = Processes(tmp)
    try:
        mapping = remap_examples(tmp / "examples")
        state = tmp / "state"
        state.mkdir(mode=0o755)
        state.chmod(0o755)
        up = procs.start("up", up_with_functions(tmp / "examples", state, tmp / "functions"))
        wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
        envoys = [p for p in children_of(up.pid) if command_name(p) == "envoy"]
        yield Mesh(up.output(), state, f"http://127.0.0.1:{mapping[18001]}", mapping, envoys)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def test_no_envoy_admin_on_loopback_tcp(mesh: Mesh) -> None:
    """Every TCP port an Envoy of the mesh listens on is one of the policies' proxy listeners
    (the gateway's, the sidecars'), and none of them answers as Envoy's admin would."""
    assert len(mesh.envoys) == 5  # the gateway and 4 sidecars
    proxy_ports = {mesh.mapping[p] for p in (10000, 15101, 15102, 15103, 15201)}
    found: set[int] = set()
    for pid in mesh.envoys:
        ports = listening_tcp_ports(pid)
        assert ports, f"envoy {pid} listens on no TCP port"
        assert ports <= proxy_ports, f"envoy {pid} listens on {ports - proxy_ports} too"
        found |= ports
    assert found == proxy_ports
    for port in sorted(found):
        for path in ("/config_dump", "/ready", "/server_info"):
            probe = as_nobody(
                "curl", "-s", "-m", "5", "-w", "\n%{http_code}", f"http://127.0.0.1:{port}{path}"
            )
            body, _, code = probe.stdout.rpartition("\n")
            assert code != "200", f"{port}{path} answered {code}: {body[:200]}"
            assert "bootstrap" not in body.lower() and "LIVE" not in body, (port, path, body)
    assert "adminPort" not in mesh.up_output  # the examples opt in to no TCP admin port


def test_admin_sockets_are_the_owners_alone(mesh: Mesh) -> None:
    nodes = ["edge.ingress"] + [
        f"{name}.default:{mesh.mapping[port]}"
        for name, port in (("models", 15101), ("models", 15102), ("models-lite", 15103),
                           ("echo", 15201))
    ]  # fmt: skip
    for node in nodes:
        socket = admin_socket(mesh.state, node)
        info = socket.stat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, socket
        assert live(socket)  # the owner (and meshfn) reach it
        probe = as_nobody("curl", "-s", "-m", "5", "--unix-socket", str(socket), "http://x/ready")
        assert probe.returncode != 0 and "LIVE" not in probe.stdout, (node, probe)
        dump = as_nobody(
            "curl", "-s", "-m", "5", "--unix-socket", str(socket), "http://x/config_dump"
        )
        assert dump.returncode != 0 and not dump.stdout, (node, dump)
    # The same with the directories searchable: the sockets' own mode (0600) refuses nobody.
    sockets = [admin_socket(mesh.state, node) for node in nodes]
    with searchable(mesh.state, *{s.parent for s in sockets}):
        for node, socket in zip(nodes, sockets, strict=True):
            reachable_by_name(socket)
            probe = as_nobody(
                "curl", "-s", "-m", "5", "--unix-socket", str(socket), "http://x/config_dump"
            )
            # curl's 7: could not connect (EACCES on the socket), not a refused request
            assert probe.returncode == 7 and not probe.stdout, (node, probe)


def test_state_directory_is_private(mesh: Mesh) -> None:
    state = mesh.state
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert "made it 0700" in " ".join(mesh.up_output.split())  # it was 0755: tightened, said so
    logs = sorted((state / "logs").glob("envoy-*.log"))
    assert len(logs) == 5
    audit = [state / "audit" / name for name in ("audit.db", "audit.db-wal", "audit.db-shm")]
    private = [*logs, *audit, state / "audit" / "subject.salt"]
    private += sorted((state / "envoy").glob("*.json"))  # bootstraps: their ADS tokens
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((state / "logs").stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "audit").stat().st_mode) == 0o700
    listing = as_nobody("ls", str(state))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr
    for path in private:
        read = as_nobody("cat", str(path))
        assert read.returncode != 0 and "Permission denied" in read.stderr, path
        assert not read.stdout
    # The same with the directories searchable: each file's own mode (0600) refuses nobody.
    with searchable(state, *{path.parent for path in private}):
        for path in private:
            reachable_by_name(path)
            read = as_nobody("cat", str(path))
            assert read.returncode != 0 and "Permission denied" in read.stderr, path
            assert not read.stdout
    if shutil.which("sqlite3"):  # the store itself, as an SQLite client would open it
        db = str(state / "audit" / "audit.db")
        query = as_nobody("sqlite3", "-readonly", db, "SELECT count(*) FROM sqlite_master")
        assert query.returncode != 0 and not query.stdout, query


def test_meshfn_still_reaches_its_envoys(mesh: Mesh) -> None:
    """Readiness got the mesh started; the console's topology shows the endpoint health the
    gateway reports (its admin /clusters, over the socket); `meshfn status` sees every proxy
    in sync."""

    def healthy() -> bool:
        page = http(mesh.admin + "/ui").body.decode()
        if "Endpoint health is unknown" in page:
            raise ValueError(page[page.index("Endpoint health is unknown") :][:300])
        return "health-healthy" in page

    wait_for("endpoint health in the console", healthy, timeout=30)
    status = http(mesh.admin + "/debug/status").json()
    assert len(status["proxies"]) == 5 and all(
        t["in_sync"] for p in status["proxies"] for t in p["types"].values()
    ), json.dumps(status["proxies"])[:2000]
    cli = meshfn("status", "--admin", mesh.admin)
    assert cli.returncode == 0 and cli.stdout.count("SYNCED") >= 10, cli.stdout


def test_an_explicit_admin_port_serves_admin_over_tcp_and_warns(tmp_path: Path) -> None:
    """A Gateway's adminPort opts in to TCP (the rig's policies set one): admin answers there
    (forwarded to the socket, which meshfn keeps using), and `meshfn validate` and `meshfn up`
    say what that exposes."""
    policies = Policies(tmp_path / "policies")
    validated = meshfn("validate", str(policies.root))
    assert validated.returncode == 0, validated.stderr
    warning = f"Gateway default/edge sets adminPort {policies.ports['envoy_admin']}"
    assert warning in validated.stderr and "ADS token" in validated.stderr
    procs = Processes(tmp_path)
    try:
        up = procs.up(policies)
        assert warning in up.output() and "Any local user" in up.output()
        port = policies.ports["envoy_admin"]
        assert live(port) and live(admin_socket(procs.tmp / "state", "edge.default"))
        dump = admin_request(port, "/config_dump?resource=dynamic_active_clusters")
        assert b"alpha.default" in dump
        # A reload that drops adminPort closes the port; one that sets it again warns again.
        docs = (p.mesh("e2e", "e2e.local", policies.ports["xds"], policies.ports["admin"]),)
        listener = policies.ports["listener"]
        policies.write("mesh.yaml", p.documents(*docs, p.gateway(None, listener)))
        wait_for("the TCP admin port to close", lambda: not tcp_answers(port), timeout=30)
        sock = admin_socket(procs.tmp / "state", "edge.default")
        wait_for("the gateway on its socket alone", lambda: live(sock), timeout=30)
        (other,) = free_ports(1)
        policies.write("mesh.yaml", p.documents(*docs, p.gateway(other, listener)))
        wait_for("admin on the new port", lambda: live(other), timeout=30)
        logged = " ".join(up.output().split())
        assert f"Gateway default/edge sets adminPort {other}" in logged
    finally:
        procs.stop_all()


def tcp_answers(port: int) -> bool:
    try:
        live(port, timeout=1)
    except OSError as exc:
        return not isinstance(exc, ConnectionRefusedError) and not isinstance(
            getattr(exc, "reason", None), ConnectionRefusedError
        )
    return True
