"""MeshModel -> Envoy resources for one workload. Pure and deterministic; golden-tested."""

from __future__ import annotations

from google.protobuf.message import Message

from meshfn.control_plane import ir

from .clusters import cluster
from .endpoints import load_assignment
from .listeners import listener
from .resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, Resources
from .routes import route_configuration
from .security import Credentials, jwks_cluster, jwks_uris, secrets
from .sidecar import sidecar_resources


def translate(
    model: ir.MeshModel, node_cluster: str, credentials: Credentials | None = None
) -> Resources | None:
    """Everything an Envoy of workload `node_cluster` needs, or None for an unknown workload.

    Every service of the mesh becomes a cluster on a gateway, not only those the current routes
    use (Istio's default without a Sidecar resource): when a route moves from one service to
    another, or Envoy NACKs a new route table and keeps the old one, the clusters the routes in
    force point at still exist. `credentials` (certificate, key, trust bundle) become the SDS
    secrets; without them the secrets are left out (offline rendering, golden files).
    """
    workload = model.workload(node_cluster)
    if workload is None:
        return None
    out: Resources
    if workload.kind == "sidecar":
        out = sidecar_resources(workload)
    else:
        services = model.services
        clusters: dict[str, Message] = {s.cluster_name: cluster(s) for s in services}
        for uri in jwks_uris(workload.jwt_rules):
            jwks = jwks_cluster(uri)
            clusters[jwks.name] = jwks
        out = {
            LISTENER: {
                lst.name: listener(lst, workload.jwt_rules, workload.authz)
                for lst in workload.listeners
            },
            ROUTE: {lst.name: route_configuration(lst) for lst in workload.listeners},
            CLUSTER: clusters,
            ENDPOINT: {s.cluster_name: load_assignment(s) for s in services},
        }
    if credentials is not None:
        out[SECRET] = dict(secrets(credentials))
    return out


__all__ = ["Credentials", "Resources", "translate"]
