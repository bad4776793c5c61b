"""Model versions for the rollout tests and benchmark: a stable version and candidates that are
good or bad in the ways a rollout must catch, built, signed and published like any function.

They are the digits example (functions/examples/digits: scikit-learn's logistic regression on the
8x8 digits, exported to ONNX and compiled by the model compiler, `kind = "onnx"`), copied under a
name of the test's choosing. Its prepare step trains the model, then changes the ONNX graph
(all but `trap`):

- `same`: the same model, a new version (a good candidate: identical answers);
- `broken-weight`: the weight rows (and intercepts) of classes 3 and 8 swapped, so the model
  answers 8 where it meant 3 and the other way round (a silently wrong model: only a shadow
  comparison catches it);
- `trap`: a module that traps on every call (every answer a 500). A compiled model cannot crash:
  the compiler checks what could (an integer division by zero, a Gather index out of range) and
  answers 400, the client's error, which a rollout does not count. So this one is the core-wasm
  chaos function (functions/testing/chaos-core, C) with the digits' inputs and outputs;
- `slow`: the same answers after `SLOW_LAYERS` extra 512x512 matrix products whose result is
  added times zero (tens of ms per call).

`build` is the one place that knows how a variant is made; the tests and bench/rollout.py only
name the variant.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from meshfn.inference.build import FUNCTIONS_DIR
from meshfn.inference.examples import dev_key, publish_dir
from meshfn.inference.registry import Registry

if TYPE_CHECKING:
    from onnx import ModelProto, NodeProto

Variant = Literal["same", "broken-weight", "trap", "slow"]
SOURCE = FUNCTIONS_DIR / "examples" / "digits"
# A candidate that errors: the model compiler makes modules that answer every input (a bad one
# is a 400, the client's fault), so a crash is a core module, the chaos function, that traps.
TRAP_SOURCE = FUNCTIONS_DIR / "testing" / "chaos-core"
_TRAP_ENTRY = "calls++;"
SWAPPED = (3, 8)  # the classes whose weights `broken-weight` swaps
SLOW_LAYERS = 500  # 512x512 products per row: ~40-60 ms of guest time on the test machines
_WIDTH = 512

# The candidate's prepare step (run by `meshfn fn build` in the staging folder). It names every
# parameter of the recipe: the build cache keys on the function's files, so a changed recipe
# is a new build.
_PREPARE = '''"""The digits model, trained as functions/examples/digits trains it, then made {variant!r}
(meshfn.testing.candidates)."""
import sys
from pathlib import Path

from meshfn.testing.candidates import prepare

prepare(Path(sys.argv[1]), {variant!r}, swapped={swapped!r}, slow=({layers}, {width}))
'''


@dataclass(frozen=True)
class Built:
    name: str
    version: str
    variant: Variant
    directory: Path


def build(workdir: Path, name: str, version: str, variant: Variant) -> Built:
    """A function directory for `name`@`version` made as `variant` (under `workdir`)."""
    assert variant in get_args(Variant), variant
    target = workdir / f"{name}-{version}-{variant}"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(SOURCE, target)
    manifest = (target / "function.toml").read_text()
    # the function's own name and version (the first ones: inputs and outputs have names too)
    manifest = re.sub(r'^name = ".*"$', f'name = "{name}"', manifest, count=1, flags=re.M)
    manifest = re.sub(r'^version = ".*"$', f'version = "{version}"', manifest, count=1, flags=re.M)
    assert re.search(
        r'^kind = "onnx"\nmodel = "model\.onnx".*\nprepare = "train\.py"$', manifest, re.M
    ), "functions/examples/digits changed: update meshfn.testing.candidates"
    if variant == "trap":  # the digits' inputs and outputs, served by a core module that traps
        shutil.rmtree(target)
        shutil.copytree(TRAP_SOURCE, target)
        source = (target / "chaos.c").read_text()
        assert _TRAP_ENTRY in source, "chaos.c changed: update meshfn.testing.candidates"
        (target / "chaos.c").write_text(
            source.replace(_TRAP_ENTRY, _TRAP_ENTRY + " __builtin_trap();")
        )
        manifest = re.sub(r"^model = .*\n|^prepare = .*\n", "", manifest, flags=re.M)
        manifest = manifest.replace('kind = "onnx"', 'kind = "core"\nsource = "chaos.c"')
        manifest = re.sub(
            r"\A(#.*\n)+", "# The digits' interface; traps on every call.\n", manifest
        )
    else:
        manifest = re.sub(
            r'^prepare = "train.py"', 'prepare = "candidate.py"', manifest, flags=re.M
        )
        (target / "candidate.py").write_text(
            _PREPARE.format(variant=variant, swapped=SWAPPED, layers=SLOW_LAYERS, width=_WIDTH)
        )
    (target / "function.toml").write_text(manifest)
    return Built(name, version, variant, target)


def prepare(
    out: Path,
    variant: Variant,
    swapped: tuple[int, int] = SWAPPED,
    slow: tuple[int, int] = (SLOW_LAYERS, _WIDTH),
    manifest: Path = Path("function.toml"),
) -> None:
    """Write the candidate's model into `out` (and its build report: held-out rows for the
    variants that answer, so `meshfn fn build` scores what is served)."""
    from meshfn.testing.onnx_models import sklearn_function

    spec = tomllib.loads(manifest.read_text())
    model, report = sklearn_function("digits", spec["inputs"][0]["name"])
    if variant == "broken-weight":
        _swap_classes(model, *swapped)
    elif variant == "slow":
        _add_slow_path(model, *slow)
    if variant == "slow":  # scoring it would take minutes
        report.pop("heldout")
    (out / spec["model"]).write_bytes(model.SerializeToString())
    report = {"dataset": "scikit-learn's bundled data (digits)", "variant": variant, **report}
    (out / "build-report.json").write_text(json.dumps(report))


def _node(model: ModelProto, op_type: str) -> NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == op_type]
    return node


def _swap_classes(model: ModelProto, a: int, b: int) -> None:
    """Swap two classes' coefficient rows and intercepts in the LinearClassifier."""
    node = _node(model, "LinearClassifier")
    attrs = {attr.name: attr for attr in node.attribute}
    coefficients, intercepts = attrs["coefficients"].floats, attrs["intercepts"].floats
    width = len(coefficients) // len(intercepts)
    rows = [list(coefficients[i * width : (i + 1) * width]) for i in range(len(intercepts))]
    rows[a], rows[b] = rows[b], rows[a]
    biases = list(intercepts)
    biases[a], biases[b] = biases[b], biases[a]
    del coefficients[:], intercepts[:]
    coefficients.extend(v for row in rows for v in row)
    intercepts.extend(biases)


def _rename_output(model: ModelProto, name: str, new: str) -> None:
    for node in model.graph.node:
        node.output[:] = [new if o == name else o for o in node.output]


def _add_slow_path(model: ModelProto, layers: int, width: int) -> None:
    """probabilities + 0 * sum(pixels @ W @ I @ I ...): the same answers, `layers` extra matrix
    products per row (the identity keeps the values finite, so times zero is zero)."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    features = graph.input[0].type.tensor_type.shape.dim[1].dim_value
    rng = np.random.default_rng(0)
    spread = rng.uniform(0, 1 / features, (features, width)).astype(np.float32)
    graph.initializer.extend(
        [
            numpy_helper.from_array(spread, "slow_spread"),
            numpy_helper.from_array(np.eye(width, dtype=np.float32), "slow_identity"),
            numpy_helper.from_array(np.zeros(1, np.float32), "slow_zero"),
        ]
    )
    _rename_output(model, "probabilities", "probabilities_raw")
    nodes = [helper.make_node("MatMul", [graph.input[0].name, "slow_spread"], ["slow_0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"slow_{i}", "slow_identity"], [f"slow_{i + 1}"]))
    nodes += [
        helper.make_node("ReduceSum", [f"slow_{layers}"], ["slow_sum"], keepdims=1),
        helper.make_node("Mul", ["slow_sum", "slow_zero"], ["slow_nothing"]),
        helper.make_node("Add", ["probabilities_raw", "slow_nothing"], ["probabilities"]),
    ]
    graph.node.extend(nodes)


def publish(workdir: Path, registry: Path, versions: list[tuple[str, str, Variant]]) -> Path:
    """Build, sign (the development key) and publish each (name, version, variant) into
    `registry`; returns the public key the backends must trust."""
    private, public = dev_key()
    store = Registry(registry)
    for name, version, variant in versions:
        built = build(workdir, name, version, variant)
        publish_dir(built.directory, store, private)
    return public
