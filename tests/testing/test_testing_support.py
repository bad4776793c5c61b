"""meshfn.testing itself: a port taken between pick and bind is retried, the shared Envoy
command line, policy builders that load, and product code that never imports the test support."""

from __future__ import annotations

import errno
import http.client
import http.server
import json
import re
import socket
import ssl
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import pytest

from meshfn import ir
from meshfn.contracts.function import GENERATION_TIMEOUT
from meshfn.control_plane.runtime.bootstrap import ProxyIdentity
from meshfn.control_plane.runtime.envoy import EnvoyProcess, envoy_binary
from meshfn.policy import load_policies
from meshfn.policy.kserve import DEADLINE_MARGIN
from meshfn.testing import envoy
from meshfn.testing.policies import Policies
from meshfn.testing.ports import PortInUse, free_port, is_port_clash, retry_on_port_clash
from meshfn.testing.processes import Processes, wait_for

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["common", "contracts", "ir", "control_plane", "xds", "inference", "ebpf"]
# Binds the port in argv[1] and serves until stopped: a stand-in for any server we start.
SERVER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    rig = Processes(tmp_path)
    yield rig
    rig.stop_all()


def test_retry_picks_again_only_on_eaddrinuse() -> None:
    calls: list[OSError] = []
    refused = OSError(errno.ECONNREFUSED, "refused")

    def start(*failures: OSError) -> str:
        if len(calls) < len(failures):
            calls.append(failures[len(calls)])
            raise calls[-1]
        return "up"

    assert retry_on_port_clash(lambda: start(PortInUse("a"), PortInUse("b"))) == "up"
    calls.clear()
    with pytest.raises(PortInUse):  # a clash on every attempt
        retry_on_port_clash(lambda: start(*[PortInUse("c")] * 3), attempts=2)
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(OSError) as caught:  # anything else is not retried
        retry_on_port_clash(lambda: start(refused))
    assert caught.value is refused and len(calls) == 1
    assert is_port_clash(OSError(errno.EADDRINUSE, "x")) and not is_port_clash(refused)


def listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def test_a_child_that_finds_its_port_taken_is_started_again_on_another(
    procs: Processes,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # taken, but not listening: no answer to the probe
        busy = taken.getsockname()[1]
        ports = [busy, free_port()]

        def start() -> int:
            port = ports.pop(0)
            proc = procs.start(f"server-{port}", [sys.executable, "-c", SERVER, str(port)])
            wait_for("the server", lambda: listening(port), proc=proc)
            return port

        # the first attempt dies of EADDRINUSE (seen in its log), the second one serves
        assert retry_on_port_clash(start) != busy
    first, second = procs.started
    assert first.poll() == 1 and "address already in use" in first.output().lower()
    assert second.poll() is None


def test_one_envoy_command_line() -> None:
    argv = envoy.argv(Path("/c.json"))
    assert argv[:4] == [str(envoy_binary()), "-c", "/c.json", "--disable-hot-restart"]
    assert argv[argv.index("--concurrency") + 1] == "1" and "--base-id" not in argv
    wasm = envoy.argv(Path("/c.json"), wasm=True)
    assert wasm[wasm.index("--component-log-level") + 1] == "wasm:info"


def test_an_envoy_of_the_mesh_drains_a_changed_listener_at_once_and_cuts_no_request(
    tmp_path: Path,
) -> None:
    """A listener update (tracing switched on or off) tells every connection of the old filter
    chain to close at once (`--drain-strategy immediate`: Connection: close, GOAWAY) and only
    closes what is left once the longest request a route allows by default has finished."""
    assert "--drain-strategy immediate" in " ".join(envoy.argv(Path("/c.json")))
    identity = ProxyIdentity("edge.default~0", "edge.default", ir.Locality(), 0, "delta")
    argv = EnvoyProcess(identity, 18000, tmp_path).argv
    assert argv[argv.index("--drain-strategy") + 1] == "immediate"
    drain = timedelta(seconds=int(argv[argv.index("--drain-time-s") + 1]))
    assert drain > GENERATION_TIMEOUT + DEADLINE_MARGIN  # a default generation's route timeout


def test_envoy_validate_accepts_and_refuses() -> None:
    admin = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    assert envoy.validate({"admin": admin}).returncode == 0
    refused = envoy.validate({"admin": admin, "no_such_field": 1})
    assert refused.returncode != 0 and "no_such_field" in refused.stdout + refused.stderr


def test_the_standard_mesh_loads(tmp_path: Path) -> None:
    policies = Policies(tmp_path / "p", protocol="sotw")
    policies.route("/v2", "beta")
    model = load_policies(policies.root)
    (gateway,) = [w for w in model.workloads if w.kind == "gateway"]
    assert {service.name for service in model.services} == {"alpha", "beta"}
    assert gateway.admin_port == policies.ports["envoy_admin"]
    assert len(set(policies.ports.values())) == len(policies.ports)


def test_product_code_never_imports_the_test_support() -> None:
    importing = re.compile(r"^\s*(from|import)\s+(meshfn\.testing\b|\.+testing\b)", re.M)
    found = [
        str(path.relative_to(ROOT))
        for folder in PRODUCT
        for path in (ROOT / folder).rglob("*.py")
        if importing.search(path.read_text())
    ]
    assert found == []


def test_the_kube_build_reports_its_steps_and_whether_it_was_cached(tmp_path: Path) -> None:
    """The progress wrapper of e2e/kube/build.sh: each step line advances the bar, everything
    reaches the log, and the last line tells a fresh build from a cached one."""
    import io

    from rich.console import Console

    from meshfn.testing import kubebuild

    fresh = tmp_path / "fresh.sh"
    fresh.write_text(
        "echo noise\n"
        "echo '[kube-build 10:00:00] apt update' >&2\n"
        "echo '[kube-build 10:00:01] go build kube-apiserver' >&2\n"
        "echo '[kube-build 10:00:02] done: /x' >&2\n"
    )
    cached = tmp_path / "cached.sh"
    cached.write_text("exit 0\n")
    failing = tmp_path / "failing.sh"
    failing.write_text("echo '[kube-build 10:00:00] apt update' >&2; exit 3\n")
    for script, code, last in ((fresh, 0, "built"), (cached, 0, "all 1 cached"), (failing, 3, "")):
        text = io.StringIO()
        log = tmp_path / f"{script.stem}.log"
        assert kubebuild.run(log, Console(file=text, width=200), script) == code
        lines = text.getvalue().strip().splitlines()
        if last:
            assert last in lines[-1], lines
        else:
            assert not any("kube binaries: built" in line for line in lines), lines
    assert "noise" in (tmp_path / "fresh.log").read_text()


class _Seen(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 204 and keeps what it got (path, headers)."""

    seen: ClassVar[list[tuple[str, dict[str, str]]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_two_bare_proxies_forward_to_their_upstream_and_the_first_one_traces(
    procs: Processes, tmp_path: Path
) -> None:
    """The benchmarks' floor (testing.envoy.start_bare_chain): a request crosses both proxies
    to the upstream; with a tracer at 100% on the first one the upstream sees its
    `traceparent`, without one none; with no upstream the second proxy answers itself."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Seen)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        upstream = [envoy.loopback(server.server_address[1])]
        collector = envoy.loopback(free_port())  # nothing listens: spans are dropped
        otlp = {
            "name": "otlp", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {"cluster_name": "otlp", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": collector}}]}]},
        }  # fmt: skip
        tracing = {
            "random_sampling": {"value": 100},
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}},
                    "service_name": "floor",
                },
            },
        }
        plain, _ = envoy.start_bare_chain(procs, tmp_path, "plain", upstream)
        traced, started = envoy.start_bare_chain(
            procs, tmp_path, "traced", upstream, tracing, [otlp]
        )
        answering, _ = envoy.start_bare_chain(procs, tmp_path, "answering", None)
        assert len(started) == 2 and all(p.pid for p in started)
        for port, path in ((plain, "/plain"), (traced, "/traced")):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
                assert reply.status == 204
        seen = dict(_Seen.seen)
        assert set(seen) == {"/plain", "/traced"}
        assert "traceparent" not in seen["/plain"]
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", seen["/traced"]["traceparent"])
        with urllib.request.urlopen(f"http://127.0.0.1:{answering}/any", timeout=10) as reply:
            assert reply.status == 200 and reply.read() == b"{}"
        assert set(dict(_Seen.seen)) == {"/plain", "/traced"}  # it never reached the upstream
    finally:
        server.shutdown()
        server.server_close()


def test_a_bare_chain_with_mtls_crosses_its_hop_over_mutual_tls_only(
    procs: Processes, tmp_path: Path
) -> None:
    """The zero-trust floor (start_bare_chain's `mtls`): a request crosses both proxies; the
    second one takes only a TLS client with a certificate of the chain's CA (plaintext and a
    client without a certificate both fail), and the first one pins the second one's ID."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Seen)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        upstream = [envoy.loopback(server.server_address[1])]
        port, _ = envoy.start_bare_chain(procs, tmp_path, "zt", upstream, mtls=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/zt", timeout=10) as reply:
            assert reply.status == 204
        assert "/zt" in dict(_Seen.seen)
        second = json.loads((tmp_path / "zt-2.json").read_text())
        (listener,) = second["static_resources"]["listeners"]
        inner = listener["address"]["socket_address"]["port_value"]
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{inner}/zt-plain", timeout=10)
        bare = ssl.create_default_context(cafile=str(tmp_path / "zt-pki" / "bundle.pem"))
        bare.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            urllib.request.urlopen(f"https://127.0.0.1:{inner}/zt-nocert", timeout=10, context=bare)
        assert {"/zt-plain", "/zt-nocert"}.isdisjoint(dict(_Seen.seen))
        first = json.loads((tmp_path / "zt-1.json").read_text())
        (cluster,) = [c for c in first["static_resources"]["clusters"] if c["name"] == "upstream"]
        tls = cluster["transport_socket"]["typed_config"]["common_tls_context"]
        sans = tls["validation_context"]["match_typed_subject_alt_names"]
        assert sans == [
            {"san_type": "URI", "matcher": {"exact": "spiffe://floor.local/ns/floor/sa/server"}}
        ]
    finally:
        server.shutdown()
        server.server_close()
