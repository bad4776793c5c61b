"""Tensor data as the host keeps it: little-endian raw bytes, whatever the client sent.

KServe v2 carries tensor data three ways: JSON arrays, the binary tensor data extension (raw
bytes after a JSON header) and gRPC (typed `contents` or `raw_input_contents`). Each is checked
here as strictly as the others (element types and ranges for JSON and typed contents, sizes
against shape x datatype and BYTES framing for raw bytes) and becomes the same raw layout:
fixed-size types as little-endian arrays, BOOL one byte per element, BYTES each element behind
a 4-byte little-endian length (Triton's layout). Raw bytes concatenate along the first
dimension, which is what dynamic batching needs, and reach the guest base64-encoded.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

assert sys.byteorder == "little", "raw tensor data is little-endian; so is every host we run on"


class TensorError(ValueError):
    """A tensor's data contradicts its datatype or shape (the caller adds which request)."""


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    size: int  # bytes per element; 0 for BYTES (variable)
    code: str  # array/struct type code ("" for BOOL and BYTES)
    low: float = 0
    high: float = 0
    kind: str = "int"  # int | float | bool | bytes


_I = {8: "b", 16: "h", 32: "i", 64: "q"}
# The largest JSON numbers that round to a finite FP16/FP32 value (round to nearest, ties to
# even: the tie above the largest finite value goes to infinity). A float32 writer prints
# FLT_MAX as 3.4028235e38, a little more than FLT_MAX itself, and that must still be FLT_MAX.
_FP16_MAX = math.nextafter(65520.0, 0.0)
_FP32_MAX = math.nextafter(2.0**128 - 2.0**103, 0.0)
_U = {8: "B", 16: "H", 32: "I", 64: "Q"}
DTYPES: dict[str, DType] = {
    **{
        f"INT{bits}": DType(
            f"INT{bits}", bits // 8, code, -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        )
        for bits, code in _I.items()
    },
    **{
        f"UINT{bits}": DType(f"UINT{bits}", bits // 8, code, 0, (1 << bits) - 1)
        for bits, code in _U.items()
    },
    "FP16": DType("FP16", 2, "e", -_FP16_MAX, _FP16_MAX, "float"),
    "FP32": DType("FP32", 4, "f", -_FP32_MAX, _FP32_MAX, "float"),
    "FP64": DType("FP64", 8, "d", -sys.float_info.max, sys.float_info.max, "float"),
    "BOOL": DType("BOOL", 1, "", kind="bool"),
    "BYTES": DType("BYTES", 0, "", kind="bytes"),
}


def dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise TensorError(f"unknown datatype {name!r}") from None


def element_count(shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape)


# ---------------------------------------------------------------- JSON values -> raw


def flatten_checked(data: Any, dt: DType, finite: bool = True) -> list[Any]:
    """The (possibly nested, row-major) JSON array `data` as a flat list, each element checked
    against `dt`. `data` comes from json.loads, so exact type tests are complete (bool, the only
    subclass of int, is rejected where a number is expected); one tight loop per kind.
    `finite=False` lets NaN and the infinities through: a model's output may hold them, and
    the raw layouts (binary data, gRPC) carry any IEEE-754 value; a client's JSON never does."""
    flat = data if type(data) is list else [data]
    if flat and type(flat[0]) is list:
        flat = _in_order(flat)
    kind = dt.kind
    if kind in _NUMBER_TYPES and _all_in_range(flat, dt):
        return flat
    if kind == "float":
        _check_floats(flat, dt, finite)
    elif kind == "int":
        _check_ints(flat, dt)
    else:
        want, what = (bool, "true/false") if kind == "bool" else (str, "a string")
        for v in flat:
            if type(v) is not want:
                raise TensorError(f"{dt.name} element {v!r} is not {what}")
    return flat


def _check_floats(flat: list[Any], dt: DType, finite: bool) -> None:
    low, high = dt.low, dt.high
    for v in flat:
        t = type(v)
        if t is not float and t is not int:
            raise TensorError(f"{dt.name} element {v!r} is not a number")
        if not low <= v <= high:
            if t is float and not math.isfinite(v):
                if finite:
                    raise TensorError(f"non-finite {dt.name} element")
                continue
            raise TensorError(f"{v} is out of range for {dt.name}")


def _check_ints(flat: list[Any], dt: DType) -> None:
    low, high = dt.low, dt.high
    for v in flat:
        if type(v) is not int:
            raise TensorError(f"{dt.name} element {v!r} is not an integer")
        if not low <= v <= high:
            raise TensorError(f"{v} is out of range for {dt.name}")


_NUMBER_TYPES: dict[str, set[type]] = {"float": {float, int}, "int": {int}}


def _all_in_range(flat: list[Any], dt: DType) -> bool:
    """Whether every element is a number of `dt`'s kind in its range, in C-speed passes (set,
    sum, min, max instead of a Python loop: ~2x on small tensors). False sends the caller to
    the element loop, which names the offending element; so a false False (a sum that
    overflows) costs time, never a wrong answer."""
    if not flat:
        return True
    kinds = set(map(type, flat))
    if not kinds <= _NUMBER_TYPES[dt.kind]:
        return False
    try:
        if float in kinds and not math.isfinite(sum(flat)):  # NaN or an infinity
            return False
        return bool(dt.low <= min(flat) and max(flat) <= dt.high)
    except OverflowError:  # an integer too large for a float beside floats
        return False


def _in_order(data: list[Any]) -> list[Any]:
    """Nested JSON arrays in row-major order. The nesting must be rectangular, as numpy reads
    it: every list at one depth as long as the others. A ragged array has no row-major order
    (read flat, [[1,2,3],[4]] for shape [2,2] would be [[1,2],[3,4]]), so it is refused rather
    than reinterpreted. A list among the innermost values stays in `flat` for the element
    check to name."""
    level = data
    while level and type(level[0]) is list:
        width = len(level[0])
        flat: list[Any] = []
        for item in level:
            if type(item) is not list or len(item) != width:
                what = f"a list of {len(item)}" if type(item) is list else repr(item)
                raise TensorError(
                    f"ragged nested data: {what} beside a list of {width} "
                    "(nested data must be rectangular, or flat in row-major order)"
                )
            flat += item
        level = flat
    return level


def pack(values: list[Any], dt: DType) -> bytes:
    """Checked flat values -> raw bytes."""
    if dt.kind == "bytes":
        elements = []
        for i, v in enumerate(values):
            try:
                elements.append(v.encode() if isinstance(v, str) else bytes(v))
            except UnicodeEncodeError:
                # JSON can escape half a UTF-16 pair ("\ud800"): valid JSON, but no text
                raise TensorError(
                    f"BYTES element {i} is not text: it holds a lone UTF-16 surrogate"
                ) from None
        return frame(elements)
    if dt.kind == "bool":
        return bytes(1 if v else 0 for v in values)
    if dt.code == "e":
        return struct.pack(f"<{len(values)}e", *values)
    return array(dt.code, values).tobytes()


def json_to_raw(
    data: Any, dt: DType, shape: tuple[int, ...] | list[int], finite: bool = True
) -> bytes:
    flat = flatten_checked(data, dt, finite)
    count = element_count(shape)
    if len(flat) != count:
        raise TensorError(f"{len(flat)} elements for shape {list(shape)} ({count} expected)")
    return pack(flat, dt)


# ---------------------------------------------------------------- raw checks and views


def frame(elements: list[bytes]) -> bytes:
    """BYTES elements -> Triton's layout (each behind a 4-byte little-endian length)."""
    parts = []
    for element in elements:
        parts.append(struct.pack("<I", len(element)))
        parts.append(element)
    return b"".join(parts)


def unframe(raw: bytes, count: int) -> list[bytes]:
    """Triton's BYTES layout -> `count` elements; any missing, short or extra byte is an error."""
    out = []
    offset, end = 0, len(raw)
    for i in range(count):
        if offset + 4 > end:
            raise TensorError(f"BYTES data ends before element {i} of {count} (no length prefix)")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > end:
            raise TensorError(
                f"BYTES element {i} claims {length} bytes but only {end - offset} remain"
            )
        out.append(raw[offset : offset + length])
        offset += length
    if offset != end:
        raise TensorError(f"{end - offset} bytes left after the {count} BYTES elements")
    return out


def check_raw(raw: bytes, dt: DType, count: int) -> None:
    """Raw bytes must be exactly `count` elements of `dt`."""
    if dt.kind == "bytes":
        unframe(raw, count)
        return
    if len(raw) != count * dt.size:
        raise TensorError(
            f"{len(raw)} bytes of {dt.name} data, but the shape needs {count} x {dt.size} = "
            f"{count * dt.size}"
        )
    if dt.kind == "bool" and raw.translate(None, b"\x00\x01"):
        raise TensorError("BOOL bytes must be 0 or 1")


def unpack(raw: bytes, dt: DType, count: int) -> list[Any]:
    """Raw bytes (already checked) -> flat JSON-ready values."""
    if dt.kind == "bytes":
        return [e.decode("utf-8", "replace") for e in unframe(raw, count)]
    if dt.kind == "bool":
        return [b == 1 for b in raw]
    if dt.code == "e":
        return list(struct.unpack(f"<{count}e", raw))
    return array(dt.code, raw).tolist()
