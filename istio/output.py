"""A Rendering as files: one multi-document YAML per kind (registry order, objects sorted),
plus the meshConfig snippet. Deterministic bytes: same IR, same files."""

from __future__ import annotations

from typing import Any

import yaml

from . import Rendering
from .registry import KINDS, MESH_CONFIG_FILE


class _Dumper(yaml.SafeDumper):
    """Block style, keys in the order rendered, no aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(documents: list[Any]) -> str:
    return "---\n".join(
        yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
        for d in documents
    )


MESH_CONFIG_HEADER = (
    "# Merge into istiod's mesh config (IstioOperator spec.meshConfig, or the Helm value\n"
    "# meshConfig): the extension providers meshfn's Telemetry objects name.\n"
)


def files(rendering: Rendering) -> dict[str, str]:
    """File name -> content, for the kinds that have objects, and mesh-config.yaml."""
    out = {k.file: dump(rendering.objects[k.kind]) for k in KINDS if rendering.objects[k.kind]}
    out[MESH_CONFIG_FILE] = MESH_CONFIG_HEADER + dump([rendering.mesh_config])
    return out
