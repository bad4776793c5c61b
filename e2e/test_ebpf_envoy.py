"""Real Envoy and a real asyncio backend (the aiohttp placeholder upstream) in the mesh's cgroup.

The Envoy <-> backend hop is redirected (counters, and no payload on `lo` for the backend's
port), every response is intact, upstream connections that close after each request work (FIN
handling under redirection: the EAGAIN hazard is for blocking sockets, Envoy and asyncio are
not), and a detach in the middle of keep-alive traffic breaks nothing.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from meshfn.ebpf import Accelerator, probe
from meshfn.testing.ebpf import attached
from meshfn.testing.processes import Processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def load_bench() -> ModuleType:
    """The static Envoy stack lives in bench/ebpf.py; reuse it rather than copy it."""
    path = Path(__file__).resolve().parents[1] / "bench" / "ebpf.py"
    spec = importlib.util.spec_from_file_location("bench_ebpf", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ebpf"] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()


@pytest.fixture
def accel(tmp_path: Path) -> Iterator[Accelerator]:
    with attached(tmp_path / "state") as (accelerator, _):
        yield accelerator


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


def get(
    conn: http.client.HTTPConnection, path: str, headers: dict[str, str] | None = None
) -> dict[str, object]:
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    body = response.read()
    assert response.status == 200, body
    reply: dict[str, object] = json.loads(body)
    return reply


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before if after[key] != before[key]}


def test_envoy_to_backend_hop_is_redirected_and_intact(
    accel: Accelerator, children: Processes, tmp_path: Path
) -> None:
    capture = probe.LoopbackCapture()
    try:
        listen, backend = bench.start_stack(
            "aiohttp", tmp_path, accel.child_preexec(), children, "envoy"
        )
        before = accel.stats()
        conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=5)
        for i in range(200):
            reply = get(conn, f"/v2/models/m{i}?q={i}")
            assert reply["service"] == "bench/backend" and reply["path"] == f"/v2/models/m{i}?q={i}"
        conn.close()
        changed = delta(before, accel.stats())
        on_backend_port = capture.payload_segments([backend], any_port=True)
        on_listener_port = capture.payload_segments([listen], any_port=True)
    finally:
        capture.close()
    # One upstream connection (Envoy's socket + the backend's) and the user's connection to
    # Envoy, which stays on TCP.
    assert changed["sockets_added"] == 2, changed
    assert changed["sockets_peer_outside"] == 1, changed
    assert changed["messages_redirected"] >= 400, changed
    assert not {"messages_no_peer", "messages_tcp_path", "sockets_add_failed"} & set(changed)
    assert on_backend_port == 0
    assert on_listener_port >= 400  # the control: the user's hop is plain TCP, seen on lo


def test_upstream_connections_closing_after_every_request(
    accel: Accelerator, children: Processes, tmp_path: Path
) -> None:
    listen, _ = bench.start_stack(
        "aiohttp", tmp_path, accel.child_preexec(), children, "envoy", requests_per_connection=1
    )
    before = accel.stats()
    conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=5)
    for i in range(100):
        assert get(conn, f"/close/{i}")["path"] == f"/close/{i}"
    conn.close()
    changed = delta(before, accel.stats())
    assert changed["sockets_added"] == 200, changed  # a new upstream connection per request
    assert changed["messages_redirected"] >= 200, changed
    assert not {"messages_no_peer", "messages_tcp_path"} & set(changed), changed
    assert accel.stats()["sockets_in_map"] <= 2  # closed sockets leave the map by themselves


def test_detach_in_the_middle_of_keep_alive_traffic(
    accel: Accelerator, children: Processes, tmp_path: Path
) -> None:
    listen, _ = bench.start_stack("aiohttp", tmp_path, accel.child_preexec(), children, "envoy")
    conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=5)
    for i in range(50):
        get(conn, f"/before/{i}")
    assert accel.stats()["messages_redirected"] >= 100
    assert accel.shutdown() == []
    assert accel.stats()["attached"] == 0
    for i in range(50):  # the same keep-alive connections, now plain TCP
        assert get(conn, f"/after/{i}")["path"] == f"/after/{i}"
    fresh = http.client.HTTPConnection("127.0.0.1", listen, timeout=5)
    assert get(fresh, "/fresh", {"connection": "close"})["path"] == "/fresh"
    conn.close()
