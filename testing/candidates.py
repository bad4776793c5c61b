"""Model versions for the rollout tests and benchmark: a stable version and candidates that are
good or bad in the ways a rollout must catch, built, signed and published like any function.

Today they are the core-wasm digits classifier (functions/examples/digits-core, C), copied under
a name of the test's choosing and built with a change:

- `same`: the same model, a new version (a good candidate: identical answers);
- `broken-weight`: the weight rows of two classes swapped, so some labels come out wrong (a
  silently wrong model: only a shadow comparison catches it);
- `trap`: a build that traps on every call (every answer a 500);
- `slow`: the same answers after a busy loop of `SLOW_SPIN` iterations (tens of ms).

When the ONNX model compiler lands (`meshfn fn build` of `kind = "onnx"`), a pair of a model and
the same model with one initializer broken belongs here: `build` is the one place that knows
how a variant is made; the tests and bench/rollout.py only name the variant.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshfn.inference.build import FUNCTIONS_DIR
from meshfn.inference.examples import dev_key, publish_dir
from meshfn.inference.registry import Registry

Variant = Literal["same", "broken-weight", "trap", "slow"]
SOURCE = FUNCTIONS_DIR / "examples" / "digits-core"
CORE = FUNCTIONS_DIR / "core"
SLOW_SPIN = 10_000_000  # ~40-60 ms of guest time on the test machines

# Run after train.py (the function's own prepare step): swap the weight rows of classes 3 and 8,
# so the model answers 8 where it meant 3 and the other way round.
_BREAK_WEIGHTS = '''"""train.py, then two classes' weight rows swapped: a broken weight."""
import re, runpy, sys
from pathlib import Path

out = Path(sys.argv[1])
sys.argv = ["train.py", str(out)]
runpy.run_path("train.py", run_name="__main__")
header = (out / "weights.h").read_text()
start = header.index("W[10][FEATURES] = {") + len("W[10][FEATURES] = {")
end = header.index("};", start)
rows = re.findall(r"\\{[^{}]*\\}", header[start:end])
rows[3], rows[8] = rows[8], rows[3]
(out / "weights.h").write_text(header[:start] + "\\n" + ",\\n".join(rows) + "\\n" + header[end:])
'''


@dataclass(frozen=True)
class Built:
    name: str
    version: str
    variant: Variant
    directory: Path


def build(workdir: Path, name: str, version: str, variant: Variant) -> Built:
    """A function directory for `name`@`version` made as `variant` (under `workdir`)."""
    target = workdir / f"{name}-{version}-{variant}"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(SOURCE, target)
    manifest = (target / "function.toml").read_text()
    # the function's own name and version (the first ones: inputs and outputs have names too)
    manifest = re.sub(r'^name = ".*"$', f'name = "{name}"', manifest, count=1, flags=re.M)
    manifest = re.sub(r'^version = ".*"$', f'version = "{version}"', manifest, count=1, flags=re.M)
    source = (target / "digits.c").read_text()
    entry = "i64 meshfn_infer(const char *req, u32 len) {"
    assert entry in source, "digits.c changed: update meshfn.testing.candidates"
    if variant == "broken-weight":
        (target / "break_weights.py").write_text(_BREAK_WEIGHTS)
        manifest = manifest.replace('prepare = "train.py"', 'prepare = "break_weights.py"')
    elif variant == "trap":
        source = source.replace(entry, entry + "\n  __builtin_trap();")
    elif variant == "slow":
        spin = f"\n  for (volatile u64 spin = 0; spin < {SLOW_SPIN}u; spin++) {{}}"
        source = source.replace(entry, entry + spin)
    (target / "function.toml").write_text(manifest)
    (target / "digits.c").write_text(source)
    return Built(name, version, variant, target)


def publish(workdir: Path, registry: Path, versions: list[tuple[str, str, Variant]]) -> Path:
    """Build, sign (the development key) and publish each (name, version, variant) into
    `registry`; returns the public key the backends must trust."""
    private, public = dev_key()
    store = Registry(registry)
    for name, version, variant in versions:
        built = build(workdir, name, version, variant)
        publish_dir(built.directory, store, private)
    return public
