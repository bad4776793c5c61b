"""C emission: one translation unit per module, one `static` function per node, constants in
one aligned blob, the ABI v2 exports (ABI.md).

Node functions take restrict pointers and are kept out of line: clang 14 at -O3 miscompiled
a run function with all nodes inlined (ONNX's attention softcap case: a later node's loads
moved across an earlier node's stores); one call per node costs nothing measurable. The SLP
vectoriser is off for the same reason (toolchain.py); loops still vectorise."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .dims import Batch, Dim, cdim, mul, numel
from .dtypes import DType
from .graph import Tensor

if TYPE_CHECKING:
    from .ops.base import Op
from .plan import Plan

RT_INCLUDE = '#include "mf_rt.h"\n'


@dataclass
class Step:
    op: Op
    inputs: list[Tensor | None]
    outputs: list[Tensor | None]  # None: an optional output the model leaves out


@dataclass
class Unit:
    """One compiled graph inside a module; `prefix` names its exports."""

    prefix: str
    steps: list[Step]
    storage: dict[str, int]  # tensor name -> buffer key
    scratch: dict[int, int]  # step index -> buffer key
    plan: Plan
    inputs: list[Tensor]
    outputs: list[Tensor]
    dynamic: bool
    metadata: dict[str, Any]
    blob: bytearray = field(default_factory=bytearray)
    blob_index: dict[tuple[str, bytes], int] = field(default_factory=dict)


class _NodeEmitter:
    def __init__(self, unit: Unit, step_no: int, step: Step) -> None:
        self.unit, self.step_no, self.step = unit, step_no, step
        self._tmp = 0

    def inp(self, i: int) -> str:
        return f"in{i}"

    def out(self, i: int) -> str:
        return f"out{i}"

    @property
    def scratch(self) -> str:
        return "scratch"

    def tmp(self, prefix: str = "v") -> str:
        self._tmp += 1
        return f"{prefix}{self._tmp}"

    def const(self, value: np.ndarray[Any, Any], dtype: DType) -> str:
        return const_ptr(self.unit, value, dtype)

    def error(self, message: str) -> str:
        label = self.step.op.node.label
        return f"return mf_fail({json.dumps(f'{label}: {message}')});"


def const_ptr(unit: Unit, value: np.ndarray[Any, Any], dtype: DType) -> str:
    data = np.ascontiguousarray(np.asarray(value).astype(dtype.np)).tobytes()
    if not data:
        data = b"\0" * 16
    key = (dtype.c, data)
    off = unit.blob_index.get(key)
    if off is None:
        pad = (-len(unit.blob)) % 16
        unit.blob.extend(b"\0" * pad)
        off = len(unit.blob)
        unit.blob.extend(data)
        unit.blob_index[key] = off
    return f"((const {dtype.c} *)({unit.prefix}blob + {off}))"


def _c_string_bytes(data: bytes) -> str:
    """Bytes as a C string literal (octal escapes: they never swallow a following digit)."""
    lines = []
    for start in range(0, len(data), 64):
        chunk = data[start : start + 64]
        lines.append('"' + "".join(f"\\{b:03o}" for b in chunk) + '"')
    return "\n".join(lines) if lines else '""'


def _symbolic_array(t: Tensor) -> str:
    assert t.value is not None
    items = []
    for v in np.asarray(t.value).reshape(-1):
        items.append(
            f"({t.dtype.c})({cdim(v)})" if isinstance(v, Batch) else f"({t.dtype.c})({int(v)})"
        )
    return "{" + ", ".join(items or ["0"]) + "}"


def _tensor_bytes(t: Tensor) -> Dim:
    return mul(numel(t.shape), t.dtype.size)


class _Nodes:
    """The run function's body: one call per node, to a function shared by nodes that emit the
    same code over the same parameters (unrolled loops, repeated layers: constants are
    arguments, so their bodies are identical)."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.fns: list[str] = []
        self.body: list[str] = []
        self.sym_decls: list[str] = []
        self.locals: dict[str, str] = {}
        self.shared: dict[tuple[str, str], str] = {}

    def storage_ptr(self, key: int) -> str:
        b = self.unit.plan.buffers[key]
        return f"(R + {b.offset}u * N)" if b.batch else f"(A + {b.offset}u)"

    def tensor_expr(self, t: Tensor, const: bool) -> str:
        if t.value is not None and not t.symbolic:
            return const_ptr(self.unit, t.value, t.dtype)
        if t.symbolic:  # a shape computed from the batch: a local array filled per run
            name = self.locals.get(t.name)
            if name is None:
                name = self.locals[t.name] = f"sym{len(self.locals)}"
                self.sym_decls.append(f"  {t.dtype.c} {name}[] = {_symbolic_array(t)};")
            return name
        q = "const " if const else ""
        return f"(({q}{t.dtype.c} *){self.storage_ptr(self.unit.storage[t.name])})"

    def add(self, k: int, step: Step) -> None:
        op = step.op
        code = op.emit(_NodeEmitter(self.unit, k, step))
        params, args = ["u32 N"], ["N"]
        for i, t in enumerate(step.inputs):
            if t is not None:
                params.append(f"const {t.dtype.c} *restrict in{i}")
                args.append(self.tensor_expr(t, True))
        for i, t in enumerate(step.outputs):
            if t is not None:
                params.append(f"{t.dtype.c} *restrict out{i}")
                args.append(self.tensor_expr(t, False))
        if k in self.unit.scratch:
            params.append("u8 *restrict scratch")
            args.append(self.storage_ptr(self.unit.scratch[k]))
        key = (", ".join(params), code)
        fn = self.shared.get(key)
        if fn is None:
            fn = self.shared[key] = f"{self.unit.prefix}n{k}"
            self.fns.append(
                f"/* {op.node.label} */\n"
                f"static __attribute__((noinline)) i32 {fn}({', '.join(params)}) {{\n"
                "  (void)N;\n"
                f"{_indent(code)}\n  return 0;\n}}\n"
            )
        self.body.append(f"  if ((st = {fn}({', '.join(args)})) != 0) return st;")


def emit_unit(unit: Unit) -> str:
    p = unit.prefix
    out: list[str] = []
    nodes = _Nodes(unit)
    for k, step in enumerate(unit.steps):
        if not step.op.VIEW:
            nodes.add(k, step)
    fns, body, sym_decls = nodes.fns, nodes.body, nodes.sym_decls

    io_lines = []
    for j, t in enumerate(unit.inputs + unit.outputs):
        b = unit.plan.buffers[unit.storage[t.name]]
        addr = (
            f"base + {unit.plan.const_bytes}u + {b.offset}u * n"
            if b.batch
            else f"base + {b.offset}u"
        )
        io_lines.append(f"  {p}io[{2 * j}] = {addr};")
        io_lines.append(f"  {p}io[{2 * j + 1}] = {cdim(_tensor_bytes(t)).replace('N', 'n')};")
    nio = max(1, 2 * (len(unit.inputs) + len(unit.outputs)))
    meta = json.dumps(unit.metadata, separators=(",", ":"), ensure_ascii=True)
    fixed = "" if unit.dynamic else " || n != 1"
    out.append(f"/* ---- unit {p} ---- */")
    out.append(
        f"static const u8 {p}blob[{max(16, len(unit.blob))}] __attribute__((aligned(16))) =\n"
        f"{_c_string_bytes(bytes(unit.blob))};"
    )
    out.append(f"static u32 {p}io[{nio}];")
    out.append(f"static u32 {p}planned;")
    out.append(f"static const char {p}meta[] = {json.dumps(meta)};")
    out.extend(fns)
    out.append(
        f'MF_EXPORT("{p}plan") u32 {p}plan(i32 n) {{\n'
        f"  if (n < 1{fixed}) return 0;\n"
        f"  u32 base = mf_arena_base();\n"
        f"  u64 need = (u64)base + {unit.plan.const_bytes}ull + {unit.plan.row_bytes}ull * (u64)n;\n"
        "  if (!mf_reserve(need)) return 0;\n"
        + "\n".join(io_lines)
        + f"\n  {p}planned = (u32)n;\n  return (u32){p}io;\n}}\n"
    )
    out.append(
        f'MF_EXPORT("{p}run") i32 {p}run(i32 n) {{\n'
        f'  if (n < 1 || (u32)n != {p}planned) return mf_fail("run(batch) without plan(batch)");\n'
        "  const u32 N = (u32)n;\n"
        "  u8 *const A = (u8 *)mf_arena_base();\n"
        f"  u8 *const R = A + {unit.plan.const_bytes}u;\n"
        "  (void)A; (void)R;\n"
        "  i32 st = 0; (void)st;\n"
        + "\n".join(sym_decls)
        + ("\n" if sym_decls else "")
        + "\n".join(body)
        + "\n  return 0;\n}\n"
    )
    out.append(
        f'MF_EXPORT("{p}metadata") i64 {p}metadata(void) {{ return mf_pack(0, {p}meta, sizeof({p}meta) - 1); }}\n'
    )
    return "\n".join(out)


MODULE_HEAD = r"""
/* Generated by meshfn.compiler: ONNX graph(s) -> core wasm, ABI v2 (compiler/ABI.md). */
extern u8 __heap_base;
static const char *mf_err_ptr = "";
static u32 mf_err_len;

static __attribute__((unused)) i32 mf_fail(const char *message) {
  u32 n = 0;
  while (message[n]) n++;
  mf_err_ptr = message;
  mf_err_len = n;
  return 1;
}

MF_INLINE u32 mf_arena_base(void) { return ((u32)&__heap_base + 15u) & ~15u; }

/* Grow linear memory to `end` bytes; 0 when the store's cap (or wasm32) refuses. */
static int mf_reserve(u64 end) {
  if (end > 0xFFFF0000ull) return 0;
  u64 have = (u64)__builtin_wasm_memory_size(0) * 65536u;
  if (end <= have) return 1;
  u32 pages = (u32)((end - have + 65535u) / 65536u);
  return __builtin_wasm_memory_grow(0, pages) != (unsigned long)-1;
}

MF_EXPORT("meshfn_error") i64 meshfn_error(void) { return mf_pack(0, mf_err_ptr, mf_err_len); }
"""

SINGLE_TAIL = r"""
MF_EXPORT("meshfn_abi_version") i32 meshfn_abi_version(void) { return 2; }
"""


def module_source(units: list[Unit], header: str) -> str:
    parts = [header, MODULE_HEAD]
    parts.extend(emit_unit(u) for u in units)
    if len(units) == 1 and units[0].prefix == "meshfn_":
        parts.append(SINGLE_TAIL)
    return "\n".join(parts)


def source_key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def _indent(code: str) -> str:
    return "\n".join("  " + line if line else line for line in code.splitlines())
