"""One stream's protocol state for one resource type, modelled on go-control-plane's
`pkg/server/stream/v3/subscription.go`.

A `Subscription` knows what the client asked for (names, wildcard or not), what it was last
brought to (`sent`, and for Delta the version of every resource it holds), which response it
must answer next (nonces) and what it answered (its `TypeStatus`). It does no I/O: the SotW and
Delta handlers (sotw.py, delta.py) decide what to send from it, so the protocol's subtleties live
and are tested here (tests/xds/test_subscription.py).

Spec: https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol (section anchors below).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Literal

import grpc

from .cache import Names, TypeSnapshot
from .names import CLUSTER, LISTENER
from .protocol import MAX_NONCE_CHARS, ProtocolError
from .status import Nack, TypeStatus

WILDCARD = "*"
# Listener and Cluster are the roots of Envoy's configuration tree: the only types whose empty
# subscription means "everything" (#how-the-client-specifies-what-resources-to-return).
WILDCARD_TYPES = frozenset({LISTENER, CLUSTER})

Intern = Callable[[Names], Names]
NonceClass = Literal["current", "stale"]


class Subscription:
    """See the module docstring; one per stream and type URL."""

    __slots__ = (
        "_held",
        "_known",
        "fingerprint",
        "first_nonce",
        "last_nonce",
        "legacy_wildcard",
        "names",
        "pending_since",
        "sent",
        "status",
        "type_url",
        "wildcard",
    )

    def __init__(self, type_url: str) -> None:
        self.type_url = type_url
        # Subscribed to everything: explicitly ("*") or by the legacy rule (set_sotw_names).
        self.wildcard = False
        # The legacy rule still applies: the client has never named a resource of this type.
        self.legacy_wildcard = type_url in WILDCARD_TYPES
        self.names: Names = frozenset()  # explicitly subscribed names (never "*"), interned
        self.fingerprint: bytes | None = None  # SotW: the last request's names, as raw bytes
        self.sent: TypeSnapshot | None = None  # the version the client was last brought to
        # Delta: what the client holds, name -> version. Usually it is exactly the wanted
        # resources of one TypeSnapshot (`_held`), shared by every stream on it, so no per-stream
        # dict is kept (two thousand entries per stream for CDS+EDS were most of a stream's
        # memory); `_known` is the explicit dict otherwise (see `known` and `returned`).
        self._known: dict[str, str] | None = {}
        self._held: TypeSnapshot | None = None
        self.first_nonce = 0
        self.last_nonce = ""
        self.pending_since = 0.0  # published_at of the snapshot awaiting ACK (0: none)
        self.status = TypeStatus()

    def wants(self, name: str) -> bool:
        return self.wildcard or name in self.names

    def held(self, ts: TypeSnapshot) -> int:
        """How many resources of `ts` the client holds once it is current (for status)."""
        return len(ts) if self.wildcard else ts.count(self.names)

    @property
    def known(self) -> dict[str, str]:
        """Delta: name -> version of every resource the client holds (built on demand from the
        shared snapshot when compact; callers may change the dict it returns)."""
        if self._known is None:
            held = self._held
            assert held is not None
            self._known = {n: r.version for n, r in held.resources.items() if self.wants(n)}
            self._held = None
        return self._known

    @known.setter
    def known(self, value: dict[str, str]) -> None:
        self._known, self._held = value, None

    def holds_nothing(self) -> bool:
        return self._known is not None and not self._known

    def known_count(self) -> int:
        """How many resources the client holds (for status), without building `known`."""
        if self._known is None:
            assert self._held is not None
            return self.held(self._held)
        return len(self._known)

    # ------------------------------------------------------------------ what the client wants

    def set_sotw_names(self, requested: Collection[str], intern: Intern) -> Names | None:
        """Apply a SotW request's `resource_names` (the whole set it wants, every time).

        Returns the names that were not subscribed before, or None when the subscription did not
        change. #how-the-client-specifies-what-resources-to-return: for LDS and CDS, a client
        that has never named a resource is subscribed to "*" (the legacy wildcard), so an empty
        first request means everything; once it has named one (even "*" itself), an empty list
        means nothing (#unsubscribing-from-resources). "*" may appear beside names: both hold.
        """
        wanted = frozenset(requested)
        if self.legacy_wildcard and not wanted:
            wildcard = True
        else:
            self.legacy_wildcard = False
            wildcard = WILDCARD in wanted
        names = intern(wanted - {WILDCARD})
        if names is self.names and wildcard == self.wildcard:
            return None
        added = names - self.names
        self.names, self.wildcard = names, wildcard
        return added

    def start_delta(self, subscribe: Collection[str], initial: Mapping[str, str]) -> None:
        """The first Delta request for this type on a stream.

        `initial` is `initial_resource_versions`: what a reconnecting client already holds
        (#incremental-xds). They seed `known`, so only what differs is sent, and names it holds
        that no longer exist are reported removed. In Delta the legacy wildcard can only start
        here: an empty `resource_names_subscribe` on the first request for LDS/CDS.
        """
        self.known = dict(initial)
        self.wildcard = self.legacy_wildcard and not subscribe
        self.legacy_wildcard = False

    def update_delta(
        self, subscribe: Collection[str], unsubscribe: Collection[str], intern: Intern
    ) -> None:
        """Apply a Delta request's (un)subscriptions, which are incremental (#incremental-xds).

        Naming a resource while wildcard keeps the wildcard (the spec's example); only
        unsubscribing "*" ends it. A name unsubscribed while still covered by the wildcard is
        marked unknown rather than forgotten, so the next reconcile either sends it again or
        reports it removed: the client must learn which (go-control-plane does the same).
        Afterwards the client is reconciled against the whole snapshot (`sent` is cleared).
        """
        known = self.known  # built before the names change: it is what the client holds now
        names = set(self.names)
        for name in subscribe:
            if name == WILDCARD:
                self.wildcard = True
            else:
                names.add(name)
        for name in unsubscribe:
            if name == WILDCARD:
                self.wildcard = False
            elif self.wildcard and name in names:
                names.discard(name)
                known[name] = ""  # never a real version: forces an update or a removal
            else:
                names.discard(name)
                known.pop(name, None)
        self.names = intern(frozenset(names))
        self.sent = None

    def delta_changes(self, ts: TypeSnapshot) -> tuple[Names, Names]:
        """(changed or added, removed) names this client must be told about to hold `ts`.

        From the last version sent, a memoised diff (shared by every stream on that version);
        otherwise, after a subscription change or on a new stream, against what it holds.
        """
        if self.sent is not None:
            changed, removed = ts.diff_from(self.sent)
            if not self.wildcard:
                changed &= self.names
                removed &= self.names
            return changed, removed
        candidates = (
            ts.resources
            if self.wildcard
            else {n: ts.resources[n] for n in self.names if n in ts.resources}
        )
        known = self.known
        changed = frozenset(n for n, r in candidates.items() if known.get(n) != r.version)
        removed = frozenset(n for n in known if n not in ts.resources and self.wants(n))
        return changed, removed

    def returned(self, ts: TypeSnapshot, changed: Names, removed: Names) -> None:
        """Delta: the client is being sent `changed` and told `removed` (its resource hints).

        Afterwards it holds every wanted resource of `ts` at its version; when it holds nothing
        else, that is all there is to know, and the state becomes compact again.
        """
        if self._known is None:
            # Compact and brought from `sent` by a diff within what it wants: still exact.
            self._held = ts
            return
        known = self._known
        for name in changed:
            known[name] = ts.resources[name].version
        for name in removed:
            known.pop(name, None)
        if len(known) == self.held(ts):  # every entry is a wanted resource of `ts`
            self._known, self._held = None, ts

    def caught_up(self, ts: TypeSnapshot) -> None:
        """Delta: nothing the client wants changed up to `ts`; it is current without a
        response (and a compact state moves on, not pinning an old snapshot)."""
        self.sent = ts
        if self._known is None:
            self._held = ts

    # ------------------------------------------------------------------ responses and replies

    def classify_nonce(self, nonce: str) -> NonceClass:
        """Is a request's `response_nonce` the reply to our latest response, or stale?

        Only a reply to the latest response is an ACK or NACK (#ack-and-nack-semantics-summary);
        a request carrying an older nonce crossed a newer response on the wire and must not be
        answered (#when-to-send-an-update). A nonce this stream never received for this type is
        not in the spec: it is a confused or hostile client, and ends the stream.
        """
        if nonce == self.last_nonce:
            return "current"
        try:
            value = int(nonce, 16) if len(nonce) <= MAX_NONCE_CHARS else -1
        except ValueError:
            value = -1
        last = int(self.last_nonce, 16) if self.last_nonce else 0
        # Nonces are one global counter: every nonce below the latest that is at least the
        # first one this stream got for this type is at worst another stream's, equally stale.
        if self.first_nonce and self.first_nonce <= value < last:
            return "stale"
        raise ProtocolError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"response_nonce {nonce[:40]!r} was never sent on this stream for {self.type_url}",
            "bad_nonce",
        )

    def on_sent(self, ts: TypeSnapshot, nonce: str, count: int, published_at: float) -> None:
        """A response bringing the client to `ts` goes out; it now awaits the reply to `nonce`."""
        self.sent = ts
        self.last_nonce = nonce
        if not self.first_nonce:
            self.first_nonce = int(nonce, 16)
        self.pending_since = published_at
        status = self.status
        status.sent_version = ts.version
        status.sent_nonce = nonce
        status.sent_at = time.time()
        status.resources = count

    def on_reply(self, error: str | None, version: str) -> float:
        """Record the ACK (no `error`) or NACK of the latest response.

        #nack: the client keeps its last good configuration, so a NACK leaves `acked` where it
        was (SotW says which version that is in `version_info`) and `sent` where it is: the
        refused version is not sent again, only a newer one. Returns when the ACKed snapshot was
        published (0.0 for a NACK or if unknown), for the push-latency metric.
        """
        status = self.status
        now = time.time()
        published = 0.0
        if error is not None:
            status.last_nack = Nack(version=status.sent_version, error=error, at=now)
            if version:
                status.acked_version = version
        else:
            status.acked_version = status.sent_version
            status.acked_at = now
            published = self.pending_since
        self.pending_since = 0.0
        return published

    def already_current(self, ts: TypeSnapshot) -> None:
        """SotW: a (re)connecting client says in `version_info` that it runs `ts` already (e.g.
        after a control-plane restart: versions are content hashes): nothing to send."""
        self.sent = ts
        self.status.sent_version = self.status.acked_version = ts.version
        self.status.resources = self.held(ts)
