"""The host side of core ABI v2 (compiled models): TensorInstance's plan/copy/run/copy path
through wasmtime's C API, driven to its edges by a hand-written module (no clang), and
tensorio's checks, which answer 400 before the guest runs."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import wasmtime

from meshfn.inference.engine import EpochTicker, new_engine
from meshfn.inference.host import (
    CallResult,
    Outcome,
    TensorArtifact,
    TensorCall,
    TensorInstance,
    load_precompiled,
)
from meshfn.inference.kserve import InferRequest, Input, KServeError, Signature, parse_http
from meshfn.inference.tensorio import PAGE, Memory, TensorIO
from meshfn.inference.tensors import dtype

# y = 2 * x over FP32 [-1, 2]; a negative first value is a bad request (status 1); more than
# 100 rows cannot be planned (memory); `bad_table` plans a table past the end of memory.
WAT = """(module
  (memory (export "memory") 1)
  (data (i32.const 512) "negative input")
  (data (i32.const 600) "{\\"abi\\":2}")
  (global $planned (mut i32) (i32.const 0))
  (global (export "__heap_base") i32 (i32.const 1024))
  (func $pack (param $p i32) (param $n i32) (result i64)
    (i64.or (i64.shl (i64.extend_i32_u (local.get $p)) (i64.const 32))
            (i64.extend_i32_u (local.get $n))))
  (func (export "meshfn_abi_version") (result i32) (i32.const VERSION))
  (func (export "meshfn_metadata") (result i64) (call $pack (i32.const 600) (i32.const 9)))
  (func (export "meshfn_error") (result i64) (call $pack (i32.const 512) (i32.const 14)))
  (func (export "meshfn_plan") (param $n i32) (result i32)
    (if (i32.gt_u (local.get $n) (i32.const 100)) (then (return (i32.const 0))))
    (global.set $planned (local.get $n))
    (i32.store (i32.const 16) (i32.const 1024))
    (i32.store (i32.const 20) (i32.mul (local.get $n) (i32.const 8)))
    (i32.store (i32.const 24) (i32.add (i32.const 1024) (i32.mul (local.get $n) (i32.const 8))))
    (i32.store (i32.const 28) (i32.mul (local.get $n) (i32.const 8)))
    (i32.const TABLE))
  (func (export "meshfn_run") (param $n i32) (result i32) (local $i i32) (local $out i32)
    (if (i32.ne (local.get $n) (global.get $planned)) (then (return (i32.const 3))))
    (if (f32.lt (f32.load (i32.const 1024)) (f32.const 0)) (then (return (i32.const 1))))
    (if (f32.eq (f32.load (i32.const 1024)) (f32.const 13)) (then (unreachable)))
    (if (f32.eq (f32.load (i32.const 1024)) (f32.const 99)) (then (loop (br 0))))
    (local.set $out (i32.add (i32.const 1024) (i32.mul (local.get $n) (i32.const 8))))
    (block (loop
      (br_if 1 (i32.ge_u (local.get $i) (i32.mul (local.get $n) (i32.const 2))))
      (f32.store (i32.add (local.get $out) (i32.mul (local.get $i) (i32.const 4)))
        (f32.mul (f32.const 2) (f32.load (i32.add (i32.const 1024)
                                                   (i32.mul (local.get $i) (i32.const 4))))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br 0)))
    (i32.const 0)))"""


@pytest.fixture(scope="module")
def engine() -> Iterator[wasmtime.Engine]:
    """Deadlines are epochs: the engine's ticker runs, so a spin is interrupted."""
    eng = new_engine()
    ticker = EpochTicker(eng).start()
    yield eng
    ticker.stop()


def instance(engine: wasmtime.Engine, version: int = 2, table: int = 16) -> TensorInstance:
    wat = WAT.replace("VERSION", str(version)).replace("TABLE", str(table))
    made = TensorArtifact(engine, wasmtime.Module(engine, wat)).instantiate(1 << 20)
    assert isinstance(made, TensorInstance)
    return made


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_plan_copy_run_copy(engine: wasmtime.Engine) -> None:
    inst = instance(engine)
    assert inst.metadata() == '{"abi":2}'
    result = inst.call(TensorCall(2, (floats(1, 2, 3, 4),), 1), 100)
    assert result == CallResult(Outcome.OK, "", (floats(2, 4, 6, 8),))
    # the same batch again: no new plan, the same answer; then another batch size
    assert inst.call(TensorCall(2, (floats(0.5, 1, 1, 1),), 1), 100).outputs == (
        floats(1, 2, 2, 2),
    )
    assert inst.call(TensorCall(1, (floats(5, 6),), 1), 100).outputs == (floats(10, 12),)


def test_statuses_traps_and_deadlines(engine: wasmtime.Engine) -> None:
    bad = instance(engine).call(TensorCall(1, (floats(-1, 0),), 1), 100)
    assert bad == CallResult(Outcome.BAD_REQUEST, "negative input")
    no_room = instance(engine).call(TensorCall(101, (b"\0" * 808,), 1), 100)
    assert no_room.outcome is Outcome.OUT_OF_MEMORY and no_room.outcome.poisons
    assert "101 row(s)" in no_room.body
    assert instance(engine).call(TensorCall(1, (floats(13, 0),), 1), 100).outcome is Outcome.TRAP
    spin = instance(engine).call(TensorCall(1, (floats(99, 0),), 1), 2)
    assert spin.outcome is Outcome.TIMEOUT
    # a size the module does not plan for: refused on the host, nothing written
    wrong = instance(engine).call(TensorCall(2, (floats(1, 2),), 1), 100)
    assert wrong.outcome is Outcome.INTERNAL and "disagrees with its signed metadata" in wrong.body
    # a table outside linear memory: the host never reads past the end
    outside = instance(engine, table=65535).call(TensorCall(1, (floats(1, 2),), 1), 100)
    assert outside == CallResult(Outcome.TRAP, "the module planned tensors outside linear memory")
    # a request of the other ABI never reaches the guest
    assert instance(engine).call("{}", 100).outcome is Outcome.INTERNAL


def test_the_ticker_sleeps_without_a_pending_deadline_and_wakes_for_one() -> None:
    """An idle engine's ticker makes no wake-ups; a call after it fell asleep still has its
    deadline enforced (a spin is interrupted at its deadline, not later), and once every
    deadline has passed the ticker sleeps again. A deadline set before the ticker existed is
    kept awake for too: instances are looked up through their engine when they set one."""
    eng = new_engine()
    made = instance(eng)  # before the ticker: its instantiation deadline is not tracked
    ticker = EpochTicker(eng).start()
    try:
        _wait(lambda: ticker.asleep)
        before = ticker.ticks
        time.sleep(0.1)
        assert ticker.asleep and ticker.ticks == before  # idle: not one tick
        started = time.monotonic()
        spin = made.call(TensorCall(1, (floats(99, 0),), 1), 20)  # 100 ms
        took = time.monotonic() - started
        assert spin.outcome is Outcome.TIMEOUT
        assert 0.09 <= took < 2.0, took
        assert ticker.ticks - before >= 20
        _wait(lambda: ticker.asleep)  # its deadline passed: asleep again
        quick = instance(eng).call(TensorCall(1, (floats(1, 2),), 1), 10_000)
        assert quick.outcome is Outcome.OK
        assert not ticker.asleep  # a 50 s deadline is pending: it ticks on meanwhile
    finally:
        ticker.stop()
    # a second ticker of an engine whose epoch already moved counts from where it starts
    again = EpochTicker(eng).start()
    try:
        spin = instance(eng).call(TensorCall(1, (floats(99, 0),), 1), 4)
        assert spin.outcome is Outcome.TIMEOUT
    finally:
        again.stop()


def _wait(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_abi_version_and_closed_store(engine: wasmtime.Engine) -> None:
    with pytest.raises(wasmtime.WasmtimeError, match="unknown meshfn ABI version"):
        instance(engine, version=1)
    inst = instance(engine)
    inst.close()
    with pytest.raises(ValueError, match="closed"):
        inst.call(TensorCall(1, (floats(1, 2),), 1), 100)


def test_precompiled_onnx_kind_loads_as_a_tensor_artifact(
    engine: wasmtime.Engine, tmp_path: Path
) -> None:
    cwasm = tmp_path / "m.cwasm"
    module = wasmtime.Module(engine, WAT.replace("VERSION", "2").replace("TABLE", "16"))
    cwasm.write_bytes(module.serialize())
    artifact = load_precompiled(engine, "onnx", cwasm)
    assert isinstance(artifact, TensorArtifact) and artifact.kind == "onnx"


# ---------------------------------------------------------------------- tensorio


METADATA = {
    "name": "m",
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "k", "datatype": "INT64", "shape": [-1]},
        {"name": "w", "datatype": "FP32", "shape": [2]},
    ],
    "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "flat", "datatype": "INT32", "shape": [3, -1]},
    ],
    "batch": "dynamic",
    "memory": {
        "initial_bytes": 2 * PAGE,
        "static_bytes": 70000,
        "arena_bytes": 1000,
        "arena_bytes_per_row": 4096,
    },
}


def test_memory_bounds_rows_exactly() -> None:
    memory = Memory.of(METADATA)
    assert memory.needed(1) == 2 * PAGE  # 75096 bytes: two pages, the initial memory
    assert memory.needed(20) == 3 * PAGE  # 152920 -> three pages
    cap = 4 * PAGE
    rows = memory.rows_within(cap)
    assert memory.needed(rows) <= cap < memory.needed(rows + 1)
    assert memory.rows_within(PAGE) == 0  # not even the initial memory fits


def request(body: dict[str, object]) -> InferRequest:
    import json

    return parse_http(json.dumps(body).encode(), Signature.from_metadata(METADATA), None)


def tensors(rows: int, k_rows: int | None = None) -> dict[str, object]:
    k = rows if k_rows is None else k_rows
    return {
        "inputs": [
            {"name": "w", "datatype": "FP32", "shape": [2], "data": [1, 2]},
            {"name": "x", "datatype": "FP32", "shape": [rows, 2], "data": [0.5] * (2 * rows)},
            {"name": "k", "datatype": "INT64", "shape": [k], "data": list(range(k))},
        ]
    }


def test_tensor_calls_in_metadata_order_and_400s_before_the_guest() -> None:
    io = TensorIO(METADATA, 4 * PAGE, "m@1")
    call = io.call(request(tensors(3)))
    assert call.rows == 3 and call.outputs == 2
    assert call.inputs == (floats(*[0.5] * 6), struct.pack("<3q", 0, 1, 2), floats(1, 2))
    with pytest.raises(KServeError, match=r"disagree on the batch dimension \(x 3, k 2\)") as e:
        io.call(request(tensors(3, 2)))
    assert e.value.status == 400
    with pytest.raises(KServeError, match="at least one row"):
        io.rows(request(tensors(0)))
    most = io.max_rows
    with pytest.raises(KServeError, match=f"takes at most {most} per call") as e:
        io.rows(request(tensors(most + 1)))
    assert e.value.status == 400
    assert io.rows(request(tensors(most))) == most


def test_outputs_resolve_the_batch_from_their_size() -> None:
    io = TensorIO(METADATA, 4 * PAGE, "m@1")
    outs = io.outputs_of(CallResult(Outcome.OK, "", (floats(1, 2, 3, 4), b"\1\0\0\0" * 6)))
    assert [(o.name, o.shape) for o in outs] == [("y", [2, 2]), ("flat", [3, 2])]
    assert outs[0].values() == [1.0, 2.0, 3.0, 4.0] and outs[1].raw() == b"\1\0\0\0" * 6
    assert outs[0].as_json()["data"] == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(KServeError, match="returned 7 bytes") as e:
        io.outputs_of(CallResult(Outcome.OK, "", (floats(1, 2), b"\0" * 7)))
    assert e.value.status == 500


def test_a_model_that_cannot_fit_its_limit_is_refused_with_the_number() -> None:
    io = TensorIO(METADATA, PAGE, "m@1")
    assert io.max_rows == 0
    assert io.refusal() == (
        "the compiled model needs 131072 bytes (0.1 MiB) of linear memory for one row, more "
        "than its limits.memoryMiB allows (0 MiB)"
    )
    assert TensorIO(METADATA, 4 * PAGE, "m@1").refusal() is None
    fixed = {**METADATA, "batch": "fixed"}
    assert TensorIO(fixed, 4 * PAGE, "m@1").max_rows == 1


def test_packed_outputs_split_and_join_by_rows() -> None:
    from meshfn.inference.batching import join, split
    from meshfn.inference.kserve import Output

    packed = Output("y", "FP32", [3, 2], None, None, floats(1, 2, 3, 4, 5, 6))
    first, second = split([packed], [1, 2])
    assert (first[0].shape, first[0].raw()) == ([1, 2], floats(1, 2))
    assert (second[0].shape, second[0].values()) == ([2, 2], [3.0, 4.0, 5.0, 6.0])
    joined = join([(first, None), (second, None)])
    assert joined.outputs is not None and joined.outputs[0].raw() == packed.raw()
    assert joined.outputs[0].shape == [3, 2]
    # a JSON output beside a packed one still joins (the host sends either the same way)
    plain = Output("y", "FP32", [1, 2], [7.0, 8.0])
    mixed = join([([plain], None), (second, None)])
    assert mixed.outputs is not None and mixed.outputs[0].values() == [7.0, 8.0, 3.0, 4.0, 5.0, 6.0]
    assert Input("x", dtype("FP32"), (1,), floats(1)).raw == floats(1)
