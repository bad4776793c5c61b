"""ADS server (grpc.aio): state-of-the-world and incremental (delta) aggregated discovery.

Protocol reference: https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol

Each stream keeps, per type, one small `Subscription` (what the client asked for, what it was last
sent, what it has ACKed), as go-control-plane does. Responses are pre-assembled bytes from the
snapshot cache, written through a generic handler with an identity serializer; requests arrive as
bytes and are parsed here, so a malformed message ends only its own stream, with INVALID_ARGUMENT.

Protocol points worth knowing (xds_protocol, "ACK/NACK and resource type instance version",
"When to send an update", "Resource warming", "Incremental xDS"):
- SotW LDS and CDS are "state of the world": every response carries the full set. EDS and RDS are
  not: a response need only carry the resources that changed, so we send the diff.
- A request whose response_nonce is not the latest one sent for its type is stale: it must not be
  treated as an ACK or NACK (SotW: ignored entirely). Delta subscription changes are incremental
  and are applied whatever the nonce.
- A NACK keeps the proxy on its last good config; we record error_detail and do not resend the
  same version.
- Make-before-break: within one push, types go out in PUSH_ORDER (endpoints before clusters,
  routes before listeners), and newly subscribed names are answered at once, so a warming
  cluster never waits for the 15 s initial-fetch timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from . import wire
from .cache import Names, Snapshot, SnapshotCache, TypeSnapshot, next_nonce
from .lite import RequestHead, names_key
from .names import CLUSTER, LISTENER, PUSH_ORDER, SHORT_NAMES
from .status import Metrics, Nack, ProxyStatus, TypeStatus

log = logging.getLogger("meshfn.xds")

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[bytes, bytes]
else:
    Context = grpc.aio.ServicerContext

SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
SUPPORTED_TYPES = frozenset(PUSH_ORDER)
# Types where an empty first subscription means "everything" (legacy wildcard).
WILDCARD_TYPES = frozenset({LISTENER, CLUSTER})
MAX_NAMES_PER_REQUEST = 100_000
MAX_NAME_BYTES = 4096
MAX_NONCE_CHARS = 32
INBOX_HIGH_WATER = 64

_stream_ids = itertools.count(1)


class ProtocolError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


class Subscription:
    """One stream's protocol state for one resource type."""

    __slots__ = (
        "fingerprint",
        "first_nonce",
        "known",
        "last_nonce",
        "names",
        "pending_since",
        "sent",
        "status",
        "type_url",
        "wildcard",
    )

    def __init__(self, type_url: str) -> None:
        self.type_url = type_url
        self.wildcard = False
        self.names: Names = frozenset()
        self.fingerprint: bytes | None = None  # SotW: the last request's names, as bytes
        self.sent: TypeSnapshot | None = None  # the version the client was last brought to
        self.known: dict[str, str] = {}  # Delta: name -> version the client holds
        self.first_nonce = 0
        self.last_nonce = ""
        self.pending_since = 0.0  # published_at of the snapshot awaiting ACK (0: none)
        self.status = TypeStatus()

    def wants(self, name: str) -> bool:
        return self.wildcard or name in self.names

    def classify_nonce(self, nonce: str) -> str:
        """'current' (ACK/NACK of the latest response), 'stale', or raise for a nonce this
        server never sent on this stream."""
        if nonce == self.last_nonce:
            return "current"
        try:
            value = int(nonce, 16) if len(nonce) <= MAX_NONCE_CHARS else -1
        except ValueError:
            value = -1
        last = int(self.last_nonce, 16) if self.last_nonce else 0
        if self.first_nonce and self.first_nonce <= value < last:
            return "stale"
        raise ProtocolError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"response_nonce {nonce[:40]!r} was never sent on this stream for {self.type_url}",
            "bad_nonce",
        )


class Stream:
    """One ADS stream: its node, subscriptions, and an inbox fed by the reader task."""

    def __init__(self, protocol: str, peer: str) -> None:
        self.id = next(_stream_ids)
        self.protocol = protocol
        self.peer = peer
        self.group = ""
        self.subs: dict[str, Subscription] = {}
        self.inbox: deque[Any] = deque()
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.dirty = False
        self.closed = False
        self.error: ProtocolError | None = None
        self.authorization: str | None = None
        self.status = ProxyStatus(
            stream_id=self.id, node_id="", group="", protocol=protocol, peer=peer
        )

    def notify(self) -> None:
        self.dirty = True
        self.wake.set()


def _identity(data: bytes) -> bytes:
    return data


def _parse_head(raw: bytes) -> tuple[bytes, Any]:
    return raw, RequestHead.FromString(raw)


Authenticator = Callable[[str, str | None], bool]


class AdsServer:
    """`authenticate(node_cluster, authorization_metadata)` decides whether a stream may have
    the configuration (and private keys) of the workload it claims to be; None trusts anyone
    (tests of the protocol alone)."""

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: Metrics | None = None,
        authenticate: Authenticator | None = None,
    ) -> None:
        self.cache = cache
        self.metrics = metrics or Metrics()
        self.authenticate = authenticate
        self._extra_handlers: list[grpc.GenericRpcHandler] = []
        self._streams: dict[int, Stream] = {}
        self._server: grpc.aio.Server | None = None
        # Labelled metric children, resolved once: labels() costs microseconds per call.
        m = self.metrics
        self._push_metrics = {
            (t, p): (m.pushes.labels(SHORT_NAMES[t], p), m.push_bytes.labels(SHORT_NAMES[t]))
            for t in PUSH_ORDER
            for p in ("sotw", "delta")
        }
        self._ack_metrics = {
            t: (
                m.acks.labels(SHORT_NAMES[t]),
                m.nacks.labels(SHORT_NAMES[t]),
                m.push_latency.labels(SHORT_NAMES[t]),
            )
            for t in PUSH_ORDER
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self, address: str = "127.0.0.1", port: int = 0) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                ("grpc.max_concurrent_streams", 100_000),
                # Large fleets reconnect at once after a restart: let calls wait for the
                # handler instead of being dropped by grpc-core (FACTS.md, fan-out ceiling).
                ("grpc.server_max_unrequested_time_in_server", 3600),
            ],
            maximum_concurrent_rpcs=None,
        )
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
                    self._sotw, request_deserializer=_identity, response_serializer=_identity
                ),
                "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
                    self._delta, request_deserializer=_identity, response_serializer=_identity
                ),
            },
        )
        server.add_generic_rpc_handlers((handler, *self._extra_handlers))
        bound = server.add_insecure_port(f"{address}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind the ADS server to {address}:{port}")
        await server.start()
        self._server = server
        log.info("ADS listening", extra={"address": f"{address}:{bound}"})
        return bound

    def add_handler(self, handler: grpc.GenericRpcHandler) -> None:
        """Serve another gRPC service on the ADS port (call before start)."""
        self._extra_handlers.append(handler)

    def is_connected(self, node_id: str) -> bool:
        return any(s.status.node_id == node_id for s in self._streams.values())

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    def proxies(self) -> list[dict[str, Any]]:
        return [
            s.status.as_dict(known_group=self.cache.get(s.group) is not None)
            for s in sorted(self._streams.values(), key=lambda s: (s.group, s.status.node_id, s.id))
            if s.group
        ]

    # ------------------------------------------------------------------ stream plumbing

    async def _sotw(self, requests: AsyncIterator[bytes], context: Context) -> None:
        await self._run(
            "sotw",
            requests,
            context,
            _parse_head,
            self._on_sotw_request,
            self._push_sotw,
        )

    async def _delta(self, requests: AsyncIterator[bytes], context: Context) -> None:
        await self._run(
            "delta",
            requests,
            context,
            discovery_pb2.DeltaDiscoveryRequest.FromString,
            self._on_delta_request,
            self._push_delta,
        )

    async def _run(
        self,
        protocol: str,
        requests: AsyncIterator[bytes],
        context: Context,
        parse: Callable[[bytes], Any],
        on_request: Callable[[Stream, Any, Context], Any],
        push: Callable[[Stream, Snapshot, Context], Any],
    ) -> None:
        stream = Stream(protocol, context.peer())
        stream.authorization = next(
            (str(v) for k, v in context.invocation_metadata() or () if k == "authorization"), None
        )
        self._streams[stream.id] = stream
        self.metrics.connected.labels(protocol).inc()
        reader = asyncio.create_task(self._read(requests, stream, parse))
        try:
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                while stream.inbox:
                    request = stream.inbox.popleft()
                    if len(stream.inbox) < INBOX_HIGH_WATER // 2:
                        stream.room.set()
                    try:
                        await on_request(stream, request, context)
                    except ProtocolError as exc:
                        stream.error = exc
                        break
                if stream.error is not None:
                    self.metrics.stream_errors.labels(stream.error.reason).inc()
                    log.warning(
                        "ending ADS stream: %s",
                        stream.error.message,
                        extra={"node": stream.status.node_id, "peer": stream.peer},
                    )
                    await context.abort(stream.error.code, stream.error.message)
                if stream.closed and not stream.inbox:
                    return
                if stream.dirty:
                    stream.dirty = False
                    snapshot = self.cache.get(stream.group)
                    if snapshot is not None:
                        await push(stream, snapshot, context)
        finally:
            reader.cancel()
            self._streams.pop(stream.id, None)
            self.metrics.connected.labels(protocol).dec()
            if stream.group:
                self.cache.unwatch(stream.group, stream.notify)
                log.info("proxy disconnected", extra={"node": stream.status.node_id})

    @staticmethod
    async def _read(
        requests: AsyncIterator[bytes], stream: Stream, parse: Callable[[bytes], Any]
    ) -> None:
        try:
            async for raw in requests:
                try:
                    request = parse(raw)
                except DecodeError:
                    stream.error = ProtocolError(
                        grpc.StatusCode.INVALID_ARGUMENT, "malformed discovery request", "malformed"
                    )
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

    def _identify(self, stream: Stream, node: base_pb2.Node, present: bool) -> None:
        if stream.group:
            return
        if not present or not (node.id or node.cluster):
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first request on a stream must carry node (id and cluster)",
                "no_node",
            )
        group = node.cluster or node.id.split("~", 1)[0]
        if len(group) > 256 or len(node.id) > 1024:
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT, "node id or cluster too long", "bad_node"
            )
        if self.authenticate is not None and not self.authenticate(group, stream.authorization):
            raise ProtocolError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"no valid bootstrap token for workload {group[:100]!r}",
                "unauthenticated",
            )
        stream.group = group
        stream.status.node_id = node.id or group
        stream.status.group = group
        self.cache.watch(group, stream.notify)
        log.info(
            "proxy connected",
            extra={"node": stream.status.node_id, "workload": group, "protocol": stream.protocol},
        )
        if self.cache.get(group) is None:
            log.warning("no configuration for workload %r yet; the proxy waits", group)

    @staticmethod
    def _check_type(type_url: str) -> None:
        if type_url not in SUPPORTED_TYPES:
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unsupported type_url {type_url[:200]!r}; served: "
                + ", ".join(SHORT_NAMES[t] for t in PUSH_ORDER),
                "bad_type",
            )

    @staticmethod
    def _check_names(names: Any) -> None:
        if len(names) > MAX_NAMES_PER_REQUEST:
            raise ProtocolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(names)} resource names in one request (limit {MAX_NAMES_PER_REQUEST})",
                "too_many_names",
            )
        if max(map(len, names), default=0) > MAX_NAME_BYTES:
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resource name longer than {MAX_NAME_BYTES} bytes",
                "bad_name",
            )

    def _subscription(self, stream: Stream, type_url: str) -> tuple[Subscription, bool]:
        sub = stream.subs.get(type_url)
        if sub is not None:
            return sub, False
        sub = stream.subs[type_url] = Subscription(type_url)
        stream.status.types[type_url] = sub.status
        return sub, True

    def _ack_or_nack(
        self, stream: Stream, sub: Subscription, error: str | None, version: str
    ) -> None:
        status = sub.status
        now = time.time()
        label = SHORT_NAMES[sub.type_url]
        acks, nacks, latency = self._ack_metrics[sub.type_url]
        if error is not None:
            status.last_nack = Nack(version=status.sent_version, error=error, at=now)
            nacks.inc()
            log.warning(
                "NACK from %s for %s version %s: %s",
                stream.status.node_id,
                label,
                status.sent_version,
                error,
            )
            if version:
                status.acked_version = version
        else:
            status.acked_version = status.sent_version
            status.acked_at = now
            acks.inc()
            if sub.pending_since:
                latency.observe(time.monotonic() - sub.pending_since)
        sub.pending_since = 0.0

    async def _send(
        self,
        stream: Stream,
        sub: Subscription,
        ts: TypeSnapshot,
        snapshot: Snapshot,
        nonce: str,
        data: bytes,
        count: int,
        context: Context,
    ) -> None:
        sub.sent = ts
        sub.last_nonce = nonce
        if not sub.first_nonce:
            sub.first_nonce = int(nonce, 16)
        sub.pending_since = snapshot.published_at
        status = sub.status
        status.sent_version = ts.version
        status.sent_nonce = nonce
        status.sent_at = time.time()
        status.resources = count
        pushes, push_bytes = self._push_metrics[(ts.type_url, stream.protocol)]
        pushes.inc()
        push_bytes.inc(len(data))
        await context.write(data)

    # ------------------------------------------------------------------ state of the world

    async def _on_sotw_request(
        self, stream: Stream, item: tuple[bytes, Any], context: Context
    ) -> None:
        raw, head = item
        if not stream.group:
            node = base_pb2.Node.FromString(head.node) if head.node else base_pb2.Node()
            self._identify(stream, node, bool(head.node))
        type_url = head.type_url
        self._check_type(type_url)
        sub, _ = self._subscription(stream, type_url)
        nonce = head.response_nonce
        if nonce:
            if sub.classify_nonce(nonce) == "stale":
                return
            error = (
                status_pb2.Status.FromString(head.error_detail).message
                if head.error_detail
                else None
            )
            self._ack_or_nack(stream, sub, error, head.version_info)
        version_info = head.version_info
        fingerprint = names_key(raw, head)
        first = sub.fingerprint is None
        if fingerprint == sub.fingerprint:
            return
        sub.fingerprint = fingerprint
        request = discovery_pb2.DiscoveryRequest.FromString(raw)
        self._check_names(request.resource_names)
        names = frozenset(request.resource_names)
        if not first and self.cache.intern(names - {"*"}) is sub.names:
            return  # same names, differently serialised
        old_names = sub.names
        sub.wildcard = "*" in names or (type_url in WILDCARD_TYPES and not names)
        sub.names = self.cache.intern(names - {"*"})
        snapshot = self.cache.get(stream.group)
        if snapshot is None:
            return
        ts = snapshot.type(type_url)
        if first and not nonce and version_info == ts.version:
            # A reconnecting proxy that already runs this exact version (e.g. after a control
            # plane restart): nothing to send.
            sub.sent = ts
            sub.status.sent_version = sub.status.acked_version = ts.version
            sub.status.resources = len(ts) if sub.wildcard else ts.count(sub.names)
            return
        if first or sub.wildcard or type_url in WILDCARD_TYPES:
            await self._send_sotw_full(stream, sub, ts, snapshot, context)
        else:
            added = sub.names - old_names
            if added:
                await self._send_sotw_names(stream, sub, ts, snapshot, added, context)

    async def _send_sotw_full(
        self,
        stream: Stream,
        sub: Subscription,
        ts: TypeSnapshot,
        snapshot: Snapshot,
        context: Context,
    ) -> None:
        names = None if (sub.wildcard or ts.type_url in WILDCARD_TYPES) else sub.names
        if names is None:
            selected = list(ts.resources.values())
        else:
            selected = [ts.resources[n] for n in sorted(names) if n in ts.resources]
        nonce, data = ts.response(
            ("sotw-full", names),
            lambda nonce: wire.sotw_response(
                ts.version, b"".join(r.sotw_entry for r in selected), ts.type_url, nonce
            ),
        )
        await self._send(stream, sub, ts, snapshot, nonce, data, len(selected), context)

    async def _send_sotw_names(
        self,
        stream: Stream,
        sub: Subscription,
        ts: TypeSnapshot,
        snapshot: Snapshot,
        names: Names,
        context: Context,
        key: object = None,
    ) -> None:
        selected = [ts.resources[n] for n in sorted(names) if n in ts.resources]
        if not selected:
            sub.sent = ts
            return

        def build(nonce: str) -> bytes:
            return wire.sotw_response(
                ts.version, b"".join(r.sotw_entry for r in selected), ts.type_url, nonce
            )

        if key is not None:
            nonce, data = ts.response(key, build)
        else:
            nonce = next_nonce()
            data = build(nonce)
        count = len(ts) if sub.wildcard else ts.count(sub.names)
        await self._send(stream, sub, ts, snapshot, nonce, data, count, context)

    async def _push_sotw(self, stream: Stream, snapshot: Snapshot, context: Context) -> None:
        for type_url in PUSH_ORDER:
            sub = stream.subs.get(type_url)
            if sub is None or sub.fingerprint is None:
                continue
            ts = snapshot.type(type_url)
            previous = sub.sent
            if previous is ts:
                continue
            if previous is not None and previous.version == ts.version:
                sub.sent = ts
                continue
            if previous is None or sub.wildcard or type_url in WILDCARD_TYPES:
                await self._send_sotw_full(stream, sub, ts, snapshot, context)
                continue
            changed, _removed = ts.diff_from(previous)
            wanted = changed & sub.names
            if not wanted:
                # Nothing this proxy subscribes to changed: it is current as it stands.
                sub.sent = ts
                continue
            await self._send_sotw_names(
                stream,
                sub,
                ts,
                snapshot,
                wanted,
                context,
                key=("sotw-diff", previous.version, sub.names),
            )

    # ------------------------------------------------------------------ delta

    async def _on_delta_request(
        self,
        stream: Stream,
        request: discovery_pb2.DeltaDiscoveryRequest,
        context: Context,
    ) -> None:
        self._identify(stream, request.node, request.HasField("node"))
        type_url = request.type_url
        self._check_type(type_url)
        self._check_names(request.resource_names_subscribe)
        self._check_names(request.resource_names_unsubscribe)
        sub, first = self._subscription(stream, type_url)
        nonce = request.response_nonce
        if nonce and sub.classify_nonce(nonce) == "current":
            error = request.error_detail.message if request.HasField("error_detail") else None
            self._ack_or_nack(stream, sub, error, "")
        subscribe = list(request.resource_names_subscribe)
        unsubscribe = list(request.resource_names_unsubscribe)
        if first:
            if len(request.initial_resource_versions) > MAX_NAMES_PER_REQUEST:
                raise ProtocolError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "too many initial_resource_versions",
                    "too_many_names",
                )
            sub.known = dict(request.initial_resource_versions)
            sub.wildcard = type_url in WILDCARD_TYPES and not subscribe
        if not (first or subscribe or unsubscribe):
            return
        names = set(sub.names)
        for name in subscribe:
            if name == "*":
                sub.wildcard = True
            else:
                names.add(name)
        for name in unsubscribe:
            if name == "*":
                sub.wildcard = False
            else:
                names.discard(name)
                sub.known.pop(name, None)
        sub.names = self.cache.intern(frozenset(names))
        sub.sent = None  # subscription changed: reconcile against the full snapshot
        snapshot = self.cache.get(stream.group)
        if snapshot is not None:
            await self._delta_reconcile(stream, sub, snapshot, context, force=first)

    async def _delta_reconcile(
        self,
        stream: Stream,
        sub: Subscription,
        snapshot: Snapshot,
        context: Context,
        force: bool = False,
    ) -> None:
        ts = snapshot.type(sub.type_url)
        if sub.sent is not None:
            changed, removed = ts.diff_from(sub.sent)
            if not sub.wildcard:
                changed &= sub.names
                removed &= sub.names
            key: object = ("delta-diff", sub.sent.version, None if sub.wildcard else sub.names)
        else:
            candidates = (
                ts.resources
                if sub.wildcard
                else {n: ts.resources[n] for n in sub.names if n in ts.resources}
            )
            changed = frozenset(n for n, r in candidates.items() if sub.known.get(n) != r.version)
            removed = frozenset(n for n in sub.known if n not in ts.resources and sub.wants(n))
            key = None
        if not changed and not removed and not force:
            sub.sent = ts
            return
        for name in changed:
            sub.known[name] = ts.resources[name].version
        for name in removed:
            sub.known.pop(name, None)

        def build(nonce: str) -> bytes:
            return wire.delta_response(
                ts.version,
                b"".join(ts.resources[n].delta_entry for n in sorted(changed)),
                ts.type_url,
                sorted(removed),
                nonce,
            )

        if key is not None:
            nonce, data = ts.response(key, build)
        else:
            nonce = next_nonce()
            data = build(nonce)
        await self._send(stream, sub, ts, snapshot, nonce, data, len(sub.known), context)

    async def _push_delta(self, stream: Stream, snapshot: Snapshot, context: Context) -> None:
        for type_url in PUSH_ORDER:
            sub = stream.subs.get(type_url)
            if sub is None or sub.sent is snapshot.type(type_url):
                continue
            await self._delta_reconcile(stream, sub, snapshot, context)
