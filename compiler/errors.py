"""Errors a user can cause by handing the compiler a model: each names the file, and where it
applies the node and operator, so `meshfn fn build` can print it as is (never a traceback)."""

from __future__ import annotations


class CompileError(Exception):
    """The model cannot be compiled; the message says why and what to do."""


class ModelFileError(CompileError):
    """The file is not a loadable ONNX model (corrupt, truncated, missing external data...)."""


class UnsupportedError(CompileError):
    """A valid model uses something the compiler does not implement (operator, opset, dtype,
    attribute or a shape it cannot keep static apart from the batch)."""


class MemoryCapError(CompileError):
    """The model needs more linear memory at its largest batch than the function may use."""

    def __init__(self, message: str, needed_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


class ToolchainError(CompileError):
    """clang or wasm-ld is missing or failed (a compiler bug when the model was accepted)."""
