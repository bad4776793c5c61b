"""Just enough of the wasm binary format to read what the build report needs (initial memory,
`__heap_base`, imports, exports) without compiling the module."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WasmInfo:
    initial_pages: int = 0
    heap_base: int = 0
    imports: list[str] = field(default_factory=list)
    exports: list[str] = field(default_factory=list)


def _leb(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, pos


def _sleb(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, pos


def _name(data: bytes, pos: int) -> tuple[str, int]:
    n, pos = _leb(data, pos)
    return data[pos : pos + n].decode("utf-8", errors="replace"), pos + n


def inspect(wasm: bytes) -> WasmInfo:
    if wasm[:4] != b"\0asm":
        raise ValueError("not a wasm module")
    info = WasmInfo()
    globals_init: list[int] = []
    export_globals: dict[str, int] = {}
    pos = 8
    while pos < len(wasm):
        sid = wasm[pos]
        size, pos = _leb(wasm, pos + 1)
        end = pos + size
        p = pos
        if sid == 2:  # imports
            count, p = _leb(wasm, p)
            for _ in range(count):
                mod, p = _name(wasm, p)
                name, p = _name(wasm, p)
                info.imports.append(f"{mod}.{name}")
                break  # any import is refused; the rest need not be decoded
        elif sid == 5:  # memory
            count, p = _leb(wasm, p)
            if count:
                _flags, p = _leb(wasm, p)
                info.initial_pages, p = _leb(wasm, p)
        elif sid == 6:  # globals
            count, p = _leb(wasm, p)
            for _ in range(count):
                p += 2  # valtype, mutability
                opcode = wasm[p]
                p += 1
                value = 0
                if opcode in {65, 66}:  # i32.const
                    value, p = _sleb(wasm, p)
                elif opcode in (0x43,):
                    p += 4
                elif opcode in (0x44,):
                    p += 8
                p += 1  # end
                globals_init.append(value)
        elif sid == 7:  # exports
            count, p = _leb(wasm, p)
            for _ in range(count):
                name, p = _name(wasm, p)
                kind = wasm[p]
                index, p = _leb(wasm, p + 1)
                info.exports.append(name)
                if kind == 3:
                    export_globals[name] = index
        pos = end
    if "__heap_base" in export_globals and export_globals["__heap_base"] < len(globals_init):
        info.heap_base = globals_init[export_globals["__heap_base"]]
    return info
