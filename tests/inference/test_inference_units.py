"""Unit tests of the inference backend's pure parts: signatures, KServe checks, config,
manifests, engine key, and the guest SDK (run on the host)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import stat
import struct
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from meshfn.inference import signing
from meshfn.inference.build import FUNCTIONS_DIR
from meshfn.inference.config import load_config, parse_config
from meshfn.inference.engine import EPOCH_TICK_S, deadline_ticks, engine_key, engine_settings
from meshfn.inference.errors import ConfigError, ManifestError, SignatureError
from meshfn.inference.gate import WorkerGate
from meshfn.inference.kserve import (
    KServeError,
    Output,
    Requested,
    Signature,
    envelope,
    parse_http,
    select,
)
from meshfn.inference.manifest import load_manifest
from meshfn.inference.tensors import unpack

# ---------------------------------------------------------------------- signing


def test_sign_verify_roundtrip_and_key_file_modes(tmp_path: Path) -> None:
    private, public = signing.generate_key(tmp_path, "k")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    key = signing.load_private_key(private)
    trusted = signing.TrustedKeys.from_paths([tmp_path])  # a directory of .pub files
    envelope_ = signing.sign(key, "module", {"module_sha256": "ab" * 32, "n": 1})
    assert signing.verify(envelope_, "module", trusted) == {"module_sha256": "ab" * 32, "n": 1}
    assert signing.load_public_key(public)
    with pytest.raises(SignatureError, match="already exists"):
        signing.generate_key(tmp_path, "k")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: e["payload"].update(module_sha256="cd" * 32), "bad signature"),
        (lambda e: e.update(kind="compiled"), "expected 'module'"),
        (lambda e: e.update(key_id="0" * 16), "untrusted key"),
        (lambda e: e.update(signature="not base64!"), "bad signature"),
        (lambda e: e.pop("signature"), "not a meshfn signature"),
        (lambda e: e.update(payload=[1]), "not an object"),
    ],
)
def test_verify_refuses_tampering(tmp_path: Path, mutate: Any, message: str) -> None:
    private, _ = signing.generate_key(tmp_path)
    key = signing.load_private_key(private)
    env = signing.sign(key, "module", {"module_sha256": "ab" * 32})
    mutate(env)
    with pytest.raises(SignatureError, match=message):
        signing.verify(env, "module", signing.TrustedKeys([key.public_key()]))


def test_verify_refuses_other_key(tmp_path: Path) -> None:
    a = signing.load_private_key(signing.generate_key(tmp_path, "a")[0])
    b = signing.load_private_key(signing.generate_key(tmp_path, "b")[0])
    env = signing.sign(a, "module", {"x": 1})
    with pytest.raises(SignatureError, match="untrusted"):
        signing.verify(env, "module", signing.TrustedKeys([b.public_key()]))


def test_bad_key_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(SignatureError, match="not a readable PEM private key"):
        signing.load_private_key(junk)
    with pytest.raises(SignatureError, match="not a readable PEM public key"):
        signing.load_public_key(junk)


# ---------------------------------------------------------------------- KServe checks

SIG = Signature.from_metadata(
    {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "t", "datatype": "BYTES", "shape": [-1]},
            {"name": "n", "datatype": "UINT8", "shape": [1]},
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }
)


def req(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "r1",
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2.5], [3, 4]]},
            {"name": "t", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
            {"name": "n", "datatype": "UINT8", "shape": [1], "data": [255]},
        ],
    }
    body.update(over)
    return body


def with_input(i: int, **over: Any) -> dict[str, Any]:
    body = req()
    body["inputs"][i].update(over)
    return body


def test_valid_request_becomes_raw_tensors() -> None:
    raw = json.dumps(req(outputs=[{"name": "y"}], parameters={"k": 1})).encode()
    parsed = parse_http(raw, SIG)
    assert parsed.id == "r1" and [o.name for o in parsed.outputs or []] == ["y"]
    assert parsed.parameters == {"k": 1}
    x, t, n = parsed.inputs
    assert (x.shape, unpack(x.raw, x.dt, 4)) == ((2, 2), [1.0, 2.5, 3.0, 4.0])  # nested, flat
    assert t.raw == b"\x02\x00\x00\x00hi" and n.raw == b"\xff"
    guest = json.loads(parsed.guest_json())
    assert guest["inputs"][0] == {
        "name": "x",
        "datatype": "FP32",
        "shape": [2, 2],
        "raw": "AACAPwAAIEAAAEBAAACAQA==",
    }
    assert guest["outputs"] == [{"name": "y"}] and guest["parameters"] == {"k": 1}
    assert json.loads(parsed.guest_json(raw=False))["inputs"][1]["data"] == ["hi"]
    assert parse_http(json.dumps(req()).encode(), SIG).outputs is None


def test_select_outputs() -> None:
    outputs = [Output("a", "FP32", [1], [1]), Output("b", "FP32", [1], [2])]
    assert [o.name for o in select(outputs, [Requested("b")], "m@1")] == ["b"]
    assert select(outputs, None, "m@1") == outputs
    with pytest.raises(KServeError, match="did not return output"):
        select(outputs, [Requested("c")], "m@1")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (json.dumps(req(extra=1)).encode(), "unknown request field"),
        (json.dumps(req(id=5)).encode(), "'id' must be a string"),
        (json.dumps(req(inputs=[])).encode(), "non-empty list"),
        (json.dumps(req(inputs="x")).encode(), "non-empty list"),
        (json.dumps(req(parameters=[])).encode(), "'parameters' must be an object"),
        (json.dumps(req(inputs=[1])).encode(), "must be an object"),
        (json.dumps(with_input(0, name="z")).encode(), "unknown input 'z'"),
        (json.dumps(with_input(0, datatype="FP64")).encode(), "expected FP32"),
        (json.dumps(with_input(0, shape=[2, 3])).encode(), "does not match"),
        (json.dumps(with_input(0, shape=[4])).encode(), "does not match"),
        (json.dumps(with_input(0, shape=[-1, 2])).encode(), "has a negative dimension"),
        (json.dumps(with_input(0, shape=[True, 2])).encode(), "does not match"),
        (json.dumps(with_input(0, data=[1, 2, 3])).encode(), "3 elements for shape"),
        (json.dumps(with_input(0, data=[1, 2, 3, "4"])).encode(), "is not a number"),
        (json.dumps(with_input(0, data=[1, 2, 3, True])).encode(), "is not a number"),
        (json.dumps(with_input(1, data=[7])).encode(), "is not a string"),
        # valid JSON (json.dumps writes it as "\\ud800"), but no text: was a UnicodeEncodeError
        (json.dumps(with_input(1, data=["\ud800"])).encode(), "lone UTF-16 surrogate"),
        (json.dumps(with_input(2, data=[256])).encode(), "out of range for UINT8"),
        (json.dumps(with_input(2, data=[1.5])).encode(), "is not an integer"),
        (
            json.dumps(with_input(2, parameters={"binary_data_size": 4})).encode(),
            "needs the Inference-Header-Content-Length",
        ),
        (json.dumps(with_input(2, bogus=1)).encode(), "unknown field"),
        (json.dumps(req(outputs=[{"name": "nope"}])).encode(), "unknown output"),
        (json.dumps(req(outputs=["y"])).encode(), "list of objects"),
    ],
)
def test_bad_requests_are_400_with_a_reason(body: bytes, message: str) -> None:
    with pytest.raises(KServeError) as info:
        parse_http(body, SIG)
    assert info.value.status == 400
    assert message in info.value.message
    assert json.loads(info.value.body()) == {"error": info.value.message}


def test_missing_and_duplicate_inputs() -> None:
    body = req()
    body["inputs"] = body["inputs"][:2]
    with pytest.raises(KServeError, match="missing input"):
        parse_http(json.dumps(body).encode(), SIG)
    body = req()
    body["inputs"].append(dict(body["inputs"][0]))
    with pytest.raises(KServeError, match="given twice"):
        parse_http(json.dumps(body).encode(), SIG)
    body = req()
    del body["inputs"][0]["shape"]
    with pytest.raises(KServeError, match="lacks shape"):
        parse_http(json.dumps(body).encode(), SIG)


def test_non_finite_floats_refused() -> None:
    raw = json.dumps(with_input(0, data=[1, 2, 3, float("nan")])).encode()
    with pytest.raises(KServeError, match="non-finite"):
        parse_http(raw, SIG)


ONE_INPUT = Signature.from_metadata(
    {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }
)


def test_raw_binary_request_is_the_only_inputs_data() -> None:
    """Triton's raw binary request (Inference-Header-Content-Length: 0)."""
    data = struct.pack("<4f", 1, 2, 3, 4)
    parsed = parse_http(data, ONE_INPUT, 0)
    (x,) = parsed.inputs
    assert (x.name, x.shape, x.raw) == ("x", (2, 2), data)
    assert parsed.binary_output and parsed.outputs is None and parsed.id is None
    fixed = Signature.from_metadata(
        {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1]}], "outputs": []}
    )
    (t,) = parse_http(b"any bytes\xff", fixed, 0).inputs
    assert (t.shape, t.raw) == ((1,), b"\x0a\x00\x00\x00any bytes\xff")


@pytest.mark.parametrize(
    ("signature", "body", "message"),
    [
        (SIG, b"\0" * 8, "needs a model with exactly one input; this one takes n, t, x"),
        (ONE_INPUT, b"\0" * 12, "12 bytes of FP32 do not fill input 'x' of shape [-1, 2]"),
        (ONE_INPUT, b"\0" * 3, "8 bytes per row"),
        (
            Signature.from_metadata(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}], "outputs": []}
            ),
            b"\0" * 8,
            "has 2 variable dimensions",
        ),
        (
            Signature.from_metadata(
                {"inputs": [{"name": "x", "datatype": "INT8", "shape": [3]}], "outputs": []}
            ),
            b"\0" * 6,
            "3 bytes per tensor",
        ),
        (
            Signature.from_metadata(
                {"inputs": [{"name": "b", "datatype": "BOOL", "shape": [2]}], "outputs": []}
            ),
            b"\x01\x02",
            "BOOL bytes must be 0 or 1",
        ),
        (
            Signature.from_metadata(
                {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [2]}], "outputs": []}
            ),
            b"ab",
            "is not [1]",
        ),
    ],
)
def test_bad_raw_binary_requests(signature: Signature, body: bytes, message: str) -> None:
    with pytest.raises(KServeError) as info:
        parse_http(body, signature, 0)
    assert info.value.status == 400 and message in info.value.message


def test_empty_outputs_list_means_all_and_a_named_model_must_match() -> None:
    assert parse_http(json.dumps(req(outputs=[])).encode(), SIG).outputs is None
    named = json.dumps(req(model_name="m", model_version="2")).encode()
    assert parse_http(named, SIG, model=("m", "2")).id == "r1"
    assert parse_http(named, SIG).id == "r1"  # nothing chosen to compare with
    unnamed = json.dumps(req(model_name="", model_version="")).encode()
    assert parse_http(unnamed, SIG, model=("m", "2")).id == "r1"  # "" names none
    for body, message in (
        (req(model_name="other"), "'model_name' is 'other', but the request's path names 'm'"),
        (req(model_version="1"), "'model_version' is '1', but the request's path names '2'"),
        (req(model_name=7), "'model_name' must be a string"),
    ):
        with pytest.raises(KServeError, match=message):
            parse_http(json.dumps(body).encode(), SIG, model=("m", "2"))


def test_non_finite_outputs_are_carried_raw() -> None:
    """NaN and the infinities are valid outputs (a client's JSON never holds them: refused
    above); binary data and gRPC carry them bit for bit."""
    out = Output("y", "FP32", [3], [float("nan"), float("inf"), float("-inf")])
    assert out.raw() == struct.pack("<3f", float("nan"), float("inf"), float("-inf"))
    assert Output("h", "FP16", [1], [float("inf")]).raw() == struct.pack("<e", float("inf"))
    with pytest.raises(KServeError, match="out of range for FP32"):
        Output("y", "FP32", [1], [1e39]).raw()  # a finite value too large is still wrong


def test_envelope_adds_name_version_and_id() -> None:
    out = envelope('{"outputs":[]}', "iris", "1", "abc")
    assert out is not None and json.loads(out) == {
        "model_name": "iris",
        "model_version": "1",
        "id": "abc",
        "outputs": [],
    }
    empty = envelope("{ }", "m", "2", None)
    assert empty is not None and json.loads(empty) == {"model_name": "m", "model_version": "2"}
    assert envelope("[1]", "m", "1", None) is None
    assert envelope("oops", "m", "1", None) is None


# ---------------------------------------------------------------------- config


def test_config_yaml_with_relative_paths(tmp_path: Path) -> None:
    path = tmp_path / "backend.yaml"
    path.write_text(
        "registry: reg\ntrustedKeys: [keys/dev.pub]\nworkers: 1\nfunctions:\n"
        "  - name: iris\n    version: '1'\n    isolation: fresh-instance-per-request\n"
        "    idleTtl: 5s\n    pool: {minIdle: 2, maxIdle: 3}\n"
        "    limits: {memoryMiB: 32, timeout: 250ms, maxConcurrency: 2, maxRequestBytes: 4096}\n"
        "  - name: iris-alias\n    artifact: iris@1\n"
    )
    cfg = load_config(path)
    assert cfg.registry == tmp_path / "reg"
    assert cfg.trustedKeys == [tmp_path / "keys/dev.pub"]
    fn = cfg.functions[0] if cfg.functions else None
    assert fn is not None and fn.isolation == "fresh-instance-per-request"
    limits = fn.limits
    assert (limits.memoryMiB, limits.timeout, limits.maxConcurrency) == (
        32,
        timedelta(seconds=0.25),
        2,
    )
    assert (fn.pool.minIdle, fn.pool.maxIdle, fn.idleTtl) == (2, 3, timedelta(seconds=5))
    assert cfg.with_overrides(workers=3).workers == 3


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"registry": "r", "bogus": 1}, "bogus"),
        ({"registry": "r", "functions": [{"name": "Bad Name"}]}, "functions.0.name"),
        ({"registry": "r", "functions": [{"name": "a", "isolation": "x"}]}, "isolation"),
        ({"registry": "r", "functions": [{"name": "a", "artifact": "noversion"}]}, "0.artifact"),
        (
            {"registry": "r", "functions": [{"name": "a", "limits": {"timeout": "0s"}}]},
            "limits.timeout",
        ),
        ({"registry": "r", "functions": [{"name": "a", "limits": {"memMB": 1}}]}, "memMB"),
        ({"registry": "r", "functions": [{"name": "a"}, {"name": "a"}]}, "declared twice"),
        (
            {"registry": "r", "functions": [{"name": "a", "pool": {"minIdle": 5, "maxIdle": 1}}]},
            "minIdle exceeds",
        ),
        (
            {"registry": "r", "functions": [{"name": "a", "codeTtl": "5s"}]},
            "codeTtl must not be shorter than idleTtl",
        ),
        ({"registry": "r", "functions": [{"name": "a", "codeTtl": "0s"}]}, "codeTtl"),
        ({"registry": "r", "codeCache": {"ttl": "25h"}}, "codeCache.ttl must be between"),
        ({"registry": "r", "codeCache": {"maxEntries": -1}}, "codeCache.maxEntries"),
        ({"registry": "r", "codeCache": {"maxEntries": "8"}}, "codeCache.maxEntries"),
        ({"registry": "r", "codeCache": {"size": 8}}, "codeCache.size"),
        ({"registry": "r", "codeCache": {"ttl": "soon"}}, "codeCache.ttl"),
        ({"workers": 2}, "registry"),
    ],
)
def test_config_errors_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


# ---------------------------------------------------------------------- manifests, engine


def test_example_manifests_load() -> None:
    kinds = {
        load_manifest(p.parent).name: load_manifest(p.parent).kind
        for p in (FUNCTIONS_DIR / "examples").glob("*/function.toml")
    }
    assert kinds == {
        "iris": "onnx", "digits": "onnx", "digits28": "onnx", "cancer": "onnx",
        "digits-cnn": "onnx", "embedder": "python", "tiny-lm": "onnx",
    }  # fmt: skip
    tiny = load_manifest(FUNCTIONS_DIR / "examples" / "tiny-lm")
    assert tiny.generate is not None and tiny.generate.engine == "step"  # a compiled step
    assert (tiny.model, tiny.max_batch) == ("step.onnx", 256)  # generation.batching's ceiling
    iris = load_manifest(FUNCTIONS_DIR / "examples" / "iris")
    assert (iris.model, iris.prepare, iris.max_batch, iris.memory_mib) == (
        "model.onnx", "train.py", 64, 64,
    )  # fmt: skip


_IO = '[[inputs]]\nname="x"\ndatatype="FP32"\nshape=[-1]\n[[outputs]]\nname="y"\ndatatype="FP32"\nshape=[-1]'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no function.toml"),
        ("name = ", "function.toml"),
        ('name="UP"\nversion="1"\nkind="python"\nmodule="m"', "name"),
        (
            'name="a"\nversion="1"\nkind="core"\n[[inputs]]\nname="x"\ndatatype="FP32"\nshape=[1]\n'
            '[[outputs]]\nname="y"\ndatatype="FP32"\nshape=[1]',
            "needs `source`",
        ),
        (
            'name="a"\nversion="1"\nkind="python"\nmodule="m"\n[[inputs]]\nname="x"\ndatatype="F32"\n'
            'shape=[1]\n[[outputs]]\nname="y"\ndatatype="FP32"\nshape=[1]',
            "datatype",
        ),
        (
            'name="a"\nversion="1"\nkind="python"\nmodule="m"\n[[inputs]]\nname="x"\ndatatype="FP32"\n'
            'shape=[0]\n[[outputs]]\nname="y"\ndatatype="FP32"\nshape=[1]',
            "dimensions",
        ),
        (
            'name="a"\nversion="1"\nkind="python"\nmodule="m"\n[[inputs]]\nname="x"\ndatatype="FP32"\n'
            'shape=[1]\n[[outputs]]\nname="y"\ndatatype="FP32"\nshape=[1]',
            "m.py does not exist",
        ),
        *(
            (f'name="a"\nversion="1"\nkind="onnx"\n{extra}{_IO}', message)
            for extra, message in (
                ("", "needs `model`"),
                ('model="m.onnx"\n', "model m.onnx does not exist"),
                ('model="../m.onnx"\n', "a path inside the function directory"),
                ('model="m.onnx"\nsource="m.c"\n', "`source` is not for kind 'onnx'"),
                ('model="m.onnx"\nmax_batch=0\n', "max_batch"),
            )
        ),
    ],
)
def test_manifest_errors(tmp_path: Path, text: str | None, message: str) -> None:
    if text is not None:
        (tmp_path / "function.toml").write_text(text)
    with pytest.raises(ManifestError, match=message):
        load_manifest(tmp_path)


def test_engine_key_and_deadlines() -> None:
    key = engine_key()
    assert key.startswith("wasmtime-50.0.1-") and key == engine_key()
    assert engine_settings()["epoch_interruption"] is True
    assert deadline_ticks(0.1) >= 0.1 / EPOCH_TICK_S + 1
    assert deadline_ticks(0.0001) == 2  # never zero: a deadline always allows one tick


# ---------------------------------------------------------------------- guest SDK on the host


def load_sdk() -> ModuleType:
    spec = importlib.util.spec_from_file_location("meshfn_sdk", FUNCTIONS_DIR / "sdk/meshfn_sdk.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sdk_handle_flatten_outputs_and_errors() -> None:
    sdk = load_sdk()
    assert sdk.flatten([[1, [2, 3]], [4]]) == [1, 2, 3, 4]
    assert sdk.flatten(5) == [5]

    class Double(sdk.Model):  # type: ignore[name-defined,misc]
        def predict(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> list[Any]:
            x = inputs["x"]
            if parameters.get("fail") == "bad":
                raise sdk.BadRequest("no thanks")
            if parameters.get("fail") == "oom":
                raise MemoryError
            if parameters.get("fail") == "bug":
                raise KeyError("k")
            return [
                sdk.Tensor("y", "FP32", x.shape, [v * 2 for v in x.data]),
                sdk.Tensor("rows", "INT64", [len(x.rows())], [len(r) for r in x.rows()]),
            ]

    model = Double()
    request = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]
    }
    out = json.loads(sdk.handle(model, json.dumps(request)))
    assert out["outputs"][0]["data"] == [2, 4, 6, 8]
    assert out["outputs"][1]["data"] == [2, 2]
    only = json.loads(sdk.handle(model, json.dumps({**request, "outputs": [{"name": "rows"}]})))
    assert [o["name"] for o in only["outputs"]] == ["rows"]
    for fail, kind in (("bad", "bad-request"), ("oom", "out-of-memory"), ("bug", "internal")):
        with pytest.raises(sdk.ModelError) as info:
            sdk.handle(model, json.dumps({**request, "parameters": {"fail": fail}}))
        assert info.value.kind == kind
    with pytest.raises(sdk.ModelError, match="unknown output"):
        sdk.handle(model, json.dumps({**request, "outputs": [{"name": "zz"}]}))


# ---------------------------------------------------------------- the worker gate (gate.py)


async def test_the_worker_gate_orders_by_priority_within_a_function_only() -> None:
    gate = WorkerGate(1)
    await gate.acquire("held", 0, None)  # the one thread, busy
    assert not gate.contended  # busy, but nobody waits: a decoding call keeps its thread
    served: list[str] = []

    async def call(owner: str, priority: int, name: str) -> None:
        await gate.acquire(owner, priority, None)
        served.append(name)
        gate.release()

    tasks = []
    for owner, priority, name in (("f", 0, "f-low"), ("g", 5, "g-high"), ("f", 5, "f-high"),
                                  ("g", 0, "g-low"), ("f", 5, "f-high-2")):  # fmt: skip
        tasks.append(asyncio.create_task(call(owner, priority, name)))
        await asyncio.sleep(0)
    gone = asyncio.create_task(call("f", 9, "cancelled"))
    timed_out = asyncio.create_task(gate.acquire("g", 9, 0.01))
    await asyncio.sleep(0.05)
    gone.cancel()
    with pytest.raises(TimeoutError):
        await timed_out
    assert gate.waiting == 5 and gate.contended
    gate.release()
    await asyncio.gather(*tasks)
    with pytest.raises(asyncio.CancelledError):
        await gone
    # f's and g's turns alternate as their waiters came; within each, higher first
    assert served == ["f-high", "g-high", "f-high-2", "g-low", "f-low"]
    assert gate.busy == 0 and gate.waiting == 0 and not gate.contended
    await gate.acquire("f", 0, 0)  # free again: no wait at all
    assert gate.busy == 1


async def test_a_waiter_handed_a_thread_as_it_gives_up_passes_it_on() -> None:
    gate = WorkerGate(1)
    await gate.acquire("held", 0, None)
    first = asyncio.create_task(gate.acquire("f", 0, None))
    second = asyncio.create_task(gate.acquire("f", 0, None))
    await asyncio.sleep(0)
    gate.release()  # hands the thread to `first`...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await second  # so the thread went on to the next waiter
    assert gate.busy == 1 and gate.waiting == 0
