"""The audit filter's C code, compiled natively against the fake proxy-wasm host (the same
sources as audit.wasm). Covers its crypto against Python's, config fail-closed, hostile headers
and tokens, body hashing and memory hygiene. Envoy behaviour is covered in e2e/test_wasm_*."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random
from pathlib import Path
from typing import Any

import pytest

from meshfn.testing.filters import harness, wasm_dir

ROOT = Path(__file__).resolve().parents[2]
SALT = bytes(range(32))
STATE = b"meshfn_audit"


fakehost = harness("fakehost")


@pytest.fixture(scope="module", params=["audit", "audit-lean"])
def host(request: pytest.FixtureRequest) -> Any:
    """Every test runs on both builds: the full one and the lean one (no per-request context)."""
    return fakehost.FakeHost(wasm_dir(native=True) / f"{request.param}_native.so")


def config(**overrides: Any) -> bytes:
    base: dict[str, Any] = {"subject_salt": SALT.hex(), "subject_source": "header"}
    base.update(overrides)
    return json.dumps(base).encode()


def full_build_only(host: Any) -> None:
    if host.lean:
        pytest.skip("body hashing needs the full build (test_lean_build_refuses_body_hashing)")


def token(claims: Any) -> bytes:
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=")
    return b"Bearer eyJhbGciOiJSUzI1NiJ9." + payload + b".c2lnbmF0dXJl"


def run(host: Any, cfg: bytes, headers: list[tuple[bytes, bytes]], **kw: Any) -> dict[str, Any]:
    root, ok = host.configure(cfg)
    assert ok, host.logs()
    ctx = host.stream(root)
    for name, value in kw.get("properties", {}).items():
        host.set_property(name, value)
    assert host.request_headers(ctx, headers, eos=kw.get("eos", True)) == fakehost.CONTINUE
    for chunk, eos in kw.get("body", []):
        assert host.request_body(ctx, chunk, eos) == fakehost.CONTINUE
    raw = host.state(STATE)
    host.delete(ctx)
    host.delete(root)
    assert raw is not None
    return json.loads(raw)  # always valid JSON, whatever the input


# ------------------------------------------------------------------ crypto


@pytest.mark.parametrize("length", [0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 1000, 65537])
def test_sha256_matches_hashlib(host: Any, length: int) -> None:
    data = random.Random(length).randbytes(length)
    assert host.sha256(data) == hashlib.sha256(data).digest()
    for step in (1, 7, 64, 100):
        assert host.sha256(data, step=step) == hashlib.sha256(data).digest()


@pytest.mark.parametrize("key_len", [0, 1, 16, 32, 63, 64, 65, 200])
@pytest.mark.parametrize("msg_len", [0, 5, 64, 300])
def test_hmac_sha256_matches_python(host: Any, key_len: int, msg_len: int) -> None:
    rng = random.Random(key_len * 1000 + msg_len)
    key, msg = rng.randbytes(key_len), rng.randbytes(msg_len)
    assert host.hmac_sha256(key, msg) == hmac.new(key, msg, "sha256").digest()


# ------------------------------------------------------------------ configuration fails closed

BAD_CONFIGS: list[tuple[bytes | None, str]] = [
    (None, "missing"),
    (b"", "missing"),
    (b"   ", "unexpected end"),
    (b"[]", "must be a JSON object"),
    (b'"salt"', "must be a JSON object"),
    (b'{"subject_salt": "00112233445566778899aabbccddeeff"', "unterminated"),
    (b'{"subject_salt": "00112233445566778899aabbccddeeff"} x', "trailing data"),
    (
        b'{"subject_salt": "00112233445566778899aabbccddeeff", "subject_salt": "ff"}',
        "duplicate key",
    ),
    (b'{"subject_salt": "0011\xff\xfe"}', "invalid UTF-8"),
    (b'{"subject_salt": "\\ud800"}', "lone surrogate"),
    (b'{"subject_salt": "a\x01b"}', "control character"),
    (b"[" * 1000 + b"]" * 1000, "nested too deeply"),
    (b'{"subject_salt": 12}', "subject_salt: must be"),
    (b"{}", "subject_salt: required"),
    (b'{"subject_salt": "0011"}', "subject_salt: must be"),
    (b'{"subject_salt": "zz112233445566778899aabbccddeeff"}', "subject_salt: must be"),
    (b'{"subject_salt": "00112233445566778899aabbccddeef"}', "subject_salt: must be"),
    (config(extra=1), "extra: unknown field"),
    (config(subject_source="cookie"), "subject_source"),
    (config(token_header="Authorization"), "token_header"),
    (config(sub_header="x sub"), "sub_header"),
    (config(tenant_header=""), "tenant_header"),
    (config(salt_id=""), "salt_id"),
    (config(tenant_claim=5), "tenant_claim"),
    (config(body_hash=True), "body_hash: must be an object"),
    (config(body_hash={"enabled": "yes"}), "body_hash.enabled"),
    (config(body_hash={"enabled": True, "max_bytes": 0}), "body_hash.max_bytes"),
    (config(body_hash={"enabled": True, "max_bytes": 1.5}), "body_hash.max_bytes"),
    (config(body_hash={"enabled": True, "max_bytes": 10**30}), "body_hash.max_bytes"),
    (config(body_hash={"enable": True}), "body_hash: unknown field"),
]


def assert_refused(host: Any, root: int) -> None:
    ctx = host.stream(root)
    assert host.request_headers(ctx, [(b"authorization", token({"sub": "a"}))]) == fakehost.PAUSE
    reply = host.local_response()
    assert reply is not None and reply.status == 503
    assert json.loads(reply.body) == {
        "error": "meshfn filter not configured: see the proxy log",
        "status": 503,
    }
    assert reply.headers == [(b"content-type", b"application/json")]
    assert host.state(STATE) is None  # nothing recorded as if the filter had run
    host.delete(ctx)


@pytest.mark.parametrize(("raw", "reason"), BAD_CONFIGS)
def test_bad_config_is_rejected_with_reason(host: Any, raw: bytes | None, reason: str) -> None:
    root, ok = host.configure(raw)
    assert not ok
    errors = [msg for level, msg in host.logs() if level == 4]
    assert len(errors) == 1 and "invalid plugin configuration" in errors[0], host.logs()
    assert reason in errors[0]
    # a stream Envoy creates under a root that failed is refused (fail closed)
    assert_refused(host, root)
    host.delete(root)


def test_huge_config_is_parsed(host: Any) -> None:
    padding = "x" * 2_000_000
    root, ok = host.configure(config(salt_id="s", tenant_claim="t" * 128) + b" " * 10)
    assert ok
    host.delete(root)
    root, ok = host.configure(config(junk=padding))
    assert not ok and "junk: unknown field" in host.logs()[-1][1]
    host.delete(root)


# ------------------------------------------------------------------ records


def test_subject_is_hmac_of_sub_and_never_raw(host: Any) -> None:
    tok = token({"sub": "alice@example.com", "tenant": "acme", "iat": 1})
    state = run(
        host,
        config(),
        [(b"authorization", tok), (b"x-request-id", b"req-1")],
    )
    expected = hmac.new(SALT, b"alice@example.com", "sha256").hexdigest()
    assert state["subject"] == expected
    assert state["tenant"] == "acme"
    assert state["subject_source"] == "header"
    assert set(state) == {
        "v",
        "subject",
        "salt_id",
        "subject_source",
        "tenant",
        "body",
        "body_sha256",
    }
    blob = json.dumps(state)
    assert "alice" not in blob and "Bearer" not in blob and SALT.hex() not in blob


def test_subject_from_jwt_authn_metadata(host: Any) -> None:
    prefix = b"metadata\0filter_metadata\0envoy.filters.http.jwt_authn\0my_payload\0"
    state = run(
        host,
        config(subject_source="jwt_authn", jwt_metadata_key="my_payload", salt_id="k2"),
        [(b"authorization", token({"sub": "mallory"}))],  # unverified header is ignored
        properties={prefix + b"sub": b"bob", prefix + b"tenant": b"t9"},
    )
    assert state["subject"] == hmac.new(SALT, b"bob", "sha256").hexdigest()
    assert state["tenant"] == "t9" and state["salt_id"] == "k2"


def test_subject_from_jwt_claim_headers(host: Any) -> None:
    """jwt_headers mode with body hashing: the full filter-state object, tenant included."""
    full_build_only(host)
    hashing = {"body_hash": {"enabled": True}}
    state = run(
        host,
        config(subject_source="jwt_headers", sub_header="x-sub", tenant_header="x-ten", **hashing),
        [(b"x-sub", b"carol"), (b"X-Ten", b"t3"), (b"authorization", token({"sub": "mallory"}))],
    )
    assert state["subject"] == hmac.new(SALT, b"carol", "sha256").hexdigest()
    assert state["tenant"] == "t3" and state["subject_source"] == "jwt_headers"
    assert state["body"] == "empty" and state["body_sha256"] is None
    cfg = config(subject_source="jwt_headers", **hashing)
    state = run(host, cfg, [(b"x-meshfn-jwt-tenant", b"t")])
    assert state["subject"] is None and state["tenant"] is None  # no sub: no tenant either
    state = run(host, cfg, [(b"x-meshfn-jwt-sub", b"")])
    assert state["subject"] is None
    # hostile tenant header values stay valid JSON (invalid UTF-8 replaced, capped at 128 bytes)
    state = run(host, cfg, [(b"x-meshfn-jwt-sub", b"s"), (b"x-meshfn-jwt-tenant", b'\xff"' * 99)])
    assert state["tenant"] == '\ufffd"' * 64


def run_raw(host: Any, cfg: bytes, headers: list[tuple[bytes, bytes]], **kw: Any) -> bytes | None:
    root, ok = host.configure(cfg)
    assert ok, host.logs()
    ctx = host.stream(root)
    assert host.request_headers(ctx, headers, eos=kw.get("eos", True)) == fakehost.CONTINUE
    for chunk, eos in kw.get("body", []):
        assert host.request_body(ctx, chunk, eos) == fakehost.CONTINUE
    raw: bytes | None = host.state(STATE)
    host.delete(ctx)
    host.delete(root)
    return raw


def run_raw_on(host: Any, root: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """One request on an already configured root."""
    ctx = host.stream(root)
    assert host.request_headers(ctx, headers) == fakehost.CONTINUE
    raw = host.state(STATE)
    host.delete(ctx)
    assert raw is not None
    return bytes(raw)


def test_bare_filter_state_is_the_subject_alone(host: Any) -> None:
    """jwt_headers mode without body hashing: the filter state is the subject's 64 hex digits
    (the access log writes salt_id, subject_source and the tenant next to it)."""
    cfg = config(subject_source="jwt_headers", sub_header="x-sub", tenant_claim="org")
    headers = [(b"x-sub", b"carol"), (b"x-meshfn-jwt-tenant", b"t3"), (b"authorization", b"x")]
    raw = run_raw(host, cfg, headers)
    assert raw == hmac.new(SALT, b"carol", "sha256").hexdigest().encode()
    assert b"t3" not in raw and b"carol" not in raw
    # hostile subjects: still exactly 64 lowercase hex digits
    for sub in (b'\xff\xfe"{', b"s" * 100_000, b"null"):
        raw = run_raw(host, cfg, [(b"x-sub", sub)])
        assert raw == hmac.new(SALT, sub, "sha256").hexdigest().encode()


@pytest.mark.parametrize("headers", [[], [(b"x-meshfn-jwt-sub", b"")], [(b"x-other", b"a")]])
def test_bare_filter_state_without_subject_is_null(host: Any, headers: Any) -> None:
    """No subject: the state is still set (`null`), so the record shows the filter ran."""
    cfg = config(subject_source="jwt_headers", body_hash={"enabled": False})
    assert run_raw(host, cfg, [*headers, (b"x-meshfn-jwt-tenant", b"t")]) == b"null"


def slot(sub: bytes) -> int:
    """The subject cache's slot for `sub` (FNV-1a, 256 slots), as audit.c computes it."""
    x = 2166136261
    for byte in sub:
        x = ((x ^ byte) * 16777619) & 0xFFFFFFFF
    return x % 256


def test_subject_cache_never_mixes_subjects(host: Any) -> None:
    """A configuration remembers the HMAC of recent subjects (keyed by the subject's bytes, one
    per slot): repeats, subjects sharing a slot, prefixes of a remembered subject and subjects
    too long to remember all give HMAC(salt, sub)."""
    a = b"user-0"
    b = next(s for i in range(1, 10_000) if slot(s := b"user-%d" % i) == slot(a))
    # a subject and its own prefix in one slot: only the length tells them apart
    long = next(s for i in range(1, 100_000) if slot(s := b"user-%d" % i) == slot(s[:-1]))
    root, ok = host.configure(config(subject_source="jwt_headers", sub_header="x-sub"))
    assert ok
    for sub in (a, a, b, a, b, b, long, long[:-1], long, b"m" * 64, b"m" * 64, b"m" * 65):
        raw = run_raw_on(host, root, [(b"x-sub", sub)])
        assert raw == hmac.new(SALT, sub, "sha256").hexdigest().encode(), sub
    host.delete(root)


def test_subject_cache_belongs_to_its_configuration(host: Any) -> None:
    """A new salt never reuses the HMACs remembered under the old one."""
    full_build_only(host)
    root, ok = host.configure(config(subject_source="jwt_headers"))
    assert ok
    headers = [(b"x-meshfn-jwt-sub", b"carol")]
    for salt in (SALT, bytes(range(100, 132))):
        if salt != SALT:
            assert host.reconfigure(
                root, config(subject_source="jwt_headers", subject_salt=salt.hex())
            )
        raw = run_raw_on(host, root, headers)
        assert raw == hmac.new(salt, b"carol", "sha256").hexdigest().encode()
    host.delete(root)


def test_bare_filter_state_only_in_jwt_headers_mode_without_body_hashing(host: Any) -> None:
    for cfg in (config(), config(subject_source="jwt_authn"), config(tenant_claim="")):
        state = json.loads(run_raw(host, cfg, []) or b"")
        assert state["subject"] is None and state["body"] == "off"
    full_build_only(host)
    cfg = config(subject_source="jwt_headers", body_hash={"enabled": True, "max_bytes": 8})
    headers = [
        (b"x-meshfn-jwt-sub", b"dave"),
        (b"x-meshfn-jwt-tenant", b"t"),
        (b"content-length", b"3"),
    ]
    state = json.loads(run_raw(host, cfg, headers, eos=False, body=[(b"abc", True)]) or b"")
    assert state["subject"] == hmac.new(SALT, b"dave", "sha256").hexdigest()
    assert state["tenant"] == "t" and state["body"] == "hashed"
    assert state["body_sha256"] == hashlib.sha256(b"abc").hexdigest()


def test_jwt_authn_mode_without_metadata_has_no_subject(host: Any) -> None:
    state = run(host, config(subject_source="jwt_authn"), [(b"authorization", token({"sub": "x"}))])
    assert state["subject"] is None and state["tenant"] is None


def test_tenant_claim_can_be_disabled(host: Any) -> None:
    state = run(
        host, config(tenant_claim=""), [(b"authorization", token({"sub": "a", "tenant": "t"}))]
    )
    assert state["tenant"] is None and state["subject"] is not None


BAD_TOKENS = [
    b"",
    b"Basic YWxhZGRpbjpvcGVuc2VzYW1l",
    b"Bearer",
    b"Bearer ",
    b"Bearer onlyonepart",
    b"Bearer a.b",
    b"Bearer a..c",
    b"Bearer a.!!!.c",
    b"Bearer a.e30.c.d",  # four parts
    b"Bearer a." + base64.urlsafe_b64encode(b"not json").rstrip(b"=") + b".c",
    b"Bearer a." + base64.urlsafe_b64encode(b"[1,2]").rstrip(b"=") + b".c",
    b"Bearer a." + base64.urlsafe_b64encode(b'{"sub": 42}').rstrip(b"=") + b".c",
    b"Bearer a." + base64.urlsafe_b64encode(b'{"sub": ""}').rstrip(b"=") + b".c",
    b"Bearer a." + base64.urlsafe_b64encode(b'{"sub": "\xff\xfe"}').rstrip(b"=") + b".c",
    b"Bearer a." + base64.urlsafe_b64encode(b'{"sub":"a","sub":"b"}').rstrip(b"=") + b".c",
    b"Bearer a." + base64.urlsafe_b64encode(b"{" * 5000).rstrip(b"=") + b".c",
    b"Bearer a.\xff\xfe\xfd.c",
    token({"sub": "x" * 20000}),  # over the 16 KiB token cap
]


@pytest.mark.parametrize("auth", BAD_TOKENS)
def test_malformed_tokens_give_no_subject(host: Any, auth: bytes) -> None:
    state = run(host, config(), [(b"authorization", auth)])
    assert state["subject"] is None
    assert state["tenant"] is None


def test_hostile_values_stay_valid_json(host: Any) -> None:
    claims = {"sub": "s", "tenant": '\u00e9\x01"\\' + "t" * 500}
    state = run(host, config(), [(b"authorization", token(claims))])
    assert state["tenant"] == '\u00e9\x01"\\' + "t" * 123  # capped at 128 bytes
    # a tenant claim of invalid UTF-8 (jwt_authn metadata is bytes): replaced, never raw
    prefix = b"metadata\0filter_metadata\0envoy.filters.http.jwt_authn\0jwt_payload\0"
    state = run(
        host,
        config(subject_source="jwt_authn"),
        [],
        properties={
            prefix + b"sub": b"\xff\xfe",
            prefix + b"tenant": b"t-\xff\xc3\x28-\xed\xa0\x80-\xe2\x82\xac",
        },
    )
    assert state["tenant"] == "t-\ufffd\ufffd(-\ufffd\ufffd\ufffd-\u20ac"
    assert state["subject"] == hmac.new(SALT, b"\xff\xfe", "sha256").hexdigest()


def test_unreadable_tokens_are_counted(host: Any) -> None:
    root, ok = host.configure(config())
    assert ok
    before = host.metric("meshfn_audit.token_unreadable")
    ctx = host.stream(root)
    host.request_headers(ctx, [(b"authorization", b"Bearer x.y.z")])
    assert host.metric("meshfn_audit.token_unreadable") == before + 1
    host.delete(ctx)
    ctx = host.stream(root)
    host.request_headers(ctx, [])  # no token at all is not unreadable
    assert host.metric("meshfn_audit.token_unreadable") == before + 1
    host.delete(ctx)
    host.delete(root)


# ------------------------------------------------------------------ body hashing


@pytest.mark.parametrize("size", [1, 63, 64, 65, 4096, 100_000])
def test_body_hash_matches_hashlib_across_chunks(host: Any, size: int) -> None:
    full_build_only(host)
    body = random.Random(size).randbytes(size)
    cuts = (
        sorted(random.Random(size + 1).sample(range(1, size), min(5, size - 1))) if size > 1 else []
    )
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
    state = run(
        host,
        config(body_hash={"enabled": True, "max_bytes": 200_000}),
        [(b"content-length", str(size).encode())],
        eos=False,
        body=[(c, i == len(chunks) - 1) for i, c in enumerate(chunks)],
    )
    assert state["body"] == "hashed"
    assert state["body_sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ([], [(b"abc", True)], "streaming"),  # no content-length: a stream, not hashed
        ([(b"content-length", b"11")], [(b"x" * 11, True)], "too_large"),
        ([(b"content-length", b"-1")], [(b"x", True)], "too_large"),
        ([(b"content-length", b"9" * 30)], [(b"x", True)], "too_large"),
        ([(b"content-length", b"5")], [(b"x" * 6, False), (b"y" * 6, True)], "too_large"),
        ([(b"content-length", b"5")], [(b"abc", False)], "incomplete"),
    ],
)
def test_body_not_hashed(host: Any, headers: Any, body: Any, expected: str) -> None:
    full_build_only(host)
    state = run(
        host, config(body_hash={"enabled": True, "max_bytes": 10}), headers, eos=False, body=body
    )
    assert state["body"] == expected
    assert state["body_sha256"] is None


def test_body_hashing_off_by_default_and_empty_request(host: Any) -> None:
    full_build_only(host)
    state = run(host, config(), [(b"content-length", b"3")], eos=False, body=[(b"abc", True)])
    assert state["body"] == "off" and state["body_sha256"] is None
    state = run(host, config(body_hash={"enabled": True}), [])
    assert state["body"] == "empty"


# ------------------------------------------------------------------ host failures and memory


def test_filter_state_failure_is_counted_and_logged(host: Any) -> None:
    root, ok = host.configure(config())
    assert ok
    ctx = host.stream(root)
    host.fail_set_property(True)
    host.request_headers(ctx, [])
    assert host.metric("meshfn_audit.emit_failed") >= 1
    assert any("could not set filter state" in m for level, m in host.logs() if level == 4)
    host.delete(ctx)
    host.delete(root)


def test_stream_keeps_its_config_across_reconfigure_and_root_delete(host: Any) -> None:
    full_build_only(host)
    root, ok = host.configure(config(salt_id="old"))
    assert ok
    ctx = host.stream(root)
    host.request_headers(ctx, [(b"authorization", token({"sub": "a"}))], eos=False)
    assert host.reconfigure(root, config(salt_id="new", subject_salt="ff" * 16))
    host.delete(root)  # root goes first: the stream still holds its configuration
    host.request_body(ctx, b"x", True)
    state = json.loads(host.state(STATE))
    assert state["salt_id"] == "old"
    assert state["subject"] == hmac.new(SALT, b"a", "sha256").hexdigest()
    host.delete(ctx)


def test_no_memory_leak_per_request(host: Any) -> None:
    root, ok = host.configure(config(body_hash={"enabled": not host.lean}))
    assert ok

    def one() -> None:
        ctx = host.stream(root)
        host.request_headers(
            ctx,
            [(b"authorization", token({"sub": "a", "tenant": "t"})), (b"content-length", b"3")],
            eos=False,
        )
        host.request_body(ctx, b"abc", True)
        host.delete(ctx)

    one()
    baseline = host.live_bytes()
    for _ in range(200):
        one()
    assert host.live_bytes() == baseline
    host.delete(root)


def test_lean_build_refuses_body_hashing(host: Any) -> None:
    """The lean build sees request headers only: body hashing would silently never happen."""
    _, ok = host.configure(config(body_hash={"enabled": True}))
    assert ok != host.lean
    if host.lean:
        assert "body_hash.enabled: needs the full build" in host.logs()[-1][1]


def test_lean_vm_serves_one_configuration(host: Any) -> None:
    """A lean VM has no per-request context to say which root a request belongs to: a second,
    different configuration in the same VM is refused, and since Envoy still runs that plugin's
    streams in this VM (measured), every request is then refused with 503: fail closed, never
    the other plugin's configuration. The same configuration twice is fine."""
    if not host.lean:
        pytest.skip("the full build keeps a configuration per root context")
    root, ok = host.configure(config(salt_id="first"))
    assert ok
    assert host.reconfigure(root + 1, config(salt_id="first"))
    state = run_raw_on(host, root, [(b"authorization", token({"sub": "a"}))])
    assert json.loads(state)["salt_id"] == "first"
    assert not host.reconfigure(root + 2, config(salt_id="second"))
    assert "give each configuration its own vm_id" in host.logs()[-1][1]
    assert_refused(host, root)
