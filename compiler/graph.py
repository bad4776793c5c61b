"""The compiler's graph: tensors with a dtype, a shape (the batch symbolic) and, when known at
build time, a value; nodes in topological order with their attributes decoded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, numpy_helper

from . import dtypes
from .dims import Batch, Dim, Shape
from .dtypes import DType
from .errors import ModelFileError, UnsupportedError

# Graphs with more than this many elements in one build-time value (weights, folded constants)
# are refused rather than baked into a module.
MAX_CONST_ELEMENTS = 1 << 28


@dataclass
class Tensor:
    name: str
    dtype: DType
    shape: Shape
    # Known at build time: a numpy array (dtype object when it holds Batch sizes: a shape
    # computed from the batch, materialised at run time only if a run-time node reads it).
    value: np.ndarray[Any, Any] | None = None
    is_input: bool = False

    @property
    def const(self) -> bool:
        return self.value is not None

    @property
    def symbolic(self) -> bool:
        return self.value is not None and self.value.dtype == object


@dataclass
class Node:
    index: int
    name: str
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    proto: onnx.NodeProto

    @property
    def label(self) -> str:
        domain = f"{self.domain}." if self.domain else ""
        return f"node {self.name or '#' + str(self.index)} ({domain}{self.op_type})"


@dataclass
class Graph:
    where: str
    opsets: dict[str, int]
    tensors: dict[str, Tensor]
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    inferred: dict[str, tuple[int, tuple[int | None, ...]]] = field(default_factory=dict)
    batch_dynamic: bool = False


def attr_value(a: onnx.AttributeProto, where: str) -> Any:
    if a.type == onnx.AttributeProto.TENSOR:
        return numpy_helper.to_array(a.t)
    if a.type == onnx.AttributeProto.TENSORS:
        return [numpy_helper.to_array(t) for t in a.tensors]
    if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return None  # control flow: the operator (unregistered) refuses the node
    if a.type == onnx.AttributeProto.SPARSE_TENSOR:
        raise UnsupportedError(f"{where}: sparse tensor attributes are not supported")
    value = onnx.helper.get_attribute_value(a)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", errors="replace") for v in value]
    return value


def _shape_of(vi: onnx.ValueInfoProto, where: str, pins: Mapping[str, int]) -> tuple[Shape, bool]:
    """The shape of a graph input: its first dimension may be symbolic (the batch); other
    symbolic dimensions must be pinned by name."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        raise UnsupportedError(f"{where}: input {vi.name!r} has no shape (rank unknown)")
    dims: list[Dim] = []
    dynamic = False
    for axis, d in enumerate(t.shape.dim):
        if d.HasField("dim_value") and d.dim_value >= 0 and not d.dim_param:
            dims.append(int(d.dim_value))
        elif d.dim_param and d.dim_param in pins:
            dims.append(int(pins[d.dim_param]))
        elif axis == 0:
            dims.append(Batch(1))
            dynamic = True
        else:
            name = d.dim_param or "?"
            raise UnsupportedError(
                f"{where}: input {vi.name!r} has a symbolic dimension {axis} ({name!r}); only "
                f"the first (batch) dimension may be symbolic: pin the others (dims={{{name!r}: "
                "...}) or export with static shapes"
            )
    return tuple(dims), dynamic


def build(model: ModelProto, where: str, pins: Mapping[str, int] | None = None) -> Graph:
    pins = pins or {}
    g = model.graph
    opsets: dict[str, int] = {}
    for op in model.opset_import:
        opsets["" if op.domain == "ai.onnx" else op.domain] = int(op.version)
    tensors: dict[str, Tensor] = {}
    for init in g.initializer:
        where_t = f"{where}: initializer {init.name!r}"
        dtype = dtypes.from_onnx(init.data_type, where_t)
        try:
            value = numpy_helper.to_array(init)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ModelFileError(f"{where_t}: cannot read its data ({exc})") from None
        if value.size > MAX_CONST_ELEMENTS:
            raise UnsupportedError(f"{where_t}: {value.size} elements is too large")
        tensors[init.name] = Tensor(init.name, dtype, tuple(int(d) for d in value.shape), value)
    if g.sparse_initializer:
        raise UnsupportedError(f"{where}: sparse initializers are not supported")
    inputs: list[str] = []
    dynamic = False
    for vi in g.input:
        if vi.name in tensors:
            continue  # an initializer listed as an input (old exporters): a constant
        if not vi.type.HasField("tensor_type"):
            raise UnsupportedError(
                f"{where}: input {vi.name!r} is not a tensor (sequences and maps are not supported)"
            )
        dtype = dtypes.from_onnx(vi.type.tensor_type.elem_type, f"{where}: input {vi.name!r}")
        shape, dyn = _shape_of(vi, where, pins)
        dynamic |= dyn
        tensors[vi.name] = Tensor(vi.name, dtype, shape, is_input=True)
        inputs.append(vi.name)
    nodes: list[Node] = []
    for i, n in enumerate(g.node):
        label = f"{where}: node {n.name or '#' + str(i)} ({n.op_type})"
        attrs = {a.name: attr_value(a, label) for a in n.attribute}
        domain = "" if n.domain == "ai.onnx" else n.domain
        nodes.append(Node(i, n.name, n.op_type, domain, list(n.input), list(n.output), attrs, n))
    outputs = [o.name for o in g.output]
    inferred: dict[str, tuple[int, tuple[int | None, ...]]] = {}
    for vi in list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and t.HasField("shape"):
            dims = tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in t.shape.dim)
            inferred[vi.name] = (t.elem_type, dims)
    return Graph(where, opsets, tensors, nodes, inputs, outputs, inferred, dynamic)
