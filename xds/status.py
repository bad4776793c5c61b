"""What each connected proxy was sent, ACKed and NACKed: the data behind `meshfn status`.

One `TypeStatus` per stream and type lives inside the stream's subscription state, so recording an
ACK is an attribute write; the registry only walks them when someone asks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .names import SHORT_NAMES


@dataclass
class Nack:
    version: str  # the version the proxy refused
    error: str
    at: float  # wall clock


@dataclass
class TypeStatus:
    sent_version: str = ""
    sent_nonce: str = ""
    sent_at: float = 0.0
    acked_version: str = ""
    acked_at: float = 0.0
    last_nack: Nack | None = None
    resources: int = 0  # how many resources the proxy holds (as far as we know)

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent_version,
            "acked": self.acked_version,
            "in_sync": bool(self.sent_version) and self.sent_version == self.acked_version,
            "resources": self.resources,
            "last_nack": None
            if self.last_nack is None
            else {
                "version": self.last_nack.version,
                "error": self.last_nack.error,
                "at": self.last_nack.at,
            },
        }


@dataclass
class ProxyStatus:
    stream_id: int
    node_id: str
    group: str
    protocol: str
    peer: str
    connected_at: float = field(default_factory=time.time)
    types: dict[str, TypeStatus] = field(default_factory=dict)

    def as_dict(self, known_group: bool) -> dict[str, Any]:
        return {
            "node": self.node_id,
            "workload": self.group,
            "known_workload": known_group,
            "protocol": self.protocol,
            "peer": self.peer,
            "connected_at": self.connected_at,
            "types": {SHORT_NAMES.get(t, t): s.as_dict() for t, s in sorted(self.types.items())},
        }


class Metrics:
    """The control plane's Prometheus metrics (own registry: tests can run several servers)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.connected = Gauge(
            "meshfn_xds_connected_proxies", "ADS streams currently open", ["protocol"], registry=r
        )
        self.pushes = Counter(
            "meshfn_xds_pushes", "Discovery responses sent", ["type", "protocol"], registry=r
        )
        self.push_bytes = Counter(
            "meshfn_xds_push_bytes", "Bytes of discovery responses sent", ["type"], registry=r
        )
        self.acks = Counter("meshfn_xds_acks", "ACKs received", ["type"], registry=r)
        self.nacks = Counter("meshfn_xds_nacks", "NACKs received", ["type"], registry=r)
        self.push_latency = Histogram(
            "meshfn_xds_push_latency_seconds",
            "From a snapshot being published to the proxy ACKing it",
            ["type"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.stream_errors = Counter(
            "meshfn_xds_stream_errors", "Streams ended by a protocol error", ["reason"], registry=r
        )
        self.reloads = Counter("meshfn_policy_reloads", "Policy reloads", ["result"], registry=r)
        self.translate_seconds = Histogram(
            "meshfn_translate_seconds",
            "Policy load + translate + encode time per reload",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.certificates = Counter(
            "meshfn_certificates_issued", "Workload certificates issued or renewed", registry=r
        )
        self.route_degraded = Gauge(
            "meshfn_route_degraded",
            "1 while the drift breaker sends a route down its chain",
            ["route"],
            registry=r,
        )
        self.drift_transitions = Counter(
            "meshfn_drift_transitions",
            "Drift breaker trips and recoveries",
            ["route", "to"],
            registry=r,
        )
        self.rollout_steps = Counter(
            "meshfn_rollout_events",
            "Rollout transitions and manual actions (started, step, promoted, rolled-back, "
            "paused, resumed, aborted)",
            ["rollout", "event"],
            registry=r,
        )
        self.snapshots = Gauge(
            "meshfn_xds_snapshot_resources",
            "Resources in the current snapshot",
            ["workload", "type"],
            registry=r,
        )
