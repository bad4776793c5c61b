"""The Istio golden cases every Istio test reads: where they are, their policies and renderings,
and Istio's real CRDs (shared test data beside the checkout, never part of the project)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from meshfn import ir
from meshfn.contracts.plugins import BUILDS
from meshfn.control_plane.policy import load_policies
from meshfn.istio import Rendering, render

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "istio"
# ../shared beside the checkout (a worktree may sit deeper: the nearest ancestor's)
CRDS = next(
    (p / "shared/istio/crd-all.gen.yaml" for p in ROOT.parents if (p / "shared/istio").is_dir()),
    ROOT.parent / "shared/istio/crd-all.gen.yaml",
)
EXAMPLES = "examples"
CASES = [EXAMPLES, *sorted(p.name for p in GOLDEN.iterdir() if (p / "in.yaml").exists())]
# Stable stand-ins for the built modules' digests (the CLI passes the real ones).
DIGESTS = {name: hashlib.sha256(f"golden:{name}".encode()).hexdigest() for name in BUILDS}


def source(case: str) -> Path:
    return ROOT / "policies" / "examples" if case == EXAMPLES else GOLDEN / case / "in.yaml"


def rendering(case: str, overlay: ir.Overlay | None = None) -> Rendering:
    model = load_policies(source(case))
    return render(model, DIGESTS, overlay=overlay or ir.Overlay())
