"""The element types the generated C handles: ONNX type <-> numpy <-> C <-> KServe v2 name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from .errors import UnsupportedError


@dataclass(frozen=True)
class DType:
    onnx: int
    name: str  # ONNX's name, for messages
    np: np.dtype[np.generic]
    c: str
    kserve: str

    @property
    def size(self) -> int:
        return int(self.np.itemsize)

    @property
    def is_float(self) -> bool:
        return self.np.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.np.kind in "iu"

    @property
    def is_bool(self) -> bool:
        return self.np.kind == "b"


def _d(onnx_type: int, name: str, np_type: type[np.generic], c: str, kserve: str) -> DType:
    return DType(onnx_type, name, np.dtype(np_type), c, kserve)


FLOAT = _d(TensorProto.FLOAT, "float32", np.float32, "float", "FP32")
DOUBLE = _d(TensorProto.DOUBLE, "float64", np.float64, "double", "FP64")
INT8 = _d(TensorProto.INT8, "int8", np.int8, "i8", "INT8")
UINT8 = _d(TensorProto.UINT8, "uint8", np.uint8, "u8", "UINT8")
INT16 = _d(TensorProto.INT16, "int16", np.int16, "i16", "INT16")
UINT16 = _d(TensorProto.UINT16, "uint16", np.uint16, "u16", "UINT16")
INT32 = _d(TensorProto.INT32, "int32", np.int32, "i32", "INT32")
UINT32 = _d(TensorProto.UINT32, "uint32", np.uint32, "u32", "UINT32")
INT64 = _d(TensorProto.INT64, "int64", np.int64, "i64", "INT64")
UINT64 = _d(TensorProto.UINT64, "uint64", np.uint64, "u64", "UINT64")
BOOL = _d(TensorProto.BOOL, "bool", np.bool_, "u8", "BOOL")

ALL = (FLOAT, DOUBLE, INT8, UINT8, INT16, UINT16, INT32, UINT32, INT64, UINT64, BOOL)
BY_ONNX = {d.onnx: d for d in ALL}
FLOATS = (FLOAT, DOUBLE)
INTS = (INT8, UINT8, INT16, UINT16, INT32, UINT32, INT64, UINT64)
NUMERIC = FLOATS + INTS
SUPPORTED_NAMES = ", ".join(d.name for d in ALL)


def from_onnx(elem_type: int, where: str) -> DType:
    dtype = BY_ONNX.get(elem_type)
    if dtype is None:
        name = (
            TensorProto.DataType.Name(elem_type)
            if elem_type in TensorProto.DataType.values()
            else str(elem_type)
        )
        raise UnsupportedError(
            f"{where}: element type {name} is not supported (supported: {SUPPORTED_NAMES})"
        )
    return dtype


def from_numpy(dtype: np.dtype[np.generic], where: str) -> DType:
    for d in ALL:
        if d.np == dtype:
            return d
    raise UnsupportedError(
        f"{where}: element type {dtype} is not supported (supported: {SUPPORTED_NAMES})"
    )
