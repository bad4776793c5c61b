"""Prometheus counters and log lines for what the ADS streams do.

The per-stream record (`TypeStatus`, behind `meshfn status`) is kept by each Subscription; this
module counts across streams. Labelled metric children are resolved once per server: `labels()`
costs microseconds, and a push to a thousand proxies would pay it a thousand times per type.
"""

from __future__ import annotations

import logging
import time

from .names import PUSH_ORDER, SHORT_NAMES
from .protocol import ProtocolError
from .status import Metrics
from .subscription import Subscription

log = logging.getLogger("meshfn.xds")

PROTOCOLS = ("sotw", "delta")


class Recorder:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = m = metrics
        self._pushes = {
            (t, p): (m.pushes.labels(SHORT_NAMES[t], p), m.push_bytes.labels(SHORT_NAMES[t]))
            for t in PUSH_ORDER
            for p in PROTOCOLS
        }
        self._replies = {
            t: (
                m.acks.labels(SHORT_NAMES[t]),
                m.nacks.labels(SHORT_NAMES[t]),
                m.push_latency.labels(SHORT_NAMES[t]),
            )
            for t in PUSH_ORDER
        }
        self._connected = {p: m.connected.labels(p) for p in PROTOCOLS}

    def opened(self, protocol: str) -> None:
        self._connected[protocol].inc()

    def closed(self, protocol: str) -> None:
        self._connected[protocol].dec()

    def pushed(self, type_url: str, protocol: str, size: int) -> None:
        pushes, push_bytes = self._pushes[(type_url, protocol)]
        pushes.inc()
        push_bytes.inc(size)

    def replied(self, node_id: str, sub: Subscription, error: str | None, published: float) -> None:
        """After `sub.on_reply`: count the ACK (and how long it took since the snapshot was
        published) or count and log the NACK with Envoy's reason."""
        acks, nacks, latency = self._replies[sub.type_url]
        if error is not None:
            nacks.inc()
            log.warning(
                "NACK from %s for %s version %s: %s",
                node_id,
                SHORT_NAMES[sub.type_url],
                sub.status.sent_version,
                error,
            )
            return
        acks.inc()
        if published:
            latency.observe(time.monotonic() - published)

    def ended(self, error: ProtocolError, node_id: str, peer: str) -> None:
        self.metrics.stream_errors.labels(error.reason).inc()
        log.warning("ending ADS stream: %s", error.message, extra={"node": node_id, "peer": peer})
