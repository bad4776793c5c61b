"""Incremental ADS (DeltaAggregatedResources): clients (un)subscribe by difference and responses
carry only changed resources and the names of removed ones (#incremental-xds).

What each client holds is tracked per resource (Subscription.known), seeded on a new stream by
the client's `initial_resource_versions`: with content-hash versions, an Envoy reconnecting to a
restarted control plane is sent only what actually changed. Delta ACKs are small, so unlike SotW
they are parsed in full.
"""

from __future__ import annotations

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from . import wire
from .cache import Names, Snapshot, TypeSnapshot
from .names import CLUSTER, PUSH_ORDER
from .protocol import MAX_NAMES_PER_REQUEST, ProtocolError, check_names, check_type
from .stream import Handler, Stream
from .subscription import Subscription


class DeltaHandler(Handler):
    protocol = "delta"

    def parse(self, raw: bytes) -> discovery_pb2.DeltaDiscoveryRequest:
        return discovery_pb2.DeltaDiscoveryRequest.FromString(raw)

    async def on_request(
        self, stream: Stream, request: discovery_pb2.DeltaDiscoveryRequest
    ) -> None:
        self.identify(stream, request.node, request.HasField("node"))
        type_url = request.type_url
        check_type(type_url)
        subscribe = request.resource_names_subscribe
        unsubscribe = request.resource_names_unsubscribe
        check_names(subscribe)
        check_names(unsubscribe)
        sub, first = stream.subscription(type_url)
        nonce = request.response_nonce
        # A stale nonce is no ACK, but Delta (un)subscriptions are changes, not a whole state:
        # they apply whatever the nonce.
        if nonce and sub.classify_nonce(nonce) == "current":
            error = request.error_detail.message if request.HasField("error_detail") else None
            self.reply(stream, sub, error, "")
        if first:
            if len(request.initial_resource_versions) > MAX_NAMES_PER_REQUEST:
                raise ProtocolError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "too many initial_resource_versions",
                    "too_many_names",
                )
            sub.start_delta(subscribe, request.initial_resource_versions)
        if not (first or subscribe or unsubscribe):
            return  # a bare ACK or NACK
        sub.update_delta(subscribe, unsubscribe, self.cache.intern)
        snapshot = self.cache.get(stream.group)
        if snapshot is not None:
            # The first request is always answered, even when the client holds everything, so
            # it knows the server has seen its subscription.
            await self._reconcile(stream, sub, snapshot, force=first)

    async def push(self, stream: Stream, snapshot: Snapshot) -> None:
        for type_url in PUSH_ORDER:
            sub = stream.subs.get(type_url)
            if sub is None or sub.sent is snapshot.type(type_url):
                continue
            before = sub.sent
            await self._reconcile(stream, sub, snapshot)
            if type_url == CLUSTER:
                await self.rewarm(stream, snapshot, before)

    async def resend(
        self, stream: Stream, sub: Subscription, ts: TypeSnapshot, snapshot: Snapshot, names: Names
    ) -> None:
        await self._respond(stream, sub, ts, snapshot, ("delta-again", names), names, frozenset())

    async def _reconcile(
        self, stream: Stream, sub: Subscription, snapshot: Snapshot, force: bool = False
    ) -> None:
        ts = snapshot.type(sub.type_url)
        # From a version sent before, the response is the same for every stream on it (with the
        # same names): share it; so is the first one to a client that holds nothing (a fleet
        # connecting at once would otherwise build, and hold in flight, one copy per stream).
        # After any other subscription change it is this stream's own.
        names = None if sub.wildcard else sub.names
        key: object = (
            ("delta-diff", sub.sent.version, names)
            if sub.sent is not None
            else ("delta-fresh", names)
            if sub.holds_nothing()
            else None
        )
        changed, removed = sub.delta_changes(ts)
        if not changed and not removed and not force:
            sub.caught_up(ts)
            return
        sub.returned(ts, changed, removed)
        await self._respond(stream, sub, ts, snapshot, key, changed, removed)

    async def _respond(
        self,
        stream: Stream,
        sub: Subscription,
        ts: TypeSnapshot,
        snapshot: Snapshot,
        key: object,
        changed: Names,
        removed: Names,
    ) -> None:
        nonce, data = self.assemble(
            ts,
            key,
            lambda nonce: wire.delta_response(
                ts.version,
                b"".join(ts.resources[n].delta_entry for n in sorted(changed)),
                ts.type_url,
                sorted(removed),
                nonce,
            ),
        )
        await self.send(stream, sub, ts, snapshot, nonce, data, sub.known_count())
