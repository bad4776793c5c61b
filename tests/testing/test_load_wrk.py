"""meshfn.testing.load.wrk (the benchmarks' closed-loop load) fails a run that was not all 2xx
answers: tiny HTTP servers on loopback answer 200 (the control: a clean run passes), 302 (wrk's
own count holds only >= 400), 500, or drop every other connection unanswered (socket errors,
which wrk counts apart)."""

from __future__ import annotations

import itertools
import shutil
import socket
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshfn.testing import load

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = itertools.count()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        drop = self.server.mode == "drop" and next(self.server.connections) % 2 == 1
        data = b""
        while True:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, data = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(data) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                data += chunk
            data = data[length:]
            if drop:  # the request read, never answered: the connection just closes
                return
            status = {"ok": "200 OK", "drop": "200 OK", "redirect": "302 Found"}.get(
                self.server.mode, "500 Internal Server Error"
            )
            sock.sendall(
                f"HTTP/1.1 {status}\r\nlocation: /elsewhere\r\ncontent-length: 2\r\n\r\nok".encode()
            )


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    srv = _Server(request.param)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/x"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


@pytest.mark.parametrize("server", ["ok"], indirect=True)
def test_a_clean_run_passes(server: str, tmp_path: Path) -> None:
    result = load.wrk(server, b"{}", 1, 4, tmp_path)
    assert result.requests > 0 and result.rps > 0 and result.p99_ms >= result.p50_ms > 0


@pytest.mark.parametrize(
    ("server", "reported"),
    [("redirect", "not2xx="), ("error", "not2xx="), ("drop", "read=")],
    indirect=["server"],
)
def test_answers_outside_2xx_and_socket_errors_fail_the_run(
    server: str, reported: str, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as failed:
        load.wrk(server, b"{}", 1, 4, tmp_path)
    assert reported in str(failed.value), failed.value


def test_the_accounting_line_is_required() -> None:
    """Output without the script's line (an older script, a crash in `done`) is an error, not
    a clean run."""
    with pytest.raises(SystemExit, match="no accounting line"):
        load.wrk_failures("Requests/sec: 6315.00\n")
    counts = "MESHFN-WRK requests=10 not2xx=0 connect=0 read=3 write=0 timeout=1 status=0\n"
    assert load.wrk_failures(counts) == (10, {"read": 3, "timeout": 1})
