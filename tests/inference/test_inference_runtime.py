"""Host, registry, signatures and pools with real wasmtime and the real (cached) builds of the
example and test functions: componentize-py components and clang core modules."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import wasmtime
from prometheus_client import generate_latest

from meshfn.contracts.function import CodeCache as CodeCacheSettings
from meshfn.contracts.qos import TENANT_HEADER
from meshfn.inference import signing
from meshfn.inference.abi import check_core_module
from meshfn.inference.backend import Backend
from meshfn.inference.codecache import CodeCache
from meshfn.inference.config import ServedFunction, parse_config
from meshfn.inference.engine import EpochTicker, engine_key, new_engine
from meshfn.inference.errors import BuildError, RegistryError, SignatureError
from meshfn.inference.examples import publish_examples
from meshfn.inference.host import (
    CallResult,
    ComponentArtifact,
    CoreArtifact,
    CoreInstance,
    Outcome,
    TensorCall,
    load_precompiled,
)
from meshfn.inference.metrics import Metrics
from meshfn.inference.pool import FunctionRuntime
from meshfn.inference.registry import Registry, sign_module
from meshfn.inference.status import functions_document

X = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]})


def chaos(mode: str) -> str:
    return json.dumps({**json.loads(X), "parameters": {"mode": mode}})


@dataclass
class Published:
    root: Path
    key: Path
    private: Path

    @property
    def registry(self) -> Registry:
        return Registry(self.root)

    @property
    def trusted(self) -> signing.TrustedKeys:
        return signing.TrustedKeys.from_paths([self.key])


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    root = tmp_path_factory.mktemp("registry")
    _, public = publish_examples(root, include_testing=True)
    return Published(root, public, public.with_suffix(".key"))


@pytest.fixture
def copy_of(published: Published, tmp_path: Path) -> Iterator[Published]:
    """A private registry holding only chaos-core (tiny), safe to tamper with."""
    root = tmp_path / "reg"
    shutil.copytree(published.root / "chaos-core", root / "chaos-core")
    yield Published(root, published.key, published.private)


@pytest.fixture(scope="module")
def engine() -> Iterator[wasmtime.Engine]:
    eng = new_engine()
    ticker = EpochTicker(eng).start()
    yield eng
    ticker.stop()


def instance(published: Published, engine: wasmtime.Engine, name: str, mib: int = 64):  # type: ignore[no-untyped-def]
    verified = published.registry.verify(name, "1", published.trusted)
    return load_precompiled(engine, verified.kind, verified.cwasm).instantiate(mib << 20)


# ---------------------------------------------------------------------- host


@pytest.mark.parametrize("name", ["chaos", "chaos-core"])
def test_runaway_is_interrupted_and_instance_poisoned(
    published: Published, engine: wasmtime.Engine, name: str
) -> None:
    inst = instance(published, engine, name)
    result = inst.call(chaos("spin"), ticks=20)  # ~100 ms at 5 ms per tick
    assert result.outcome is Outcome.TIMEOUT and result.outcome.poisons  # interrupted, not done
    if name == "chaos":  # a trapped component refuses re-entry; core modules do not, hence
        assert inst.call(X, 20).outcome is Outcome.TRAP  # the pool discards both kinds


@pytest.mark.parametrize(("name", "mib"), [("chaos", 32), ("chaos-core", 4)])
def test_memory_hog_gets_out_of_memory(
    published: Published, engine: wasmtime.Engine, name: str, mib: int
) -> None:
    inst = instance(published, engine, name, mib)
    result = inst.call(chaos("hog"), ticks=2000)
    assert result.outcome is Outcome.OUT_OF_MEMORY, result
    assert result.outcome.poisons


def test_guest_sees_no_host_environment_or_files(
    published: Published, engine: wasmtime.Engine
) -> None:
    inst = instance(published, engine, "chaos")
    result = inst.call(chaos("env"), 400)
    assert result.outcome is Outcome.OK
    probe = json.loads(json.loads(result.body)["outputs"][0]["parameters"]["probe"])
    assert probe == {"env": {}}  # not even the build machine's environment was baked in
    assert inst.call(chaos("print"), 400).outcome is Outcome.OK  # print goes nowhere
    for mode in ("fs", "sleep"):  # sleep traps (no clock capability): it cannot hold a worker
        result = instance(published, engine, "chaos").call(chaos(mode), 400)
        assert result.outcome is Outcome.TRAP, result
        assert "host capability that model functions do not have" in result.body


def test_publish_refuses_components_with_imports(published: Published, tmp_path: Path) -> None:
    wasm = tmp_path / "env-1.wasm"
    wasm.write_bytes(
        wasmtime.wat2wasm('(component (import "wasi:cli/environment@0.2.0" (instance)))')
    )
    info = {"name": "env", "version": "1", "kind": "python", "metadata": {},
            "module_sha256": signing.sha256_file(wasm)}  # fmt: skip
    (tmp_path / "env-1.json").write_text(json.dumps(info))
    key = signing.load_private_key(published.private)
    sign_module(wasm, key)
    with pytest.raises(RegistryError, match="component imports wasi:cli/environment"):
        Registry(tmp_path / "reg").publish(wasm, key)
    assert not (tmp_path / "reg" / "env").exists()


def test_core_trap_and_model_errors(published: Published, engine: wasmtime.Engine) -> None:
    core = instance(published, engine, "chaos-core")
    assert core.call(chaos("trap"), 100).outcome is Outcome.TRAP
    py = instance(published, engine, "chaos")
    assert py.call(chaos("reject"), 400).outcome is Outcome.BAD_REQUEST
    raised = py.call(chaos("raise"), 400)
    assert raised.outcome is Outcome.INTERNAL and "chaos asked to fail" in raised.body
    assert py.call(X, 400).outcome is Outcome.OK  # model errors do not poison


def test_iris_compiled_model_predicts(published: Published, engine: wasmtime.Engine) -> None:
    inst = instance(published, engine, "iris")
    flowers = struct.pack("<8f", 5.1, 3.5, 1.4, 0.2, 6.7, 3.0, 5.2, 2.3)
    result = inst.call(TensorCall(2, (flowers,), 2), 400)
    assert result.outcome is Outcome.OK
    labels, probabilities = result.outputs
    assert struct.unpack("<2q", labels) == (0, 2)  # setosa, virginica
    rows = struct.unpack("<6f", probabilities)
    assert all(abs(sum(rows[i : i + 3]) - 1) < 1e-5 for i in (0, 3))
    assert inst.call(json.dumps({}), 400).outcome is Outcome.INTERNAL  # never ABI v1's JSON


def core_module(
    engine: wasmtime.Engine,
    *,
    alloc: str = "(i32.const 1024)",
    infer: str = "(call $pack (local.get $p) (local.get $n))",  # echo the request, status ok
    version: str = "(i32.const 1)",
    memory: str = '(memory (export "memory") 1)',
) -> CoreInstance:
    """A hand-written core ABI module, to drive the host's raw C-API call path to its edges."""
    wat = f"""(module
      {memory}
      (data (i32.const 16) "{{}}")
      (func $pack (param $p i32) (param $n i32) (result i64)
        (i64.or (i64.shl (i64.extend_i32_u (local.get $p)) (i64.const 32))
                (i64.extend_i32_u (local.get $n))))
      (func (export "meshfn_abi_version") (result i32) {version})
      (func (export "meshfn_alloc") (param $n i32) (result i32) {alloc})
      (func (export "meshfn_metadata") (result i64) (call $pack (i32.const 16) (i32.const 2)))
      (func (export "meshfn_infer") (param $p i32) (param $n i32) (result i64) {infer}))"""
    artifact = CoreArtifact(engine, wasmtime.Module(engine, wat))
    instance = artifact.instantiate(1 << 20)
    assert isinstance(instance, CoreInstance)
    return instance


def test_core_calls_through_the_c_api(engine: wasmtime.Engine) -> None:
    inst = core_module(engine)
    assert inst.metadata() == "{}"
    for body in ('{"a": 1}', "é" * 3000):  # the request bytes round-trip through linear memory
        assert inst.call(body, 100) == CallResult(Outcome.OK, body)
    status1 = "(i64.or (i64.const 0x4000000000000000) (call $pack (local.get $p) (i32.const 2)))"
    assert core_module(engine, infer=status1).call("{}", 100).outcome is Outcome.BAD_REQUEST
    no_room = core_module(engine, alloc="(i32.const 0)").call("{}", 100)
    assert no_room.outcome is Outcome.OUT_OF_MEMORY
    past_end = core_module(engine, infer="(call $pack (i32.const 65530) (i32.const 100))")
    assert "outside linear memory" in past_end.call("{}", 100).body
    high = core_module(engine, alloc="(i32.const -16)")  # 0xFFFFFFF0: unsigned, out of memory
    assert high.call("{}", 100).outcome is Outcome.TRAP
    assert core_module(engine, infer="(unreachable)").call("{}", 100).outcome is Outcome.TRAP
    spin = core_module(engine, infer="(loop (br 0)) (unreachable)").call("{}", 2)
    assert spin.outcome is Outcome.TIMEOUT
    inst.close()
    with pytest.raises(ValueError, match="closed"):  # never a call into a freed store
        inst.call("{}", 100)


def test_core_abi_mismatches_fail_cleanly(engine: wasmtime.Engine) -> None:
    # a core function speaks version 1; version 2 is a compiled model's (kind onnx, its own
    # artifact: test_tensor_abi.py)
    for version in ("(i32.const 2)", "(i32.const 3)"):
        with pytest.raises(wasmtime.WasmtimeError, match="unknown meshfn ABI version"):
            core_module(engine, version=version)
    with pytest.raises(wasmtime.WasmtimeError, match="'memory' has the wrong kind"):
        core_module(engine, memory='(memory 1) (func (export "memory"))')
    with pytest.raises(wasmtime.WasmtimeError, match="lacks ABI export 'memory'"):
        core_module(engine, memory="(memory 1)")
    # wasmtime checks value types on every call: a wrong signature is an error, not a crash
    wat = """(module (memory (export "memory") 1)
      (func (export "meshfn_abi_version") (result i32) (i32.const 1))
      (func (export "meshfn_alloc") (param i64) (result i32) (i32.const 64))
      (func (export "meshfn_metadata") (result i64) (i64.const 0))
      (func (export "meshfn_infer") (param i32 i32) (result i64) (i64.const 0)))"""
    wrong = CoreArtifact(engine, wasmtime.Module(engine, wat)).instantiate(1 << 20)
    assert wrong.call("{}", 100).outcome is Outcome.TRAP


# ---------------------------------------------------------------------- registry and signatures


def test_verify_good_entry(published: Published) -> None:
    v = published.registry.verify("digits", "1", published.trusted)
    assert v.kind == "onnx" and v.metadata["name"] == "digits" and v.metadata["abi"] == 2
    assert published.registry.verify("chaos-core", "1", published.trusted).kind == "core"
    assert v.cwasm.name == f"{engine_key()}.cwasm" and v.intact()
    assert v.build["report"]["heldout_accuracy"] > 0.9


@pytest.mark.parametrize("target", ["module.wasm", "compiled/*.cwasm"])
def test_tampered_files_refused(copy_of: Published, target: str) -> None:
    entry = copy_of.root / "chaos-core" / "1"
    path = next(entry.glob(target))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SignatureError, match="digest mismatch"):
        copy_of.registry.verify("chaos-core", "1", copy_of.trusted)


def test_unsigned_untrusted_and_wrong_engine_refused(copy_of: Published, tmp_path: Path) -> None:
    entry = copy_of.root / "chaos-core" / "1"
    other = signing.TrustedKeys(
        [signing.load_private_key(signing.generate_key(tmp_path)[0]).public_key()]
    )
    with pytest.raises(SignatureError, match="untrusted key"):
        copy_of.registry.verify("chaos-core", "1", other)
    record = next(entry.glob("compiled/*.json"))
    envelope = json.loads(record.read_text())
    envelope["payload"]["cwasm_sha256"] = "0" * 64  # forged record
    record.write_text(json.dumps(envelope))
    with pytest.raises(SignatureError, match="bad signature"):
        copy_of.registry.verify("chaos-core", "1", copy_of.trusted)
    for path in entry.glob("compiled/*"):
        path.rename(path.with_name("wasmtime-0.0.0-other" + path.suffix))
    with pytest.raises(RegistryError, match="no precompiled artifact"):
        copy_of.registry.verify("chaos-core", "1", copy_of.trusted)
    (entry / "module.sig.json").unlink()
    with pytest.raises(SignatureError, match="unsigned"):
        copy_of.registry.verify("chaos-core", "1", copy_of.trusted)
    with pytest.raises(RegistryError, match="not in the registry"):
        copy_of.registry.verify("nothing", "1", copy_of.trusted)


def test_publish_refuses_modified_or_unsigned_modules(published: Published, tmp_path: Path) -> None:
    src = published.root / "chaos-core" / "1"
    wasm = tmp_path / "chaos-core-1.wasm"
    shutil.copyfile(src / "module.wasm", wasm)
    payload = json.loads((src / "module.sig.json").read_text())["payload"]
    (tmp_path / "chaos-core-1.json").write_text(json.dumps(payload))
    key = signing.load_private_key(published.private)
    registry = Registry(tmp_path / "reg")
    with pytest.raises(SignatureError, match="not signed"):
        registry.publish(wasm, key)
    sign_module(wasm, key)
    wasm.write_bytes(wasm.read_bytes() + b"\0")  # changed after signing
    with pytest.raises(SignatureError, match="does not match its signature"):
        registry.publish(wasm, key)
    shutil.copyfile(src / "module.wasm", wasm)
    entry = registry.publish(wasm, key)
    assert registry.verify("chaos-core", "1", published.trusted).cwasm.parent == entry / "compiled"


def test_core_abi_rules_enforced() -> None:
    with pytest.raises(BuildError, match="may not import"):
        check_core_module(wasmtime.wat2wasm('(module (import "env" "f" (func)))'), "t")
    with pytest.raises(BuildError, match="missing core ABI exports"):
        check_core_module(wasmtime.wat2wasm('(module (memory (export "memory") 1))'), "t")
    with pytest.raises(BuildError, match="not a valid core wasm"):
        check_core_module(b"\0asm garbage", "t")


# ---------------------------------------------------------------------- pools and lifecycle


@pytest.fixture
def prewarm() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(1)
    yield executor
    executor.shutdown(wait=True)


def runtime(
    pub: Published, engine: wasmtime.Engine, executor: ThreadPoolExecutor, name: str, **spec: object
) -> FunctionRuntime:
    fs = ServedFunction.model_validate({"name": name, "version": "1", **spec})
    rt = FunctionRuntime(
        fs, "1", (name, "1"), engine, pub.registry, pub.trusted, Metrics(), executor
    )
    rt.verify()
    assert rt.refusal is None
    return rt


def counter(rt: FunctionRuntime) -> float:
    result = rt.invoke(chaos("counter")).result
    assert result.outcome is Outcome.OK, result
    return float(json.loads(result.body)["outputs"][0]["data"][0])


@pytest.mark.parametrize("name", ["chaos", "chaos-core"])
def test_isolation_modes(
    published: Published, engine: wasmtime.Engine, prewarm: ThreadPoolExecutor, name: str
) -> None:
    reuse = runtime(published, engine, prewarm, name, isolation="reuse")
    assert not reuse.loaded
    first = reuse.invoke(chaos("counter"))
    assert first.cold and reuse.loaded
    assert [counter(reuse), counter(reuse)] == [2.0, 3.0]  # same instance keeps its state
    assert not reuse.invoke(X).cold
    fresh = runtime(published, engine, prewarm, name, isolation="fresh-instance-per-request")
    assert [counter(fresh) for _ in range(3)] == [1.0, 1.0, 1.0]


def test_a_request_racing_the_instance_drop_ends_dormancy(
    published: Published, engine: wasmtime.Engine, prewarm: ThreadPoolExecutor
) -> None:
    """The drop can land while a request holds an instance, which then goes back to the pool:
    the next request takes it and the function is no longer dormant (the reaper can drop again)."""
    rt = runtime(published, engine, prewarm, "chaos-core", codeTtl="600s")
    assert counter(rt) == 1.0
    instance, generation, _ = rt._take()  # a request in flight
    rt.drop_instances()
    assert rt.dormant and not rt._idle
    rt._give_back(instance, generation, CallResult(Outcome.OK, "{}"))
    assert counter(rt) == 2.0  # the same instance, given back after the drop
    assert not rt.dormant and rt.metrics.resumes.labels(rt.label)._value.get() == 0
    rt.drop_instances()
    assert rt.dormant and not rt._idle
    assert counter(rt) == 1.0  # a new instance from the kept code: a resume
    assert rt.metrics.resumes.labels(rt.label)._value.get() == 1
    assert rt.metrics.cold_starts.labels(rt.label)._value.get() == 1


def test_trapped_instance_is_replaced(
    published: Published, engine: wasmtime.Engine, prewarm: ThreadPoolExecutor
) -> None:
    rt = runtime(published, engine, prewarm, "chaos-core", limits={"timeout": "20ms"})
    assert [counter(rt), counter(rt)] == [1.0, 2.0]
    assert rt.invoke(chaos("spin")).result.outcome is Outcome.TIMEOUT
    assert counter(rt) == 1.0  # a new instance
    assert rt.invoke(chaos("trap")).result.outcome is Outcome.TRAP
    assert counter(rt) == 1.0


def test_warm_pool_min_and_max_idle_and_unload(
    published: Published, engine: wasmtime.Engine, prewarm: ThreadPoolExecutor
) -> None:
    rt = runtime(published, engine, prewarm, "chaos-core", pool={"minIdle": 3, "maxIdle": 4})
    rt.invoke(X)
    deadline = time.monotonic() + 5
    while len(rt._idle) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(rt._idle) >= 3
    rt.unload()
    assert not rt.loaded and len(rt._idle) == 0
    capped = runtime(published, engine, prewarm, "chaos-core", pool={"minIdle": 0, "maxIdle": 1})
    with ThreadPoolExecutor(4) as many:
        list(many.map(lambda _: capped.invoke(X), range(16)))
    assert len(capped._idle) <= 1


def test_file_changed_after_verification_is_rechecked(
    copy_of: Published, engine: wasmtime.Engine, prewarm: ThreadPoolExecutor
) -> None:
    rt = runtime(copy_of, engine, prewarm, "chaos-core")
    assert rt.invoke(X).result.outcome is Outcome.OK
    rt.unload()
    flip_a_byte(next((copy_of.root / "chaos-core/1/compiled").glob("*.cwasm")))
    with pytest.raises(Exception, match=r"refused: .*digest mismatch"):
        rt.invoke(X)
    assert rt.refusal is not None and rt.refusal.status == 403


def flip_a_byte(cwasm: Path) -> None:
    data = bytearray(cwasm.read_bytes())
    data[-100] ^= 0x01
    cwasm.write_bytes(bytes(data))  # same size; mtime/ctime change


@pytest.mark.parametrize("path", ["request", "warm-up"])
def test_kept_code_is_rechecked_before_every_new_instance(
    copy_of: Published, engine: wasmtime.Engine, prewarm: ThreadPoolExecutor, path: str
) -> None:
    """Code kept past the idle TTL (codeTtl) is checked against its files before it makes a new
    instance, on the request path and for a predicted warm-up: a rewritten artifact is verified
    and loaded again (never instantiated from the old mapping), a tampered one refused."""
    rt = runtime(copy_of, engine, prewarm, "chaos-core", codeTtl="1h")
    assert counter(rt) == 1.0
    first = rt._artifact
    rt.drop_instances()
    assert rt.dormant and rt.loaded
    assert counter(rt) == 1.0 and rt._artifact is first  # unchanged: the kept code, a resume
    rt.drop_instances()
    cwasm = next((copy_of.root / "chaos-core/1/compiled").glob("*.cwasm"))
    cwasm.write_bytes(cwasm.read_bytes())  # rewritten, same bytes: identity changed
    if path == "warm-up":
        rt.warm(1)
    assert counter(rt) == 1.0
    assert rt._artifact is not first and rt.refusal is None  # verified and deserialized again
    assert rt.metrics.cold_starts.labels(rt.label)._value.get() == 2
    rt.drop_instances()
    flip_a_byte(cwasm)
    with pytest.raises(Exception, match=r"refused: .*digest mismatch"):
        rt.warm(1) if path == "warm-up" else rt.invoke(X)
    assert rt.refusal is not None and rt.refusal.status == 403 and not rt.loaded


def test_kept_code_of_a_deleted_artifact_is_dropped(
    copy_of: Published, engine: wasmtime.Engine, prewarm: ThreadPoolExecutor
) -> None:
    rt = runtime(copy_of, engine, prewarm, "chaos-core", codeTtl="1h")
    assert counter(rt) == 1.0
    rt.drop_instances()
    shutil.rmtree(copy_of.root / "chaos-core")
    with pytest.raises(Exception, match="refused"):
        rt.invoke(X)
    assert rt.refusal is not None and not rt.loaded


# ---------------------------------------------------------------------- backend (no sockets)


async def until(done: Callable[[], bool], seconds: float = 2.0, every: float = 0.01) -> None:
    """Poll the backend's state from the test's event loop (the reaper runs on it)."""
    for _ in range(round(seconds / every)):
        if done():
            return
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {seconds} s")


def backend_for(pub: Published, functions: list[dict[str, object]], workers: int = 2) -> Backend:
    cfg = parse_config(
        {
            "registry": str(pub.root),
            "trustedKeys": [str(pub.key)],
            "workers": workers,
            "functions": functions,
        }
    )
    return Backend(cfg)


async def test_runaway_does_not_block_other_functions_and_limits(published: Published) -> None:
    b = backend_for(published, [
        {"name": "chaos-core", "limits": {"timeout": "2s", "maxConcurrency": 1}},
        {"name": "digits"},
        {"name": "chaos", "limits": {"memoryMiB": 32}},
    ])  # fmt: skip
    await b.start()
    try:
        spin = asyncio.create_task(b.infer("chaos-core", None, chaos("spin").encode()))
        for _ in range(500):  # until the spin holds chaos-core's one slot
            if b.inflight:
                break
            await asyncio.sleep(0.01)
        busy = await b.infer("chaos-core", None, X.encode())
        assert busy.status == 429 and b"concurrency limit" in busy.body
        body = json.dumps(
            {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [0] * 64}]}
        )
        for _ in range(5):
            assert (await b.infer("digits", None, body.encode())).status == 200
        assert not spin.done()  # digits answered while chaos-core spun
        timed_out = await spin
        assert timed_out.status == 504
        assert json.loads(timed_out.body)["error"] == (
            "function chaos-core@1 exceeded its 2000 ms deadline and was interrupted"
        )
        hog = await b.infer("chaos", None, chaos("hog").encode())
        assert hog.status == 500
        assert "exceeded its memory limit of 32 MiB" in json.loads(hog.body)["error"]
        assert (await b.infer("chaos", None, X.encode())).status == 200
    finally:
        await b.drain(1)


PRIORITY_QOS = {
    "policy": "tenants/qos",
    "defaultClass": "low",
    "classes": [{"name": "low", "priority": 0}, {"name": "high", "priority": 10}],
    "tenants": [{"name": "acme", "class": "high"}],
}


async def _served_in_order(b: Backend, queued: Callable[[], int]) -> list[str]:
    """One worker, held by a spinning call; then three requests of the low class and one of
    the high class queue behind it, in that order. Returns who was answered in what order."""
    order: list[str] = []

    async def send(who: str, mode: str) -> None:
        headers = {TENANT_HEADER.encode(): who.encode()}
        reply = await b.infer("chaos", None, chaos(mode).encode(), headers)
        order.append(f"{who}:{reply.status}")

    tasks = [asyncio.create_task(send("initech", "spin"))]
    await until(lambda: b.inflight == 1 and queued() == 0, 10)
    for i, who in enumerate(("initech", "globex", "initech", "acme")):
        tasks.append(asyncio.create_task(send(who, "echo")))
        await until(lambda i=i: queued() == i + 1, 10)  # type: ignore[misc]
    await asyncio.gather(*tasks)
    return order


async def test_a_higher_class_gets_the_next_free_worker_first(published: Published) -> None:
    """At saturation the guest calls waiting for a worker thread run highest class first (a
    QoSPolicy's priorities; arrival order within a class), not in the thread pool's FIFO."""
    b = backend_for(published, [
        {"name": "chaos", "limits": {"timeout": "300ms"}, "qos": PRIORITY_QOS},
    ], workers=1)  # fmt: skip
    await b.start()
    try:
        gate = b.dispatcher.gate
        order = await _served_in_order(b, lambda: gate.waiting)
        assert order == ["initech:504", "acme:200", "initech:200", "globex:200", "initech:200"]
        assert gate.busy == 0 and gate.waiting == 0
    finally:
        await b.drain(1)


async def test_a_higher_class_is_batched_first(published: Published) -> None:
    # batches of one go at once; the queue delay lets the queued requests outwait the spin
    b = backend_for(published, [
        {"name": "chaos", "limits": {"timeout": "300ms"}, "qos": PRIORITY_QOS,
         "batching": {"maxBatchSize": 1, "maxQueueDelay": "500ms"}},
    ], workers=1)  # fmt: skip
    await b.start()
    try:

        def queued() -> int:
            lane = b.dispatcher.lanes.get("chaos@1")
            return len(lane.batcher.queue) if lane is not None and lane.batcher else 0

        order = await _served_in_order(b, queued)
        assert order == ["initech:504", "acme:200", "initech:200", "globex:200", "initech:200"]
    finally:
        await b.drain(1)


async def test_waiting_for_a_worker_honours_the_deadline(published: Published) -> None:
    """A call that waits for a thread longer than its client's timeout is a 504 that never
    runs, and the thread goes on to the next waiter."""
    b = backend_for(published, [{"name": "chaos", "limits": {"timeout": "300ms"}}], workers=1)
    await b.start()
    try:
        spin = asyncio.create_task(b.infer("chaos", None, chaos("spin").encode()))
        await until(lambda: b.inflight == 1, 10)
        hurried = json.dumps({**json.loads(X), "parameters": {"mode": "counter", "timeout": 50000}})
        late = await b.infer("chaos", None, hurried.encode())
        assert late.status == 504
        assert "before a worker was free" in json.loads(late.body)["error"]
        assert (await spin).status == 504
        again = await b.infer("chaos", None, chaos("counter").encode())
        assert again.status == 200
        assert b.dispatcher.gate.busy == 0 and b.dispatcher.gate.waiting == 0
    finally:
        await b.drain(1)


async def test_bad_input_never_reaches_the_function(published: Published) -> None:
    b = backend_for(published, [{"name": "chaos-core", "limits": {"maxRequestBytes": 200}}])
    await b.start()
    try:
        bad = [
            b"{not json",
            json.dumps(
                {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [1]}]}
            ).encode(),
            json.dumps(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}
            ).encode(),
            b'{"inputs": [' + b" " * 300 + b"]}",
        ]
        statuses = [(await b.infer("chaos-core", None, body)).status for body in bad]
        assert statuses == [400, 400, 400, 413]
        assert (await b.infer("nope", None, X.encode())).status == 404
        assert (await b.infer("chaos-core", "9", X.encode())).status == 404
        reply = await b.infer("chaos-core", "1", chaos("counter").encode())
        assert json.loads(reply.body)["outputs"][0]["data"] == [1]  # first call that ran
    finally:
        await b.drain(1)


async def test_refused_function_is_4xx_while_others_serve(copy_of: Published) -> None:
    shutil.copytree(copy_of.root / "chaos-core", copy_of.root / "twin")
    (copy_of.root / "twin/1/module.wasm").write_bytes(b"\0asm tampered")
    b = backend_for(copy_of, [{"name": "chaos-core"}, {"name": "twin"}, {"name": "ghost"}])
    await b.start()
    try:
        refused = await b.infer("twin", None, X.encode())
        assert refused.status == 403 and b"refused" in refused.body
        assert (await b.infer("ghost", None, X.encode())).status == 404
        assert b.model_ready("twin", None).status == 503
        assert b.metadata("twin", None).status == 403
        # the server stays ready (the others serve); the index says which one is not and why
        assert b.ready
        index = {m["name"]: m for m in b.repository_index()}
        assert index["twin"]["state"] == "UNAVAILABLE" and "refused" in index["twin"]["reason"]
        assert index["chaos-core"]["state"] == "READY"
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
    finally:
        await b.drain(1)


async def test_idle_functions_scale_to_zero(published: Published) -> None:
    b = backend_for(published, [{"name": "chaos-core", "idleTtl": "100ms", "pool": {"minIdle": 2}}])
    await b.start()
    try:
        rt = b.lookup("chaos-core", None)
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        assert rt.loaded
        await until(lambda: not rt.loaded)
        assert not rt._idle
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        assert b.metrics.cold_starts.labels(rt.label)._value.get() == 2
    finally:
        await b.drain(1)


async def test_code_ttl_keeps_the_code_after_the_instances_go(published: Published) -> None:
    """codeTtl: at the idle TTL the instances go but the code stays, so the next request
    instantiates from it (a resume, not a cold start); at the code TTL the code goes too."""
    b = backend_for(
        published,
        [{"name": "chaos", "idleTtl": "300ms", "codeTtl": "1200ms", "pool": {"minIdle": 2}}],
    )
    await b.start()
    try:
        rt = b.lookup("chaos", None)
        assert (await b.infer("chaos", None, X.encode())).status == 200
        first = rt._artifact
        await until(lambda: len(rt._idle) == 2, seconds=5)  # the pool refilled to minIdle
        await until(lambda: rt.dormant, seconds=5)
        assert rt.loaded and not rt._idle and b.metrics.idle.labels(rt.label)._value.get() == 0
        await asyncio.sleep(0.1)  # stays dormant: the pool is not refilled without a request
        assert rt.dormant and not rt._idle
        assert (await b.infer("chaos", None, X.encode())).status == 200
        assert rt._artifact is first and not rt.dormant
        assert b.metrics.cold_starts.labels(rt.label)._value.get() == 1
        assert b.metrics.resumes.labels(rt.label)._value.get() == 1
        await until(lambda: not rt.loaded, seconds=5)  # the code TTL
        assert not rt._idle and b.metrics.unloads.labels(rt.label)._value.get() == 1
        assert (await b.infer("chaos", None, X.encode())).status == 200
        assert b.metrics.cold_starts.labels(rt.label)._value.get() == 2
    finally:
        await b.drain(1)


def backend_with(pub: Published, functions: list[dict[str, object]], **config: object) -> Backend:
    """backend_for with backend-level settings (e.g. codeCache)."""
    base = backend_for(pub, functions)
    return Backend(base.config.with_overrides(**config))


def lookups(b: Backend, label: str) -> tuple[float, float]:
    """(hits, misses) of `label` in the code cache's metric."""
    counter = b.metrics.code_cache_lookups
    return counter.labels(label, "hit")._value.get(), counter.labels(label, "miss")._value.get()


async def test_component_linker_is_shared_and_code_outlives_the_code_ttl(
    published: Published,
) -> None:
    b = backend_for(
        published,
        [{"name": "chaos", "idleTtl": "50ms"}, {"name": "embedder"}, {"name": "chaos-core"}],
    )
    await b.start()
    try:
        chaos_rt, embedder_rt = b.lookup("chaos", None), b.lookup("embedder", None)
        assert (await b.infer("chaos", None, X.encode())).status == 200
        first = chaos_rt._artifact
        assert isinstance(first, ComponentArtifact) and first.linker is b.code.linker
        assert lookups(b, chaos_rt.label) == (0, 1) and b.code.held == 1
        # the code TTL: the function lets its code go, and the process keeps it
        await until(lambda: not chaos_rt.loaded and b.code.held == 0)
        assert len(b.code) == 1
        assert (await b.infer("chaos", None, X.encode())).status == 200
        assert chaos_rt._artifact is first and lookups(b, chaos_rt.label) == (1, 1)
        assert chaos_rt.cold_starts == 2 and chaos_rt.code_cache_hits == 1
        document = functions_document(b)
        assert document["code_cache"] == {
            "entries": 1, "held": 1, "ttl_s": 900.0, "max_entries": 32,
        }  # fmt: skip
        chaos_status = next(f for f in document["functions"] if f["name"] == "chaos")
        assert chaos_status["cold_starts"] == 2 and chaos_status["code_cache_hits"] == 1
        # many threads instantiate different components through the one linker at once
        text = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                       "data": ["hello mesh"]}]})  # fmt: skip
        calls = [(chaos_rt, X), (embedder_rt, text)] * 4
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda call: call[0].invoke(call[1]).result, calls))
        assert [r.outcome for r in results] == [Outcome.OK] * 8, results
        metrics = generate_latest(b.metrics.registry).decode()
        assert 'meshfn_code_cache_entries{state="held"} 2.0' in metrics  # chaos, embedder
        assert 'meshfn_code_cache_lookups_total{function="chaos@1",outcome="hit"} 1.0' in metrics
    finally:
        await b.drain(1)
    assert len(b.code) == 0  # shutdown lets everything go


async def test_code_cache_off_deserializes_every_load(published: Published) -> None:
    b = backend_with(published, [{"name": "chaos", "idleTtl": "50ms"}], codeCache={"maxEntries": 0})
    await b.start()
    try:
        rt = b.lookup("chaos", None)
        assert (await b.infer("chaos", None, X.encode())).status == 200
        first = rt._artifact
        await until(lambda: not rt.loaded and len(b.code) == 0)  # nothing kept
        assert (await b.infer("chaos", None, X.encode())).status == 200
        second = rt._artifact
        assert isinstance(first, ComponentArtifact) and isinstance(second, ComponentArtifact)
        assert second.component is not first.component  # deserialized again
        assert lookups(b, rt.label) == (0, 2) and rt.code_cache_hits == 0
    finally:
        await b.drain(1)


async def test_code_cache_is_shared_by_one_artifacts_functions_and_expires(
    published: Published,
) -> None:
    b = backend_with(
        published,
        [
            {"name": "a", "artifact": "chaos-core@1", "idleTtl": "50ms"},
            {"name": "b", "artifact": "chaos-core@1", "idleTtl": "50ms"},
        ],
        codeCache={"ttl": "300ms"},
    )
    await b.start()
    try:
        a, other = b.lookup("a", None), b.lookup("b", None)
        assert (await b.infer("a", None, X.encode())).status == 200
        assert (await b.infer("b", None, X.encode())).status == 200
        assert a._artifact is other._artifact and len(b.code) == 1 and b.code.held == 1
        assert lookups(b, a.label) == (0, 1) and lookups(b, other.label) == (1, 0)
        await until(lambda: not a.loaded and not other.loaded and b.code.held == 0)
        assert len(b.code) == 1
        await until(lambda: len(b.code) == 0, seconds=3)  # the cache's own TTL
        assert (await b.infer("a", None, X.encode())).status == 200
        assert lookups(b, a.label) == (0, 2)  # gone: deserialized again
    finally:
        await b.drain(1)


async def test_code_cache_never_hands_out_code_of_a_changed_file(copy_of: Published) -> None:
    b = backend_for(copy_of, [{"name": "chaos-core", "idleTtl": "50ms"}])
    await b.start()
    try:
        rt = b.lookup("chaos-core", None)
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        first = rt._artifact
        await until(lambda: not rt.loaded and b.code.held == 0)
        assert len(b.code) == 1
        verified = rt.verified
        assert verified is not None
        os.utime(verified.cwasm)  # rewritten in place (same bytes, new identity)
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        assert rt._artifact is not first and lookups(b, rt.label) == (0, 2)
        assert rt.verified is not None and rt.verified.code_key != verified.code_key
    finally:
        await b.drain(1)


async def test_only_code_let_go_at_the_code_ttl_is_kept(published: Published) -> None:
    """A repository unload (Triton's: free it now) and a refusal drop the code at once."""
    b = backend_for(published, [{"name": "chaos-core"}])
    await b.start()
    try:
        rt = b.lookup("chaos-core", None)
        for reason, kept in (("repository", 0), ("refused", 0), ("idle", 1)):
            assert (await b.infer("chaos-core", None, X.encode())).status == 200
            rt.unload(reason)
            assert len(b.code) == kept and b.code.held == 0, reason
    finally:
        await b.drain(1)


async def test_memory_pressure_drops_free_code_after_warm_instances(published: Published) -> None:
    b = backend_for(
        published,
        [
            {"name": "chaos-core", "idleTtl": "50ms"},
            {"name": "digits", "pool": {"minIdle": 1}, "idleTtl": "1h"},
        ],
    )
    await b.start()
    try:
        rt, digits = b.lookup("chaos-core", None), b.lookup("digits", None)
        assert (await b.infer("chaos-core", None, X.encode())).status == 200
        body = json.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                                       "data": [0.0] * 64}]})  # fmt: skip
        assert (await b.infer("digits", None, body.encode())).status == 200
        await until(lambda: not rt.loaded and b.code.held == 1 and digits.idle_instances == 1)
        assert len(b.code) == 2
        b.config = b.config.with_overrides(lowMemory=1 << 20)  # more than this machine has
        await until(lambda: b.pressure and len(b.code) == 1, seconds=3)
        assert digits.loaded and digits.idle_instances == 0  # held code stays, instances go
    finally:
        await b.drain(1)


def test_code_cache_loads_once_for_concurrent_callers(published: Published) -> None:
    """Eight threads asking for one artifact's code at once: one deserialize, one shared
    artifact, every hold released exactly once."""
    engine = new_engine()
    trusted = signing.TrustedKeys.from_paths([published.key])
    key = Registry(published.root).verify("chaos", "1", trusted).code_key
    metrics = Metrics()
    cache = CodeCache(engine, metrics)
    barrier = threading.Barrier(8)

    def one(_: int) -> object:
        barrier.wait()
        artifact, _hit = cache.acquire(key, "chaos@1")
        return artifact

    with ThreadPoolExecutor(8) as pool:
        artifacts = list(pool.map(one, range(8)))
    assert len({id(a) for a in artifacts}) == 1 and cache.held == 1
    lookups = metrics.code_cache_lookups
    assert lookups.labels("chaos@1", "miss")._value.get() == 1
    assert lookups.labels("chaos@1", "hit")._value.get() == 7
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: cache.release(key), range(8)))
    assert cache.held == 0 and len(cache) == 1  # kept for the TTL


def test_code_cache_bounds_and_errors(published: Published, tmp_path: Path) -> None:
    """Unit: the size cap (least recently released first out), a failed load holds nothing,
    and a release without an acquire is a bug, not a silent miscount."""
    engine = new_engine()
    trusted = signing.TrustedKeys.from_paths([published.key])
    registry = Registry(published.root)
    keys = [registry.verify(n, "1", trusted).code_key for n in ("chaos-core", "digits")]
    cache = CodeCache(engine, Metrics(), CodeCacheSettings(maxEntries=1))
    first, hit = cache.acquire(keys[0], "x")
    assert not hit and cache.acquire(keys[0], "x") == (first, True) and cache.held == 1
    cache.release(keys[0])
    cache.release(keys[0])
    assert len(cache) == 1 and cache.held == 0
    cache.acquire(keys[1], "y")
    cache.release(keys[1])
    assert len(cache) == 1 and cache.acquire(keys[1], "y")[1]  # keys[0] went (the cap)
    cache.release(keys[1])
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(keys[0])
    other = wasmtime.Engine(wasmtime.Config())  # code of another engine does not load
    broken = CodeCache(other, Metrics())
    with pytest.raises(wasmtime.WasmtimeError):
        broken.acquire(keys[0], "x")
    assert len(broken) == 0
    assert cache.drop_free() == 1 and len(cache) == 0


def test_examples_are_cached_and_republish_is_skipped(published: Published) -> None:
    from meshfn.inference.build import FUNCTIONS_DIR, build

    assert build(FUNCTIONS_DIR / "examples/digits").cached
    again, _ = publish_examples(published.root, include_testing=True)
    assert all(p.skipped for p in again)
