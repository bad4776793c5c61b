"""Operators defined as ONNX functions (Attention, Celu, Mish, GroupNormalization, the loss
functions...) that no unit implements are replaced by their function bodies before lowering,
so their semantics come from the ONNX schema itself and every unit they use is already tested.

A body is used only when each of its nodes means the same at the body's opset as at the model's
(the same schema version in effect), so inlining never changes what a node computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def _body(
    node: NodeProto, opsets: dict[str, int], types: dict[str, onnx.TypeProto]
) -> onnx.FunctionProto | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = opsets.get(domain)
    if version is None:
        return None
    # the function-body API is missing from onnx's type stubs
    schema: Any = _schema(node.op_type, domain, version)
    if schema is None:
        return None
    raw = None
    if schema.has_context_dependent_function:
        usable = [v for v in schema.context_dependent_function_opset_versions if v <= version]
        if usable and all(not n or n in types for n in node.input):
            empty = onnx.TypeProto()
            tps = [(types[n] if n else empty).SerializeToString() for n in node.input]
            try:
                raw = schema.get_context_dependent_function_with_opset_version(
                    max(usable), node.SerializeToString(), tps
                )
            except Exception:
                raw = None
    elif schema.has_function:
        usable = [v for v in schema.function_opset_versions if v <= version]
        if usable:
            raw = schema.get_function_with_opset_version(max(usable))
    if not raw:
        return None
    body = onnx.FunctionProto()
    body.ParseFromString(raw)
    graphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(a.type in graphs for n in body.node for a in n.attribute):
        return None  # control flow inside (If, Scan, Loop): not compiled, so not inlined
    for op in body.opset_import:  # every body node must mean what it means in the model
        d = "" if op.domain == "ai.onnx" else op.domain
        if d not in opsets:
            return None
        for n in body.node:
            nd = "" if n.domain == "ai.onnx" else n.domain
            if nd != d:
                continue
            a, b = _schema(n.op_type, d, op.version), _schema(n.op_type, d, opsets[d])
            if a is None or b is None or a.since_version != b.since_version:
                return None
    return body


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
    """Inline, in place, every node no unit implements whose operator is an ONNX function;
    returns how many were inlined (shape inference is run again when any was)."""
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
