"""Each object's own IR: a Service, Route or Function lowered on its own, without
cross-references. The loader computes it once per document (Loaded.lowered, cached with the
file), so a reload after a one-file change lowers one file; the passes put the pieces together."""

from __future__ import annotations

from meshfn import ir
from meshfn.contracts.function import FunctionSettings

from ..model import Function, Locality, Route, Service
from ..validate import Loaded

_NO_LOCALITY = ir.Locality()


def locality(value: Locality | None) -> ir.Locality:
    if value is None:
        return _NO_LOCALITY
    return ir.Locality(value.region or "", value.zone or "", value.node or "")


def lower(item: Loaded) -> ir.Service | ir.Route | ir.Function | None:
    """The IR of one object on its own (no cross-references), cached on the loaded item."""
    if isinstance(item.obj, Service):
        return _service(item)
    if isinstance(item.obj, Route):
        return _route(item)
    if isinstance(item.obj, Function):
        return _function(item)
    return None


def _function(item: Loaded) -> ir.Function:
    assert isinstance(item.obj, Function)
    spec = item.obj.spec
    # The spec IS the settings plus backend and gateway: take the settings' fields as they are
    # (validated already), no mapping.
    settings = FunctionSettings.model_construct(
        **{field: getattr(spec, field) for field in FunctionSettings.model_fields}
    )
    return ir.Function(
        name=item.name,
        namespace=item.namespace,
        backend=f"{item.namespace}/{spec.backend}",
        settings=settings,
        egress=tuple(sorted({_qualified(p.service, item.namespace) for p in spec.egress})),
    )


def _qualified(ref: str, namespace: str) -> str:
    return ref if "/" in ref else f"{namespace}/{ref}"


def _service(item: Loaded) -> ir.Service:
    assert isinstance(item.obj, Service)
    spec = item.obj.spec
    return ir.Service(
        name=item.name,
        namespace=item.namespace,
        port=spec.port,
        protocol=spec.protocol,
        connect_timeout=spec.connectTimeout,
        endpoints=tuple(
            ir.Endpoint(
                address=e.address,
                port=e.port or spec.port,
                weight=e.weight,
                locality=locality(e.locality),
                sidecar_port=e.sidecar.port if e.sidecar is not None else None,
                grpc_port=e.grpcPort,
            )
            for e in spec.endpoints
        ),
        external=spec.external,
        load_balancer=spec.loadBalancer,
    )


def _route(item: Loaded) -> ir.Route:
    assert isinstance(item.obj, Route)
    spec = item.obj.spec
    matches = []
    for m in spec.matches:
        path = m.path
        if path.exact is not None:
            path_match = ir.PathMatch("exact", path.exact)
        elif path.regex is not None:
            path_match = ir.PathMatch("regex", path.regex)
        else:
            assert path.prefix is not None
            path_match = ir.PathMatch("prefix", path.prefix)
        headers = []
        for h in m.headers:
            if h.present:
                headers.append(ir.HeaderMatch(h.name.lower(), "present", "", h.invert))
            elif h.exact is not None:
                headers.append(ir.HeaderMatch(h.name.lower(), "exact", h.exact, h.invert))
            elif h.prefix is not None:
                headers.append(ir.HeaderMatch(h.name.lower(), "prefix", h.prefix, h.invert))
            else:
                assert h.regex is not None
                headers.append(ir.HeaderMatch(h.name.lower(), "regex", h.regex, h.invert))
        matches.append(
            ir.RouteMatch(
                path=path_match, headers=tuple(headers), methods=tuple(sorted(set(m.methods)))
            )
        )
    retries = None
    if spec.retries is not None:
        retries = ir.Retry(
            attempts=spec.retries.attempts,
            retry_on=tuple(dict.fromkeys(spec.retries.retryOn)),
            per_try_timeout=spec.retries.perTryTimeout,
        )
    return ir.Route(
        name=item.name,
        namespace=item.namespace,
        hosts=tuple(sorted(set(spec.hosts))),
        matches=tuple(matches),
        service=f"{spec.destination.namespace or item.namespace}/{spec.destination.service}",
        timeout=spec.timeout,
        retries=retries,
    )
