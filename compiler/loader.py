"""Reading an ONNX file: parse, external data (baked in at build), topological order, checker,
shape inference. Every failure is a ModelFileError or UnsupportedError naming the file."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, external_data_helper

from .errors import ModelFileError, UnsupportedError

# Anything bigger is not a model for a serverless function (and would not fit in wasm32 memory).
MAX_FILE_BYTES = 2 << 30


def load(path: str | os.PathLike[str]) -> ModelProto:
    """The model at `path` with its external data read in, nodes in topological order, checked
    and with shapes inferred."""
    where = str(path)
    model = parse(Path(path))
    return prepare(model, where)


def parse(path: Path) -> ModelProto:
    where = str(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ModelFileError(f"{where}: cannot read the model: {exc.strerror or exc}") from None
    if size > MAX_FILE_BYTES:
        raise ModelFileError(f"{where}: {size} bytes is larger than the {MAX_FILE_BYTES} supported")
    try:
        data = path.read_bytes()
        model = ModelProto()
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise ModelFileError(f"{where}: not a valid ONNX model (protobuf: {exc})") from None
    if not model.HasField("graph"):
        raise ModelFileError(f"{where}: not an ONNX model (no graph; empty or truncated file?)")
    _read_external_data(model, path.parent, where)
    return model


def _read_external_data(model: ModelProto, base: Path, where: str) -> None:
    """Load every tensor stored outside the .onnx file (PyTorch's exporter writes weights to
    `model.onnx.data`), refusing locations that leave the model's folder."""
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = external_data_helper.ExternalDataInfo(tensor)
        location = info.location or ""
        target = (base / location).resolve()
        if not location or Path(location).is_absolute() or base.resolve() not in target.parents:
            raise ModelFileError(
                f"{where}: tensor {tensor.name!r} names external data {location!r} outside the "
                "model's folder"
            )
        try:
            file_size = target.stat().st_size
        except OSError:
            raise ModelFileError(
                f"{where}: tensor {tensor.name!r} needs external data file {location!r}, which is "
                f"missing (expected at {target})"
            ) from None
        offset = int(info.offset or 0)
        length = info.length
        if (
            offset < 0
            or offset > file_size
            or (length is not None and offset + int(length) > file_size)
        ):
            raise ModelFileError(
                f"{where}: tensor {tensor.name!r} needs bytes {offset}..{offset + int(length or 0)} "
                f"of {location!r}, which has only {file_size} (truncated?)"
            )
        with open(target, "rb") as f:
            f.seek(offset)
            raw = f.read(int(length) if length is not None else -1)
        tensor.raw_data = raw
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT


def prepare(model: ModelProto, where: str) -> ModelProto:
    if model.graph.node and not model.opset_import:
        raise ModelFileError(f"{where}: the model declares no opset")
    for func in model.functions:
        raise UnsupportedError(
            f"{where}: model-local functions ({func.domain}.{func.name}) are not supported; "
            "export with function inlining"
        )
    sort_nodes(model, where)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise ModelFileError(f"{where}: the ONNX checker refuses the model: {first}") from None
    except (RuntimeError, ValueError) as exc:
        raise ModelFileError(f"{where}: the ONNX checker failed: {exc}") from None
    try:
        return onnx.shape_inference.infer_shapes(
            model, check_type=True, strict_mode=True, data_prop=True
        )
    except (onnx.shape_inference.InferenceError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise ModelFileError(f"{where}: ONNX shape inference refuses the model: {first}") from None


def sort_nodes(model: ModelProto, where: str) -> None:
    """Reorder the graph's nodes topologically (Kahn; the file's order where it already is one),
    refusing a cycle with the nodes on it."""
    graph = model.graph
    nodes = list(graph.node)
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            if not out:
                continue
            if out in producer:
                raise ModelFileError(
                    f"{where}: tensor {out!r} is produced by two nodes "
                    f"({_label(nodes[producer[out]], producer[out])} and {_label(node, i)})"
                )
            producer[out] = i
    if _is_topological(nodes, producer):
        return
    order = _kahn_order(nodes, producer)
    if len(order) != len(nodes):
        done = set(order)
        stuck = [_label(nodes[i], i) for i in range(len(nodes)) if i not in done]
        more = f" and {len(stuck) - 8} more" if len(stuck) > 8 else ""
        raise ModelFileError(f"{where}: the graph has a cycle through {', '.join(stuck[:8])}{more}")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def _is_topological(nodes: list[onnx.NodeProto], producer: dict[str, int]) -> bool:
    return all(
        producer.get(name, -1) < i for i, node in enumerate(nodes) for name in node.input if name
    )


def _kahn_order(nodes: list[onnx.NodeProto], producer: dict[str, int]) -> list[int]:
    import heapq

    users: dict[int, list[int]] = defaultdict(list)
    pending = [0] * len(nodes)
    for i, node in enumerate(nodes):
        deps = {producer[name] for name in node.input if name in producer}
        for d in deps:
            users[d].append(i)
        pending[i] = len(deps)
    heap = [i for i in range(len(nodes)) if pending[i] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(heap, u)
    return order


def _label(node: onnx.NodeProto, index: int) -> str:
    return f"node {node.name or '#' + str(index)} ({node.op_type})"
