"""Scan loops with a trip count known at build time are unrolled, and operators defined as ONNX functions (Attention, Celu, Mish, GroupNormalization, the loss
functions...) that no unit implements are replaced by their function bodies before lowering,
so their semantics come from the ONNX schema itself and every unit they use is already tested.

A body is used only when each of its nodes means the same at the body's opset as at the model's
(the same schema version in effect), so inlining never changes what a node computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnx.defs
from onnx import ModelProto, NodeProto

from .errors import ModelFileError

MAX_ROUNDS = 6  # functions whose bodies use functions


def _schema(op: str, domain: str, version: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op, version, domain)
    except onnx.defs.SchemaError:
        return None


def _types(model: ModelProto) -> dict[str, onnx.TypeProto]:
    g = model.graph
    out = {vi.name: vi.type for vi in [*g.input, *g.value_info, *g.output]}
    for init in g.initializer:
        out[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
    return out


def _defaults(node: NodeProto, opsets: dict[str, int]) -> dict[str, onnx.AttributeProto]:
    """The schema's attribute defaults (what a body's attribute references fall back to)."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    schema = _schema(node.op_type, domain, opsets.get(domain, 1))
    out: dict[str, onnx.AttributeProto] = {}
    for name, attr in schema.attributes.items() if schema else []:
        default = attr.default_value
        if default is not None and default.type != onnx.AttributeProto.UNDEFINED:
            out[name] = default
    return out


def _raw_body(
    schema: Any, node: NodeProto, version: int, types: dict[str, onnx.TypeProto]
) -> bytes | None:
    """The serialized FunctionProto of the schema's body for this node, if it has one."""
    if schema.has_context_dependent_function:
        usable = [v for v in schema.context_dependent_function_opset_versions if v <= version]
        if not usable or any(n and n not in types for n in node.input):
            return None
        empty = onnx.TypeProto()
        tps = [(types[n] if n else empty).SerializeToString() for n in node.input]
        try:
            raw: bytes = schema.get_context_dependent_function_with_opset_version(
                max(usable), node.SerializeToString(), tps
            )
        except Exception:
            return None
        return raw
    if schema.has_function:
        usable = [v for v in schema.function_opset_versions if v <= version]
        return schema.get_function_with_opset_version(max(usable)) if usable else None
    return None


def _same_meaning(body: onnx.FunctionProto, opsets: dict[str, int]) -> bool:
    """Every body node means at the body's opset what it means at the model's."""
    for op in body.opset_import:
        d = "" if op.domain == "ai.onnx" else op.domain
        if d not in opsets:
            return False
        for n in body.node:
            if ("" if n.domain == "ai.onnx" else n.domain) != d:
                continue
            a, b = _schema(n.op_type, d, op.version), _schema(n.op_type, d, opsets[d])
            if a is None or b is None or a.since_version != b.since_version:
                return False
    return True


def _body(
    node: NodeProto, opsets: dict[str, int], types: dict[str, onnx.TypeProto]
) -> onnx.FunctionProto | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = opsets.get(domain)
    # the function-body API is missing from onnx's type stubs
    schema: Any = None if version is None else _schema(node.op_type, domain, version)
    raw = None if schema is None or version is None else _raw_body(schema, node, version, types)
    if not raw:
        return None
    body = onnx.FunctionProto()
    body.ParseFromString(raw)
    graphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(a.type in graphs for n in body.node for a in n.attribute):
        return None  # control flow inside (If, Scan, Loop): not compiled, so not inlined
    return body if _same_meaning(body, opsets) else None


def _inline(
    node: NodeProto,
    body: onnx.FunctionProto,
    prefix: str,
    schema_defaults: dict[str, onnx.AttributeProto],
) -> list[NodeProto]:
    names = {name: "" for name in body.input}
    for formal, actual in zip(body.input, node.input, strict=False):
        names[formal] = actual
    for formal, actual in zip(body.output, node.output, strict=False):
        names[formal] = actual
    attrs = {a.name: a for a in node.attribute}
    defaults = {**schema_defaults, **{a.name: a for a in body.attribute_proto}}

    def rename(name: str) -> str:
        if not name:
            return ""
        if name not in names:
            names[name] = prefix + name
        return names[name]

    out = []
    for n in body.node:
        copy = NodeProto()
        copy.CopyFrom(n)
        del copy.input[:]
        del copy.output[:]
        copy.input.extend(rename(x) if x in names or x else "" for x in n.input)
        copy.output.extend(rename(x) for x in n.output)
        copy.name = prefix + (n.name or n.op_type)
        del copy.attribute[:]
        for a in n.attribute:
            if a.ref_attr_name:
                src = attrs.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
                if src is None:
                    continue  # the caller left it out: the inner node's own default applies
                new = onnx.AttributeProto()
                new.CopyFrom(src)
                new.name = a.name
                copy.attribute.append(new)
            else:
                copy.attribute.append(a)
        out.append(copy)
    return out


def expand(model: ModelProto, implemented: Callable[[str, str, int], bool], where: str) -> int:
    """Unroll, in place, Scans with a static trip count, and inline every node no unit
    implements whose operator is an ONNX function; returns how many nodes were replaced (shape
    inference is run again when any was)."""
    opsets = {
        ("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in model.opset_import
    }
    total = 0
    for _ in range(MAX_ROUNDS):
        types = _types(model)
        nodes: list[NodeProto] = []
        changed = 0
        for i, node in enumerate(model.graph.node):
            domain = "" if node.domain == "ai.onnx" else node.domain
            version = opsets.get(domain, 0)
            if node.op_type == "Scan" and not domain and version >= 9:
                unrolled = (
                    None
                    if implemented(domain, "Scan", version)
                    else _unroll_scan(model, node, total + changed, where)
                )
                if unrolled is not None:
                    nodes.extend(unrolled)
                    changed += 1
                    continue
            body = (
                None if implemented(domain, node.op_type, version) else _body(node, opsets, types)
            )
            if body is None:
                nodes.append(node)
                continue
            prefix = f"{node.name or node.op_type}_{total + changed}_{i}__"
            nodes.extend(_inline(node, body, prefix, _defaults(node, opsets)))
            changed += 1
        if not changed:
            break
        total += changed
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        try:
            inferred = onnx.shape_inference.infer_shapes(
                model, check_type=True, strict_mode=True, data_prop=True
            )
        except (onnx.shape_inference.InferenceError, RuntimeError, ValueError) as exc:
            raise ModelFileError(
                f"{where}: shape inference fails after inlining ONNX functions: {exc}"
            ) from None
        model.CopyFrom(inferred)
    return total


MAX_UNROLLED_NODES = 50_000


def _scan_static_trip(
    model: ModelProto, node: NodeProto, where: str
) -> tuple[int, list[int], int] | None:
    """(trip count, scan input axes, number of state variables) of a Scan whose trip count is
    known at build time, else None (then the node is refused as an unsupported operator)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    n_scan = int(attrs.get("num_scan_inputs", 0))
    n_state = len(node.input) - n_scan
    if n_scan <= 0 or n_state < 0:
        return None
    axes = [int(a) for a in attrs.get("scan_input_axes", [0] * n_scan)]
    shapes = {
        vi.name: vi.type.tensor_type.shape for vi in [*model.graph.input, *model.graph.value_info]
    }
    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    trips = set()
    for name, axis in zip(node.input[n_state:], axes, strict=True):
        if name in inits:
            dims = inits[name]
            trips.add(int(dims[axis + len(dims) if axis < 0 else axis]))
        elif name in shapes and len(shapes[name].dim) > 0:
            rank = len(shapes[name].dim)
            d = shapes[name].dim[axis + rank if axis < 0 else axis]
            if not d.HasField("dim_value"):
                return None
            trips.add(int(d.dim_value))
        else:
            return None
    if len(trips) != 1:
        return None
    return trips.pop(), axes, n_state


def _ints(attrs: dict[str, onnx.AttributeProto], name: str) -> list[int]:
    return [int(v) for v in onnx.helper.get_attribute_value(attrs[name])] if name in attrs else []


def _const(name: str, value: Any) -> NodeProto:
    tensor = onnx.numpy_helper.from_array(np.asarray(value, dtype=np.int64))
    return onnx.helper.make_node("Constant", [], [name], name=name, value=tensor)


class _Unroller:
    """Scan (opset 9+) with a trip count known at build time, unrolled: each iteration's slice
    is a Gather (folded when the scanned tensor is a constant, as k-nearest-neighbour exports'
    training rows are), the body's names are renamed per iteration, scan outputs are stacked
    with Unsqueeze + Concat. Names the body reads from the outer graph stay as they are."""

    def __init__(
        self,
        model: ModelProto,
        node: NodeProto,
        trip: int,
        axes: list[int],
        n_state: int,
        index: int,
    ) -> None:
        attrs = {a.name: a for a in node.attribute}
        self.node, self.trip, self.axes, self.n_state = node, trip, axes, n_state
        self.body = attrs["body"].g
        self.in_dirs = _ints(attrs, "scan_input_directions")
        self.out_dirs = _ints(attrs, "scan_output_directions")
        self.out_axes = _ints(attrs, "scan_output_axes")
        self.opset = next(
            (o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13
        )
        self.prefix = f"{node.name or 'Scan'}_{index}__"
        self.inner = {o for n in self.body.node for o in n.output} | {
            i.name for i in self.body.input
        }
        self.out: list[NodeProto] = []
        self.state = list(node.input[:n_state])
        self.scan_outs: list[list[str]] = [[] for _ in range(len(self.body.output) - n_state)]

    def iteration(self, t: int) -> None:
        names: dict[str, str] = {}
        for k, vi in enumerate(self.body.input):
            if k < self.n_state:
                names[vi.name] = self.state[k]
                continue
            j = k - self.n_state
            step = self.trip - 1 - t if j < len(self.in_dirs) and self.in_dirs[j] == 1 else t
            idx, sliced = f"{self.prefix}i{t}_{j}_index", f"{self.prefix}i{t}_{j}"
            self.out.append(_const(idx, step))
            source = self.node.input[self.n_state + j]
            self.out.append(
                onnx.helper.make_node(
                    "Gather", [source, idx], [sliced], name=sliced, axis=self.axes[j]
                )
            )
            names[vi.name] = sliced

        def rename(x: str) -> str:
            if x and x not in names and x in self.inner:
                names[x] = f"{self.prefix}t{t}_{x}"
            return names.get(x, x)  # otherwise the outer graph's (or an omitted input)

        for n in self.body.node:
            copy = NodeProto()
            copy.CopyFrom(n)
            del copy.input[:]
            del copy.output[:]
            copy.input.extend(rename(x) for x in n.input)
            copy.output.extend(rename(x) for x in n.output)
            copy.name = f"{self.prefix}t{t}_{n.name or n.op_type}"
            self.out.append(copy)
        self.state = [rename(vi.name) for vi in self.body.output[: self.n_state]]
        for j, vi in enumerate(self.body.output[self.n_state :]):
            self.scan_outs[j].append(rename(vi.name))

    def stack(self, j: int, target: str) -> None:
        axis = self.out_axes[j] if j < len(self.out_axes) else 0
        parts = self.scan_outs[j]
        if j < len(self.out_dirs) and self.out_dirs[j] == 1:
            parts = parts[::-1]
        axis_name = f"{self.prefix}o{j}_axis"
        if self.opset >= 13:  # Unsqueeze takes its axes as an input from opset 13
            self.out.append(_const(axis_name, [axis]))
        stacked = []
        for t, part in enumerate(parts):
            u = f"{self.prefix}o{j}_{t}"
            if self.opset >= 13:
                self.out.append(onnx.helper.make_node("Unsqueeze", [part, axis_name], [u], name=u))
            else:
                self.out.append(
                    onnx.helper.make_node("Unsqueeze", [part], [u], name=u, axes=[axis])
                )
            stacked.append(u)
        self.out.append(
            onnx.helper.make_node("Concat", stacked, [target], name=f"{self.prefix}o{j}", axis=axis)
        )

    def nodes(self) -> list[NodeProto]:
        for t in range(self.trip):
            self.iteration(t)
        outputs = list(self.node.output)
        for k in range(self.n_state):
            if k < len(outputs) and outputs[k]:
                self.out.append(
                    onnx.helper.make_node(
                        "Identity", [self.state[k]], [outputs[k]], name=f"{self.prefix}state{k}"
                    )
                )
        for j in range(len(self.scan_outs)):
            target = outputs[self.n_state + j] if self.n_state + j < len(outputs) else ""
            if target:
                self.stack(j, target)
        return self.out


def _unroll_scan(
    model: ModelProto, node: NodeProto, index: int, where: str
) -> list[NodeProto] | None:
    info = _scan_static_trip(model, node, where)
    if info is None:
        return None
    trip, axes, n_state = info
    body = next(a.g for a in node.attribute if a.name == "body")
    graphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(a.type in graphs for n in body.node for a in n.attribute):
        return None  # nested control flow
    if trip == 0 or trip * (len(body.node) + 3) > MAX_UNROLLED_NODES:
        return None
    return _Unroller(model, node, trip, axes, n_state, index).nodes()
