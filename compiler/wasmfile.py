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


def _leb(data: bytes, pos: int, signed: bool = False) -> tuple[int, int]:
    """A LEB128 integer at `pos` (two's complement when `signed`) and the position after it."""
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if signed and b & 0x40:
                result -= 1 << shift
            return result, pos


def _name(data: bytes, pos: int) -> tuple[str, int]:
    n, pos = _leb(data, pos)
    return data[pos : pos + n].decode("utf-8", errors="replace"), pos + n


def _imports(
    wasm: bytes, p: int, info: WasmInfo, _globals: list[int], _exports: dict[str, int]
) -> None:
    count, p = _leb(wasm, p)
    if count:  # any import is refused; the first names it
        mod, p = _name(wasm, p)
        name, p = _name(wasm, p)
        info.imports.append(f"{mod}.{name}")


def _memory(
    wasm: bytes, p: int, info: WasmInfo, _globals: list[int], _exports: dict[str, int]
) -> None:
    count, p = _leb(wasm, p)
    if count:
        _flags, p = _leb(wasm, p)
        info.initial_pages, p = _leb(wasm, p)


# the bytes an init expression's constant takes after its opcode (i32/i64 are LEB128)
_CONST_BYTES = {0x43: 4, 0x44: 8}


def _globals(
    wasm: bytes, p: int, _info: WasmInfo, values: list[int], _exports: dict[str, int]
) -> None:
    count, p = _leb(wasm, p)
    for _ in range(count):
        p += 2  # valtype, mutability
        opcode = wasm[p]
        p += 1
        value = 0
        if opcode in (0x41, 0x42):  # i32.const, i64.const
            value, p = _leb(wasm, p, signed=True)
        else:
            p += _CONST_BYTES.get(opcode, 0)
        p += 1  # end
        values.append(value)


def _export_section(
    wasm: bytes, p: int, info: WasmInfo, _globals: list[int], globals_by_name: dict[str, int]
) -> None:
    count, p = _leb(wasm, p)
    for _ in range(count):
        name, p = _name(wasm, p)
        kind = wasm[p]
        index, p = _leb(wasm, p + 1)
        info.exports.append(name)
        if kind == 3:
            globals_by_name[name] = index


_SECTIONS = {2: _imports, 5: _memory, 6: _globals, 7: _export_section}


def inspect(wasm: bytes) -> WasmInfo:
    if wasm[:4] != b"\0asm":
        raise ValueError("not a wasm module")
    info = WasmInfo()
    values: list[int] = []
    globals_by_name: dict[str, int] = {}
    pos = 8
    while pos < len(wasm):
        sid = wasm[pos]
        size, pos = _leb(wasm, pos + 1)
        section = _SECTIONS.get(sid)
        if section is not None:
            section(wasm, pos, info, values, globals_by_name)
        pos += size
    index = globals_by_name.get("__heap_base")
    if index is not None and index < len(values):
        info.heap_base = values[index]
    return info
