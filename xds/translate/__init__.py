"""MeshModel -> Envoy resources for one workload. Pure and deterministic; golden-tested."""

from __future__ import annotations

from meshfn.control_plane import ir

from .clusters import cluster
from .endpoints import load_assignment
from .listeners import listener
from .resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, Resources
from .routes import route_configuration


def translate(model: ir.MeshModel, node_cluster: str) -> Resources | None:
    """Everything an Envoy of workload `node_cluster` needs, or None for an unknown workload.

    Every service of the mesh becomes a cluster, not only those the current routes use (Istio's
    default without a Sidecar resource): when a route moves from one service to another, or
    Envoy NACKs a new route table and keeps the old one, the clusters the routes in force point
    at still exist.
    """
    workload = model.workload(node_cluster)
    if workload is None:
        return None
    services = model.services
    return {
        LISTENER: {lst.name: listener(lst) for lst in workload.listeners},
        ROUTE: {lst.name: route_configuration(lst) for lst in workload.listeners},
        CLUSTER: {s.cluster_name: cluster(s) for s in services},
        ENDPOINT: {s.cluster_name: load_assignment(s) for s in services},
    }


__all__ = ["Resources", "translate"]
