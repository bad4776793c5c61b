"""wasmtime instances of model functions: loading precompiled artifacts, isolation, one call.

Every store gets `set_wasi` (a component's first WASI call aborts the whole process otherwise)
with an empty WasiConfig: no preopened directories, no environment, no arguments, stdio
discarded. Every call sets a fresh epoch deadline; a trapped instance is poisoned and must be
dropped by its owner. Nothing here compiles: artifacts come from `Component/Module.deserialize_file`
(mmap of a registry `.cwasm`), which is the point of precompiling at publish time.
"""

from __future__ import annotations

import ctypes
import enum
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import wasmtime
from wasmtime import _ffi
from wasmtime import component as wc

from .engine import arm

# python: a component (meshfn:model); core: a core module of ABI v1 (JSON); onnx: a compiled
# model, a core module of ABI v2 (raw tensors, compiler/ABI.md)
Kind = Literal["python", "core", "onnx"]
KINDS: tuple[Kind, ...] = ("python", "core", "onnx")

_EXTERN_FUNC = _ffi.WASMTIME_EXTERN_FUNC.value
_EXTERN_MEMORY = _ffi.WASMTIME_EXTERN_MEMORY.value

# Instantiation runs guest start-up code (componentize-py's snapshot restore is quick, but a
# hostile module could loop): bound it like a call.
INSTANTIATE_TICKS = 400


class Outcome(enum.Enum):
    OK = "ok"
    BAD_REQUEST = "bad-request"  # the model rejected the input (400)
    OUT_OF_MEMORY = "out-of-memory"  # the guest hit its memory cap
    INTERNAL = "internal"  # the model reported an error
    TIMEOUT = "timeout"  # epoch deadline interrupted it
    TRAP = "trap"  # any other trap

    @property
    def poisons(self) -> bool:
        """Whether the instance must be discarded after this outcome."""
        return self in (Outcome.TIMEOUT, Outcome.TRAP, Outcome.OUT_OF_MEMORY)


@dataclass(frozen=True, slots=True)
class CallResult:
    outcome: Outcome
    body: str  # response JSON for OK (ABI v2: ""), else a message
    outputs: tuple[bytes, ...] = ()  # ABI v2: each output's raw bytes, in metadata order


@dataclass(frozen=True, slots=True)
class TensorCall:
    """One ABI v2 call (compiler/ABI.md): `rows` is the batch it is planned for, `inputs` each
    input's raw little-endian bytes in metadata order, already checked by the host against
    the signed metadata (tensorio.py); `outputs` how many tensors come back."""

    rows: int
    inputs: tuple[bytes, ...]
    outputs: int


# What a guest call takes: a request JSON text (python, ABI v1) or raw tensors (ABI v2).
GuestRequest = str | TensorCall


_CORE_STATUS = {
    0: Outcome.OK,
    1: Outcome.BAD_REQUEST,
    2: Outcome.OUT_OF_MEMORY,
    3: Outcome.INTERNAL,
}
_WIT_ERRORS = {
    "bad-request": Outcome.BAD_REQUEST,
    "out-of-memory": Outcome.OUT_OF_MEMORY,
    "internal": Outcome.INTERNAL,
}


_STUB_CALL = re.compile(r"^\s*\d+: 0x[0-9a-f]+ - libc\.so!(\w+)", re.M)


def classify_trap(exc: Exception) -> CallResult:
    text = str(exc)
    if "wasm trap: interrupt" in text:
        return CallResult(Outcome.TIMEOUT, "interrupted at its deadline")
    first = text.split("\n", 2)[1] if text.count("\n") >= 1 else ""
    stub = _STUB_CALL.search(text)
    if stub and "<unknown>!<wasm function" in first:
        # componentize-py --stub-wasi replaced every WASI import with a trapping stub
        return CallResult(
            Outcome.TRAP,
            f"it called a host capability that model functions do not have ({stub.group(1)}): "
            "no files, clocks, sleeping, environment or network",
        )
    # The first "wasm trap:" line names the cause; the backtrace before it is noise for clients.
    reason = next((line.strip() for line in reversed(text.splitlines()) if "wasm trap" in line), "")
    return CallResult(Outcome.TRAP, reason or text.splitlines()[0] if text else "trap")


class Instance(Protocol):
    def call(self, request: GuestRequest, ticks: int) -> CallResult: ...

    def metadata(self) -> str: ...

    def close(self) -> None: ...


def _store(engine: wasmtime.Engine, memory_bytes: int) -> wasmtime.Store:
    store = wasmtime.Store(engine)
    store.set_wasi(wasmtime.WasiConfig())  # nothing granted; never skip (see module doc)
    store.set_limits(memory_size=memory_bytes, instances=64, tables=64, memories=8)
    _deadline(store, INSTANTIATE_TICKS)
    return store


def _deadline(store: wasmtime.Store, ticks: int, context: Any = None) -> None:
    """The one way a deadline is set: the engine's ticker must be awake until it passes.
    Armed after it is set, so the ticker's epoch can be behind the deadline's base by at most
    the one tick it is counting (EpochTicker.arm's margin); armed before, a thread descheduled
    in between could get a deadline later than the ticker ticks for."""
    _SET_EPOCH_DEADLINE(store._context() if context is None else context, ticks)
    arm(store.engine, ticks)


class ComponentInstance:
    """A componentize-py guest implementing the `meshfn:model` world."""

    __slots__ = ("_generate_next", "_generate_start", "_infer", "_meta", "_store")

    def __init__(self, artifact: ComponentArtifact, memory_bytes: int) -> None:
        self._store = _store(artifact.engine, memory_bytes)
        instance = artifact.linker.instantiate(self._store, artifact.component)
        infer = instance.get_func(self._store, "infer")
        meta = instance.get_func(self._store, "metadata")
        if infer is None or meta is None:
            raise wasmtime.WasmtimeError("component does not export meshfn:model infer/metadata")
        self._infer, self._meta = infer, meta
        # generation (built before the world had it: absent, and such a guest does not generate)
        self._generate_start = instance.get_func(self._store, "generate-start")
        self._generate_next = instance.get_func(self._store, "generate-next")

    def call(self, request: GuestRequest, ticks: int) -> CallResult:
        if not isinstance(request, str):
            return _wrong_request(request)
        return self._result(self._infer, ticks, request)

    def generate_start(self, request: str, ticks: int) -> CallResult:
        """Start a generation (JSON settings and prompt in, {"prompt_tokens": n} out)."""
        if self._generate_start is None:
            return CallResult(Outcome.INTERNAL, "the guest was built without generation")
        return self._result(self._generate_start, ticks, request)

    def generate_next(self, ticks: int) -> CallResult:
        """The current generation's next piece, under `ticks` (the per-token budget)."""
        if self._generate_next is None:
            return CallResult(Outcome.INTERNAL, "the guest was built without generation")
        return self._result(self._generate_next, ticks)

    def _result(self, func: Any, ticks: int, *args: str) -> CallResult:
        _deadline(self._store, ticks)
        try:
            result = func(self._store, *args)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            return classify_trap(exc)
        # wasmtime-py lifts result<string, infer-error> untagged (the two cases have distinct
        # Python types): the ok string itself, or the infer-error Variant.
        if isinstance(result, str):
            return CallResult(Outcome.OK, result)
        if isinstance(result, wc.Variant) and result.tag in ("ok", "err"):  # tagged form
            if result.tag == "ok":
                return CallResult(Outcome.OK, str(result.payload))
            result = result.payload
        if isinstance(result, wc.Variant) and result.tag in _WIT_ERRORS:
            return CallResult(_WIT_ERRORS[result.tag], str(result.payload))
        return CallResult(
            Outcome.TRAP, f"infer returned an unexpected value of type {type(result).__name__}"
        )

    def metadata(self) -> str:
        _deadline(self._store, INSTANTIATE_TICKS)
        return str(self._meta(self._store))

    def close(self) -> None:
        self._store.close()


def _c_function(name: str, restype: Any, *argtypes: Any) -> Any:
    """A function of wasmtime's C API as a ctypes function object of our own (`dll[name]` makes
    a new one): the generated wrapper in `wasmtime._bindings` adds a Python call per use, and its
    `wasmtime_memory_data` returns a POINTER(c_uint8) that needs a cast (~1-2 us) to become an
    address; with `c_void_p` it is an int. Per-call path of core guests only (bench/coldstart.py)."""
    function = _ffi.dll[name]
    function.restype = restype
    function.argtypes = argtypes
    return function


_CONTEXT = ctypes.POINTER(_ffi.wasmtime_context_t)
_MEMORY = ctypes.POINTER(_ffi.wasmtime_memory_t)
_TRAP = ctypes.POINTER(_ffi.wasm_trap_t)
_FUNC_CALL = _c_function(
    "wasmtime_func_call",
    ctypes.POINTER(_ffi.wasmtime_error_t),
    _CONTEXT,
    ctypes.POINTER(_ffi.wasmtime_func_t),
    ctypes.POINTER(_ffi.wasmtime_val_t),
    ctypes.c_size_t,
    ctypes.POINTER(_ffi.wasmtime_val_t),
    ctypes.c_size_t,
    ctypes.POINTER(_TRAP),
)
_MEMORY_DATA = _c_function("wasmtime_memory_data", ctypes.c_void_p, _CONTEXT, _MEMORY)
_MEMORY_DATA_SIZE = _c_function("wasmtime_memory_data_size", ctypes.c_size_t, _CONTEXT, _MEMORY)
_SET_EPOCH_DEADLINE = _c_function(
    "wasmtime_context_set_epoch_deadline", None, _CONTEXT, ctypes.c_uint64
)


class _CoreCall:
    """One exported core function called through wasmtime's C API (`wasmtime_func_call`) with
    value arrays allocated once per instance.

    wasmtime-py's `Func.__call__` re-reads the function type and converts every argument and
    result through `Val` on each call: ~25 us of Python for what is a ~2 us C call, three times
    per request. wasmtime still checks the argument and result types on every call (a mismatch
    is a WasmtimeError, not undefined behaviour), and a trap is raised as `wasmtime.Trap`, as
    from `Func.__call__`. Only i32 parameters and one i32/i64 result occur in the core ABI.
    Uses `wasmtime._ffi`, which is why `wasmtime` is pinned to one version.
    """

    __slots__ = (
        "_args", "_func", "_nparams", "_params", "_result", "_returned", "_store", "_trap",
        "_trap_ref", "_wide",
    )  # fmt: skip

    def __init__(
        self, store: wasmtime.Store, func: _ffi.wasmtime_func_t, nparams: int, wide: bool
    ) -> None:
        self._store = store  # its context is fetched per call: a closed store raises ValueError
        self._func = ctypes.byref(func)
        self._params = (_ffi.wasmtime_val_t * max(1, nparams))()
        for param in self._params:
            param.kind = _ffi.WASMTIME_I32
        # Views into the value arrays, made once (indexing a ctypes array makes a new object).
        self._args = [param.of for param in self._params[:nparams]]
        self._nparams = nparams
        self._result = (_ffi.wasmtime_val_t * 1)()
        self._returned = self._result[0].of
        self._wide = wide  # i64 result
        self._trap = _TRAP()  # NULL; wasmtime sets it only on a trap (then a fresh one)
        self._trap_ref = ctypes.byref(self._trap)

    def __call__(self, *args: int) -> int:
        for view, arg in zip(self._args, args, strict=True):
            view.i32 = arg
        error = _FUNC_CALL(
            self._store._context(),
            self._func,
            self._params,
            self._nparams,
            self._result,
            1,
            self._trap_ref,
        )
        if error:
            raise wasmtime.WasmtimeError._from_ptr(error)
        trap = self._trap
        if trap:
            self._trap = _TRAP()
            self._trap_ref = ctypes.byref(self._trap)
            raise wasmtime.Trap._from_ptr(trap)
        returned = self._returned
        return int(returned.i64 if self._wide else returned.i32)


class _CoreMemory:
    """Bounds-checked reads and writes of a core instance's linear memory (which may move when
    it grows, so its base address is looked up on every access)."""

    __slots__ = ("_memory", "_store")

    def __init__(self, store: wasmtime.Store, memory: _ffi.wasmtime_memory_t) -> None:
        self._store = store
        self._memory = ctypes.byref(memory)

    def _base(self, start: int, length: int) -> int:
        context = self._store._context()  # raises ValueError once the store is closed
        size = _MEMORY_DATA_SIZE(context, self._memory)
        if start < 0 or length < 0 or start + length > size:
            raise IndexError("outside linear memory")
        return cast(int, _MEMORY_DATA(context, self._memory) or 0)

    def write(self, start: int, data: bytes) -> None:
        ctypes.memmove(self._base(start, len(data)) + start, data, len(data))

    def read(self, start: int, length: int) -> bytes:
        return ctypes.string_at(self._base(start, length) + start, length)


def _core_export(
    store: wasmtime.Store, instance: wasmtime.Instance, name: str, kind: int
) -> _ffi.wasmtime_extern_t:
    """One export by name (`Instance.exports` wraps every export in Python objects: ~40 us)."""
    item = _ffi.wasmtime_extern_t()
    raw = name.encode()
    found = _ffi.wasmtime_instance_export_get(
        store._context(), ctypes.byref(instance._instance), raw, len(raw), ctypes.byref(item)
    )
    if not found:
        raise wasmtime.WasmtimeError(f"core module lacks ABI export {name!r}")
    if cast(int, item.kind) != kind:  # ctypes returns the field as an int
        raise wasmtime.WasmtimeError(f"core module export {name!r} has the wrong kind")
    return item


class CoreInstance:
    """A core module implementing the meshfn core ABI v1 (functions/core/ABI.md)."""

    __slots__ = ("_alloc", "_infer", "_memory", "_meta", "_store")

    def __init__(self, artifact: CoreArtifact, memory_bytes: int) -> None:
        self._store = store = _store(artifact.engine, memory_bytes)
        instance = wasmtime.Instance(store, artifact.module, [])
        memory = _core_export(store, instance, "memory", _EXTERN_MEMORY).of.memory
        alloc, infer, meta, version = (
            _core_export(store, instance, name, _EXTERN_FUNC).of.func
            for name in ("meshfn_alloc", "meshfn_infer", "meshfn_metadata", "meshfn_abi_version")
        )
        if _CoreCall(store, version, 0, wide=False)() != 1:
            raise wasmtime.WasmtimeError("core module speaks an unknown meshfn ABI version")
        self._memory = _CoreMemory(store, memory)
        self._alloc = _CoreCall(store, alloc, 1, wide=False)
        self._infer = _CoreCall(store, infer, 2, wide=True)
        self._meta = _CoreCall(store, meta, 0, wide=True)

    def _unpack(self, packed: int) -> tuple[int, str]:
        packed &= 0xFFFF_FFFF_FFFF_FFFF
        status, ptr, length = packed >> 62, (packed >> 32) & 0x3FFF_FFFF, packed & 0xFFFF_FFFF
        return status, self._memory.read(ptr, length).decode("utf-8", errors="replace")

    def call(self, request: GuestRequest, ticks: int) -> CallResult:
        if not isinstance(request, str):
            return _wrong_request(request)
        _deadline(self._store, ticks)
        raw = request.encode()
        try:
            ptr = self._alloc(len(raw)) & 0xFFFF_FFFF
            if not ptr:
                return CallResult(Outcome.OUT_OF_MEMORY, "cannot allocate the request buffer")
            self._memory.write(ptr, raw)
            status, body = self._unpack(self._infer(ptr, len(raw)))
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            return classify_trap(exc)
        except IndexError:  # a pointer outside memory: a broken module
            return CallResult(Outcome.TRAP, "the module returned a pointer outside linear memory")
        return CallResult(_CORE_STATUS[status], body)

    def metadata(self) -> str:
        _deadline(self._store, INSTANTIATE_TICKS)
        return self._unpack(self._meta())[1]

    def close(self) -> None:
        self._store.close()


def _wrong_request(request: object) -> CallResult:
    """A request of the other ABI reached an instance (a host bug, never the client's)."""
    return CallResult(Outcome.INTERNAL, f"this guest does not take a {type(request).__name__}")


def _plan_table(words: bytes) -> tuple[tuple[int, int], ...]:
    """ABI v2's I/O table: little-endian u32 (address, size) pairs."""
    flat = struct.unpack(f"<{len(words) // 4}I", words)
    return tuple(zip(flat[::2], flat[1::2], strict=True))


class TensorInstance:
    """A compiled model (core ABI v2, compiler/ABI.md): per call, at most one `meshfn_plan`
    (only when the batch size changes: the layout is a pure function of it), one copy in per
    input, one `meshfn_run`, one copy out per output. The host checked every input's size
    against the signed metadata before (tensorio.py); the sizes are checked again against
    the module's own table here, so a module that disagrees with its metadata is refused
    rather than read past.

    The per-call path is the serving cost of a small model (a few microseconds of wasm), so it
    asks wasmtime for the memory's base once per call instead of per tensor: the planned
    tensors are checked to lie inside the memory when they are planned (linear memory never
    shrinks), and the base is asked again after the run, which may have grown (and so moved)
    the memory. Exports a call does
    not need (error, metadata) are looked up when first used, and the ABI version is checked
    once per artifact (bench/models.py: the cold start). A generative step function's decode
    steps (generation.py) are such calls too, one per step of a batch of streams."""

    __slots__ = (
        "_error", "_instance", "_memory", "_plan", "_rows", "_run", "_store", "_table",
    )  # fmt: skip

    def __init__(self, artifact: TensorArtifact, memory_bytes: int) -> None:
        self._store = store = _store(artifact.engine, memory_bytes)
        self._instance = instance = wasmtime.Instance(store, artifact.module, [])
        memory = _core_export(store, instance, "memory", _EXTERN_MEMORY).of.memory
        plan, run = (
            _core_export(store, instance, name, _EXTERN_FUNC).of.func
            for name in ("meshfn_plan", "meshfn_run")
        )
        if not artifact.checked:
            version = _core_export(store, instance, "meshfn_abi_version", _EXTERN_FUNC).of.func
            if _CoreCall(store, version, 0, wide=False)() != 2:
                raise wasmtime.WasmtimeError("compiled model speaks an unknown meshfn ABI version")
            artifact.checked = True
        self._memory = ctypes.byref(memory)
        self._plan = _CoreCall(store, plan, 1, wide=False)
        self._run = _CoreCall(store, run, 1, wide=False)
        self._error: _CoreCall | None = None
        self._rows = 0  # the batch size planned last
        self._table: tuple[tuple[int, int], ...] = ()

    def _read(self, start: int, length: int) -> bytes:
        context = self._store._context()
        if start < 0 or length < 0 or start + length > _MEMORY_DATA_SIZE(context, self._memory):
            raise IndexError("outside linear memory")
        return ctypes.string_at(cast(int, _MEMORY_DATA(context, self._memory)) + start, length)

    def _call(self, name: str) -> int:
        """A metadata or error call (export looked up on first use)."""
        if name == "meshfn_error" and self._error is not None:
            return self._error()
        func = _core_export(self._store, self._instance, name, _EXTERN_FUNC).of.func
        call = _CoreCall(self._store, func, 0, wide=True)
        if name == "meshfn_error":
            self._error = call
        return call()

    def _text(self, packed: int) -> str:
        packed &= 0xFFFF_FFFF_FFFF_FFFF
        ptr, length = (packed >> 32) & 0x3FFF_FFFF, packed & 0xFFFF_FFFF
        return self._read(ptr, length).decode("utf-8", errors="replace")

    def _planned(self, request: TensorCall) -> tuple[tuple[int, int], ...] | None:
        if request.rows != self._rows:
            self._rows = 0
            table = self._plan(request.rows) & 0xFFFF_FFFF
            if not table:
                return None
            count = len(request.inputs) + request.outputs
            self._table = _plan_table(self._read(table, 8 * count))
            end = max((a + n for a, n in self._table), default=0)
            if end > _MEMORY_DATA_SIZE(self._store._context(), self._memory):
                raise IndexError("outside linear memory")  # memory never shrinks: once is enough
            self._rows = request.rows
        return self._table

    def _write(
        self, table: tuple[tuple[int, int], ...], request: TensorCall, base: int
    ) -> CallResult | None:
        for (address, size), data in zip(table, request.inputs, strict=False):
            if len(data) != size:
                return CallResult(
                    Outcome.INTERNAL,
                    f"the module takes {size} bytes for an input of {request.rows} row(s), "
                    f"not {len(data)}: it disagrees with its signed metadata",
                )
            ctypes.memmove(base + address, data, size)
        return None

    def _once(self, request: TensorCall, context: Any) -> CallResult:
        table = self._planned(request)
        if table is None:
            return CallResult(
                Outcome.OUT_OF_MEMORY, f"no memory for a batch of {request.rows} row(s)"
            )
        memory = self._memory
        wrong = self._write(table, request, cast(int, _MEMORY_DATA(context, memory)))
        if wrong is not None:
            return wrong
        status = self._run(request.rows)
        if status:
            return CallResult(
                _CORE_STATUS.get(status, Outcome.INTERNAL), self._text(self._call("meshfn_error"))
            )
        base = cast(int, _MEMORY_DATA(context, memory))  # the run may have moved it
        string_at = ctypes.string_at
        return CallResult(
            Outcome.OK, "", tuple(string_at(base + a, n) for a, n in table[len(request.inputs) :])
        )

    def call(self, request: GuestRequest, ticks: int) -> CallResult:
        if not isinstance(request, TensorCall):
            return _wrong_request(request)
        context = self._store._context()  # raises ValueError once the store is closed
        _deadline(self._store, ticks, context)
        try:
            return self._once(request, context)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            return classify_trap(exc)
        except IndexError:  # a table outside memory: a broken module
            return CallResult(Outcome.TRAP, "the module planned tensors outside linear memory")

    def metadata(self) -> str:
        _deadline(self._store, INSTANTIATE_TICKS)
        return self._text(self._call("meshfn_metadata"))

    def close(self) -> None:
        self._store.close()


def component_linker(engine: wasmtime.Engine) -> wc.Linker:
    """A component Linker with WASI p2 for `engine`.

    Building one costs ~150 us, so a server builds it once per engine and shares it: it holds
    no per-function or per-instance state (instances get their WASI context from their own
    store), and instantiating through it only reads it, from any thread.
    """
    linker = wc.Linker(engine)
    linker.add_wasip2()
    return linker


class ComponentArtifact:
    kind: Kind = "python"

    def __init__(
        self, engine: wasmtime.Engine, component: wc.Component, linker: wc.Linker | None = None
    ) -> None:
        self.engine = engine
        self.component = component
        self.linker = linker if linker is not None else component_linker(engine)

    def instantiate(self, memory_bytes: int) -> Instance:
        return ComponentInstance(self, memory_bytes)


class CoreArtifact:
    kind: Kind = "core"

    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module) -> None:
        self.engine = engine
        self.module = module

    def instantiate(self, memory_bytes: int) -> Instance:
        return CoreInstance(self, memory_bytes)


class TensorArtifact:
    kind: Kind = "onnx"

    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module) -> None:
        self.engine = engine
        self.module = module
        self.checked = False  # its meshfn_abi_version() was 2 (checked at the first instance)

    def instantiate(self, memory_bytes: int) -> Instance:
        return TensorInstance(self, memory_bytes)


Artifact = ComponentArtifact | CoreArtifact | TensorArtifact


def load_precompiled(
    engine: wasmtime.Engine, kind: Kind, cwasm: Path, linker: wc.Linker | None = None
) -> Artifact:
    """mmap a registry `.cwasm`; raises WasmtimeError if it was built for another engine.

    Components are instantiated through `linker` (see `component_linker`; a new one if None).
    """
    if kind == "python":
        component = wc.Component.deserialize_file(engine, str(cwasm))
        return ComponentArtifact(engine, component, linker)
    module = wasmtime.Module.deserialize_file(engine, str(cwasm))
    return TensorArtifact(engine, module) if kind == "onnx" else CoreArtifact(engine, module)


def component_imports(artifact: Artifact) -> list[str]:
    """Names a component imports; meshfn:model components must import nothing."""
    if not isinstance(artifact, ComponentArtifact):
        return []
    return [str(name) for name in artifact.component.type.imports(artifact.engine)]


def compile_module(engine: wasmtime.Engine, kind: Kind, wasm: Path) -> tuple[Artifact, bytes]:
    """Compile (publish time only, never in the server) and return the artifact and its bytes."""
    if kind == "python":
        component = wc.Component.from_file(engine, str(wasm))
        return ComponentArtifact(engine, component), bytes(component.serialize())
    module = wasmtime.Module.from_file(engine, str(wasm))
    artifact = TensorArtifact(engine, module) if kind == "onnx" else CoreArtifact(engine, module)
    return artifact, bytes(module.serialize())


def metadata_of(artifact: Artifact, memory_bytes: int = 64 << 20) -> dict[str, object]:
    instance = artifact.instantiate(memory_bytes)
    try:
        loaded: dict[str, object] = json.loads(instance.metadata())
        return loaded
    finally:
        instance.close()
