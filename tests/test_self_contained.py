"""A clone with nothing beside it runs every test: no test, bench or test support reads a path
outside the repository (the Istio CRDs once came from ../shared, and a fresh clone failed 95
tests). Checked on the source, where such a path is written: a path literal that climbs out
(`..`, an absolute path into the machine's home or work folders), or `Path(__file__).parents[N]`
that reaches above the repository root."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("tests", "e2e", "bench", "testing")
# Absolute places a test might read that belong to this machine, not to the repository.
# (/usr, /etc, /proc, /sys and /tmp are the system's and the tests' scratch space.)
OUTSIDE = re.compile(r"^\.\./|(^|[\s'\"=])(/work/|/root/|/home/)|(^|/)shared/istio")
# Where a test may legitimately name ~/.cache: the build caches ./dev.sh fills.
ALLOWED_HOME = (".cache",)
# A line that carries this comment hands the path to meshfn as hostile input that must be
# refused (a model's external data escaping its folder): written, never read by the test.
HOSTILE = "# hostile path: refused, never read"


def sources() -> Iterator[Path]:
    for folder in CHECKED:
        yield from (p for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose, not paths)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            out.add(id(first.value))
    return out


def _depth(path: Path) -> int:
    """How many `parents` steps from this file reach the repository root."""
    return len(path.relative_to(ROOT).parts) - 1


def _parents_index(node: ast.Subscript) -> int | None:
    """N in `Path(__file__)...parents[N]`, else None."""
    value = node.value
    if not (isinstance(value, ast.Attribute) and value.attr == "parents"):
        return None
    if "__file__" not in ast.unparse(value):
        return None
    if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
        return node.slice.value
    return None


def problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    prose = _docstrings(tree)
    lines = path.read_text().splitlines()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in prose
            and HOSTILE not in lines[node.lineno - 1]
        ):
            text = node.value
            if OUTSIDE.search(text) and not any(f"/{a}" in text for a in ALLOWED_HOME):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: path {text!r}")
        n = _parents_index(node) if isinstance(node, ast.Subscript) else None
        if n is not None and n > _depth(path):
            found.append(
                f"{path.relative_to(ROOT)}:{node.lineno}: parents[{n}] climbs above the "
                f"repository root (this file is {_depth(path)} folder(s) deep)"
            )
        # ROOT.parent / ...: beside the clone
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "parent"
            and isinstance(node.value, ast.Name)
            and node.value.id in {"ROOT", "REPO"}
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_or_bench_reads_outside_the_repository() -> None:
    found = [p for path in sources() for p in problems(path)]
    assert found == [], "\n".join(found)


def test_the_check_sees_each_way_out(tmp_path: Path) -> None:
    """The scanner itself: each pattern it exists for is reported (a check that cannot fail
    proves nothing)."""
    probe = ROOT / "tests" / "_probe_outside.py"
    probe.write_text(
        "from pathlib import Path\n"
        "ROOT = Path(__file__).resolve().parents[1]\n"
        "A = Path(__file__).resolve().parents[3]\n"
        "B = ROOT.parent / 'shared'\n"
        "C = '../shared/istio/crd-all.gen.yaml'\n"
        "D = '/work/main/x'\n"
        "E = Path.home() / '.cache' / 'meshfn'\n"
        "F = '../../etc/passwd'  # hostile path: refused, never read\n"
    )
    try:
        found = problems(probe)
    finally:
        probe.unlink()
    assert len(found) == 4, found
    assert any("parents[3]" in f for f in found)
    assert any("ROOT.parent" in f for f in found)
    assert any("../shared" in f for f in found)
    assert any("/work/main" in f for f in found)
