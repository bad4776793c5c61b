"""The host side of core ABI v2 (compiler/ABI.md), what `kind = "onnx"` functions speak: a
checked request's tensors become one `TensorCall` (raw bytes in metadata order, the batch it
is planned for), and the module's raw outputs become KServe outputs without a JSON step.

Everything a compiled model could refuse for its shape is refused here, with a 400, before the
guest runs: the KServe checks (names, datatypes, shapes against the metadata, element counts)
are kserve.py's, for every function; what ABI v2 adds is one batch for all inputs (every `-1`
of an input is the batch N, so they must agree), at least one row, and no more rows than the
function's memory holds. That bound comes from the signed build report (`memory`): the
module's static data and two arenas, one of a constant size and one of a size per row, so
the memory a batch of N rows needs is known exactly on the host, and a request that would not
fit gets a 400 instead of an out-of-memory failure inside the guest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .host import CallResult, TensorCall
from .kserve import InferRequest, KServeError, Output
from .tensors import dtype, element_count

PAGE = 65536


@dataclass(frozen=True, slots=True)
class Memory:
    """A compiled model's linear memory (signed metadata `memory`, in bytes)."""

    initial: int  # the module's initial memory
    static: int  # data, stack and the heap base (16-aligned): where the tensor arenas start
    arena: int  # the constant-size arena
    per_row: int  # the batch arena, per row

    @classmethod
    def of(cls, metadata: dict[str, Any]) -> Memory:
        memory = metadata["memory"]
        return cls(
            int(memory["initial_bytes"]),
            int(memory["static_bytes"]),
            int(memory["arena_bytes"]),
            int(memory["arena_bytes_per_row"]),
        )

    def needed(self, rows: int) -> int:
        """Bytes of linear memory a call of `rows` rows needs (whole wasm pages)."""
        end = self.static + self.arena + self.per_row * rows
        return max(self.initial, -(-end // PAGE) * PAGE)

    def rows_within(self, cap: int) -> int:
        """The most rows whose call fits in `cap` bytes (0: not even one)."""
        if self.needed(1) > cap:
            return 0
        if not self.per_row:
            return 1 << 30
        return max(1, (cap // PAGE * PAGE - self.static - self.arena) // self.per_row)


@dataclass(frozen=True, slots=True)
class _Out:
    name: str
    datatype: str
    shape: tuple[int, ...]
    item: int  # bytes per element
    known: int  # product of the dimensions that are not -1


class TensorIO:
    """One served compiled model's signature, as its guest calls need it."""

    def __init__(self, metadata: dict[str, Any], memory_cap: int, label: str) -> None:
        self.label = label
        self.inputs = [str(t["name"]) for t in metadata["inputs"]]
        # inputs whose first dimension is the batch
        self.batched = [str(t["name"]) for t in metadata["inputs"] if t["shape"][:1] == [-1]]
        self.dynamic = metadata.get("batch") == "dynamic"
        self.outputs = [
            _Out(
                str(t["name"]),
                str(t["datatype"]),
                tuple(int(d) for d in t["shape"]),
                dtype(str(t["datatype"])).size,
                element_count([int(d) for d in t["shape"] if d != -1]),
            )
            for t in metadata["outputs"]
        ]
        self.memory = Memory.of(metadata)
        self.cap = memory_cap
        self.max_rows = self.memory.rows_within(memory_cap) if self.dynamic else 1
        if not self.dynamic and self.memory.needed(1) > memory_cap:
            self.max_rows = 0

    def refusal(self) -> str | None:
        """Why the function cannot be served within its memory limit, if it cannot."""
        if self.max_rows >= 1:
            return None
        need = self.memory.needed(1)
        return (
            f"the compiled model needs {need} bytes ({need / 2**20:.1f} MiB) of linear memory "
            f"for one row, more than its limits.memoryMiB allows ({self.cap >> 20} MiB)"
        )

    def rows(self, request: InferRequest, split: bool = False) -> int:
        """The request's batch, checked: every batched input agrees, at least one row, and no
        more than the memory limit holds (400s, before the guest runs); `split`: the batcher
        cuts it into calls that fit (`oversize: split`), so any number of rows goes."""
        if not self.dynamic:
            return 1
        by_name = {t.name: t.shape[0] for t in request.inputs}
        sizes = {name: by_name[name] for name in self.batched}
        rows = next(iter(sizes.values()))
        if any(n != rows for n in sizes.values()):
            dims = ", ".join(f"{name} {n}" for name, n in sizes.items())
            raise KServeError(
                400, f"inputs of {self.label} disagree on the batch dimension ({dims})"
            )
        if rows < 1:
            raise KServeError(400, f"{self.label} needs at least one row (the batch is 0)")
        if rows > self.max_rows and not split:
            raise KServeError(
                400,
                f"request has {rows} rows but {self.label} takes at most {self.max_rows} per call "
                f"within its memory limit of {self.cap >> 20} MiB "
                f"({self.memory.per_row} bytes per row)",
            )
        return rows

    def call(self, request: InferRequest) -> TensorCall:
        rows = self.rows(request)
        by_name = {t.name: t.raw for t in request.inputs}
        return TensorCall(rows, tuple(by_name[name] for name in self.inputs), len(self.outputs))

    def outputs_of(self, result: CallResult) -> list[Output]:
        """The module's raw outputs as KServe outputs, each `-1` resolved from its size."""
        outs = []
        for spec, raw in zip(self.outputs, result.outputs, strict=True):
            shape = list(spec.shape)
            per = spec.item * spec.known
            if -1 in shape:
                if not per or len(raw) % per:
                    raise KServeError(
                        500, f"function {self.label} returned {len(raw)} bytes for {spec.name!r}"
                    )
                shape[shape.index(-1)] = len(raw) // per
            elif len(raw) != per:
                raise KServeError(
                    500, f"function {self.label} returned {len(raw)} bytes for {spec.name!r}"
                )
            outs.append(Output(spec.name, spec.datatype, shape, None, None, raw))
        return outs
