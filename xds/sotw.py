"""State-of-the-world ADS (StreamAggregatedResources): every request names the whole set a client
wants for a type, and every response carries a version of that type.

LDS and CDS responses carry the full set (meshfn's snapshots are per workload, so the set is the
workload's, whatever names are asked for). EDS and RDS responses need only carry what changed
(#grouping-resources-into-responses), so a push sends the diff and a new name is answered alone.

SotW ACKs repeat every subscribed name (50 KB for a thousand clusters); parsing and comparing
them dominated a one-endpoint push (FACTS.md, "ADS fan-out ceiling"). Requests are therefore
first parsed as a `RequestHead` without the names (lite.py), and the names are only parsed when
their raw bytes differ from the previous request's.
"""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from . import wire
from .cache import Names, Resource, Snapshot, TypeSnapshot
from .lite import RequestHead, names_key
from .names import CLUSTER, PUSH_ORDER
from .protocol import check_names, check_type
from .stream import Handler, Stream
from .subscription import WILDCARD_TYPES, Subscription


class SotwHandler(Handler):
    protocol = "sotw"

    def parse(self, raw: bytes) -> tuple[bytes, Any]:
        return raw, RequestHead.FromString(raw)

    async def on_request(self, stream: Stream, request: tuple[bytes, Any]) -> None:
        raw, head = request
        if not stream.group:
            node = base_pb2.Node.FromString(head.node) if head.node else base_pb2.Node()
            self.identify(stream, node, bool(head.node))
        type_url = head.type_url
        check_type(type_url)
        sub, _ = stream.subscription(type_url)
        nonce = head.response_nonce
        if nonce:
            if sub.classify_nonce(nonce) == "stale":
                return  # neither an ACK nor a new subscription: ignore it whole
            error = (
                status_pb2.Status.FromString(head.error_detail).message
                if head.error_detail
                else None
            )
            self.reply(stream, sub, error, head.version_info)
        fingerprint = names_key(raw, head)
        first = sub.fingerprint is None
        if fingerprint == sub.fingerprint:
            return  # an ACK naming what the last request named: the common case, cheap
        sub.fingerprint = fingerprint
        names = discovery_pb2.DiscoveryRequest.FromString(raw).resource_names
        check_names(names)
        added = sub.set_sotw_names(names, self.cache.intern)
        if added is None and not first:
            return  # same names, differently serialised
        snapshot = self.cache.get(stream.group)
        if snapshot is None:
            return
        ts = snapshot.type(type_url)
        if first and not nonce and head.version_info == ts.version:
            sub.already_current(ts)
            return
        if first or sub.wildcard or type_url in WILDCARD_TYPES:
            await self._send_full(stream, sub, ts, snapshot)
        elif added:
            # Newly named resources are answered at once, not at the next version: a warming
            # cluster would otherwise wait for its initial-fetch timeout (#resource-warming).
            await self._send_names(stream, sub, ts, snapshot, added)

    async def push(self, stream: Stream, snapshot: Snapshot) -> None:
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
                await self._send_full(stream, sub, ts, snapshot)
                if type_url == CLUSTER:
                    await self.rewarm(stream, snapshot, previous)
                continue
            changed, _removed = ts.diff_from(previous)
            wanted = changed & sub.names
            if not wanted:
                # Nothing this proxy subscribes to changed: it is current as it stands.
                sub.sent = ts
                continue
            await self._send_names(
                stream, sub, ts, snapshot, wanted, key=("sotw-diff", previous.version, sub.names)
            )

    async def resend(
        self, stream: Stream, sub: Subscription, ts: TypeSnapshot, snapshot: Snapshot, names: Names
    ) -> None:
        await self._send_names(stream, sub, ts, snapshot, names, key=("sotw-again", names))

    async def _send_full(
        self, stream: Stream, sub: Subscription, ts: TypeSnapshot, snapshot: Snapshot
    ) -> None:
        names = None if (sub.wildcard or ts.type_url in WILDCARD_TYPES) else sub.names
        if names is None:
            selected = list(ts.resources.values())
        else:
            selected = [ts.resources[n] for n in sorted(names) if n in ts.resources]
        await self._respond(
            stream, sub, ts, snapshot, selected, ("sotw-full", names), len(selected)
        )

    async def _send_names(
        self,
        stream: Stream,
        sub: Subscription,
        ts: TypeSnapshot,
        snapshot: Snapshot,
        names: Names,
        key: object = None,
    ) -> None:
        selected = [ts.resources[n] for n in sorted(names) if n in ts.resources]
        if not selected:
            sub.sent = ts
            return
        await self._respond(stream, sub, ts, snapshot, selected, key, sub.held(ts))

    async def _respond(
        self,
        stream: Stream,
        sub: Subscription,
        ts: TypeSnapshot,
        snapshot: Snapshot,
        selected: list[Resource],
        key: object,
        count: int,
    ) -> None:
        nonce, data = self.assemble(
            ts,
            key,
            lambda nonce: wire.sotw_response(
                ts.version, b"".join(r.sotw_entry for r in selected), ts.type_url, nonce
            ),
        )
        await self.send(stream, sub, ts, snapshot, nonce, data, count)
