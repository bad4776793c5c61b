"""The proxy-wasm filters for tests and benchmarks: built modules and the native harness."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Literal

from envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2 import (
    HttpFilter,
)

from meshfn import wasm_filters as filters
from meshfn.contracts.plugins import AuditSettings, DegradeSettings, FilterKind, build_name
from meshfn.xds.translate import wasm


@cache
def wasm_dir(native: bool = False) -> Path:
    """The built modules (with `native`, also the harness's shared objects), built if needed."""
    return filters.build(native)


def wasm_path(kind: FilterKind, lean: bool = False) -> Path:
    return wasm_dir() / f"{build_name(kind, lean)}.wasm"


@cache
def harness(name: Literal["fakehost", "envoy_static"]) -> ModuleType:
    """The filters' test harness (wasm_filters/harness/<name>.py: the fake ABI host's driver, or
    static Envoy configs for e2e tests and benchmarks). wasm_filters/ ships as source, not as a
    package, so it is loaded by path; each module is loaded once."""
    path = filters.source_dir() / "harness" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"meshfn_harness_{name}", path)
    if spec is None or spec.loader is None:
        raise filters.BuildError(f"{path} not found")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def audit_filter(settings: AuditSettings) -> HttpFilter:
    """translate.wasm.audit_filter on the built modules."""
    return wasm.audit_filter(settings, wasm_dir())


def degrade_filter(settings: DegradeSettings) -> HttpFilter:
    return wasm.degrade_filter(settings, wasm_dir())


def meshfn_filter(audit: AuditSettings | None, degrade: DegradeSettings | None) -> HttpFilter:
    return wasm.meshfn_filter(audit, degrade, wasm_dir())
