"""Running a compiled module (ABI v2) from Python with wasmtime: what the tests, the
conformance runner and the benchmark use. The backend has its own host; this one shows the
protocol in a few lines and keeps the per-call path to one wasm call when the batch repeats."""

from __future__ import annotations

import ctypes
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
        self.module = module if module is not None else wasmtime.Module(self.engine, wasm)
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
            raise RunError(status, self._unpack(int(self._error(self.store))).decode(errors="replace"))
        outs = []
        for (addr, size), spec in zip(table[len(self.inputs) :], self.outputs, strict=True):
            dtype = _BY_KSERVE[spec["datatype"]].np
            flat = np.frombuffer(bytes(self.memory.read(self.store, addr, addr + size)), dtype=dtype)
            shape = list(spec["shape"])
            if -1 in shape:
                known = int(np.prod([d for d in shape if d != -1])) or 1
                shape[shape.index(-1)] = flat.size // known if known else 0
            outs.append(flat.reshape(shape))
        return outs


_ = ctypes
