"""The layering is a contract (docs/concepts/architecture.md): checked here as well as by `lint-imports`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]

# What a pure stage must never pull in: storage, servers, metrics, process spawning.
IMPURE = ("sqlite3", "prometheus_client", "grpc", "subprocess", "meshfn.audit.store")

_PROBE = """
import json, sys
before = set(sys.modules)
import {module}
new = sorted(m for m in set(sys.modules) - before)
print(json.dumps(new))
"""


def imported_by(module: str) -> list[str]:
    """Every module a fresh interpreter loads to import `module`."""
    done = subprocess.run(
        [sys.executable, "-P", "-c", _PROBE.format(module=module)],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",  # with -P nothing of the working directory is on sys.path anyway
    )
    loaded: list[str] = json.loads(done.stdout)
    return loaded


def test_importing_the_translator_loads_nothing_impure() -> None:
    loaded = imported_by("meshfn.xds.translate")
    assert "meshfn.xds.translate" in loaded
    assert [m for m in IMPURE if m in loaded] == []
    assert not [m for m in loaded if m.startswith("meshfn.control_plane")]


def test_the_ir_and_the_contracts_import_no_stage() -> None:
    for module in ("meshfn.ir", "meshfn.contracts.plugins", "meshfn.contracts.function"):
        loaded = imported_by(module)
        meshfn = {m for m in loaded if m.startswith("meshfn.")}
        assert meshfn <= {
            "meshfn.ir",
            "meshfn.contracts",
            "meshfn.contracts.durations",
            "meshfn.contracts.function",
            "meshfn.contracts.plugins",
            "meshfn.contracts.principals",
            "meshfn.contracts.qos",
            "meshfn.contracts.rollout",
            "meshfn.contracts.tracing",
            "meshfn.contracts.words",
        }, (module, sorted(meshfn))
        assert [m for m in IMPURE if m in loaded] == [], module


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle in a directed graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_cycle_between_meshfns_packages() -> None:
    """Squash meshfn's import graph to its packages (meshfn.xds, meshfn.xds.translate, ...):
    the package graph has no cycle at any depth."""
    graph = grimp.build_graph("meshfn")
    packages = sorted(m for m in graph.modules if graph.find_children(m))
    for depth in (2, 3):
        level = [p for p in packages if p.count(".") == depth - 1]

        def owner(module: str, level: list[str] = level) -> str | None:
            return next((p for p in level if module == p or module.startswith(p + ".")), None)

        edges: dict[str, set[str]] = {}
        for importer in graph.modules:
            source = owner(importer)
            for imported in graph.find_modules_directly_imported_by(importer):
                target = owner(imported)
                if source and target and source != target:
                    edges.setdefault(source, set()).add(target)
        assert _cycle(edges) is None, f"package cycle: {' -> '.join(_cycle(edges) or [])}"


def test_a_cycle_is_found() -> None:
    """The cycle finder itself (a test that cannot fail proves nothing)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_lint_imports_passes() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# Packages whose modules are one layer: vocabulary (ir, contracts, common), one module
# (health), test support, and the packages a layered parent already places as one unit.
FLAT = {
    "meshfn.ir",
    "meshfn.contracts",
    "meshfn.common",
    "meshfn.common.kube",
    "meshfn.health",
    "meshfn.testing",
    "meshfn.control_plane.identity",
    "meshfn.control_plane.runtime",
    "meshfn.control_plane.runtime.console",
    "meshfn.xds.fragments",
    "meshfn.xds.translate",
    "meshfn.xds.translate.httpfilters",
}


def test_every_package_is_layered_exhaustively() -> None:
    """The folder tree is the layering: every package with modules of its own has an
    exhaustive layers contract (a module that sits in no layer then fails lint-imports), or is
    flat on purpose (FLAT, above). A new package has to choose."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = {
        f"meshfn.{c}" if c != "meshfn" and not c.startswith("meshfn.") else c
        for contract in config["contracts"]
        if contract["type"] == "layers" and contract.get("exhaustive")
        for c in contract.get("containers", ())
    }
    graph = grimp.build_graph("meshfn")
    packages = {m for m in graph.modules if graph.find_children(m)}
    assert packages - layered - FLAT == set(), "layer these packages (pyproject.toml)"
    assert (layered | FLAT) - packages == set(), "contracts or FLAT name packages that are gone"
