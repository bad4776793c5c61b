"""What an operator unit is: a class registered for one (domain, op_type) that reads its
attributes, resolves its output dtypes and shapes (the batch kept symbolic), optionally folds
itself at build time, and emits C.

Adding an operator: write a subclass of `Op` decorated with `@register` in a module of this
package and list that module in `ops/__init__.py` (one line)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, NoReturn, Protocol

import numpy as np
import onnx.defs

from .. import dtypes
from ..dims import Batch, Dim, Shape, cdim, numel, show, static
from ..dtypes import DType
from ..errors import UnsupportedError
from ..graph import Node, Tensor

_MISSING = object()


class Emitter(Protocol):
    """What a unit's `emit` may ask of the code generator."""

    def inp(self, i: int) -> str:
        """C pointer (typed, `const`) to input i's elements."""

    def out(self, i: int) -> str:
        """C pointer (typed) to output i's elements."""

    def const(self, value: np.ndarray[Any, Any], dtype: DType) -> str:
        """C pointer to a build-time array baked into the module."""

    def tmp(self, prefix: str = "v") -> str:
        """A fresh C identifier."""

    def error(self, message: str) -> str:
        """A C statement that ends the run with status 1 (bad request) and `message`."""

    @property
    def scratch(self) -> str:
        """C `u8 *` to the node's scratch bytes (`Op.scratch_bytes`)."""


class Op:
    OP: ClassVar[str] = ""
    DOMAIN: ClassVar[str] = ""
    # Oldest schema version (since_version) whose semantics this unit implements.
    SINCE: ClassVar[int] = 1
    # Inputs whose values must be known at build time (shapes, axes, pads...).
    STATIC_INPUTS: ClassVar[tuple[int, ...]] = ()
    # Output 0 is input 0's bytes under another shape (Reshape, Flatten...): no code, no copy.
    VIEW: ClassVar[bool] = False
    # `fold` may succeed without every input's value (Shape and Size need shapes only,
    # CastLike only its first input's value): it is tried even when some are unknown.
    FROM_SHAPES: ClassVar[bool] = False
    # What the docs table says the unit refuses (attributes, dtypes).
    NOTES: ClassVar[str] = ""

    def __init__(self, node: Node, inputs: Sequence[Tensor | None], version: int, where: str):
        self.node = node
        self.inputs = list(inputs)
        self.version = version  # the schema's since_version in effect for this model
        self.where = where
        self.outs: list[Tensor | None] = []

    # ---- reading the node -----------------------------------------------------------------
    def fail(self, why: str) -> NoReturn:
        raise UnsupportedError(f"{self.where}: {self.node.label}: {why}")

    def attr(self, name: str, default: Any = _MISSING) -> Any:
        if name in self.node.attrs and self.node.attrs[name] is not None:
            return self.node.attrs[name]
        if default is _MISSING:
            self.fail(f"attribute {name!r} is required")
        return default

    def has(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] is not None

    def x(self, i: int) -> Tensor:
        t = self.inputs[i] if i < len(self.inputs) else None
        if t is None:
            self.fail(f"input {i} is required")
        return t

    def value(self, i: int) -> np.ndarray[Any, Any]:
        """The build-time value of input i (shape operands)."""
        t = self.x(i)
        if t.value is None:
            self.fail(
                f"input {i} ({t.name!r}) must be known when the model is compiled (a constant "
                "or computed from shapes); a value computed at run time is not supported"
            )
        return t.value

    def ints(self, i: int) -> list[Any]:
        """A static 1-D integer input as Python ints (or Batch sizes)."""
        v = self.value(i)
        return [x if isinstance(x, Batch) else int(x) for x in np.asarray(v).reshape(-1)]

    def need(self, i: int, allowed: Sequence[DType]) -> DType:
        t = self.x(i)
        if t.dtype not in allowed:
            names = ", ".join(d.name for d in allowed)
            self.fail(f"input {i} ({t.name!r}) is {t.dtype.name}; supported: {names}")
        return t.dtype

    def same_dtype(self, *idx: int) -> DType:
        ds = {self.x(i).dtype for i in idx if self.has(i)}
        if len(ds) != 1:
            self.fail("inputs must share one element type")
        return ds.pop()

    def zero_points(self, *pairs: tuple[int, int]) -> None:
        """Quantised operators: each (zero point, tensor) pair of inputs; a zero point that is
        given has its tensor's element type."""
        for z, of in pairs:
            if self.has(z) and self.x(z).dtype != self.x(of).dtype:
                self.fail(
                    f"input {z} (a zero point) must be {self.x(of).dtype.name} like input {of}"
                )

    def qlinear_types(self) -> DType:
        """QLinear operators' eight inputs (a, a_scale, a_zero, b, b_scale, b_zero, y_scale,
        y_zero): 8-bit tensors and zero points, float32 scales, a's and y's per tensor;
        returns y's element type."""
        eight = (dtypes.INT8, dtypes.UINT8)
        for i in (0, 2, 3, 5):  # the zero points are required here
            self.need(i, eight)
        self.zero_points((2, 0), (5, 3))
        for i in (1, 4, 6):
            self.need(i, (dtypes.FLOAT,))
        for i in (1, 2, 6, 7):
            if static(numel(self.shape(i))) != 1:
                self.fail(f"input {i} must be one value (per tensor)")
        return self.need(7, eight)

    def axis(self, axis: int, rank: int) -> int:
        if not -rank <= axis < max(rank, 1):
            self.fail(f"axis {axis} is out of range for rank {rank}")
        return axis + rank if axis < 0 else axis

    # ---- the unit's three jobs ------------------------------------------------------------
    def infer(self) -> list[tuple[DType, Shape]]:
        """Check attributes and input dtypes; return each output's dtype and shape."""
        raise NotImplementedError

    def fold(self) -> list[np.ndarray[Any, Any]] | None:
        """Outputs computed at build time when every input is known; None defers to ONNX's
        reference implementation."""
        return None

    def scratch_bytes(self) -> Dim:
        return 0

    def emit(self, e: Emitter) -> str:
        raise NotImplementedError

    # ---- helpers for units ----------------------------------------------------------------
    def shape(self, i: int) -> Shape:
        return self.x(i).shape

    def oshape(self, i: int = 0) -> Shape:
        t = self.outs[i]
        assert t is not None
        return t.shape

    def out_dtype(self, i: int = 0) -> DType:
        t = self.outs[i]
        assert t is not None
        return t.dtype

    def has_out(self, i: int) -> bool:
        return i < len(self.outs) and self.outs[i] is not None

    def numel_c(self, shape: Shape) -> str:
        return cdim(numel(shape))

    def show(self, shape: Shape) -> str:
        return show(shape)


REGISTRY: dict[tuple[str, str], type[Op]] = {}


def register(cls: type[Op]) -> type[Op]:
    key = (cls.DOMAIN, cls.OP)
    if key in REGISTRY:
        raise RuntimeError(f"operator {key} registered twice")
    REGISTRY[key] = cls
    return cls


def schema_version(op_type: str, domain: str, opset: int) -> int | None:
    try:
        return int(onnx.defs.get_schema(op_type, opset, domain).since_version)
    except onnx.defs.SchemaError:
        return None


def supported_list(domain: str | None = None) -> str:
    names = sorted((f"{d}.{o}" if d else o) for d, o in REGISTRY if domain is None or d == domain)
    return ", ".join(names)


__all__ = ["REGISTRY", "Emitter", "Op", "dtypes", "register", "schema_version"]
