"""ONNX's own node conformance cases through compiled wasm (meshfn.compiler.conformance).

Every case whose operators are registered is attempted; a claimed operator failing a case is a
bug. Cases not attempted are listed, with the reason, in conformance_excluded.txt: a case that
starts being refused (or stops) fails here until the list is regenerated and reviewed."""

from __future__ import annotations

from pathlib import Path

from meshfn.compiler import conformance

EXCLUDED = Path(__file__).with_name("conformance_excluded.txt")

# The operators the issue names (MLP/CNN exports, transformer blocks, shape plumbing): each
# must be exercised by at least one passing ONNX case.
REQUIRED = {
    "Gemm", "MatMul", "Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "BatchNormalization",
    "Relu", "Sigmoid", "Tanh", "LeakyRelu", "Gelu", "Erf", "Softmax", "LogSoftmax", "Reshape",
    "Flatten", "Transpose", "Concat", "Gather", "Slice", "Squeeze", "Unsqueeze", "ReduceMean",
    "ReduceSum", "ReduceMax", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Equal", "Less",
    "Greater", "Where", "Shape", "Constant", "ConstantOfShape", "Expand", "Identity", "Cast",
    "LayerNormalization", "ArgMax", "Clip", "Exp", "Log",
}  # fmt: skip


def test_node_conformance() -> None:
    summary = conformance.run()
    print(summary.line())
    failed = [f"{o.name}: {o.detail}" for o in summary.outcomes if o.status == "failed"]
    assert not failed, f"{len(failed)} claimed cases fail:\n" + "\n".join(failed)
    assert summary.attempted > 800, summary.line()

    listed = conformance.read_excluded(EXCLUDED.read_text())
    now = {o.name: o.detail for o in summary.outcomes if o.status in ("refused", "unclaimed")}
    newly = sorted(set(now) - set(listed))
    stale = sorted(set(listed) - set(now))
    assert not newly, "cases newly excluded (regenerate the list and say why):\n" + "\n".join(
        f"{n}: {now[n]}" for n in newly
    )
    assert not stale, "listed as excluded but now attempted (regenerate the list):\n" + "\n".join(
        stale
    )

    missing = REQUIRED - conformance.covered_operators(summary)
    assert not missing, f"no passing ONNX case exercises {sorted(missing)}"
