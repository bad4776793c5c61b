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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import wasmtime
from wasmtime import _ffi
from wasmtime import component as wc

Kind = Literal["python", "core"]

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
    body: str  # response JSON for OK, else a message


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
    def call(self, request: str, ticks: int) -> CallResult: ...

    def metadata(self) -> str: ...

    def close(self) -> None: ...


def _store(engine: wasmtime.Engine, memory_bytes: int) -> wasmtime.Store:
    store = wasmtime.Store(engine)
    store.set_wasi(wasmtime.WasiConfig())  # nothing granted; never skip (see module doc)
    store.set_limits(memory_size=memory_bytes, instances=64, tables=64, memories=8)
    store.set_epoch_deadline(INSTANTIATE_TICKS)
    return store


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

    def call(self, request: str, ticks: int) -> CallResult:
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
        self._store.set_epoch_deadline(ticks)
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
        self._store.set_epoch_deadline(INSTANTIATE_TICKS)
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


def _abi_version(store: wasmtime.Store, instance: wasmtime.Instance) -> int:
    version = _core_export(store, instance, "meshfn_abi_version", _EXTERN_FUNC).of.func
    return _CoreCall(store, version, 0, wide=False)()


class CoreInstance:
    """A core module implementing the meshfn core ABI v1 (functions/core/ABI.md)."""

    __slots__ = ("_alloc", "_infer", "_memory", "_meta", "_store")

    def __init__(self, store: wasmtime.Store, instance: wasmtime.Instance) -> None:
        self._store = store
        memory = _core_export(store, instance, "memory", _EXTERN_MEMORY).of.memory
        alloc, infer, meta = (
            _core_export(store, instance, name, _EXTERN_FUNC).of.func
            for name in ("meshfn_alloc", "meshfn_infer", "meshfn_metadata")
        )
        self._memory = _CoreMemory(store, memory)
        self._alloc = _CoreCall(store, alloc, 1, wide=False)
        self._infer = _CoreCall(store, infer, 2, wide=True)
        self._meta = _CoreCall(store, meta, 0, wide=True)

    def _unpack(self, packed: int) -> tuple[int, str]:
        packed &= 0xFFFF_FFFF_FFFF_FFFF
        status, ptr, length = packed >> 62, (packed >> 32) & 0x3FFF_FFFF, packed & 0xFFFF_FFFF
        return status, self._memory.read(ptr, length).decode("utf-8", errors="replace")

    def call(self, request: str, ticks: int) -> CallResult:
        _SET_EPOCH_DEADLINE(self._store._context(), ticks)
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
        self._store.set_epoch_deadline(INSTANTIATE_TICKS)
        return self._unpack(self._meta())[1]

    def close(self) -> None:
        self._store.close()


@dataclass(frozen=True, slots=True)
class TensorResult:
    """A v2 run: OK with each output's raw bytes, or another outcome with a message."""

    outcome: Outcome
    outputs: tuple[bytes, ...] = ()
    message: str = ""


class TensorInstance:
    """A core module implementing the meshfn core ABI v2 (functions/core/ABI.md, version 2):
    raw tensors in an I/O table (`meshfn_plan(batch)`), one `meshfn_run(batch)`, outputs read
    back. What meshfn's model compiler emits and what the tiny-lm step function implements by
    hand; the backend runs generative step functions through `run` (generation.py). The I/O
    table is planned again only when the batch size changes (the module accepts a run only for
    the batch it planned last)."""

    __slots__ = ("_error", "_memory", "_meta", "_plan", "_planned", "_run", "_store", "_table")

    def __init__(self, store: wasmtime.Store, instance: wasmtime.Instance) -> None:
        self._store = store
        memory = _core_export(store, instance, "memory", _EXTERN_MEMORY).of.memory
        plan, run, error, meta = (
            _core_export(store, instance, name, _EXTERN_FUNC).of.func
            for name in ("meshfn_plan", "meshfn_run", "meshfn_error", "meshfn_metadata")
        )
        self._memory = _CoreMemory(store, memory)
        self._plan = _CoreCall(store, plan, 1, wide=False)
        self._run = _CoreCall(store, run, 1, wide=False)
        self._error = _CoreCall(store, error, 0, wide=True)
        self._meta = _CoreCall(store, meta, 0, wide=True)
        self._planned = 0
        self._table: list[tuple[int, int]] = []

    def _packed(self, packed: int) -> str:
        packed &= 0xFFFF_FFFF_FFFF_FFFF
        ptr, length = (packed >> 32) & 0x3FFF_FFFF, packed & 0xFFFF_FFFF
        return self._memory.read(ptr, length).decode("utf-8", errors="replace")

    def _plan_for(self, batch: int, entries: int) -> list[tuple[int, int]] | None:
        if batch != self._planned:
            address = self._plan(batch) & 0xFFFF_FFFF
            if not address:
                return None
            words = self._memory.read(address, 8 * entries)
            values = [int.from_bytes(words[i : i + 4], "little") for i in range(0, len(words), 4)]
            self._table = list(zip(values[0::2], values[1::2], strict=True))
            self._planned = batch
        return self._table

    def run(self, batch: int, inputs: tuple[bytes, ...], outputs: int, ticks: int) -> TensorResult:
        """One run over `batch` rows: `inputs` each exactly its table size, `outputs` the
        number of outputs to read; never past `ticks` epoch ticks."""
        _SET_EPOCH_DEADLINE(self._store._context(), ticks)
        try:
            table = self._plan_for(batch, len(inputs) + outputs)
            if table is None:
                return TensorResult(
                    Outcome.OUT_OF_MEMORY, message=f"cannot plan a batch of {batch}"
                )
            for (address, size), data in zip(table, inputs, strict=False):
                if len(data) != size:
                    return TensorResult(
                        Outcome.INTERNAL, message=f"an input of {len(data)} bytes, not {size}"
                    )
                self._memory.write(address, data)
            status = self._run(batch)
            if status:
                message = self._packed(self._error())
                return TensorResult(_CORE_STATUS.get(status, Outcome.INTERNAL), message=message)
            return TensorResult(
                Outcome.OK, tuple(self._memory.read(a, n) for a, n in table[len(inputs) :])
            )
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            failed = classify_trap(exc)
            return TensorResult(failed.outcome, message=failed.body)
        except IndexError:
            return TensorResult(Outcome.TRAP, message="the I/O table points outside memory")

    def call(self, request: str, ticks: int) -> CallResult:
        return CallResult(
            Outcome.BAD_REQUEST,
            "this function is a generative step function: use its generate endpoints",
        )

    def metadata(self) -> str:
        self._store.set_epoch_deadline(INSTANTIATE_TICKS)
        return self._packed(self._meta())

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
        store = _store(self.engine, memory_bytes)
        instance = wasmtime.Instance(store, self.module, [])
        version = _abi_version(store, instance)
        if version == 1:
            return CoreInstance(store, instance)
        if version == 2:
            return TensorInstance(store, instance)
        raise wasmtime.WasmtimeError(f"core module speaks an unknown meshfn ABI version {version}")


Artifact = ComponentArtifact | CoreArtifact


def load_precompiled(
    engine: wasmtime.Engine, kind: Kind, cwasm: Path, linker: wc.Linker | None = None
) -> Artifact:
    """mmap a registry `.cwasm`; raises WasmtimeError if it was built for another engine.

    Components are instantiated through `linker` (see `component_linker`; a new one if None).
    """
    if kind == "python":
        component = wc.Component.deserialize_file(engine, str(cwasm))
        return ComponentArtifact(engine, component, linker)
    return CoreArtifact(engine, wasmtime.Module.deserialize_file(engine, str(cwasm)))


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
    return CoreArtifact(engine, module), bytes(module.serialize())


def metadata_of(artifact: Artifact, memory_bytes: int = 64 << 20) -> dict[str, object]:
    instance = artifact.instantiate(memory_bytes)
    try:
        loaded: dict[str, object] = json.loads(instance.metadata())
        return loaded
    finally:
        instance.close()
