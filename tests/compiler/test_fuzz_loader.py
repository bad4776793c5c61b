"""The loader against mutated and broken ONNX files (meshfn.testing.onnx_fuzz): every file ends
in a model or a CompileError that names it, within a time limit, nothing crashes, and a mutant
that compiles answers as onnxruntime does wherever onnxruntime accepts it too."""

from __future__ import annotations

from pathlib import Path

from meshfn.testing import onnx_fuzz

MUTANTS = 150  # with the fixed seed: ~15-25 s on one core


def test_loader_survives_mutated_models(tmp_path: Path) -> None:
    paths = onnx_fuzz.write_corpus(tmp_path, MUTANTS, seed=34)
    results = onnx_fuzz.run(paths)
    assert len(results) == len(paths)
    bad = [r for r in results if r["result"] in ("crash", "hang", "wrong")]
    assert not bad, bad
    unnamed = [r for r in results if r["result"] == "refused" and not r["named"]]
    assert not unnamed, unnamed
    by = {r["file"]: r for r in results}
    for name in ("cycle", "dangling", "huge", "missing-data"):
        r = by[str(tmp_path / f"structural-{name}.onnx")]
        assert r["result"] == "refused", r
    refused = sum(r["result"] == "refused" for r in results)
    print(f"{len(results)} files: {refused} refused, {len(results) - refused} loaded")
