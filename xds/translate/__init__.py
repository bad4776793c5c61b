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

    Only the services this workload routes to become clusters (like Istio's Sidecar scoping):
    an edge Envoy does not need the whole mesh.
    """
    workload = model.workload(node_cluster)
    if workload is None:
        return None
    service_keys = sorted({r.service for lst in workload.listeners for r in lst.routes})
    services = [model.service(key) for key in service_keys]
    return {
        LISTENER: {lst.name: listener(lst) for lst in workload.listeners},
        ROUTE: {lst.name: route_configuration(lst) for lst in workload.listeners},
        CLUSTER: {s.cluster_name: cluster(s) for s in services},
        ENDPOINT: {s.cluster_name: load_assignment(s) for s in services},
    }


__all__ = ["Resources", "translate"]
