"""Running a compiled module (ABI v2) from Python with wasmtime: what the tests, the
conformance runner and the benchmark use. The backend has its own host; this one shows the
protocol in a few lines and keeps the per-call path to one wasm call when the batch repeats."""

from __future__ import annotations

import ctypes
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import wasmtime

from .dtypes import ALL

_BY_KSERVE = {d.kserve: d for d in ALL}


class RunError(RuntimeError):
    """The module refused the request (status 1-3) with its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"status {status}: {message}")
        self.status = status


def _engine() -> wasmtime.Engine:
    return wasmtime.Engine()


class Runner:
    def __init__(
        self,
        wasm: bytes | None = None,
        prefix: str = "meshfn_",
        module: wasmtime.Module | None = None,
        engine: wasmtime.Engine | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if module is not None and engine is None:
            raise ValueError("a precompiled module needs the engine it was compiled for")
        self.engine = engine or _engine()
        if module is None and wasm is None:
            raise ValueError("give the module's wasm bytes or a precompiled module")
        self.module = module if module is not None else wasmtime.Module(self.engine, wasm or b"")
        self.store = wasmtime.Store(self.engine)
        self.instance = wasmtime.Instance(self.store, self.module, [])
        ex = self.instance.exports(self.store)
        self.memory = cast(wasmtime.Memory, ex["memory"])
        self._plan = cast(wasmtime.Func, ex[f"{prefix}plan"])
        self._run = cast(wasmtime.Func, ex[f"{prefix}run"])
        self._error = cast(wasmtime.Func, ex["meshfn_error"])
        if metadata is None:
            meta = cast(wasmtime.Func, ex[f"{prefix}metadata"])
            metadata = json.loads(self._unpack(int(meta(self.store))).decode())
        self.metadata = dict(metadata)
        self.inputs = self.metadata["inputs"]
        self.outputs = self.metadata["outputs"]
        self._table: list[tuple[int, int]] = []
        self._planned = 0

    def _unpack(self, packed: int) -> bytes:
        packed &= 0xFFFF_FFFF_FFFF_FFFF
        ptr, length = (packed >> 32) & 0x3FFF_FFFF, packed & 0xFFFF_FFFF
        return bytes(self.memory.read(self.store, ptr, ptr + length))

    def plan(self, batch: int) -> list[tuple[int, int]]:
        if batch != self._planned:
            table = int(self._plan(self.store, batch)) & 0xFFFF_FFFF
            if not table:
                raise RunError(2, f"cannot plan memory for batch {batch}")
            n = len(self.inputs) + len(self.outputs)
            raw = self.memory.read(self.store, table, table + 8 * n)
            words = np.frombuffer(bytes(raw), dtype="<u4")
            self._table = [(int(words[2 * i]), int(words[2 * i + 1])) for i in range(n)]
            self._planned = batch
        return self._table

    def __call__(
        self, inputs: Sequence[np.ndarray[Any, Any]] | Mapping[str, np.ndarray[Any, Any]]
    ) -> list[np.ndarray[Any, Any]]:
        if isinstance(inputs, Mapping):
            inputs = [inputs[spec["name"]] for spec in self.inputs]
        arrays = [
            np.ascontiguousarray(a, dtype=_BY_KSERVE[spec["datatype"]].np)
            for a, spec in zip(inputs, self.inputs, strict=True)
        ]
        batch = 1
        if self.metadata.get("batch") == "dynamic":
            for a, spec in zip(arrays, self.inputs, strict=True):
                if spec["shape"] and spec["shape"][0] == -1:
                    batch = int(a.shape[0])
                    break
        table = self.plan(batch)
        for (addr, size), a in zip(table, arrays, strict=False):
            data = a.tobytes()
            if len(data) != size:
                raise ValueError(f"input of {len(data)} bytes where the module expects {size}")
            self.memory.write(self.store, data, addr)
        status = int(self._run(self.store, batch))
        if status:
            raise RunError(
                status, self._unpack(int(self._error(self.store))).decode(errors="replace")
            )
        outs = []
        for (addr, size), spec in zip(table[len(self.inputs) :], self.outputs, strict=True):
            dtype = _BY_KSERVE[spec["datatype"]].np
            flat = np.frombuffer(
                bytes(self.memory.read(self.store, addr, addr + size)), dtype=dtype
            )
            shape = list(spec["shape"])
            if -1 in shape:
                known = int(np.prod([d for d in shape if d != -1])) or 1
                shape[shape.index(-1)] = flat.size // known if known else 0
            outs.append(flat.reshape(shape))
        return outs


# ------------------------------------------------------------------------ the fast call path
@functools.cache
def _ffi_functions() -> dict[str, Any]:
    """wasmtime C API functions as ctypes objects of our own, made once per process."""
    from wasmtime import _ffi

    ctx = ctypes.POINTER(_ffi.wasmtime_context_t)

    def c(name: str, restype: Any, *argtypes: Any) -> Any:
        fn = _ffi.dll[name]
        fn.restype = restype
        fn.argtypes = argtypes
        return fn

    return {
        "call": c(
            "wasmtime_func_call", ctypes.POINTER(_ffi.wasmtime_error_t), ctx,
            ctypes.POINTER(_ffi.wasmtime_func_t), ctypes.POINTER(_ffi.wasmtime_val_t),
            ctypes.c_size_t, ctypes.POINTER(_ffi.wasmtime_val_t), ctypes.c_size_t,
            ctypes.POINTER(ctypes.POINTER(_ffi.wasm_trap_t)),
        ),
        "data": c("wasmtime_memory_data", ctypes.c_void_p, ctx, ctypes.POINTER(_ffi.wasmtime_memory_t)),
        "size": c("wasmtime_memory_data_size", ctypes.c_size_t, ctx, ctypes.POINTER(_ffi.wasmtime_memory_t)),
        "export": c(
            "wasmtime_instance_export_get", ctypes.c_bool, ctx, ctypes.POINTER(_ffi.wasmtime_instance_t),
            ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(_ffi.wasmtime_extern_t),
        ),
    }  # fmt: skip


class FastRunner:
    """The ABI v2 protocol through wasmtime's C API, as a serving host calls it: exports looked
    up by name once, argument buffers made once, numpy views over each tensor's bytes made once
    per planned batch, then per request one copy in per input, one wasm call, one copy out per
    output (wasmtime-py's `Func.__call__` converts every value through Python objects, ~25 us a
    call). Uses `wasmtime._ffi` (hence the pinned wasmtime)."""

    def __init__(
        self,
        wasm: bytes | None = None,
        prefix: str = "meshfn_",
        module: wasmtime.Module | None = None,
        engine: wasmtime.Engine | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        from wasmtime import _ffi

        if module is not None and engine is None:
            raise ValueError("a precompiled module needs the engine it was compiled for")
        self._ffi = _ffi
        self._fn = _ffi_functions()
        self.engine = engine or _engine()
        if module is None and wasm is None:
            raise ValueError("give the module's wasm bytes or a precompiled module")
        self.module = module if module is not None else wasmtime.Module(self.engine, wasm or b"")
        self.store = wasmtime.Store(self.engine)
        self.instance = wasmtime.Instance(self.store, self.module, [])
        self._ctx = self.store._context()  # fixed for the store's life
        self._memory = self._export("memory", _ffi.WASMTIME_EXTERN_MEMORY.value).of.memory
        self._mem_ref = ctypes.byref(self._memory)
        self._funcs = {
            name: self._export(f"{prefix}{name}", _ffi.WASMTIME_EXTERN_FUNC.value).of.func
            for name in ("plan", "run", "metadata")
        }
        self._funcs["error"] = self._export("meshfn_error", _ffi.WASMTIME_EXTERN_FUNC.value).of.func
        self._refs = {name: ctypes.byref(f) for name, f in self._funcs.items()}
        self._args = (_ffi.wasmtime_val_t * 1)()
        self._args[0].kind = _ffi.WASMTIME_I32
        self._arg = self._args[0].of
        self._result = (_ffi.wasmtime_val_t * 1)()
        self._ret = self._result[0].of
        self._trap = ctypes.POINTER(_ffi.wasm_trap_t)()
        self._trap_ref = ctypes.byref(self._trap)
        if metadata is None:
            metadata = json.loads(self._unpack(self._invoke("metadata", None, wide=True)))
        self.metadata = dict(metadata)
        self.inputs = self.metadata["inputs"]
        self.outputs = self.metadata["outputs"]
        self._dynamic = self.metadata.get("batch") == "dynamic"
        self._batch = 0
        self._in_views: list[np.ndarray[Any, Any]] = []
        self._out_views: list[np.ndarray[Any, Any]] = []

    def _export(self, name: str, kind: int) -> Any:
        item = self._ffi.wasmtime_extern_t()
        raw = name.encode()
        found = self._fn["export"](
            self._ctx, ctypes.byref(self.instance._instance), raw, len(raw), ctypes.byref(item)
        )
        if not found or int(item.kind) != kind:
            raise wasmtime.WasmtimeError(f"module lacks export {name!r} of the right kind")
        return item

    def _invoke(self, name: str, arg: int | None, wide: bool = False) -> int:
        nargs = 0
        if arg is not None:
            self._arg.i32 = arg
            nargs = 1
        if self._fn["call"](
            self._ctx, self._refs[name], self._args, nargs, self._result, 1, self._trap_ref
        ):
            raise RunError(3, f"calling {name} failed")
        if self._trap:
            self._trap = ctypes.POINTER(self._ffi.wasm_trap_t)()
            self._trap_ref = ctypes.byref(self._trap)
            raise RunError(3, f"{name} trapped")
        return int(self._ret.i64 if wide else self._ret.i32)

    def _unpack(self, packed: int) -> bytes:
        packed &= 0xFFFF_FFFF_FFFF_FFFF
        ptr, length = (packed >> 32) & 0x3FFF_FFFF, packed & 0xFFFF_FFFF
        base = self._fn["data"](self._ctx, self._mem_ref)
        return ctypes.string_at(base + ptr, length)

    def _views(self, batch: int) -> None:
        """numpy arrays over each input's and output's bytes for `batch` rows (linear memory
        only grows in `meshfn_plan`, so they stay valid until the next plan)."""
        table = self._invoke("plan", batch) & 0xFFFF_FFFF
        if not table:
            raise RunError(2, f"cannot plan memory for batch {batch}")
        base = self._fn["data"](self._ctx, self._mem_ref)
        n = len(self.inputs) + len(self.outputs)
        words = np.frombuffer(ctypes.string_at(base + table, 8 * n), dtype="<u4")
        views = []
        for j, spec in enumerate(self.inputs + self.outputs):
            addr, size = int(words[2 * j]), int(words[2 * j + 1])
            dtype = _BY_KSERVE[spec["datatype"]].np
            flat = np.frombuffer((ctypes.c_char * size).from_address(base + addr), dtype=dtype)  # type: ignore[call-overload]
            shape = list(spec["shape"])
            if -1 in shape:
                known = int(np.prod([d for d in shape if d != -1])) or 1
                shape[shape.index(-1)] = flat.size // known if known else 0
            views.append(flat.reshape(shape))
        self._in_views = views[: len(self.inputs)]
        self._out_views = views[len(self.inputs) :]
        self._batch = batch

    def __call__(
        self, inputs: Sequence[np.ndarray[Any, Any]] | Mapping[str, np.ndarray[Any, Any]]
    ) -> list[np.ndarray[Any, Any]]:
        if isinstance(inputs, Mapping):
            inputs = [inputs[spec["name"]] for spec in self.inputs]
        batch = inputs[0].shape[0] if self._dynamic else 1
        if batch != self._batch:
            self._views(batch)
        for view, a in zip(self._in_views, inputs, strict=True):
            np.copyto(view, a, casting="same_kind")
        self._arg.i32 = batch
        if self._fn["call"](
            self._ctx, self._refs["run"], self._args, 1, self._result, 1, self._trap_ref
        ):
            raise RunError(3, "wasm call failed")
        if self._trap:
            self._trap = ctypes.POINTER(self._ffi.wasm_trap_t)()
            self._trap_ref = ctypes.byref(self._trap)
            raise RunError(3, "wasm trap")
        status = self._ret.i32
        if status:
            raise RunError(
                status,
                self._unpack(self._invoke("error", None, wide=True)).decode(errors="replace"),
            )
        return [v.copy() for v in self._out_views]
