"""Envoy's admin interface in `meshfn up`: a unix socket (mode 0600) in the state directory, a
TCP port only where a Gateway's `adminPort` opts in (with a warning), and a private state
directory. Real Envoy checks the bootstraps (`--mode validate`) and serves one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import resource
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from meshfn.common.files import private_directory
from meshfn.common.unix import MAX_SOCKET_PATH
from meshfn.control_plane.runtime.bootstrap import (
    ADMIN_CLUSTER,
    ADMIN_TCP_LISTENER,
    CONNECTIONS_MONITOR,
    AdminSocketPathTooLong,
    ProxyIdentity,
    admin_port_warnings,
    admin_socket_path,
    bootstrap_json,
    connection_limit,
)
from meshfn.control_plane.runtime.console.graph import ProxyStats
from meshfn.policy import load_policies
from meshfn.testing import policies as p
from meshfn.testing.envoy import admin_request, argv, live, validate
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import MESHFN, Processes, listening_tcp_ports, wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "policies" / "examples"


def identity(admin_port: int = 0) -> ProxyIdentity:
    model = load_policies(EXAMPLES)
    gateway = next(w for w in model.workloads if w.kind == "gateway")
    found = ProxyIdentity.for_workload(gateway, "Bearer test-token")
    return dataclasses.replace(found, admin_port=admin_port)


def test_examples_open_no_admin_port() -> None:
    model = load_policies(EXAMPLES)
    assert all(w.admin_port == 0 for w in model.workloads)
    assert admin_port_warnings(model) == []
    assert "adminPort" not in (EXAMPLES / "mesh.yaml").read_text()


def test_bootstrap_serves_admin_on_a_private_socket(tmp_path: Path) -> None:
    sock = admin_socket_path(tmp_path, "edge.ingress~0")
    assert sock == tmp_path / "envoy" / "edge.ingress-0.sock"
    config = bootstrap_json(identity(), "127.0.0.1", 18000, sock)
    assert config["admin"] == {"address": {"pipe": {"path": str(sock), "mode": 0o600}}}
    assert "listeners" not in config["static_resources"]  # nothing on TCP but the proxies
    assert [c["name"] for c in config["static_resources"]["clusters"]] == ["meshfn-xds"]
    result = validate(config)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_admin_port_forwards_to_the_socket(tmp_path: Path) -> None:
    sock = admin_socket_path(tmp_path, "edge.ingress~0")
    config = bootstrap_json(identity(19000), "127.0.0.1", 18000, sock)
    assert config["admin"]["address"]["pipe"]["path"] == str(sock)
    (listener,) = config["static_resources"]["listeners"]
    assert listener["name"] == ADMIN_TCP_LISTENER
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19000}
    (tcp_proxy,) = listener["filter_chains"][0]["filters"]
    assert tcp_proxy["typed_config"]["cluster"] == ADMIN_CLUSTER
    admin = next(c for c in config["static_resources"]["clusters"] if c["name"] == ADMIN_CLUSTER)
    endpoint = admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"] == {"pipe": {"path": str(sock)}}
    result = validate(config)
    assert result.returncode == 0, result.stdout + result.stderr


def bootstrap_command(state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MESHFN, "bootstrap", "edge.ingress", "--policies", str(EXAMPLES),
         "--state-dir", str(state), *extra],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_meshfn_bootstrap_serves_admin_on_a_private_socket_too(tmp_path: Path) -> None:
    """`meshfn bootstrap` (an Envoy you run yourself) as `meshfn up`: admin on a unix socket in
    the state directory; TCP only on request (--admin-port), with `meshfn up`'s warning."""
    state = tmp_path / "state"
    result = bootstrap_command(state)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    config = json.loads(result.stdout)
    sock = admin_socket_path(state, "edge.ingress~0")
    assert config["admin"] == {"address": {"pipe": {"path": str(sock), "mode": 0o600}}}
    assert "listeners" not in config["static_resources"]
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700  # made for Envoy to bind in
    assert validate(config).returncode == 0

    tcp = bootstrap_command(state, "--admin-port", "19000")
    assert tcp.returncode == 0
    warning = " ".join(tcp.stderr.split())
    assert warning.startswith("warning: --admin-port 19000 for edge.ingress: its Envoy's admin")
    for risk in ("127.0.0.1:19000", "without authentication", "Any local user", "ADS token",
                 "private key", "drain or stop", "Drop --admin-port"):  # fmt: skip
        assert risk in warning, warning
    config = json.loads(tcp.stdout)
    assert config["admin"]["address"]["pipe"]["path"] == str(sock)
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19000}
    assert validate(config).returncode == 0

    elsewhere = tmp_path / "run" / "admin.sock"
    moved = json.loads(bootstrap_command(state, "--admin-socket", str(elsewhere)).stdout)
    assert moved["admin"]["address"]["pipe"]["path"] == str(elsewhere)
    assert not elsewhere.parent.exists()  # a directory of the user's: never made or chmodded
    deep = bootstrap_command(tmp_path / ("d" * MAX_SOCKET_PATH))
    assert deep.returncode == 1 and "use a shorter --state-dir" in deep.stderr, deep.stderr
    assert "Traceback" not in deep.stderr


def test_socket_paths_fit_or_fail_clearly(tmp_path: Path) -> None:
    long_node = "a-very-long-service-name-" * 3 + ".default:15101~0"
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path)) - 40))
    short = admin_socket_path(deep, long_node)  # the node's name does not fit: a digest does
    assert len(os.fsencode(short)) <= MAX_SOCKET_PATH
    assert short.parent == deep / "envoy" and len(short.stem) == 16
    assert short == admin_socket_path(deep, long_node)  # stable
    assert short != admin_socket_path(deep, long_node.replace("15101", "15102"))
    too_deep = tmp_path / ("d" * MAX_SOCKET_PATH)
    with pytest.raises(AdminSocketPathTooLong, match="use a shorter --state-dir"):
        admin_socket_path(too_deep, "edge.ingress~0")
    relative = admin_socket_path(Path("state"), "edge.ingress~0")
    assert relative.is_absolute()  # Envoy may run elsewhere than its supervisor's cwd


def test_admin_port_warning_names_the_risk(tmp_path: Path) -> None:
    (tmp_path / "mesh.yaml").write_text(
        p.documents(p.mesh("m", "m.local"), p.gateway(19000, 10000, namespace="ingress"))
    )
    model = load_policies(tmp_path)
    (warning,) = admin_port_warnings(model)
    assert warning.startswith("warning: Gateway ingress/edge sets adminPort 19000")
    for risk in ("without authentication", "Any local user", "ADS token", "private key",
                 "drain or stop"):  # fmt: skip
        assert risk in warning
    shown = subprocess.run(
        [MESHFN, "validate", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert shown.returncode == 0 and warning in shown.stderr, shown.stderr
    quiet = subprocess.run(
        [MESHFN, "validate", str(EXAMPLES)], capture_output=True, text=True, check=False
    )
    assert quiet.returncode == 0 and "adminPort" not in quiet.stderr + quiet.stdout


def test_private_directory(tmp_path: Path) -> None:
    fresh = tmp_path / "a" / "state"
    assert private_directory(fresh) is None
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    fresh.chmod(0o755)
    assert private_directory(fresh) == 0o755  # tightened: the caller logs it
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    fresh.chmod(0o750)
    assert private_directory(fresh) == 0o750
    fresh.chmod(0o500)  # narrower: made usable by its owner, nothing to report
    assert private_directory(fresh) is None
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_envoy_serves_admin_on_the_socket_only(tmp_path: Path) -> None:
    """A real Envoy on the bootstrap (no control plane: it stays initializing, which admin
    reports): the socket answers, with mode 0600, and Envoy binds no TCP port for admin."""
    sock = admin_socket_path(tmp_path, "edge.ingress~0")
    sock.parent.mkdir(mode=0o700)
    (xds,) = free_ports(1)
    config = tmp_path / "bootstrap.json"
    config.write_text(json.dumps(bootstrap_json(identity(), "127.0.0.1", xds, sock)))
    procs = Processes(tmp_path)
    try:
        proc = procs.start("envoy", argv(config))
        wait_for("the admin socket", sock.exists, proc=proc)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(5)
        client.connect(str(sock))
        client.sendall(b"GET /server_info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
        client.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"state"' in answer
        with pytest.raises(OSError, match="503"):  # not LIVE: no ADS server behind it
            live(sock)
        assert listening_tcp_ports(proc.pid) == set()
    finally:
        procs.stop_all()


def _probe_listener(port: int) -> dict[str, object]:
    """A static listener answering 200 itself: what ADS would otherwise send, for a test with
    no control plane."""
    hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    route = {"match": {"prefix": "/"}, "direct_response": {"status": 200}}
    return {
        "name": "probe",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": hcm + "HttpConnectionManager",
                "stat_prefix": "probe",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
                "http_filters": [{
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                }],
            },
        }]}],
    }  # fmt: skip


def _get(conn: socket.socket) -> bytes:
    """One GET on a kept-alive connection; its answer's head, or b"" when the proxy closed it."""
    try:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                return b""
            answer += chunk
        return answer
    except ConnectionError:
        return b""


def test_every_proxy_has_a_connection_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = {
        "name": CONNECTIONS_MONITOR,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors."
            "downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": str(connection_limit()),
        },
    }
    sock = Path("/tmp/x.sock")
    config = bootstrap_json(identity(), "127.0.0.1", 18000, sock)
    assert config["overload_manager"] == {"resource_monitors": [monitor]}
    # half the open files the proxy inherits: each connection may need one upstream
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert connection_limit() == max(64, soft // 2 - 128)
    monkeypatch.setenv("MESHFN_PROXY_MAX_CONNECTIONS", "5000")
    assert connection_limit() == 5000
    for bad in ("0", "-3", "many", str(2**31)):
        monkeypatch.setenv("MESHFN_PROXY_MAX_CONNECTIONS", bad)
        with pytest.raises(ValueError, match="must be an integer from 1 to 2147483647"):
            connection_limit()


def test_past_its_connection_limit_a_proxy_refuses_new_connections_and_keeps_its_own(
    tmp_path: Path,
) -> None:
    """A real Envoy on meshfn's bootstrap with a limit of 3 (no control plane: a static
    listener answers, and the initial fetch gives up after 0.5 s): three kept-alive connections
    are served, a fourth is closed as it is accepted and counted while the three keep working,
    one closed makes room for a new one, and the opt-in admin port ignores the limit."""
    sock = admin_socket_path(tmp_path, "edge.ingress~0")
    sock.parent.mkdir(mode=0o700)
    xds, port, admin_port = free_ports(3)
    config = bootstrap_json(identity(admin_port), "127.0.0.1", xds, sock, max_connections=3)
    config["static_resources"]["listeners"].append(_probe_listener(port))
    for kind in ("cds_config", "lds_config"):
        config["dynamic_resources"][kind]["initial_fetch_timeout"] = "0.5s"
    path = tmp_path / "bootstrap.json"
    path.write_text(json.dumps(config))
    procs = Processes(tmp_path)
    held: list[socket.socket] = []
    try:
        proc = procs.start("envoy", argv(path))
        wait_for("the probe listener", lambda: port in listening_tcp_ports(proc.pid), proc=proc)
        for _ in range(3):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            assert _get(held[-1]).startswith(b"HTTP/1.1 200")
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert _get(extra) == b""  # closed as it was accepted
        extra.close()
        assert all(_get(c).startswith(b"HTTP/1.1 200") for c in held)
        stats = admin_request(sock, "/stats?filter=downstream_global_cx_overflow").decode()
        assert f"listener.127.0.0.1_{port}.downstream_global_cx_overflow: 1" in stats, stats
        # what meshfn up reads from its proxies for /metrics and `meshfn status`
        proxies = ProxyStats(lambda: {"edge.ingress": sock})
        asyncio.run(proxies.refresh())
        assert proxies.connection_status() == [{"proxy": "edge.ingress", "connections_refused": 1}]
        with socket.create_connection(("127.0.0.1", admin_port), timeout=5) as admin:
            admin.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert admin.recv(4096).startswith(b"HTTP/1.1 ")
        held.pop().close()
        fresh = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append(fresh)
        answer = b""
        for _ in range(50):  # Envoy counts the closed connection out on its next event
            answer = _get(fresh)
            if answer:
                break
            fresh.close()
            time.sleep(0.05)
            fresh = held[-1] = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        for conn in held:
            conn.close()
        procs.stop_all()
