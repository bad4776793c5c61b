"""Exact C literals for attribute values."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .dtypes import DType


def flit(x: float, dtype: DType) -> str:
    """An exact C literal for a float attribute (hex float), typed for `dtype`."""
    x = float(x)
    if math.isnan(x):
        return "MF_NAN"
    if math.isinf(x):
        return "MF_INF" if x > 0 else "(-MF_INF)"
    if dtype.c == "float":
        return f"{float(np.float32(x)).hex()}f"
    if dtype.is_float:
        return x.hex()
    return repr(int(x))


def ilit(x: int, dtype: DType) -> str:
    if dtype.c in ("i64",):
        return f"((i64){int(x)}LL)" if x >= 0 else f"((i64)({int(x) + 1}LL - 1))"
    if dtype.c == "u64":
        return f"((u64){int(x)}ULL)"
    return f"(({dtype.c}){int(x)})"


def lit(x: Any, dtype: DType) -> str:
    if dtype.is_float:
        return flit(float(x), dtype)
    if dtype.is_bool:
        return "1" if bool(x) else "0"
    return ilit(int(x), dtype)
