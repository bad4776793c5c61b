"""The Istio golden cases every Istio test reads: where they are, their policies and renderings,
and Istio's real CRDs: the one copy vendored in istio/crds/ with their licence and version, which
the renderer's own schema check (meshfn.istio.schema, from the package data) reads too."""

from __future__ import annotations

import hashlib
from pathlib import Path

from meshfn import ir
from meshfn.contracts.plugins import BUILDS
from meshfn.istio import Rendering, render
from meshfn.policy import load_policies

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "istio"
CRDS = ROOT / "istio" / "crds" / "crd-all.gen.yaml"  # Istio 1.31's own, unmodified (= schema.CRDS)
EXAMPLES = "examples"
CASES = [EXAMPLES, *sorted(p.name for p in GOLDEN.iterdir() if (p / "in.yaml").exists())]
# Stable stand-ins for the built modules' digests (the CLI passes the real ones).
DIGESTS = {name: hashlib.sha256(f"golden:{name}".encode()).hexdigest() for name in BUILDS}


def source(case: str) -> Path:
    return ROOT / "policies" / "examples" if case == EXAMPLES else GOLDEN / case / "in.yaml"


def rendering(case: str, overlay: ir.Overlay | None = None) -> Rendering:
    model = load_policies(source(case))
    return render(model, DIGESTS, overlay=overlay or ir.Overlay())
