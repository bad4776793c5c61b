"""What the per-kind renderers share: the render context, objects, their origins, warnings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from meshfn import ir
from meshfn.xds.fragments.messages import seconds

from .options import RenderOptions

Obj = dict[str, Any]
Loc = tuple[str | int, ...]

MANAGED_BY = {"app.kubernetes.io/managed-by": "meshfn"}


@dataclass(frozen=True, order=True)
class Source:
    """The meshfn object something came from: its policy kind, namespace ("" for the Mesh) and
    name. The CLI maps it (with a field path) to file:line through the loader's Provenance."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return (
            f"{self.kind} {self.namespace}/{self.name}"
            if self.namespace
            else f"{self.kind} {self.name}"
        )


@dataclass(frozen=True, order=True)
class RenderWarning:
    """A part of a policy Istio cannot express (or can only approximate): `code` names the
    case (docs/concepts/istio.md), `path` is the policy field."""

    code: str
    source: Source
    path: Loc
    message: str


ObjectId = tuple[str, str, str]  # (kind, namespace, name)


def object_id(obj: Obj) -> ObjectId:
    meta = obj["metadata"]
    return (obj["kind"], meta.get("namespace", ""), meta["name"])


@dataclass
class Context:
    """One render: the inputs, and what the kind renderers produce (objects, warnings, and which
    meshfn objects each Istio object came from)."""

    model: ir.MeshModel
    options: RenderOptions
    digests: Mapping[str, str]  # build name (contracts.plugins.BUILDS) -> module sha256
    overlay: ir.Overlay
    objects: dict[ObjectId, Obj] = field(default_factory=dict)
    origins: dict[ObjectId, set[Source]] = field(default_factory=dict)
    warnings: set[RenderWarning] = field(default_factory=set)

    def emit(self, obj: Obj, *sources: Source) -> Obj:
        key = object_id(obj)
        if key in self.objects and self.objects[key] != obj:
            raise AssertionError(f"two different {key[0]} {key[1]}/{key[2]} rendered")
        self.objects[key] = obj
        self.origins.setdefault(key, set()).update(sources)
        return obj

    def warn(self, code: str, source: Source, path: Loc, message: str) -> None:
        self.warnings.add(RenderWarning(code, source, path, message))


def meta(name: str, namespace: str) -> Obj:
    return {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)}


def resource(api_version: str, kind: str, name: str, namespace: str, spec: Obj) -> Obj:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": meta(name, namespace),
        "spec": spec,
    }


def selector(options: RenderOptions, workload: str) -> Obj:
    return {"matchLabels": options.labels(workload)}


_MS = timedelta(milliseconds=1)


def istio_duration(ctx: Context, value: timedelta, source: Source, path: Loc) -> str:
    """A duration for an Istio API field: istiod takes whole milliseconds of at least 1ms
    (agent.ValidateDuration rejects the object otherwise, and every route or setting in it with
    it), so a finer one is rounded up, with the warning `duration-rounded`. Envoy's own fields
    (EnvoyFilter patches) keep `seconds`."""
    rounded = max(_MS, -(-value // _MS) * _MS)  # ceiling, in whole milliseconds
    if rounded != value:
        ctx.warn(
            "duration-rounded",
            source,
            path,
            f"Istio takes durations in whole milliseconds of at least 1ms: "
            f"{seconds(value)} is rendered as {seconds(rounded)}",
        )
    return seconds(rounded)


def service_source(service: ir.Service) -> Source:
    return Source("Service", service.namespace, service.name)


def route_source(model: ir.MeshModel, route: ir.Route) -> Source:
    """A Function's routes are named function-<name> (policy.kserve.function_route)."""
    name = route.name.removeprefix("function-")
    if route.name != name and any(
        f.namespace == route.namespace and f.name == name for f in model.functions
    ):
        return Source("Function", route.namespace, name)
    return Source("Route", route.namespace, route.name)


def fallback_source(service: ir.Service) -> Source:
    assert service.traffic is not None
    return Source("FallbackPolicy", service.namespace, service.traffic.policy)


def mesh_source(model: ir.MeshModel) -> Source:
    return Source("Mesh", "", model.name)


class Unrenderable(ValueError):
    """Policies meshfn runs, but that Istio cannot tell apart: nothing is written."""


def check_selectable(model: ir.MeshModel, options: RenderOptions) -> None:
    """Istio selects a workload's pods by one label (`options.label_key`: the workload's name):
    a Gateway and a Service with sidecars of one name in one namespace would get each other's
    audit plugin, Telemetry, EnvoyFilters and authorization, and their objects' names collide."""
    seen: dict[tuple[str, str], Source] = {}
    workloads = [Source("Gateway", g.namespace, g.name) for g in gateways(model)]
    workloads += [Source("Service", s.namespace, s.name) for s in sidecar_services(model)]
    for source in workloads:
        other = seen.setdefault((source.namespace, source.name), source)
        if other is not source:
            label = f"{options.label_key}: {source.name}"
            raise Unrenderable(
                f"{other} and {source} share the pod label {label!r}: Istio would apply each "
                "one's audit plugin, Telemetry, EnvoyFilters and authorization to the other's "
                "pods; rename one of them"
            )


ISTIO_REGEX_MAX = 1024  # istiod's validateStringRegexp: a longer one refuses the object


def check_regexes(model: ir.MeshModel) -> None:
    """Route regexes (path and header) istiod refuses, with the whole VirtualService."""
    for gw in gateways(model):
        for listener in gw.listeners:
            for route in listener.routes:
                for match in route.matches:
                    regexes = [match.path] + [h for h in match.headers if h.kind == "regex"]
                    for item in regexes:
                        if item.kind == "regex" and len(item.value) > ISTIO_REGEX_MAX:
                            raise Unrenderable(
                                f"{route_source(model, route)}: a regex of {len(item.value)} "
                                f"characters; Istio refuses regexes over {ISTIO_REGEX_MAX}"
                            )


def gateways(model: ir.MeshModel) -> list[ir.Workload]:
    return [w for w in model.workloads if w.kind == "gateway"]


def rolled_out(model: ir.MeshModel, route: ir.Route, index: int) -> ir.Rollout | None:
    """The rollout splitting match `index` of a route: a Function's /v2/models/{name} paths
    (Triton's repository load and unload act on every version: never split nor mirrored)."""
    if not route.function or not route.matches[index].path.value.startswith("/v2/models/"):
        return None
    return model.rollout_of(f"{route.namespace}/{route.function}")


def sidecar_services(model: ir.MeshModel) -> list[ir.Service]:
    """Services whose endpoints have sidecars (pods with istio-proxy, or VMs with it)."""
    return [s for s in model.services if s.has_sidecars]


def account(identity: str) -> str:
    """The service account of a SPIFFE ID (spiffe://td/ns/<ns>/sa/<account>)."""
    return identity.rsplit("/sa/", 1)[1]
