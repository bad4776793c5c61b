"""One ADS stream and the loop that serves it, shared by the SotW and Delta handlers.

Each stream has two tasks: a reader that parses requests into an inbox (and stops reading when
the inbox is full, so a flooding client is throttled by gRPC flow control rather than by our
memory), and the handler loop, which answers requests in order and, when the stream's snapshot
changed (`notify`), pushes. Nothing here waits on anything but the network: translation happens
before a snapshot is published (cache.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, ClassVar

import grpc
from envoy.config.core.v3 import base_pb2
from google.protobuf.message import DecodeError

from .auth import StreamAuth, authorization
from .cache import Names, Snapshot, SnapshotCache, TypeSnapshot, next_nonce
from .names import CLUSTER, ENDPOINT
from .protocol import ProtocolError
from .recording import Recorder
from .status import ProxyStatus
from .subscription import Subscription

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[bytes, bytes]
else:
    Context = grpc.aio.ServicerContext

log = logging.getLogger("meshfn.xds")

INBOX_HIGH_WATER = 64

_stream_ids = itertools.count(1)


def malformed() -> ProtocolError:
    return ProtocolError(
        grpc.StatusCode.INVALID_ARGUMENT, "malformed discovery request", "malformed"
    )


class WriteBudget:
    """Bounds the bytes of large responses being written at once, across all streams.

    grpc copies each response into its own buffer and holds it until the client's flow-control
    window takes it. When a fleet connects at once, every stream is sent its whole
    configuration (hundreds of KB) and a slow reader keeps it buffered: at 10,000 streams that
    was gigabytes (bench/xds_push.py, cp_peak_rss_mb). A response waits here until the ones in
    flight leave room. Small ones (pushes of a changed endpoint) never wait: they are the
    latency that matters, and they are small.
    """

    SMALL = 64 * 1024

    def __init__(self, limit: int = 64 * 1024 * 1024) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def write(self, context: Context, data: bytes) -> None:
        size = len(data)
        if size < self.SMALL:
            await context.write(data)
            return
        while self.used and self.used + size > self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # it was this one's turn: pass it on
                raise
        self.used += size
        try:
            await context.write(data)
        finally:
            self.used -= size
            self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Stream:
    """One ADS stream: its node, subscriptions, and an inbox fed by the reader task."""

    def __init__(self, protocol: str, context: Context) -> None:
        self.id = next(_stream_ids)
        self.protocol = protocol
        self.context = context
        self.peer = context.peer()
        self.authorization = authorization(context)
        self.group = ""
        self.subs: dict[str, Subscription] = {}
        self.inbox: deque[Any] = deque()
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.dirty = False
        self.closed = False
        # What has happened on the stream so far, for a caller that needs to know it is quiet
        # (tests' negative checks): requests read, responses written, and whether the handler
        # is between waits (answering or pushing).
        self.requests = 0
        self.responses = 0
        self.busy = False
        self.error: ProtocolError | None = None
        self.status = ProxyStatus(
            stream_id=self.id, node_id="", group="", protocol=protocol, peer=self.peer
        )

    def notify(self) -> None:
        """The cache published a new snapshot for this stream's group."""
        self.dirty = True
        self.wake.set()

    def subscription(self, type_url: str) -> tuple[Subscription, bool]:
        """This stream's Subscription for `type_url`, and whether it was just created."""
        sub = self.subs.get(type_url)
        if sub is not None:
            return sub, False
        sub = self.subs[type_url] = Subscription(type_url)
        self.status.types[type_url] = sub.status
        return sub, True


class Handler(ABC):
    """The protocol half of a stream (SotW or Delta): parse, answer, push."""

    protocol: ClassVar[str]

    def __init__(
        self,
        cache: SnapshotCache,
        recorder: Recorder,
        auth: StreamAuth,
        budget: WriteBudget | None = None,
    ) -> None:
        self.cache = cache
        self.recorder = recorder
        self.auth = auth
        self.budget = budget or WriteBudget()

    @abstractmethod
    def parse(self, raw: bytes) -> Any:
        """Decode one request (raise DecodeError for garbage); runs in the reader task."""

    @abstractmethod
    async def on_request(self, stream: Stream, request: Any) -> None:
        """Answer one request; raise ProtocolError to end the stream."""

    @abstractmethod
    async def push(self, stream: Stream, snapshot: Snapshot) -> None:
        """Bring every subscription of the stream to `snapshot`, in make-before-break order."""

    @abstractmethod
    async def resend(
        self, stream: Stream, sub: Subscription, ts: TypeSnapshot, snapshot: Snapshot, names: Names
    ) -> None:
        """Send `names` of `ts` again, although the client holds them at this version."""

    async def rewarm(
        self, stream: Stream, snapshot: Snapshot, clusters_before: TypeSnapshot | None
    ) -> None:
        """After a push that changed clusters, send their endpoints again.

        Envoy replaces a changed cluster with a new one that warms until it gets its
        ClusterLoadAssignment, but it does not ask again for an assignment it already
        subscribes to. Unless the server sends it, the new cluster waits for the initial-fetch
        timeout (15 s) before it serves, and the old one serves meanwhile: a hot reload that
        changed a load balancer took 15 s to apply. Sent after the clusters, so the new ones
        receive it (Istio pushes endpoints after every cluster push for the same reason).
        """
        sub = stream.subs.get(ENDPOINT)
        clusters = snapshot.type(CLUSTER)
        endpoints = snapshot.type(ENDPOINT)
        if clusters_before is None or sub is None or sub.sent is not endpoints:
            return
        names = frozenset(
            n
            for n in clusters.needed_by_changes(clusters_before, ENDPOINT)
            if sub.wants(n) and n in endpoints.resources
        )
        if names:
            await self.resend(stream, sub, endpoints, snapshot, names)

    def identify(self, stream: Stream, node: base_pb2.Node, present: bool) -> None:
        """On the first request: check who the stream is and start watching its snapshot."""
        if stream.group:
            return
        group, node_id = self.auth.identify(node, present, stream.authorization)
        stream.group = group
        stream.status.node_id = node_id
        stream.status.group = group
        self.cache.watch(group, stream.notify)
        log.info(
            "proxy connected",
            extra={"node": node_id, "workload": group, "protocol": stream.protocol},
        )
        if self.cache.get(group) is None:
            log.warning("no configuration for workload %r yet; the proxy waits", group)

    @staticmethod
    def assemble(ts: TypeSnapshot, key: object, build: Callable[[str], bytes]) -> tuple[str, bytes]:
        """(nonce, bytes) of a response: shared by every stream asking with the same `key`
        (memoised on the TypeSnapshot), or built for this stream alone when `key` is None."""
        if key is not None:
            return ts.response(key, build)
        nonce = next_nonce()
        return nonce, build(nonce)

    async def send(
        self,
        stream: Stream,
        sub: Subscription,
        ts: TypeSnapshot,
        snapshot: Snapshot,
        nonce: str,
        data: bytes,
        count: int,
    ) -> None:
        sub.on_sent(ts, nonce, count, snapshot.published_at)
        self.recorder.pushed(ts.type_url, stream.protocol, len(data))
        stream.responses += 1
        if len(data) < WriteBudget.SMALL:  # the common push: no coroutine in between
            await stream.context.write(data)
        else:
            await self.budget.write(stream.context, data)

    def reply(self, stream: Stream, sub: Subscription, error: str | None, version: str) -> None:
        """The client answered our latest response: ACK (`error` None) or NACK."""
        published = sub.on_reply(error, version)
        self.recorder.replied(stream.status.node_id, sub, error, published)

    async def serve(self, stream: Stream, requests: AsyncIterator[bytes]) -> None:
        """Run the stream until the client closes it or breaks the protocol."""
        reader = asyncio.create_task(self._read(requests, stream))
        try:
            while True:
                stream.busy = False
                await stream.wake.wait()
                stream.busy = True
                stream.wake.clear()
                while stream.inbox:
                    request = stream.inbox.popleft()
                    if len(stream.inbox) < INBOX_HIGH_WATER // 2:
                        stream.room.set()
                    try:
                        await self.on_request(stream, request)
                    except ProtocolError as exc:
                        stream.error = exc
                        break
                    except DecodeError:  # a part parsed lazily (SotW: node, names, error detail)
                        stream.error = malformed()
                        break
                if stream.error is not None:
                    self.recorder.ended(stream.error, stream.status.node_id, stream.peer)
                    await stream.context.abort(stream.error.code, stream.error.message)
                if stream.closed and not stream.inbox:
                    return
                if stream.dirty:
                    stream.dirty = False
                    snapshot = self.cache.get(stream.group)
                    if snapshot is not None:
                        await self.push(stream, snapshot)
        finally:
            reader.cancel()
            if stream.group:
                self.cache.unwatch(stream.group, stream.notify)
                log.info("proxy disconnected", extra={"node": stream.status.node_id})

    async def _read(self, requests: AsyncIterator[bytes], stream: Stream) -> None:
        try:
            async for raw in requests:
                stream.requests += 1
                try:
                    request = self.parse(raw)
                except DecodeError:
                    stream.error = malformed()
                    return
                stream.inbox.append(request)
                stream.wake.set()
                if len(stream.inbox) >= INBOX_HIGH_WATER:
                    stream.room.clear()
                    await stream.room.wait()
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.RpcError):
            pass
        finally:
            stream.closed = True
            stream.wake.set()
