"""Prometheus metrics of meshfn's Kubernetes side (watches, applies, leadership), on the
registry the control plane's /metrics serves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class KubeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.watch_restarts = Counter(
            "meshfn_kube_watch_restarts",
            "Watches re-opened from the last resourceVersion",
            ["kind", "cause"],
            registry=r,
        )
        self.relists = Counter(
            "meshfn_kube_relists", "Full lists (start, 410 Gone)", ["kind", "cause"], registry=r
        )
        self.apiserver_up = Gauge(
            "meshfn_kube_apiserver_reachable",
            "1 while the last request to the apiserver got an answer",
            registry=r,
        )
        self.builds = Counter(
            "meshfn_kube_policy_builds", "Policy set compilations", ["result"], registry=r
        )
        self.applies = Counter(
            "meshfn_kube_applies",
            "Server-side applies by kind and result",
            ["kind", "result"],
            registry=r,
        )
        self.prunes = Counter("meshfn_kube_prunes", "Objects pruned", ["kind"], registry=r)
        self.status_writes = Counter(
            "meshfn_kube_status_writes", "Status patches and Events written", ["what"], registry=r
        )
        self.leader = Gauge(
            "meshfn_kube_leader", "1 while this replica holds the Lease", registry=r
        )
        self.leader_changes = Counter(
            "meshfn_kube_leader_transitions",
            "Times this replica gained or lost the Lease",
            ["to"],
            registry=r,
        )
        self.pending = Gauge(
            "meshfn_kube_pending_objects",
            "Rendered objects not yet applied (apiserver unreachable, conflict)",
            registry=r,
        )
