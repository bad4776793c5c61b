"""Pass 9, sidecars: one workload per endpoint that declares a sidecar, each with its own node
cluster, enforcing what its service's workloads enforce (and the repository guard of the
functions it serves), passing on the verified tenant where those functions have QoS."""

from __future__ import annotations

from dataclasses import dataclass

from meshfn import ir

from .shedding import Shed


@dataclass(frozen=True)
class Complete(Shed):
    """`sidecar_workloads`: per service in order, per endpoint with a sidecar."""

    sidecar_workloads: tuple[ir.Workload, ...]


def place(shed: Shed) -> Complete:
    workloads = []
    for service in shed.services:
        access = shed.access[("service", service.key)]
        guard = shed.guards.get(("service", service.key))
        authz = access.authz + ((guard,) if guard is not None else ())
        claim = shed.tenant_claims.get(service.key)
        workloads += [
            ir.Workload(
                name=service.name,
                namespace=service.namespace,
                kind="sidecar",
                admin_port=0,
                xds_protocol="delta",
                locality=endpoint.locality,
                listeners=(),
                identity=service.identity,
                jwt_rules=access.jwt_rules,
                authz=authz,
                inbound=ir.Inbound(
                    service=service.key,
                    address=endpoint.address,
                    port=endpoint.sidecar_port,
                    app_port=endpoint.port,
                    protocol=service.protocol,
                    mtls=endpoint.mtls,
                    grpc_app_port=endpoint.grpc_port,
                    tenant_claim=claim,
                    functions=guard is not None,  # the repository guard: it serves functions
                ),
            )
            for endpoint in service.endpoints
            if endpoint.sidecar_port is not None
        ]
    return Complete(**vars(shed), sidecar_workloads=tuple(workloads))
