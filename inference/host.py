"""wasmtime instances of model functions: loading precompiled artifacts, isolation, one call.

Every store gets `set_wasi` (a component's first WASI call aborts the whole process otherwise)
with an empty WasiConfig: no preopened directories, no environment, no arguments, stdio
discarded. Every call sets a fresh epoch deadline; a trapped instance is poisoned and must be
dropped by its owner. Nothing here compiles: artifacts come from `Component/Module.deserialize_file`
(mmap of a registry `.cwasm`), which is the point of precompiling at publish time.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import wasmtime
from wasmtime import component as wc

Kind = Literal["python", "core"]

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

    __slots__ = ("_infer", "_meta", "_store")

    def __init__(self, artifact: ComponentArtifact, memory_bytes: int) -> None:
        self._store = _store(artifact.engine, memory_bytes)
        instance = artifact.linker.instantiate(self._store, artifact.component)
        infer = instance.get_func(self._store, "infer")
        meta = instance.get_func(self._store, "metadata")
        if infer is None or meta is None:
            raise wasmtime.WasmtimeError("component does not export meshfn:model infer/metadata")
        self._infer, self._meta = infer, meta

    def call(self, request: str, ticks: int) -> CallResult:
        self._store.set_epoch_deadline(ticks)
        try:
            result = self._infer(self._store, request)
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


class CoreInstance:
    """A core module implementing the meshfn core ABI v1 (functions/core/ABI.md)."""

    __slots__ = ("_alloc", "_infer", "_memory", "_meta", "_store")

    def __init__(self, artifact: CoreArtifact, memory_bytes: int) -> None:
        self._store = _store(artifact.engine, memory_bytes)
        instance = wasmtime.Instance(self._store, artifact.module, [])
        exports = instance.exports(self._store)
        try:
            memory, alloc = exports["memory"], exports["meshfn_alloc"]
            infer, meta = exports["meshfn_infer"], exports["meshfn_metadata"]
            version = exports["meshfn_abi_version"]
        except KeyError as exc:
            raise wasmtime.WasmtimeError(f"core module lacks ABI export {exc}") from None
        assert isinstance(memory, wasmtime.Memory)
        assert isinstance(alloc, wasmtime.Func) and isinstance(infer, wasmtime.Func)
        assert isinstance(meta, wasmtime.Func) and isinstance(version, wasmtime.Func)
        if version(self._store) != 1:
            raise wasmtime.WasmtimeError("core module speaks an unknown meshfn ABI version")
        self._memory, self._alloc, self._infer, self._meta = memory, alloc, infer, meta

    def _unpack(self, packed: int) -> tuple[int, str]:
        packed &= 0xFFFF_FFFF_FFFF_FFFF
        status, ptr, length = packed >> 62, (packed >> 32) & 0x3FFF_FFFF, packed & 0xFFFF_FFFF
        data = self._memory.read(self._store, ptr, ptr + length)
        return status, bytes(data).decode("utf-8", errors="replace")

    def call(self, request: str, ticks: int) -> CallResult:
        self._store.set_epoch_deadline(ticks)
        raw = request.encode()
        try:
            ptr = self._alloc(self._store, len(raw))
            if not ptr:
                return CallResult(Outcome.OUT_OF_MEMORY, "cannot allocate the request buffer")
            self._memory.write(self._store, raw, ptr)
            status, body = self._unpack(self._infer(self._store, ptr, len(raw)))
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            return classify_trap(exc)
        except IndexError:  # result pointer outside memory: a broken module
            return CallResult(Outcome.TRAP, "result points outside linear memory")
        return CallResult(_CORE_STATUS[status], body)

    def metadata(self) -> str:
        self._store.set_epoch_deadline(INSTANTIATE_TICKS)
        return self._unpack(self._meta(self._store))[1]

    def close(self) -> None:
        self._store.close()


class ComponentArtifact:
    kind: Kind = "python"

    def __init__(self, engine: wasmtime.Engine, component: wc.Component) -> None:
        self.engine = engine
        self.component = component
        self.linker = wc.Linker(engine)
        self.linker.add_wasip2()

    def instantiate(self, memory_bytes: int) -> Instance:
        return ComponentInstance(self, memory_bytes)


class CoreArtifact:
    kind: Kind = "core"

    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module) -> None:
        self.engine = engine
        self.module = module

    def instantiate(self, memory_bytes: int) -> Instance:
        return CoreInstance(self, memory_bytes)


Artifact = ComponentArtifact | CoreArtifact


def load_precompiled(engine: wasmtime.Engine, kind: Kind, cwasm: Path) -> Artifact:
    """mmap a registry `.cwasm`; raises WasmtimeError if it was built for another engine."""
    if kind == "python":
        return ComponentArtifact(engine, wc.Component.deserialize_file(engine, str(cwasm)))
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
