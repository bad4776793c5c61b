"""ONNX model -> core wasm module: load, build the graph, resolve each node through its unit
(fold what is known at build time), plan buffers, emit C, clang, report."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import AttributeProto, ModelProto

from . import dtypes, graph, inline, loader, toolchain, wasmfile
from .codegen import Step, Unit, module_source
from .dims import Batch, Dim, Shape, is_static, mul, numel, show, static
from .dtypes import DType
from .errors import CompileError, MemoryCapError, UnsupportedError
from .graph import Graph, Node, Tensor
from .ops import REGISTRY, Op, schema_version, supported_list
from .plan import FOREVER, Buffer, plan

# A folded constant larger than this stays a run-time computation (a module should not carry
# a broadcast of its weights), unless the unit cannot run at all.
FOLD_LIMIT = 1 << 16
KNOWN_DOMAINS = ("", "ai.onnx.ml")
NONDETERMINISTIC = frozenset(
    (
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
    )
)
PAGE = 65536
STACK_BYTES = 65536  # -z stack-size in toolchain.py


@dataclass(frozen=True)
class Options:
    max_batch: int = 64
    memory_cap_bytes: int | None = None
    dims: Mapping[str, int] = field(default_factory=dict)
    # Graph inputs baked in as constants (the conformance runner uses it for shape operands).
    freeze_inputs: Mapping[str, np.ndarray[Any, Any]] = field(default_factory=dict)
    use_cache: bool = True


@dataclass
class CompiledModel:
    wasm: bytes
    c_source: str
    metadata: dict[str, Any]
    report: dict[str, Any]


class _Materialize(Op):
    """Copies a build-time value into a graph output's buffer (outputs are always buffers)."""

    OP = "(output)"

    def infer(self) -> list[tuple[DType, Shape]]:
        t = self.x(0)
        return [(t.dtype, t.shape)]

    def emit(self, e: Any) -> str:
        n = self.numel_c(self.x(0).shape)
        return f"for (u32 i = 0; i < {n}; i++) {e.out(0)}[i] = {e.inp(0)}[i];"


def _reference_fold(
    node: Node, ins: list[Tensor | None], opsets: dict[str, int]
) -> list[Any] | None:
    """Outputs of a node whose inputs are all known, by ONNX's reference implementation."""
    from onnx.reference import ReferenceEvaluator

    feeds = {t.name: t.value for t in ins if t is not None}
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            ref = ReferenceEvaluator(node.proto, opsets=dict(opsets))
            outs = ref.run(None, feeds)
    except Exception:
        return None
    return list(outs)


def _check_inferred(g: Graph, t: Tensor, label: str) -> None:
    """Our shape against ONNX's inference: a disagreement is refused, never run."""
    known = g.inferred.get(t.name)
    if known is None:
        return
    elem, dims = known
    if elem and elem != t.dtype.onnx:
        raise CompileError(
            f"{g.where}: {label}: output {t.name!r} is {t.dtype.name} here but ONNX infers "
            f"element type {elem} (a compiler bug; please report)"
        )
    if not dims and t.shape:
        return  # unknown rank in ONNX's inference
    if len(dims) != len(t.shape) or any(
        d is not None and isinstance(s, int) and d != s for d, s in zip(dims, t.shape, strict=False)
    ):
        raise CompileError(
            f"{g.where}: {label}: output {t.name!r} has shape {show(t.shape)} here but ONNX "
            f"infers {list(dims)} (a compiler bug; please report)"
        )


def _set_value(t: Tensor, value: Any, label: str, where: str) -> None:
    arr = np.asarray(value)
    if arr.dtype != object:
        arr = arr.astype(t.dtype.np, copy=False)
    if not is_static(t.shape) or tuple(arr.shape) != tuple(t.shape):
        raise CompileError(
            f"{where}: {label}: folded output {t.name!r} has shape {list(arr.shape)}, expected "
            f"{show(t.shape)} (a compiler bug; please report)"
        )
    t.value = arr


def _implemented(domain: str, op_type: str, opset: int) -> bool:
    cls = REGISTRY.get((domain, op_type))
    if cls is None:
        return False
    version = schema_version(op_type, domain, opset)
    return version is not None and version >= cls.SINCE


def _unsupported(node: Node, where: str, version: int | None, opset: int) -> UnsupportedError:
    what = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
    if version is None:
        return UnsupportedError(
            f"{where}: {node.label}: {what} is not an operator of opset {opset} of domain "
            f"{node.domain or 'ai.onnx'}"
        )
    advice = ""
    if node.op_type == "ZipMap":
        advice = (
            " (ZipMap turns probabilities into a list of maps: export with "
            "options={id(model): {'zipmap': False}} in skl2onnx)"
        )
    return UnsupportedError(
        f"{where}: {node.label}: operator {what} is not supported{advice}; supported: "
        f"{supported_list()}"
    )


class _Lowering:
    """The node-by-node walk of `lower`: each node is folded at build time or becomes a step."""

    def __init__(self, g: Graph, where: str) -> None:
        self.g, self.where = g, where
        self.steps: list[Step] = []
        self.ops_used: Counter[str] = Counter()
        self.folded = 0

    def inputs_of(self, node: Node) -> list[Tensor | None]:
        ins: list[Tensor | None] = []
        for name in node.inputs:
            if name and name not in self.g.tensors:
                raise CompileError(f"{self.where}: {node.label}: input {name!r} is never produced")
            ins.append(self.g.tensors[name] if name else None)
        return ins

    def node(self, node: Node) -> None:
        g, where = self.g, self.where
        ins = self.inputs_of(node)
        if node.domain not in g.opsets:
            raise UnsupportedError(
                f"{where}: {node.label}: domain {node.domain!r} has no opset import"
            )
        version = schema_version(node.op_type, node.domain, g.opsets[node.domain])
        cls = REGISTRY.get((node.domain, node.op_type))
        known = [t for t in ins if t is not None]
        all_known = all(t.value is not None and not t.symbolic for t in known)
        if cls is None or version is None:
            if not (version is not None and all_known and self.fold_unregistered(node, ins)):
                raise _unsupported(node, where, version, g.opsets[node.domain])
            return
        if version < cls.SINCE:
            raise UnsupportedError(
                f"{where}: {node.label}: {node.op_type} from opset {g.opsets[node.domain]} "
                f"(version {version}) is not supported; supported from version {cls.SINCE} "
                f"(re-export with opset >= {cls.SINCE})"
            )
        op = cls(node, ins, version, where)
        outs = self.outputs(op, node)
        if node.op_type in NONDETERMINISTIC:
            op.fail("random operators are not supported")
        if self.fold(op, cls, node, ins, outs, all_known):
            return
        self.steps.append(Step(op, ins, outs))
        self.ops_used[f"{node.domain}.{node.op_type}" if node.domain else node.op_type] += 1

    def fold_unregistered(self, node: Node, ins: list[Tensor | None]) -> bool:
        """An operator no unit implements, all of whose inputs are known: ONNX's reference
        implementation computes it at build time (constant subgraphs of exporters)."""
        if not node.outputs or node.op_type in NONDETERMINISTIC:
            return False
        outs = _reference_fold(node, ins, self.g.opsets)
        if outs is None:
            return False
        for name, value in zip(node.outputs, outs, strict=False):
            if name:
                arr = np.asarray(value)
                dtype = dtypes.from_numpy(arr.dtype, f"{self.where}: {node.label}")
                self.g.tensors[name] = Tensor(name, dtype, tuple(int(d) for d in arr.shape), arr)
        self.folded += 1
        return True

    def outputs(self, op: Op, node: Node) -> list[Tensor | None]:
        try:
            types = op.infer()
        except UnsupportedError as exc:
            if str(exc).startswith(self.where):
                raise
            raise UnsupportedError(f"{self.where}: {node.label}: {exc}") from None
        outs: list[Tensor | None] = []
        for j, name in enumerate(node.outputs):
            if not name:
                outs.append(None)
                continue
            if j >= len(types):
                op.fail(f"output {j} ({name!r}) is not supported")
            dtype, shape = types[j]
            t = Tensor(name, dtype, tuple(shape))
            _check_inferred(self.g, t, node.label)
            self.g.tensors[name] = t
            outs.append(t)
        op.outs = outs
        return outs

    def fold(
        self, op: Op, cls: type[Op], node: Node, ins: list[Tensor | None],
        outs: list[Tensor | None], all_known: bool,
    ) -> bool:  # fmt: skip
        known = [t for t in ins if t is not None]
        small = all(
            t is None or not is_static(t.shape) or static(numel(t.shape)) <= FOLD_LIMIT
            for t in outs
        )
        if not (cls.FROM_SHAPES or all(t.value is not None for t in known)) or not (
            small or cls.VIEW
        ):
            return False
        values = op.fold()
        if values is None and all_known and not cls.FROM_SHAPES:
            values = _reference_fold(node, ins, self.g.opsets)
        if values is None:
            return False
        for out_t, v in zip(outs, values, strict=False):
            if out_t is not None:
                _set_value(out_t, v, node.label, self.where)
        self.folded += 1
        return True

    def graph_outputs(self) -> tuple[list[Tensor], list[str]]:
        """The graph's outputs as buffers: a value known at build time is copied into one."""
        out_tensors: list[Tensor] = []
        out_names: list[str] = []
        for name in self.g.outputs:
            if name not in self.g.tensors:
                raise CompileError(f"{self.where}: graph output {name!r} is never produced")
            t = self.g.tensors[name]
            if t.value is not None:
                node = Node(-1, f"output {name}", "(output)", "", [name], [name + "#out"], {}, None)  # type: ignore[arg-type]
                m = _Materialize(node, [t], 1, self.where)
                o = Tensor(name + "#out", t.dtype, t.shape)
                m.outs = [o]
                self.steps.append(Step(m, [t], [o]))
                t = o
            out_tensors.append(t)
            out_names.append(name)
        return out_tensors, out_names


def _graph(model: ModelProto, where: str, options: Options) -> Graph:
    g = graph.build(model, where, options.dims)
    for name, value in options.freeze_inputs.items():
        t = g.tensors[name]
        t.value = np.asarray(value).astype(t.dtype.np)
        t.shape = tuple(int(d) for d in t.value.shape)
        t.is_input = False
        g.inputs.remove(name)
    g.batch_dynamic = any(isinstance(d, Batch) for name in g.inputs for d in g.tensors[name].shape)
    for domain in g.opsets:
        used = [n for n in g.nodes if n.domain == domain]
        if domain not in KNOWN_DOMAINS and used:
            raise UnsupportedError(
                f"{where}: {used[0].label}: operator domain {domain!r} is not supported "
                f"(supported: ai.onnx, ai.onnx.ml)"
            )
    return g


def lower(
    model: ModelProto, where: str, options: Options, prefix: str = "meshfn_"
) -> tuple[Unit, dict[str, Any]]:
    """Everything but clang: the unit to emit and the report's model-side figures."""
    inlined = inline.expand(model, _implemented, where)
    g = _graph(model, where, options)
    walk = _Lowering(g, where)
    for node in g.nodes:
        walk.node(node)
    out_tensors, out_names = walk.graph_outputs()
    in_tensors = [g.tensors[n] for n in g.inputs]
    steps = _prune(walk.steps, out_tensors)
    ops_used, folded = walk.ops_used, walk.folded

    storage, scratch, buffers = _lifetimes(steps, in_tensors, out_tensors)
    the_plan = plan(list(buffers.values()))
    metadata = {
        "abi": 2,
        "batch": "dynamic" if g.batch_dynamic else "fixed",
        "inputs": [_io(t, t.name) for t in in_tensors],
        "outputs": [_io(t, n) for t, n in zip(out_tensors, out_names, strict=True)],
    }
    unit = Unit(
        prefix, steps, storage, scratch, the_plan, in_tensors, out_tensors, g.batch_dynamic,
        metadata,
    )  # fmt: skip
    params = _parameters(model)
    info = {
        "model": where,
        "opset": {(d or "ai.onnx"): v for d, v in sorted(g.opsets.items())},
        "operators": dict(sorted(ops_used.items())),
        "folded_nodes": folded,
        "inlined_functions": inlined,
        "parameters": params,
        "batch": metadata["batch"],
        "inputs": metadata["inputs"],
        "outputs": metadata["outputs"],
    }
    return unit, info


def _parameters(model: ModelProto) -> int:
    """Learned values: initializer elements, and the float values of ai.onnx.ml operators'
    attributes (coefficients, tree thresholds and leaf weights, scaler offsets: skl2onnx keeps
    them there, not in initializers)."""
    count = sum(
        int(np.asarray(init.dims, dtype=np.int64).prod()) if init.dims else 1
        for init in model.graph.initializer
    )
    for node in model.graph.node:
        if node.domain != "ai.onnx.ml":
            continue
        for attr in node.attribute:
            if attr.type == AttributeProto.FLOATS:
                count += len(attr.floats)
            elif attr.type == AttributeProto.TENSOR:
                count += int(np.asarray(attr.t.dims, dtype=np.int64).prod()) if attr.t.dims else 1
    return count


def _prune(steps: list[Step], outputs: list[Tensor]) -> list[Step]:
    """Drop nodes no graph output depends on (exporters leave some; they cost time and memory)."""
    needed = {t.name for t in outputs}
    kept: list[Step] = []
    for step in reversed(steps):
        if any(t is not None and t.name in needed for t in step.outputs):
            kept.append(step)
            needed.update(t.name for t in step.inputs if t is not None)
    return kept[::-1]


def _io(t: Tensor, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "datatype": t.dtype.kserve,
        "shape": [-1 if isinstance(d, Batch) else int(d) for d in t.shape],
    }


def _bytes(t: Tensor) -> Dim:
    return mul(numel(t.shape), t.dtype.size)


def _lifetimes(
    steps: list[Step], inputs: list[Tensor], outputs: list[Tensor]
) -> tuple[dict[str, int], dict[int, int], dict[int, Buffer]]:
    storage: dict[str, int] = {}
    buffers: dict[int, Buffer] = {}

    def new(size: Dim, first: int) -> int:
        key = len(buffers)
        buffers[key] = Buffer(key, size, first, first)
        return key

    for t in inputs:
        storage[t.name] = new(_bytes(t), -1)
    scratch: dict[int, int] = {}
    for k, step in enumerate(steps):
        for t_in in step.inputs:
            if t_in is not None and t_in.name in storage:
                b = buffers[storage[t_in.name]]
                b.last = max(b.last, k)
        for j, t_out in enumerate(step.outputs):
            if t_out is None:
                continue
            if (
                step.op.VIEW
                and j == 0
                and step.inputs[0] is not None
                and step.inputs[0].name in storage
            ):
                storage[t_out.name] = storage[step.inputs[0].name]
            else:
                storage[t_out.name] = new(_bytes(t_out), k)
        s = step.op.scratch_bytes()
        if s != 0:
            scratch[k] = new(s, k)
    for t in outputs:
        buffers[storage[t.name]].last = FOREVER
    # a view keeps its storage alive as long as any of its names is read
    return storage, scratch, buffers


def build_module(units: list[Unit], use_cache: bool = True) -> tuple[bytes, str]:
    source = module_source(units, toolchain.RUNTIME_HEADER)
    return toolchain.build(source, use_cache=use_cache), source


def _proto(model: str | os.PathLike[str] | ModelProto) -> tuple[ModelProto, str]:
    if isinstance(model, ModelProto):
        where = model.graph.name or "<model>"
        copy = ModelProto()
        copy.CopyFrom(model)  # sorting and shape inference must not change the caller's graph
        return loader.prepare(copy, where), where
    return loader.load(model), str(model)


def analyze(
    model: str | os.PathLike[str] | ModelProto, options: Options | None = None
) -> dict[str, Any]:
    """Everything the build checks, without clang: the metadata (inputs and outputs, the batch
    as -1) and the report's model-side figures. Raises what `compile_model` would."""
    options = options or Options()
    proto, where = _proto(model)
    unit, info = lower(proto, where, options)
    steps = unit.steps
    constants = sum(
        int(t.value.nbytes)
        for s in steps
        for t in s.inputs
        if t is not None and t.value is not None and not t.symbolic
    )
    # a lower bound of what compile_model measures exactly (data segment + stack + arena)
    estimate = STACK_BYTES + constants + unit.plan.bytes_at(options.max_batch)
    if options.memory_cap_bytes is not None and estimate > options.memory_cap_bytes:
        raise MemoryCapError(
            f"{where}: needs at least {estimate} bytes ({estimate / 2**20:.1f} MiB) of linear "
            f"memory at batch {options.max_batch}, more than the {options.memory_cap_bytes} "
            "allowed; raise limits.memoryMiB or lower the largest batch",
            estimate,
        )
    return {
        **info,
        "arena_bytes": unit.plan.const_bytes,
        "arena_bytes_per_row": unit.plan.row_bytes,
        "memory_lower_bound": estimate,
    }


def compile_model(
    model: str | os.PathLike[str] | ModelProto, options: Options | None = None
) -> CompiledModel:
    """Compile an ONNX model (a path, with its external data beside it, or a ModelProto) into a
    core wasm module speaking ABI v2, with its build report."""
    options = options or Options()
    proto, where = _proto(model)
    unit, info = lower(proto, where, options)
    wasm, source = build_module([unit], options.use_cache)
    w = wasmfile.inspect(wasm)
    if w.imports:
        raise CompileError(f"{where}: the module imports {w.imports} (a compiler bug)")
    base = (w.heap_base + 15) // 16 * 16
    peak = base + unit.plan.bytes_at(options.max_batch)
    peak_pages = max(w.initial_pages, (peak + PAGE - 1) // PAGE)
    report = {
        **info,
        "module_bytes": len(wasm),
        "constant_bytes": len(unit.blob),
        "memory": {
            "static_bytes": base,
            "arena_bytes": unit.plan.const_bytes,
            "arena_bytes_per_row": unit.plan.row_bytes,
            "max_batch": options.max_batch,
            "peak_bytes": peak_pages * PAGE,
        },
        "toolchain": {"clang": toolchain.clang_version(), "flags": " ".join(toolchain.CFLAGS)},
    }
    cap = options.memory_cap_bytes
    if cap is not None and peak_pages * PAGE > cap:
        need = peak_pages * PAGE
        raise MemoryCapError(
            f"{where}: needs {need} bytes ({need / 2**20:.1f} MiB) of linear memory at batch "
            f"{options.max_batch}, more than the {cap} bytes ({cap / 2**20:.1f} MiB) allowed; "
            "raise limits.memoryMiB or lower the largest batch",
            need,
        )
    return CompiledModel(wasm, source, unit.metadata, report)
