"""The backend's asyncio + httptools HTTP/1.1 server on real loopback sockets."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator

import pytest

from meshfn.inference.http import HttpServer, Request, Response
from meshfn.inference.kserve import error_body

HANDLED: list[str] = []  # paths in the order the handler started them
CANCELLED: list[str] = []


async def echo(request: Request) -> Response:
    HANDLED.append(request.path)
    if request.path == "/slow":
        await asyncio.sleep(0.05)
    if request.path == "/forever":
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            CANCELLED.append(request.path)
            raise
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    if request.path.startswith("/stream"):
        return Response(200, b"", b"text/event-stream", stream=_pieces(request.path),
                        trailers=lambda: [(b"x-done", b"1")])  # fmt: skip
    body = json.dumps({"method": request.method, "path": request.path, "len": len(request.body)})
    return Response(200, body.encode())


STREAM_GAP = 0.2


async def _pieces(path: str) -> AsyncIterator[bytes]:
    """The first piece at once, a pause, then the last two one after the other (/stream-bug:
    a bug after the first piece)."""
    yield b"first"
    await asyncio.sleep(STREAM_GAP)
    if path == "/stream-bug":
        raise RuntimeError("stream bug")
    yield b"second"
    yield b"last"


@pytest.fixture
async def server() -> AsyncIterator[tuple[HttpServer, int]]:
    srv = HttpServer(echo, lambda path: 100 if path == "/small" else 10_000, error_body)
    await srv.start("127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    yield srv, port
    await srv.close()


async def exchange(port: int, raw: bytes, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(-1), 5) if read_until_close else b""
    finally:
        writer.close()


def post(path: str, body: bytes, close: bool = False) -> bytes:
    conn = b"Connection: close\r\n" if close else b""
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (
        path.encode(),
        len(body),
        conn,
        body,
    )


async def test_pipelined_requests_answered_in_order(server: tuple[HttpServer, int]) -> None:
    _, port = server
    raw = post("/slow", b"abc") + post("/fast?q=1", b"") + post("/last", b"xy", close=True)
    out = await exchange(port, raw)
    bodies = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in out.split(b"HTTP/1.1 ")[1:]]
    assert [b["path"] for b in bodies] == ["/slow", "/fast", "/last"]
    assert [b["len"] for b in bodies] == [3, 0, 2]
    assert out.count(b"Connection: close") == 1


async def test_body_limit_by_content_length_and_chunked(server: tuple[HttpServer, int]) -> None:
    _, port = server
    out = await exchange(port, post("/small", b"x" * 101))
    assert out.startswith(b"HTTP/1.1 413 ") and b"exceeds 100 bytes" in out
    assert b"Connection: close" in out
    chunked = (
        b"POST /small HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"40\r\n" + b"y" * 64 + b"\r\n40\r\n" + b"y" * 64 + b"\r\n0\r\n\r\n"
    )
    out = await exchange(port, chunked)
    assert out.startswith(b"HTTP/1.1 413 ")
    ok = await exchange(port, post("/big", b"z" * 5000, close=True))
    assert ok.startswith(b"HTTP/1.1 200 ") and b'"len": 5000' in ok


async def test_malformed_http_gets_400_and_close(server: tuple[HttpServer, int]) -> None:
    _, port = server
    out = await exchange(port, b"NONSENSE\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ")
    assert "malformed HTTP request" in json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
    # past the header limit: the status that says which part, and why
    long_path = b"GET /" + b"a" * (70 << 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    out = await exchange(port, long_path)
    assert out.startswith(b"HTTP/1.1 414 ") and b"request line is longer" in out
    many = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 1000) for i in range(70))
    out = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert out.startswith(b"HTTP/1.1 431 ") and b"headers exceed" in out


async def test_handler_exception_is_500_and_connection_survives(
    server: tuple[HttpServer, int],
) -> None:
    _, port = server
    out = await exchange(port, post("/boom", b"") + post("/after", b"", close=True))
    assert out.startswith(b"HTTP/1.1 500 ") and b'"path": "/after"' in out


async def test_expect_100_continue(server: tuple[HttpServer, int]) -> None:
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n"
    )
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
        b"HTTP/1.1 100 Continue"
    )
    writer.write(b"ok")
    out = await asyncio.wait_for(reader.read(-1), 5)
    writer.close()
    assert out.startswith(b"HTTP/1.1 200 ")


async def test_expect_100_continue_past_the_limit_is_413_at_once(
    server: tuple[HttpServer, int],
) -> None:
    """A client that waits for 100 Continue is told the final status instead (RFC 9110
    10.1.1), without sending the body it announced."""
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /small HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1000\r\n\r\n"
    )
    out = await asyncio.wait_for(reader.read(-1), 5)  # answered and closed, no body sent
    writer.close()
    assert out.startswith(b"HTTP/1.1 413 ") and b"exceeds 100 bytes" in out
    assert out.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in out


async def test_stop_listening_closes_idle_keepalive(server: tuple[HttpServer, int]) -> None:
    srv, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/a", b""))
    await asyncio.wait_for(reader.readuntil(b'"len": 0}'), 5)
    srv.stop_listening()
    assert await asyncio.wait_for(reader.read(-1), 5) == b""  # closed by the server
    writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


def answers(out: bytes) -> list[str]:
    return [
        json.loads(part.split(b"\r\n\r\n", 1)[1])["path"] for part in out.split(b"HTTP/1.1 ")[1:]
    ]


async def test_inline_and_waiting_handlers_keep_the_order(server: tuple[HttpServer, int]) -> None:
    """A request nothing waits before runs in the parser callback; one behind a waiting
    handler is queued behind it; in every mix the answers come in request order."""
    _, port = server
    paths = ["/a", "/slow", "/b", "/slow", "/slow", "/c", "/d"]
    raw = b"".join(post(p, b"") for p in paths[:-1]) + post(paths[-1], b"", close=True)
    assert answers(await exchange(port, raw)) == paths
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for path in ("/e", "/slow", "/f"):  # one at a time: each starts inline
        writer.write(post(path, b""))
        await asyncio.wait_for(reader.readuntil(path.encode() + b'", "len": 0}'), 5)
    writer.close()


async def test_nothing_runs_after_a_closing_response(server: tuple[HttpServer, int]) -> None:
    _, port = server
    HANDLED.clear()
    out = await exchange(port, post("/first", b"", close=True) + post("/never", b""))
    assert answers(out) == ["/first"] and HANDLED == ["/first"]
    HANDLED.clear()
    out = await exchange(port, post("/slow", b"", close=True) + post("/never", b""))
    assert answers(out) == ["/slow"] and HANDLED == ["/slow"]


async def test_closing_the_server_cancels_a_waiting_handler() -> None:
    srv = HttpServer(echo, lambda path: 10_000, error_body)
    await srv.start("127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    CANCELLED.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/forever", b""))
    await writer.drain()
    for _ in range(100):
        if "/forever" in HANDLED:
            break
        await asyncio.sleep(0.01)
    await srv.close()
    await asyncio.sleep(0)
    assert CANCELLED == ["/forever"]  # the cancellation reached the handler it resumed
    assert await asyncio.wait_for(reader.read(-1), 5) == b""
    writer.close()


async def test_a_resumed_handler_keeps_its_context() -> None:
    """A handler started in the parser callback and resumed by the worker task runs in one
    context (the worker's), as when the worker ran it from the start."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("v", default="unset")

    async def handler(request: Request) -> Response:
        before = var.get()
        var.set(request.path)
        await asyncio.sleep(0.01)
        return Response(200, json.dumps({"path": f"{before}>{var.get()}"}).encode())

    srv = HttpServer(handler, lambda path: 10_000, error_body)
    await srv.start("127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        out = await exchange(port, post("/a", b"") + post("/b", b"", close=True))
        assert answers(out) == ["unset>/a", "/a>/b"]  # one connection, one context
    finally:
        await srv.close()


async def _reads(port: int, path: str) -> list[tuple[float, bytes]]:
    """A request's answer as the reads that got it, each with when it came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
    loop = asyncio.get_running_loop()
    started = loop.time()
    reads: list[tuple[float, bytes]] = []
    try:
        while data := await asyncio.wait_for(reader.read(65536), 5):
            reads.append((loop.time() - started, data))
    finally:
        writer.close()
    return reads


async def test_a_stream_writes_its_head_with_the_first_piece_and_its_end_with_the_trailers(
    server: tuple[HttpServer, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each write is an event for every proxy on the way: the head goes in one write with the
    first text, the last piece in one with the final chunk and the trailers."""
    writes: list[bytes] = []
    transport = asyncio.selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
    original = transport.write

    def spy(self: asyncio.Transport, data: bytes) -> None:
        writes.append(bytes(data))
        original(self, data)

    monkeypatch.setattr(transport, "write", spy)
    reads = await _reads(server[1], "/stream")
    out = b"".join(data for _, data in reads)
    assert b"".join(writes).endswith(out) and out.startswith(b"HTTP/1.1 200 OK\r\n")
    request, *served = writes  # the client's request went out first
    assert request.startswith(b"GET /stream ")
    assert served[0].startswith(b"HTTP/1.1 200") and served[0].endswith(b"\r\n\r\n5\r\nfirst\r\n")
    # "second" and "last" came in one turn of the loop: one write with the end
    assert served[1:] == [b"6\r\nsecond\r\n4\r\nlast\r\n0\r\nx-done: 1\r\n\r\n"]
    assert b"".join(served) == out and reads[-1][0] >= STREAM_GAP


async def test_a_stream_that_fails_midway_is_cut_not_followed_by_a_500(
    server: tuple[HttpServer, int],
) -> None:
    reads = await _reads(server[1], "/stream-bug")
    out = b"".join(data for _, data in reads)
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"5\r\nfirst\r\n")
    assert b"500" not in out and b"0\r\n\r\n" not in out  # no last chunk: a failed stream
