"""Pass 1, resolve references: the Mesh, the Gateways, the Gateway each Route and Function
attaches to, the Services, each Service's FallbackPolicy, and what each QoSPolicy binds; each
looked up once, here, for every pass after this one.

The reference and QoS checks (policy.references, policy.qos) have passed: everything resolves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshfn import ir

from ..fallback import policies_by_service
from ..model import Function, Gateway, Mesh, QoSPolicy, Route
from ..qos import Bindings, claim_of
from ..references import resolve_gateway
from ..validate import Loaded


@dataclass(frozen=True)
class Attached:
    """A Route or Function, and the key (namespace/name) of the Gateway it attaches to."""

    item: Loaded
    gateway: str


@dataclass(frozen=True)
class QoSBindings:
    """The QoSPolicies as policy.qos binds them. `policies`: in (namespace, name) order;
    `targets`: per target (kind, namespace/name) the policy bound to it; `backends`: per
    Function (namespace/name) the policy its backend applies (its own, else its gateway's);
    `claims`: per policy (its ref) the verified JWT claim that names the tenant."""

    policies: tuple[Loaded, ...]
    targets: Mapping[tuple[str, str], Loaded]
    backends: Mapping[str, Loaded]
    claims: Mapping[str, str]


@dataclass(frozen=True)
class Resolved:
    """The first stage. Each pass's stage is the one before it plus what the pass adds (a
    subclass: later passes read every earlier stage's fields), built from the earlier stage's
    fields (`vars`: stages are plain frozen dataclasses, without slots).

    `items`: every object as loaded; `gateways`: by key (namespace/name), in key order;
    `attached`: every Route and Function, in the order written; `service_items`: every Service,
    in (namespace, name) order; `fallback`: per service key its FallbackPolicy."""

    items: tuple[Loaded, ...]
    mesh: Mesh
    gateways: Mapping[str, Loaded]
    attached: tuple[Attached, ...]
    service_items: tuple[Loaded, ...]
    fallback: Mapping[str, Loaded]
    bindings: QoSBindings


def resolve(items: list[Loaded]) -> Resolved:
    mesh = next(i.obj for i in items if isinstance(i.obj, Mesh))
    assert isinstance(mesh, Mesh)
    gateways = {f"{i.namespace}/{i.name}": i for i in items if isinstance(i.obj, Gateway)}
    attached = []
    for item in items:
        if isinstance(item.obj, Route | Function):
            gateway = resolve_gateway(item, gateways)
            assert isinstance(gateway, Loaded), gateway  # the reference checks passed
            attached.append(Attached(item, f"{gateway.namespace}/{gateway.name}"))
    fallback = policies_by_service(items)
    qos = Bindings(items)
    backends = {
        f"{a.item.namespace}/{a.item.name}": policy
        for a in attached
        if isinstance(a.item.obj, Function)
        and (policy := qos.for_function_on(a.item, a.gateway)) is not None
    }
    claims = {}
    for policy in qos.policies:
        assert isinstance(policy.obj, QoSPolicy)
        claims[policy.ref] = claim_of(policy.obj.spec, mesh)
    return Resolved(
        items=tuple(items),
        mesh=mesh,
        gateways=dict(sorted(gateways.items())),
        attached=tuple(attached),
        service_items=tuple(
            sorted(
                (i for i in items if isinstance(i.lowered, ir.Service)),
                key=lambda i: (i.namespace, i.name),
            )
        ),
        fallback=fallback,
        bindings=QoSBindings(tuple(qos.policies), dict(qos.by_target), backends, claims),
    )
