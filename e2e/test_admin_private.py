"""On a shared host, other local users get nothing from a running `meshfn up`: no Envoy admin
interface on loopback TCP (it is a unix socket in the state directory), no application behind a
sidecar on a port of its own (unix sockets there too: nobody skips the sidecar), and the state
directory (bootstraps with ADS tokens, logs, the audit store and its salt) is the owner's
alone. Checked as the unprivileged user `nobody` against the example mesh; meshfn itself still
reaches every Envoy (readiness, the console's endpoint health, `meshfn status`).

The census (`test_every_listening_socket_is_accounted_for`) lists every socket the mesh's
processes listen on (`ss -lntupx`) with who answers and why; a new one fails it until it is
classified, and `test_nobody_gets_an_answer_only_where_the_mesh_means_to` fails if any but the
gateway's answers a caller without a credential."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from meshfn_e2e import (
    Processes,
    admin_get,
    children_of,
    command_name,
    remap_examples,
    world_searchable_tmp,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc

from meshfn.common.adminauth import admin_headers
from meshfn.common.unix import unix_request
from meshfn.testing import policies as p
from meshfn.testing.envoy import admin_request, admin_socket, live
from meshfn.testing.policies import Policies
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import listening_tcp_ports, meshfn, up_with_functions, wait_for
from meshfn.xds.names import CLUSTER as CLUSTER_TYPE

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
    pid: int  # meshfn up's


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    # With a state directory that starts out world-readable too (meshfn up must tighten it).
    tmp = world_searchable_tmp("meshfn-private-")
    procs = Processes(tmp)
    try:
        mapping = remap_examples(tmp / "examples")
        state = tmp / "state"
        state.mkdir(mode=0o755)
        state.chmod(0o755)
        up = procs.start("up", up_with_functions(tmp / "examples", state, tmp / "functions"))
        wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
        envoys = [p for p in children_of(up.pid) if command_name(p) == "envoy"]
        admin = f"http://127.0.0.1:{mapping[18001]}"
        yield Mesh(up.output(), state, admin, mapping, envoys, up.pid)
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
        page = admin_get(mesh.admin, "/ui", mesh.state).body.decode()
        if "Endpoint health is unknown" in page:
            raise ValueError(page[page.index("Endpoint health is unknown") :][:300])
        return "health-healthy" in page

    wait_for("endpoint health in the console", healthy, timeout=30)
    status = admin_get(mesh.admin, "/debug/status", mesh.state).json()
    assert len(status["proxies"]) == 5 and all(
        t["in_sync"] for p in status["proxies"] for t in p["types"].values()
    ), json.dumps(status["proxies"])[:2000]
    cli = meshfn("status", "--state-dir", str(mesh.state))
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


# ------------------------------------------------------------------------------ the census
#
# THE CONSOLE'S EXPECTED STATE, in one place: the control plane's admin API and console
# authenticate every caller (issue 40; meshfn.control_plane.runtime.admin.OPEN lists what
# answers without a credential, with why). Every console path but the public ones answers 401
# without the owner's credential or with a wrong one, and 200 with it.
CONSOLE_OPEN_PATHS = ("/healthz", "/readyz", "/.well-known/jwks.json")  # public by design
CONSOLE_PATHS = ("/ui", "/ui?subject_raw=alice", "/debug/status", "/metrics")


def console_headers(state: Path) -> dict[str, str]:
    """What the owner shows the console: the admin token it wrote into STATE/admin/token."""
    return admin_headers(state)


Access = Literal["public", "credential", "private"]


@dataclass(frozen=True)
class Socket:
    """One listening socket of the mesh: "tcp"/"udp" with its port, or "unix" with its path."""

    kind: str
    where: str
    port: int
    pid: int
    process: str


@dataclass(frozen=True)
class Role:
    who: str
    access: Access
    why: str


def mesh_pids(root: int) -> set[int]:
    found, todo = {root}, [root]
    while todo:
        children = children_of(todo.pop())
        found.update(children)
        todo += children
    return found


def listening(pids: set[int]) -> list[Socket]:
    """Every socket `pids` listen on (TCP, UDP and unix), as `ss -lntupx` (run as root, so
    it names every process) lists them."""
    out = subprocess.run(
        ["ss", "-H", "-l", "-n", "-t", "-u", "-p", "-x"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = []
    for line in out.splitlines():
        owners = {int(pid): name for name, pid in re.findall(r'\("([^"]*)",pid=(\d+)', line)}
        mine = owners.keys() & pids
        if not mine:
            continue
        netid, local = line.split()[0], line.split()[4]
        pid = min(mine)
        if netid in ("tcp", "udp"):
            port = int(local.rsplit(":", 1)[1])
            found.append(Socket(netid, local, port, pid, owners[pid]))
        else:
            found.append(Socket("unix", local, 0, pid, owners[pid]))
    return found


def role(mesh: Mesh, sock: Socket) -> Role | None:
    """Who answers on `sock` and why that is safe; None: a socket nobody has classified."""
    port = {mapped: original for original, mapped in mesh.mapping.items()}.get(sock.port)
    if sock.kind == "tcp" and port == 10000:
        return Role(
            "the gateway edge.ingress (Envoy)",
            "public",
            "the mesh's front door: every route's policy decides (the models want a tenant "
            "token: 403 without one), and the sidecars audit what reaches a service",
        )
    if sock.kind == "tcp" and port in (15101, 15102, 15103, 15201):
        return Role(
            f"a sidecar (Envoy) of the endpoint on {port}",
            "credential",
            "mTLS STRICT: no request is read before a client certificate of the mesh's CA, "
            "then JWT and authorization for the service",
        )
    if sock.kind == "tcp" and port == 18000:
        return Role(
            "the control plane: ADS, access logs, rate-limit service (gRPC)",
            "credential",
            "every ADS stream and limit-service call shows its node's bootstrap token (an HMAC "
            "under a key in the state directory); access logs only from connected proxies",
        )
    if sock.kind == "tcp" and port == 18001:
        return Role(
            "the control plane: admin API and console",
            "credential",
            "token-protected: an admin token or a console session, viewer or auditor (issue 40)",
        )
    if sock.kind != "unix":
        return None
    path = Path(sock.where)
    private = "a unix socket (mode 0600) in the private state directory (0700)"
    if path.parent == mesh.state / "envoy":
        return Role(f"Envoy's admin ({path.stem})", "private", private)
    if path.parent == mesh.state / "workloads" or path.parent.parent == mesh.state / "inference":
        return Role(
            f"the application behind a sidecar ({path.stem})",
            "private",
            f"{private}: only its sidecar's user reaches it, over an Envoy pipe address",
        )
    if path == mesh.state / "audit-signer" / "signer.sock":
        return Role("the audit signer", "private", private)
    return None


@pytest.fixture(scope="module")
def census(mesh: Mesh) -> list[tuple[Socket, Role | None]]:
    found = listening(mesh_pids(mesh.pid))
    return [(sock, role(mesh, sock)) for sock in found]


def census_table(census: list[tuple[Socket, Role | None]]) -> str:
    rows = [
        f"{s.kind:4} {s.where:60} {s.process:7} {r.access if r else '???':10} "
        f"{r.who if r else 'UNCLASSIFIED'}: {r.why if r else ''}"
        for s, r in sorted(census, key=lambda c: (c[0].kind, c[0].where))
    ]
    return "\n".join(rows)


def test_every_listening_socket_is_accounted_for(mesh: Mesh, census: list[Any]) -> None:
    table = census_table(census)
    print(table)
    assert all(r is not None for _, r in census), table
    m = mesh.mapping
    tcp = {s.port for s, _ in census if s.kind == "tcp"}
    assert tcp == {m[p] for p in (10000, 15101, 15102, 15103, 15201, 18000, 18001)}, table
    assert not [s for s, _ in census if s.kind == "udp"], table
    unix = [s for s, _ in census if s.kind == "unix"]
    # 5 Envoy admins, 3 backends with an HTTP and a gRPC socket each, the echo upstream, the
    # audit signer: 13, beside the 7 TCP listeners (the issue counted 20 before: the same
    # number, with the 7 application ports on TCP).
    assert len(unix) == 13, table
    for sock in unix:
        info = Path(sock.where).stat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, sock
    assert stat.S_IMODE((mesh.state / "workloads").stat().st_mode) == 0o700
    for own in (mesh.state / "inference").iterdir():  # each backend's own directory
        assert stat.S_IMODE(own.stat().st_mode) == 0o700, own
    # with eBPF redirection on (the examples' `acceleration: auto`): it redirects TCP between
    # the mesh's own sockets and leaves unix sockets alone, so it opens no way around a sidecar
    status = admin_get(mesh.admin, "/debug/status", mesh.state).json()
    assert status["acceleration"]["attached"], status["acceleration"]
    for port in (9101, 9102, 9103, 9111, 9112, 9113, 9201):  # the policies' application ports
        assert m[port] not in tcp
        probe = as_nobody("curl", "-s", "-m", "5", f"http://127.0.0.1:{m[port]}/v2/models")
        assert probe.returncode == 7, (port, probe)  # connection refused: nothing listens


def test_nobody_gets_an_answer_only_where_the_mesh_means_to(mesh: Mesh, census: list[Any]) -> None:
    """As `nobody`, without any credential: the gateway answers (its policies refuse what needs
    a token), everything else refuses before it serves anything."""
    for sock, found in census:
        if found is None or found.access != "public":
            assert _plain_answer(sock) is None, (sock, found, _plain_answer(sock))
        if found is None:
            raise AssertionError(f"unclassified: {sock}")
        if sock.kind == "unix":
            _private(mesh, sock)
        elif found.access == "public" and sock.port == mesh.mapping[10000]:
            _gateway(sock.port)
        elif sock.port == mesh.mapping[18001]:
            _console(mesh, sock.port)
        elif sock.port == mesh.mapping[18000]:
            _control_plane(sock.port, mesh.state)
        else:
            _sidecar(sock.port)


def _plain_answer(sock: Socket) -> str | None:
    """What `nobody` gets from a plain request (HTTP/1.1, then HTTP/2 without TLS): the first
    HTTP status, or None when neither gets one or it is 401 (a server that wants a credential
    and says so: the console and its admin API)."""
    where = ["--unix-socket", sock.where, "http://x/"] if sock.kind == "unix" else []
    where = where or [f"http://127.0.0.1:{sock.port}/"]
    for version in ("--http1.1", "--http2-prior-knowledge"):
        probe = as_nobody(
            "curl", "-s", "-m", "5", version, "-o", "/dev/null", "-w", "%{http_code}", *where
        )
        if probe.stdout not in ("", "000", "401"):
            return f"{version}: HTTP {probe.stdout}"
    return None


def _private(mesh: Mesh, sock: Socket) -> None:
    """Refused by the kernel (the directory's permissions), while the owner reaches it: an
    application behind a sidecar answers its owner as it would its sidecar."""
    probe = as_nobody("curl", "-sv", "-m", "5", "--unix-socket", sock.where, "http://x/")
    assert probe.returncode == 7 and "Permission denied" in probe.stderr, (sock, probe)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as owner:
        owner.settimeout(5)
        owner.connect(sock.where)
    path = Path(sock.where)
    original = _application_port(mesh, path)
    if original is None:
        return
    if original in (9111, 9112, 9113):  # the backends' KServe gRPC
        with grpc.insecure_channel(f"unix:{path}") as channel:
            live = service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                service_pb2.ServerLiveRequest(), timeout=5
            )
        assert live.live, sock
    else:
        status, body = unix_request(path, "/v2/health/ready" if original < 9200 else "/echo")
        assert status == 200, (sock, body[:200])


def _application_port(mesh: Mesh, path: Path) -> int | None:
    """The policies' port of the application behind a sidecar listening at `path`: the echo
    placeholder's socket in STATE/workloads, a backend's http.sock or grpc.sock in its own
    STATE/inference/<address>-<port>/ (the only directory its sandbox lets it write)."""
    original = {v: k for k, v in mesh.mapping.items()}
    if path.parent == mesh.state / "workloads":
        return original[int(path.stem.rsplit("-", 1)[1])]
    if path.parent.parent == mesh.state / "inference":
        http_port = original[int(path.parent.name.rsplit("-", 1)[1])]
        return http_port + 10 if path.stem == "grpc" else http_port  # the examples' grpcPort
    return None


def _gateway(port: int) -> None:
    def status(path: str) -> str:
        return as_nobody(
            "curl", "-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}",
            f"http://127.0.0.1:{port}{path}",
        ).stdout  # fmt: skip

    assert status("/v2/models") == "403"  # the models want a tenant's token
    assert status("/v2/models/iris") == "403"
    assert status("/echo/hi") == "200"  # a route the examples leave open


def _sidecar(port: int) -> None:
    """mTLS STRICT: neither plaintext nor TLS without a client certificate gets an answer."""
    for url in (f"http://127.0.0.1:{port}/", f"https://127.0.0.1:{port}/"):
        probe = as_nobody("curl", "-sk", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}", url)
        assert probe.returncode != 0 and probe.stdout == "000", (url, probe)


def _control_plane(port: int, state: Path) -> None:
    """ADS and the limit service: UNAUTHENTICATED without a node's token; access logs only
    from proxies connected over ADS; plain HTTP gets no answer."""
    node = base_pb2.Node(id="edge.ingress~0", cluster="edge.ingress")
    bodies = {
        "envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources": (
            discovery_pb2.DeltaDiscoveryRequest(node=node, type_url=CLUSTER_TYPE),
            "16",
        ),
        "envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources": (
            discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER_TYPE),
            "16",
        ),
        "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit": (
            rls_pb2.RateLimitRequest(domain="default/tenants"),
            "16",
        ),
        "envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs": (
            als_pb2.StreamAccessLogsMessage(),
            "7",
        ),
    }
    probes = Path(tempfile.mkdtemp(prefix="meshfn-probe-", dir="/tmp"))
    try:
        probes.chmod(0o755)
        for index, (method, (message, code)) in enumerate(bodies.items()):
            raw = message.SerializeToString()
            frame = probes / f"{index}.grpc"
            frame.write_bytes(b"\0" + struct.pack(">I", len(raw)) + raw)
            frame.chmod(0o644)
            probe = as_nobody(
                "curl", "-s", "-m", "5", "--http2-prior-knowledge", "-X", "POST",
                "-H", "content-type: application/grpc", "-H", "te: trailers",
                "-H", "x-meshfn-node: edge.ingress", "--data-binary", f"@{frame}",
                "-D", "-", "-o", "/dev/null", f"http://127.0.0.1:{port}/{method}",
            )  # fmt: skip
            assert f"grpc-status: {code}" in probe.stdout, (method, probe)
    finally:
        shutil.rmtree(probes)
    plain = as_nobody("curl", "-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}",
                      f"http://127.0.0.1:{port}/")  # fmt: skip
    assert not plain.stdout.startswith("2"), plain


def _console(mesh: Mesh, port: int) -> None:
    def status(path: str, *headers: str) -> str:
        args = [arg for header in headers for arg in ("-H", header)]
        return as_nobody(
            "curl", "-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}", *args,
            f"http://127.0.0.1:{port}{path}",
        ).stdout  # fmt: skip

    for path in CONSOLE_OPEN_PATHS:
        assert status(path) == "200", path
    owner = console_headers(mesh.state)
    for path in CONSOLE_PATHS:
        assert status(path) == "401", path
        assert status(path, "authorization: Bearer wrong") == "401", path
        assert status(path, *(f"{k}: {v}" for k, v in owner.items())) == "200", path
