"""MeshModel -> Istio objects (plain dicts), validated against Istio's schemas. Pure and
deterministic like the xDS translator, and built on the same shared pieces (meshfn.xds.fragments
for the filters' settings and the Envoy pieces of its EnvoyFilters, meshfn.xds.names for route
and cluster names), so one policy set means the same on raw Envoy and on an Istio mesh.
docs/concepts/istio.md maps every field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshfn import ir

from .core import (
    Context,
    Obj,
    ObjectId,
    RenderWarning,
    Source,
    Unrenderable,
    check_regexes,
    check_selectable,
    mesh_source,
)
from .options import DEFAULT, OFFLINE_SALT, RenderOptions
from .registry import BY_KIND, KINDS, MESH_CONFIG_FILE
from .schema import SchemaError, validate
from .telemetry import mesh_config
from .wasm import MissingModule

NO_OVERLAY = ir.Overlay()


@dataclass(frozen=True)
class Rendering:
    """Objects by kind (registry order, each sorted by namespace and name), the meshConfig
    snippet, every warning, and which meshfn objects each Istio object came from."""

    objects: dict[str, list[Obj]]
    mesh_config: Obj
    warnings: tuple[RenderWarning, ...]
    origins: dict[ObjectId, frozenset[Source]]


def render(
    model: ir.MeshModel,
    digests: Mapping[str, str],
    options: RenderOptions = DEFAULT,
    overlay: ir.Overlay = NO_OVERLAY,
) -> Rendering:
    """Every object, validated; raises SchemaError naming the first invalid object and the
    schema path (nothing is returned then), MissingModule when `digests` lacks a build,
    Unrenderable when Istio could not tell two workloads apart or refuses a route's regex."""
    check_selectable(model, options)
    check_regexes(model)
    ctx = Context(model, options, digests, overlay)
    for kind in KINDS:
        kind.render(ctx)
    if model.acceleration == "ebpf":
        ctx.warn(
            "no-ebpf-acceleration",
            mesh_source(model),
            ("spec", "acceleration"),
            "Istio's proxies are not accelerated by meshfn's eBPF programs (acceleration: ebpf "
            "requires them; auto would fall back to plain TCP)",
        )
    objects: dict[str, list[Obj]] = {k.kind: [] for k in KINDS}
    for key in sorted(ctx.objects):
        obj = ctx.objects[key]
        validate(obj)
        objects[obj["kind"]].append(obj)
    return Rendering(
        objects=objects,
        mesh_config=mesh_config(ctx),
        warnings=tuple(sorted(ctx.warnings)),
        origins={k: frozenset(v) for k, v in sorted(ctx.origins.items())},
    )


__all__ = [
    "BY_KIND",
    "DEFAULT",
    "KINDS",
    "MESH_CONFIG_FILE",
    "OFFLINE_SALT",
    "MissingModule",
    "RenderOptions",
    "RenderWarning",
    "Rendering",
    "SchemaError",
    "Source",
    "Unrenderable",
    "render",
]
