"""Markers applied by folder, fixture and the test support a module uses, never by hand.

`./dev.sh unit` deselects everything that needs a real process or toolchain (`-m "not (e2e or
slow or postgres or envoy or clang or fuzz)"`), so a marker has to follow what a test really
starts: a test module that imports the Envoy rig is an `envoy` test whether or not its author
remembered to say so. Loaded for every run by pyproject's `addopts` (`-p meshfn.testing.markers`).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

MARKERS = {
    "e2e": "starts meshfn's real processes (e2e/)",
    "slow": "a real kube-apiserver, a benchmark run, the docs' command sequences or site build",
    "postgres": "starts a real PostgreSQL server",
    "envoy": "starts real Envoy (or `envoy --mode validate`)",
    "clang": "compiles C with clang (filters, core-wasm functions, fuzz targets)",
    "fuzz": "runs the coverage-guided fuzzers",
}

# The test support a module uses -> what it starts (meshfn.testing's own modules).
_SUPPORT = {
    "meshfn.testing.envoy": ("envoy",),
    "meshfn.testing.processes": ("envoy",),
    "meshfn.testing.postgres": ("postgres",),
    "meshfn.testing.filters": ("clang",),
    "meshfn.testing.fuzz": ("fuzz", "clang"),
    "meshfn.testing.fuzz_targets": ("fuzz",),
    "meshfn.testing.ebpf": ("clang",),
    "meshfn.testing.kubebuild": ("slow",),
    "meshfn.inference.build": ("clang",),
    "meshfn.inference.examples": ("clang",),
    # the model compiler builds every model it is given with clang
    "meshfn.compiler.pipeline": ("clang",),
    "meshfn.compiler.conformance": ("clang",),
    "meshfn.testing.onnx_fuzz": ("clang",),
}
# Test files that are slow by what they do, not by what they import: the task pages' command
# sequences (each a dozen `meshfn` processes, a function build), the strict site build.
_SLOW_FILES = {"test_tasks.py", "test_site.py", "test_kube.py"}
# Fixtures -> what they start.
_FIXTURES = {"pg": ("postgres",)}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def _support_of(module: types.ModuleType) -> set[str]:
    """The markers implied by what a test module took from meshfn.testing (and the builders)."""
    found: set[str] = set()
    for value in vars(module).values():
        origin = value.__name__ if isinstance(value, types.ModuleType) else None
        origin = origin or getattr(value, "__module__", None)
        if isinstance(origin, str):
            found.update(_SUPPORT.get(origin, ()))
    return found


def markers_for(item: pytest.Item) -> set[str]:
    """Every automatic marker of one collected test."""
    path = Path(str(item.path))
    found: set[str] = set()
    if "e2e" in path.parts:
        found.add("e2e")
    if path.parent.name == "fuzz" and path.parent.parent.name == "tests":
        found.add("fuzz")
    if path.name.endswith("_bench_smoke.py") or path.name in _SLOW_FILES:
        found.add("slow")
    module = getattr(item, "module", None)
    if module is not None:
        found |= _support_of(module)
    for fixture in getattr(item, "fixturenames", ()):
        found.update(_FIXTURES.get(fixture, ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "postgres" in callspec.params.values():
        found.add("postgres")
    return found


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(markers_for(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(getattr(pytest.mark, name))
