"""meshfn's model compiler: ONNX -> C -> core wasm module (ABI v2, ABI.md).

A build-time stage: `meshfn fn build` calls `compile_model`; the backend only ever sees the
signed module. Nothing here imports meshfn's runtime."""

from __future__ import annotations

from .errors import CompileError, MemoryCapError, ModelFileError, ToolchainError, UnsupportedError
from .pipeline import CompiledModel, Options, analyze, compile_model

__all__ = [
    "CompileError",
    "CompiledModel",
    "MemoryCapError",
    "ModelFileError",
    "Options",
    "ToolchainError",
    "UnsupportedError",
    "analyze",
    "compile_model",
]
