"""The backend's asyncio + httptools HTTP/1.1 server on real loopback sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from meshfn.inference.http import HttpServer, Request, Response
from meshfn.inference.kserve import error_body


async def echo(request: Request) -> Response:
    if request.path == "/slow":
        await asyncio.sleep(0.05)
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    body = json.dumps({"method": request.method, "path": request.path, "len": len(request.body)})
    return Response(200, body.encode())


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
