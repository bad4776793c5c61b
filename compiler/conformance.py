"""ONNX's own node conformance cases (onnx.backend.test), run through compiled wasm.

Every case whose operators are all registered is attempted: lowered (inputs that feed a
build-time operand, such as Reshape's shape, are baked in from the case's data), compiled in
modules of many cases at once (one clang run and one wasmtime compile per module; cached by
content), run in wasmtime and compared with the expected outputs at the case's own tolerance.
A case the compiler refuses (an attribute or dtype it does not claim) is excluded with the
compiler's message as the reason; anything that compiles must pass."""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import wasmtime

from . import loader, toolchain
from .codegen import Unit
from .errors import CompileError
from .ops import REGISTRY
from .pipeline import Options, build_module, lower
from .runner import RunError, Runner

CASES_PER_MODULE = 32


@dataclass
class Outcome:
    name: str
    status: str  # passed | failed | refused | unclaimed
    detail: str = ""


@dataclass
class Summary:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    @property
    def passed(self) -> int:
        return self.count("passed")

    @property
    def attempted(self) -> int:
        return self.count("passed") + self.count("failed")

    @property
    def total(self) -> int:
        return len(self.outcomes)

    def line(self) -> str:
        return (
            f"ops_conformance={self.passed}/{self.attempted} (of {self.total} node cases; "
            f"{self.count('refused')} refused by a unit, {self.count('unclaimed')} with an "
            "unregistered operator)"
        )


@functools.cache
def load_cases() -> list[Any]:
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return list(load_model_tests(kind="node"))


def _claimed(model: Any) -> list[str]:
    """The case's operators that no unit claims and that are not ONNX functions (whose bodies
    the compiler inlines)."""
    import onnx.defs

    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    missing = []
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        try:
            schema: Any = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
            function = schema.has_function or schema.has_context_dependent_function
        except onnx.defs.SchemaError:
            function = False
        unrolled = node.op_type == "Scan" and not domain  # static trip counts are unrolled
        if (domain, node.op_type) not in REGISTRY and not function and not unrolled:
            missing.append(f"{domain + '.' if domain else ''}{node.op_type}")
    return sorted(set(missing))


def _freeze(model: Any, inputs: Sequence[np.ndarray[Any, Any]]) -> dict[str, Any]:
    """Graph inputs that feed an operand a unit needs at build time, with the case's values."""
    names = [vi.name for vi in model.graph.input]
    by_name = dict(zip(names, inputs, strict=False))
    frozen: dict[str, Any] = {}
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        cls = REGISTRY.get((domain, node.op_type))
        if cls is None:
            continue
        for idx in cls.STATIC_INPUTS:
            if idx < len(node.input) and node.input[idx] in by_name:
                frozen[node.input[idx]] = by_name[node.input[idx]]
    return frozen


@dataclass
class _Prepared:
    case: Any
    unit: Unit
    frozen: dict[str, Any]


def _differing_frozen(case: Any, frozen: dict[str, Any]) -> str | None:
    names = [vi.name for vi in case.model.graph.input]
    for inputs, _ in case.data_sets[1:]:
        for name, value in zip(names, inputs, strict=False):
            if name in frozen and not np.array_equal(frozen[name], _arr(value)):
                return str(name)
    return None


def _lower_baking_ints(
    case: Any, frozen: dict[str, Any], index: int
) -> tuple[Unit, dict[str, Any]]:
    """Lower; if a shape operand is computed from the case's integer inputs, bake those in too
    (a case with one data set only: the values are then fixed)."""
    try:
        return _lower(case, frozen, index), frozen
    except CompileError as exc:
        if "must be known when the model is compiled" not in str(exc) or len(case.data_sets) > 1:
            raise
        names = [vi.name for vi in case.model.graph.input]
        inputs = [_arr(v) for v in case.data_sets[0][0]]
        more = {
            n: v for n, v in zip(names, inputs, strict=False) if np.asarray(v).dtype.kind in "iu"
        }
        if not set(more) - set(frozen):
            raise
        frozen = {**frozen, **more}
        return _lower(case, frozen, index), frozen


def _prepare(case: Any, index: int) -> _Prepared | Outcome:
    missing = _claimed(case.model)
    if missing:
        return Outcome(case.name, "unclaimed", "not supported: " + ", ".join(missing))
    if not case.data_sets:
        return Outcome(case.name, "refused", "the case has no data")
    frozen = _freeze(case.model, [_arr(v) for v in case.data_sets[0][0]])
    differing = _differing_frozen(case, frozen)
    if differing:
        return Outcome(case.name, "refused", f"data sets differ in build-time input {differing!r}")
    try:
        unit, frozen = _lower_baking_ints(case, frozen, index)
    except CompileError as exc:
        return Outcome(case.name, "refused", str(exc).removeprefix(case.name + ": "))
    return _Prepared(case, unit, frozen)


def _lower(case: Any, frozen: dict[str, Any], index: int) -> Unit:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        proto = loader.prepare(_copy(case.model), case.name)
        unit, _ = lower(proto, case.name, Options(freeze_inputs=frozen), prefix=f"c{index}_")
    return unit


def _copy(model: Any) -> Any:
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _arr(v: Any) -> Any:
    from onnx import TensorProto, numpy_helper

    return numpy_helper.to_array(v) if isinstance(v, TensorProto) else v


def _compare(case: Any, got: list[np.ndarray[Any, Any]], want: list[Any]) -> str | None:
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for k, (g0, w0) in enumerate(zip(got, want, strict=True)):
        g, w = g0, np.asarray(w0)
        if g.dtype != w.dtype:
            return f"output {k}: dtype {g.dtype}, expected {w.dtype}"
        if g.shape != w.shape:
            if g.size == w.size and g.size <= 1:
                g = g.reshape(w.shape)
            else:
                return f"output {k}: shape {g.shape}, expected {w.shape}"
        if w.dtype.kind in "fc":
            try:
                np.testing.assert_allclose(g, w, rtol=case.rtol, atol=case.atol)
            except AssertionError as exc:
                lines = [
                    line for line in str(exc).splitlines() if "Max" in line or "Mismatch" in line
                ]
                return f"output {k}: " + "; ".join(lines)
        elif not np.array_equal(g, w):
            bad = int(np.sum(g != w))
            return f"output {k}: {bad} of {w.size} elements differ"
    return None


def _run_case(engine: wasmtime.Engine, module: wasmtime.Module, prepared: _Prepared) -> Outcome:
    case = prepared.case
    unit = prepared.unit
    try:
        runner = Runner(module=module, engine=engine, prefix=unit.prefix, metadata=unit.metadata)
    except (wasmtime.WasmtimeError, KeyError) as exc:
        return Outcome(case.name, "failed", f"instantiate: {exc}")
    names = [vi.name for vi in case.model.graph.input]
    for inputs, expected in case.data_sets:
        feed = [_arr(v) for n, v in zip(names, inputs, strict=False) if n not in prepared.frozen]
        outputs = [_arr(v) for v in expected]
        try:
            got = runner(feed)
        except (RunError, wasmtime.WasmtimeError, wasmtime.Trap, ValueError, TypeError) as exc:
            return Outcome(case.name, "failed", f"run: {exc}")
        why = _compare(case, got, list(outputs))
        if why:
            return Outcome(case.name, "failed", why)
    return Outcome(case.name, "passed")


@functools.cache
def _wasmtime_version() -> str:
    from importlib.metadata import version

    return version("wasmtime")


def _module(engine: wasmtime.Engine, units: list[Unit]) -> wasmtime.Module:
    wasm, _ = build_module(units)
    digest = hashlib.sha256(wasm).hexdigest()[:32]
    cwasm = toolchain.cache_dir() / "cwasm" / f"{digest}-{_wasmtime_version()}.cwasm"
    if cwasm.is_file():
        try:
            return wasmtime.Module.deserialize_file(engine, str(cwasm))
        except wasmtime.WasmtimeError:
            pass
    module = wasmtime.Module(engine, wasm)
    cwasm.parent.mkdir(parents=True, exist_ok=True)
    tmp = cwasm.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(module.serialize())
    tmp.replace(cwasm)
    return module


def _build_group(engine: wasmtime.Engine, group: list[_Prepared]) -> list[Outcome]:
    try:
        module = _module(engine, [p.unit for p in group])
    except Exception as exc:
        if len(group) == 1:
            return [
                Outcome(
                    group[0].case.name, "failed", f"build: {type(exc).__name__}: {str(exc)[:2000]}"
                )
            ]
        half = len(group) // 2  # find the case that breaks the build
        return _build_group(engine, group[:half]) + _build_group(engine, group[half:])
    return [_run_case(engine, module, p) for p in group]


def run(names: Iterable[str] | None = None, jobs: int | None = None) -> Summary:
    cases = load_cases()
    if names is not None:
        wanted = set(names)
        cases = [c for c in cases if c.name in wanted]
    outcomes: dict[str, Outcome] = {}
    prepared: list[_Prepared] = []
    for i, case in enumerate(cases):
        p = _prepare(case, i)
        if isinstance(p, Outcome):
            outcomes[case.name] = p
        else:
            prepared.append(p)
    groups = [prepared[i : i + CASES_PER_MODULE] for i in range(0, len(prepared), CASES_PER_MODULE)]
    engine = wasmtime.Engine()
    jobs = jobs or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(lambda g: _build_group(engine, g), groups):
            for o in result:
                outcomes[o.name] = o
    return Summary([outcomes[c.name] for c in cases])


def excluded_text(summary: Summary) -> str:
    """The committed list of cases not attempted, one per line: name, status, reason."""
    lines = [
        "# ONNX node conformance cases the compiler does not attempt, with the reason",
        "# (unclaimed: an operator no unit registers; refused: a unit refuses an attribute,",
        "# dtype or shape of the case). Regenerate: python -m meshfn.compiler.conformance",
        "# --write-excluded tests/compiler/conformance_excluded.txt",
    ]
    for o in summary.outcomes:
        if o.status in ("refused", "unclaimed"):
            reason = " ".join(o.detail.split())
            lines.append(f"{o.name}\t{o.status}\t{reason[:300]}")
    return "\n".join(lines) + "\n"


def read_excluded(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _status, reason = line.split("\t", 2)
            out[name] = reason
    return out


def covered_operators(summary: Summary) -> set[str]:
    """Operators that appear in at least one passing case."""
    by_name = {c.name: c for c in load_cases()}
    ops: set[str] = set()
    for o in summary.outcomes:
        if o.status == "passed":
            for node in by_name[o.name].model.graph.node:
                domain = "" if node.domain == "ai.onnx" else node.domain
                ops.add(f"{domain}.{node.op_type}" if domain else node.op_type)
    return ops


def main() -> None:
    import argparse
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="case names (default: all)")
    parser.add_argument("--show", default="failed", help="statuses to list (comma separated)")
    parser.add_argument("--write-excluded", type=Path, help="write the list of cases not attempted")
    args = parser.parse_args()
    summary = run(args.names or None)
    if args.write_excluded:
        args.write_excluded.write_text(excluded_text(summary))
    show = set(args.show.split(","))
    for o in summary.outcomes:
        if o.status in show:
            print(f"{o.status:9} {o.name}: {o.detail}")
    print(summary.line())
    sys.exit(1 if summary.count("failed") else 0)


if __name__ == "__main__":
    main()
