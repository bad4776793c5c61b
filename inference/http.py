"""A small HTTP/1.1 server on asyncio + httptools (llhttp), made for the backend's hot path.

Chosen by measurement (bench/functions.py --http-stacks, same trivial JSON handler, loopback):
aiohttp 212 us p50 / 11.7k req/s, aiohttp+uvloop 161 us / 16.1k, uvicorn(httptools, uvloop)
137 us / 17.9k, asyncio+httptools 120 us / 49.7k. The backend needs little of a framework
(fixed routes, JSON bodies, keep-alive), so the parser plus ~200 lines wins ~90 us per request.

Per connection, requests are answered strictly in order (pipelining-safe) by one task; reading
pauses while too many are queued. Bodies larger than the route's limit get 413 from the
Content-Length header before they are read, or as soon as a chunked body crosses the limit, and
the connection is closed.

A response may stream (`Response.stream`, generation's server-sent events): its chunks go out
with chunked transfer encoding as they come, never gathered, then its trailers (`trailers()`,
read once the stream ends: the generation's usage record). Writing waits while the client does
not read (the transport's flow control), so generation waits too instead of buffering ahead;
a client that goes away cancels the stream (its generation stops before its next token).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast

import httptools

log = logging.getLogger("meshfn.inference.http")

MAX_QUEUED = 16  # pipelined requests per connection before we stop reading
MAX_HEADER_BYTES = 64 << 10


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[bytes, bytes]
    body: bytes
    keep_alive: bool
    query: str = ""  # after `?`, undecoded
    http11: bool = True  # HTTP/1.1 (chunked responses); else 1.0: a stream ends with the close


Trailers = Callable[[], list[tuple[bytes, bytes]]]


@dataclass(slots=True)
class Response:
    status: int
    body: bytes
    content_type: bytes = b"application/json"
    close: bool = False
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # A streamed body: chunks written as they come (chunked encoding), then `trailers()`.
    stream: AsyncIterator[bytes] | None = None
    trailers: Trailers | None = None


Handler = Callable[[Request], Coroutine[Any, Any, Response]]  # a coroutine: _start drives it
BodyLimit = Callable[[str], int]
ErrorBody = Callable[[str], bytes]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}

# The connection a handler serves (set in each connection's context, which handlers run in).
_connection: contextvars.ContextVar[HttpProtocol | None] = contextvars.ContextVar(
    "meshfn_http_connection", default=None
)


def on_disconnect(callback: Callable[[], None]) -> Callable[[], None]:
    """Call `callback` if the current request's client goes away (a generation stops); returns
    the function that forgets it (the request finished first)."""
    connection = _connection.get()
    if connection is None:
        return lambda: None
    connection.on_lost.add(callback)
    return lambda: connection.on_lost.discard(callback)


def stream_head(response: Response, keep_alive: bool, chunked: bool) -> bytes:
    """The status line and headers of a streamed response (no Content-Length)."""
    reason = _REASONS.get(response.status, b"Unknown")
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nCache-Control: no-cache\r\n" % (
        response.status,
        reason,
        response.content_type,
    )
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n"
    for name, value in response.extra_headers:
        head += name + b": " + value + b"\r\n"
    if not keep_alive:
        head += b"Connection: close\r\n"
    return head + b"\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def last_chunk(trailers: list[tuple[bytes, bytes]]) -> bytes:
    return b"0\r\n" + b"".join(name + b": " + value + b"\r\n" for name, value in trailers) + b"\r\n"


def encode(response: Response, keep_alive: bool) -> bytes:
    reason = _REASONS.get(response.status, b"Unknown")
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        response.status,
        reason,
        response.content_type,
        len(response.body),
    )
    for name, value in response.extra_headers:
        head += name + b": " + value + b"\r\n"
    if not keep_alive:
        head += b"Connection: close\r\n"
    return head + b"\r\n" + response.body


def _query(url: bytes) -> str:
    """The query string of a request target (before any fragment), as text."""
    mark = url.find(b"?")
    if mark < 0:
        return ""
    return url[mark + 1 :].split(b"#", 1)[0].decode("latin-1")


def query_values(query: str, key: str) -> list[str]:
    """Every value `key` has in a query string (Request.query), in order, undecoded."""
    found = []
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == key:
            found.append(value)
    return found


def _too_large(limit: int) -> str:
    return f"request body exceeds {limit} bytes"


class _HeadTooLarge(httptools.HttpParserError):
    """A request line (414) or header block (431) past MAX_HEADER_BYTES."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Pending:
    __slots__ = ("body", "headers", "limit", "path", "too_large", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.too_large = 0  # the limit that was exceeded, 0 if none
        self.path = ""  # known once the headers are complete
        self.limit = 0  # the route's body limit, likewise


class _Started:
    """A request whose handler began in the parser's callback and then waited (for `future`):
    the connection's worker task goes on with it, in order, where it stopped."""

    __slots__ = ("coro", "future", "request")

    def __init__(self, coro: Any, future: Any, request: Request) -> None:
        self.coro, self.future, self.request = coro, future, request


class _Resume:
    """Awaiting this continues a started coroutine: the awaiting task first waits for what the
    coroutine was waiting for, then sends on what the task gets (a result, or a cancellation
    thrown in), as the task would have done had it run the coroutine from the start."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Any, first: Any) -> None:
        self.coro, self.first = coro, first

    def __await__(self) -> Any:
        waiting = self.first
        while True:
            try:
                sent = yield waiting
            except BaseException as exc:  # a cancellation: passed on to the handler
                try:
                    waiting = self.coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    waiting = self.coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _ready(response: Response) -> Response:
    """A response the handler finished at once, for the worker task to write (a stream)."""
    return response


class HttpProtocol(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending = _Pending()
        self.size = 0
        self.header_bytes = 0
        self.queue: deque[Request | Response | _Started] = deque()
        self.wakeup = asyncio.Event()
        self.worker: asyncio.Task[None] | None = None
        self.context = contextvars.Context()
        self.closing = False
        self.busy = False
        self.streaming = False  # a streamed response is being written
        self.writable = asyncio.Event()  # the transport takes more (flow control)
        self.writable.set()
        self.on_lost: set[Callable[[], None]] = set()  # on_disconnect's callbacks

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server.connections.add(self)
        # the worker task's context, which handlers started in _start run in too (as they did
        # when the worker ran every handler)
        self.context = contextvars.copy_context()
        self.context.run(_connection.set, self)
        self.worker = asyncio.get_running_loop().create_task(self._work(), context=self.context)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        self.wakeup.set()
        self.writable.set()
        for callback in list(self.on_lost):
            try:
                callback()
            except Exception:
                log.exception("disconnect callback failed")
        self.on_lost.clear()
        if self.streaming and self.worker is not None:
            # the client is gone mid-stream: stop the stream (and its generation) now, not
            # when its next chunk would have been written
            self.worker.cancel()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            # llhttp reports a callback's exception as its own ("`on_url` callback error")
            cause = exc if isinstance(exc, _HeadTooLarge) else exc.__context__
            if isinstance(cause, _HeadTooLarge):
                self._fail(cause.status, str(cause))
            else:
                self._fail(400, f"malformed HTTP request: {exc}")

    # ---------------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        self.pending = _Pending()
        self.size = 0
        self.header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.pending.url += url
        self.header_bytes += len(url)
        if self.header_bytes > MAX_HEADER_BYTES:
            raise _HeadTooLarge(414, f"the request line is longer than {MAX_HEADER_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            raise _HeadTooLarge(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes")
        self.pending.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        # the path and its body limit, once per request (the body callbacks reuse them)
        self.pending.path = self._path()
        limit = self.pending.limit = self.server.body_limit(self.pending.path)
        length = self.pending.headers.get(b"content-length")
        expects = self.pending.headers.get(b"expect", b"").lower() == b"100-continue"
        if length is not None and length.isdigit() and int(length) > limit:
            self.pending.too_large = limit
            if expects:  # the client waits to be told: the final status instead of 100
                self._fail(413, _too_large(limit))
        elif expects:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.pending.too_large:
            return
        self.size += len(body)
        limit = self.pending.limit
        if self.size > limit:
            self.pending.too_large = limit
            self.pending.body.clear()
            return
        self.pending.body.append(body)

    def on_message_complete(self) -> None:
        pending = self.pending
        if self.closing:  # answered already (_fail), or the connection is done
            return
        if pending.too_large:
            self._enqueue(
                Response(413, self.server.error_body(_too_large(pending.too_large)), close=True)
            )
            return
        self._enqueue(
            Request(
                method=self.parser.get_method().decode("latin-1"),
                path=pending.path,
                headers=pending.headers,
                body=b"".join(pending.body),
                keep_alive=self.parser.should_keep_alive(),
                query=_query(pending.url),
                http11=self.parser.get_http_version() != "1.0",
            )
        )

    # ---------------------------------------------------------------- internals

    def _path(self) -> str:
        url = self.pending.url
        cut = min((i for i in (url.find(b"?"), url.find(b"#")) if i >= 0), default=len(url))
        return url[:cut].decode("latin-1")

    def _enqueue(self, item: Request | Response | _Started) -> None:
        if type(item) is Request:
            if self.closing:  # after a response that closes the connection: never run
                return
            if not self.queue and not self.busy:
                self._start(item)
                return
        self.queue.append(item)
        if len(self.queue) >= MAX_QUEUED and self.transport is not None:
            self.transport.pause_reading()
        self.wakeup.set()

    def _start(self, request: Request) -> None:
        """Run the handler at once, in this callback: a request nothing is queued before is
        answered without waking the worker task (a warm core call never waits, so most
        requests finish here: ~10 us less each). A handler that waits is queued as _Started."""
        coro = self.server.handler(request)
        try:
            waiting = self.context.run(coro.send, None)
        except StopIteration as stop:
            if stop.value.stream is not None:  # the worker task writes it as it comes
                self._enqueue(_Started(_ready(stop.value), None, request))
                return
            self._respond(request, stop.value)
        except Exception:
            self._respond(request, self._crashed(request))
        else:
            self._enqueue(_Started(coro, waiting, request))

    def _crashed(self, request: Request) -> Response:
        log.exception("handler failed", extra={"path": request.path})
        return Response(500, self.server.error_body("internal server error"))

    def _respond(self, request: Request, response: Response) -> bool:
        """Write the response; False once the connection is done (closed, or to be)."""
        assert self.transport is not None
        keep_alive = request.keep_alive and not response.close and not self.server.draining
        if self.transport.is_closing():
            self.closing = True
            return False
        self.transport.write(encode(response, keep_alive))
        if not keep_alive:
            self.closing = True
            self.transport.close()
        return keep_alive

    def _fail(self, status: int, message: str) -> None:
        self._enqueue(Response(status, self.server.error_body(message), close=True))
        self.closing = True  # stop parsing; the worker answers and closes

    async def _work(self) -> None:
        transport = self.transport
        assert transport is not None
        try:
            while (item := await self._next(transport)) is not None:
                if len(self.queue) < MAX_QUEUED // 2 and not transport.is_closing():
                    transport.resume_reading()
                if isinstance(item, Response):  # an error the parser answered: the last one
                    if not transport.is_closing():
                        transport.write(encode(item, False))
                        transport.close()
                    return
                if not await self._answer(item):  # it closed the connection
                    return
        except asyncio.CancelledError:
            transport.close()
            raise

    async def _next(self, transport: asyncio.Transport) -> Request | Response | _Started | None:
        """The next item in the queue, waiting for one; None (and the connection closed) once
        it is closing with nothing left to answer."""
        while not self.queue:
            if self.closing and not self.busy:
                transport.close()
                return None
            self.wakeup.clear()
            await self.wakeup.wait()
            if self.closing and not self.queue:
                transport.close()
                return None
        return self.queue.popleft()

    async def _answer(self, item: Request | _Started) -> bool:
        """Run the handler for a request (or resume one started at once) and write its
        response; False when that closed the connection."""
        request = item.request if isinstance(item, _Started) else item
        self.busy = True
        try:
            if isinstance(item, _Started):
                response = await _Resume(item.coro, item.future)
            else:
                response = await self.server.handler(item)
            if response.stream is not None:
                return await self._stream(request, response)
        except Exception:
            response = self._crashed(request)
        finally:
            self.busy = False
        return self._respond(request, response)

    async def _stream(self, request: Request, response: Response) -> bool:
        """Write a streamed response as its chunks come; False when the connection is done.
        HTTP/1.0 clients get the body unframed, ended by closing the connection."""
        transport = self.transport
        assert transport is not None and response.stream is not None
        chunked = request.http11
        keep_alive = chunked and request.keep_alive and not response.close
        keep_alive = keep_alive and not self.server.draining
        stream = response.stream
        self.streaming = True
        out = _Grouped(transport)
        try:
            if transport.is_closing():
                return False
            out.send(stream_head(response, keep_alive, chunked))
            async for data in stream:
                if transport.is_closing():
                    return False
                if data:
                    out.send(chunk(data) if chunked else data)
                if not self.writable.is_set():
                    await self.writable.wait()
        except Exception:
            # The head is out (or about to be): a 500 now would follow part of a body. Cut the
            # connection before the last chunk instead, which a proxy reads as a failed stream.
            log.exception("stream failed", extra={"path": request.path})
            out.drop()
            self.closing = True
            transport.close()
            return False
        finally:
            self.streaming = False
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        if transport.is_closing():
            return False
        if chunked:
            out.send(last_chunk(response.trailers() if response.trailers else []))
        out.flush()
        if not keep_alive:
            self.closing = True
            transport.close()
        return keep_alive

    def close_if_idle(self) -> None:
        if not self.busy and not self.queue and self.transport is not None:
            self.closing = True
            self.wakeup.set()


class _Grouped:
    """A streamed response's writes, joined while one turn of the event loop lasts: the head
    goes with the first text, the last event with the final chunk and the trailers. Each write
    is an event for every proxy on the way (~80 us of an Envoy's CPU here), and a head written
    apart from the first chunk put a whole turn of each proxy before the first token."""

    __slots__ = ("_loop", "_out", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []

    def send(self, data: bytes) -> None:
        if not self._out:
            self._loop.call_soon(self.flush)
        self._out.append(data)

    def flush(self) -> None:
        if self._out and not self._transport.is_closing():
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def drop(self) -> None:
        self._out.clear()


class HttpServer:
    def __init__(self, handler: Handler, body_limit: BodyLimit, error_body: ErrorBody) -> None:
        self.handler = handler
        self.body_limit = body_limit
        self.error_body = error_body
        self.connections: set[HttpProtocol] = set()
        self.draining = False
        self._server: asyncio.Server | None = None

    async def start(
        self, host: str, port: int, backlog: int = 1024, sock: socket.socket | None = None
    ) -> None:
        """Listen on host:port, or accept from `sock` (a listening TCP or unix socket: a
        supervisor's, or one of the backend's own)."""
        loop = asyncio.get_running_loop()
        if sock is not None and sock.family == socket.AF_UNIX:
            self._server = await loop.create_unix_server(
                lambda: HttpProtocol(self), sock=sock, backlog=backlog
            )
            return
        if sock is not None:
            self._server = await loop.create_server(lambda: HttpProtocol(self), sock=sock)
            return
        self._server = await loop.create_server(
            lambda: HttpProtocol(self), host, port, backlog=backlog, reuse_address=True
        )

    @property
    def sockets(self) -> list[Any]:
        return list(self._server.sockets) if self._server else []

    def stop_listening(self) -> None:
        """No new connections; requests on open ones still get answers (with Connection:
        close), and idle keep-alive connections are closed now."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()

    async def close(self) -> None:
        self.stop_listening()
        for conn in list(self.connections):
            if conn.worker is not None:
                conn.worker.cancel()
        if self._server is not None:
            await self._server.wait_closed()
