"""The core module ABIs' import and export rules, checked before anything runs a module: at
build (`meshfn fn build`) and again at publish (a module need not come from our build).

Version 1 (functions/core/ABI.md) is for hand-written core functions (JSON in and out);
version 2 (compiler/ABI.md) is what the model compiler emits for `kind = "onnx"` (raw tensors).
Neither may import anything: a core function gets no host capabilities at all.
"""

from __future__ import annotations

from typing import Literal

import wasmtime

from .errors import BuildError

AbiVersion = Literal[1, 2]
EXPORTS: dict[int, tuple[str, ...]] = {
    1: ("memory", "meshfn_abi_version", "meshfn_metadata", "meshfn_alloc", "meshfn_infer"),
    2: (
        "memory", "meshfn_abi_version", "meshfn_metadata", "meshfn_plan", "meshfn_run",
        "meshfn_error",
    ),
}  # fmt: skip
CORE_EXPORTS = EXPORTS[1]


def check_core_module(wasm: bytes, where: str, abi: AbiVersion = 1) -> None:
    """Enforce the core ABI's import/export rules before anything runs the module."""
    try:
        module = wasmtime.Module(wasmtime.Engine(), wasm)
    except wasmtime.WasmtimeError as exc:
        raise BuildError(f"{where}: not a valid core wasm module: {exc}") from None
    imports = [f"{i.module}.{i.name}" for i in module.imports]
    if imports:
        raise BuildError(f"{where}: core functions may not import anything, found {imports}")
    exports = {e.name for e in module.exports}
    missing = [e for e in EXPORTS[abi] if e not in exports]
    if missing:
        raise BuildError(f"{where}: missing core ABI exports {missing} (ABI v{abi})")
