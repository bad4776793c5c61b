"""The audit filter in real Envoy (mTLS + jwt_authn + the wasm filter + the file access log),
collected in-process by AuditCollector into a real store: every field of the record, and no
secret (token, raw subject, body) anywhere in the store's files."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http.client as httpclient
import json
import socket
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from meshfn_e2e import http

from meshfn.audit import AuditCollector, AuditStore
from meshfn.audit.sqlite import SqliteStore
from meshfn.contracts.plugins import AuditSettings, BodyHash, DegradeSettings
from meshfn.testing.audit import Trail
from meshfn.testing.envoy import argv as envoy_argv
from meshfn.testing.envoy import start as start_envoy
from meshfn.testing.filters import audit_filter, harness, meshfn_filter
from meshfn.testing.ports import free_ports, retry_on_port_clash
from meshfn.testing.processes import Processes, wait_for
from meshfn.xds.translate.wasm import access_log, early_header_mutation, jwt_claim_headers

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
SALT = "5e" * 32
ALICE = "spiffe://e2e.local/ns/default/sa/alice"


es = harness("envoy_static")


def to_dict(message: Any) -> dict[str, Any]:
    result: dict[str, Any] = es.to_dict(message)
    return result


@dataclass
class Rig:
    port: int
    admin: int
    certs: Any
    jwt: Any
    journal: Path
    store: AuditStore
    collector: AuditCollector
    trail: Trail

    def request(
        self,
        path: str,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        client: str | None = "alice",
    ) -> tuple[int, bytes]:
        conn = httpclient.HTTPSConnection(
            "127.0.0.1", self.port, context=self.certs.client_context(client), timeout=5
        )
        try:
            chunked = (headers or {}).get("transfer-encoding") == "chunked"
            conn.request(
                method,
                path,
                body=iter([body]) if chunked else body,
                headers=headers or {},
                encode_chunked=chunked,
            )
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


@pytest.mark.parametrize("rig", ["jwt_headers", "meshfn", "bare"], indirect=True)
async def test_claim_headers_cannot_be_spoofed(rig: Rig) -> None:
    """jwt_headers mode: claim headers a client sends itself are removed before any filter runs
    (early header mutation); only jwt_authn, after verifying a token, can set them."""
    spoof = {"x-meshfn-jwt-sub": "victim", "x-meshfn-jwt-tenant": "victim-tenant"}
    token = rig.jwt.token({"sub": "real-user", "tenant": "real-tenant"})
    assert (await asyncio.to_thread(rig.request, "/open", "GET", spoof))[0] == 200
    with_token = {**spoof, "authorization": f"Bearer {token}"}
    assert (await asyncio.to_thread(rig.request, "/jwt/x", "GET", with_token))[0] == 200
    got = await records(rig, 2)
    by_path = {r["path"]: r for r in got}
    assert by_path["/open"]["subject"] is None and by_path["/open"]["tenant"] is None
    real = hmac.new(bytes.fromhex(SALT), b"real-user", "sha256").hexdigest()
    assert by_path["/jwt/x"]["tenant"] == "real-tenant"
    assert rig.store.query(subject=real) == [by_path["/jwt/x"]]


def raw_request(rig: Rig, head: bytes, body: bytes = b"") -> bytes:
    """Bytes straight onto the TLS connection, in one write: nothing between us and Envoy's
    codec, and the body arrives with the headers (the echo upstream answers without reading
    the body, so a body sent later could still be in flight when the response ends the stream)."""
    ctx = rig.certs.client_context("alice")
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", rig.port), timeout=5)) as sock:
        sock.sendall(head + b"connection: close\r\n\r\n" + body)
        return sock.recv(200)


@pytest.fixture
async def rig(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    """Param: the audit filter's subject source (jwt_authn metadata by default)."""
    param = getattr(request, "param", "jwt_authn")
    combined = param == "meshfn"  # the combined filter, audit part in jwt_headers mode
    bare = param == "bare"  # jwt_headers mode without body hashing: bare filter state
    source = "jwt_headers" if combined or bare else param
    procs = Processes(tmp_path)
    certs = es.make_certs(tmp_path / "certs", {"alice": ALICE})
    jwt = es.Jwt.new()
    journal = tmp_path / "journal" / "edge.jsonl"
    journal.parent.mkdir()
    settings = AuditSettings(
        subject_salt=SALT,
        salt_id="k1",
        subject_source=source,
        body_hash=BodyHash(enabled=not bare, max_bytes=4096),
    )
    claims = [to_dict(c) for c in jwt_claim_headers(settings)] if source == "jwt_headers" else None
    degrade = DegradeSettings(rules=[]) if combined else None
    audit = meshfn_filter(settings, degrade) if combined else audit_filter(settings)
    # audit after jwt_authn: it reads what jwt_authn verified
    filters = [jwt.filter(claim_to_headers=claims), es.to_dict(audit)]
    early = [es.to_dict(early_header_mutation(degrade, settings))] if claims else None

    def start() -> tuple[int, int]:
        port, admin, upstream = free_ports(3)
        listener = es.listener(
            port,
            filters,
            [es.route("models", "backend")],
            access_logs=[es.to_dict(access_log(journal, settings))],
            tls=certs,
            early=early,
        )
        config = tmp_path / "envoy.json"
        config.write_text(json.dumps(es.bootstrap(admin, {"backend": upstream}, listener)))
        backend = procs.upstream("upstream", "backend", upstream)
        start_envoy(procs, "envoy", envoy_argv(config, wasm=True), admin)
        wait_for(
            "upstream", lambda: http(f"http://127.0.0.1:{upstream}/").status == 200, proc=backend
        )
        return port, admin

    trail = Trail(tmp_path / "audit.db", tmp_path)
    store = trail.store
    collector = AuditCollector(store, poll_interval=0.02, signer=trail.signer)
    collector.watch(journal, "edge~0")
    try:
        port, admin = await asyncio.to_thread(retry_on_port_clash, start)
        await collector.start()
        yield Rig(port, admin, certs, jwt, journal, store, collector, trail)
    finally:
        await collector.stop()
        procs.stop_all()
        trail.close()


async def records(rig: Rig, count: int) -> list[dict[str, Any]]:
    for _ in range(300):
        if rig.store.count() >= count:
            break
        await asyncio.sleep(0.05)
    return rig.store.query(limit=None)


@pytest.mark.parametrize("rig", ["jwt_authn", "jwt_headers", "meshfn"], indirect=True)
async def test_audit_records_in_real_envoy(rig: Rig) -> None:
    token = rig.jwt.token({"sub": "alice@example.com", "tenant": "acme"})
    forged = rig.jwt.token({"sub": "mallory"}, key=es.Jwt.new().key)
    body = b'{"inputs": [1, 2, 3], "secret-body-marker": true}'
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    head = (
        b"POST /jwt/infer?api_key=SECRET-QUERY HTTP/1.1\r\nhost: models\r\n"
        + f"authorization: Bearer {token}\r\ntraceparent: 00-{trace}-00f067aa0ba902b7-01\r\n".encode()
        + f"x-request-id: req-one\r\ncontent-length: {len(body)}\r\n".encode()
    )
    first = await asyncio.to_thread(raw_request, rig, head, body)
    assert first.startswith(b"HTTP/1.1 200"), first
    calls = [
        ("/jwt/infer", "GET", {"authorization": f"Bearer {forged}"}, None),
        ("/jwt/infer", "GET", {}, None),
        ("/open", "POST", {"transfer-encoding": "chunked"}, b"streamed"),
        ("/open/big", "POST", {}, b"x" * 5000),
    ]
    statuses = [await asyncio.to_thread(rig.request, p, m, h, b) for p, m, h, b in calls]
    assert [s for s, _ in statuses] == [401, 401, 200, 200]

    got = await records(rig, len(calls) + 1)
    assert len(got) == len(calls) + 1
    by_path = {(r["method"], r["path"], r["status"]): r for r in got}
    ok = by_path[("POST", "/jwt/infer", 200)]
    assert ok["id"] == "req-one"
    subject = hmac.new(bytes.fromhex(SALT), b"alice@example.com", "sha256").hexdigest()
    assert rig.store.query(subject=subject) == [ok]  # recorded under the subject's pseudonym
    assert len(ok["subject"]) == 32
    assert ok["tenant"] == "acme" and ok["salt_id"] == "k1"
    assert ok["subject_source"] in ("jwt_authn", "jwt_headers")
    assert ok["body"] == "hashed" and ok["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert ok["trace_id"] == trace
    assert ok["principal"] == ALICE
    assert ok["upstream_cluster"] == "backend" and ok["envoy_route"] == "models"
    assert ok["audited"] is True and ok["duration_us"] > 0
    assert ok["time"].endswith("Z") and ok["authority"] == "models"

    rejected = [r for r in got if r["status"] == 401]
    assert len(rejected) == 2
    # jwt_authn answered these before the audit filter: recorded by the access log all the same,
    # and an unverified sub is never recorded
    assert all(r["subject"] is None and not r["audited"] for r in rejected), rejected
    assert all(r["path"] == "/jwt/infer" and r["principal"] == ALICE for r in rejected)
    streamed = by_path[("POST", "/open", 200)]
    assert streamed["body"] == "streaming" and streamed["body_sha256"] is None
    assert by_path[("POST", "/open/big", 200)]["body"] == "too_large"

    await rig.collector.stop()  # flush + final checkpoint, then look at the raw files
    await rig.collector.start()
    report = rig.trail.verify()
    assert report.ok and report.records == len(calls) + 1 and report.unsigned_tail == 0
    assert isinstance(rig.store, SqliteStore)
    raw = b"".join(p.read_bytes() for p in rig.store.path.parent.glob("audit.db*") if p.is_file())
    for secret in (
        b"alice@example.com",
        b"mallory",
        token.encode(),
        b"SECRET-QUERY",
        b"secret-body-marker",
        bytes.fromhex(SALT),
        SALT.encode(),
    ):
        assert secret not in raw, secret
    # nor in what Envoy wrote
    journal = rig.journal.read_bytes()
    for secret in (b"alice@example.com", token.encode(), b"SECRET-QUERY", b"secret-body-marker"):
        assert secret not in journal


async def test_hostile_requests_still_make_one_valid_record_each(rig: Rig) -> None:
    requests = [
        b"GET /p\xff\xfe/\xc3\xa9 HTTP/1.1\r\nhost: a\r\n",
        b"GET /q HTTP/1.1\r\nhost: a\r\nx-request-id: " + b"i" * 5000 + b"\r\n"
        b"authorization: Bearer " + b"a" * 30000 + b"\r\n",
        b"GET /r HTTP/1.1\r\nhost: a\r\ntraceparent: "
        + b"zz" * 1000
        + b"\r\nauthorization: Bearer a.!!!.b\r\n",
        b"GET /s HTTP/1.1\r\nhost: x\xff\r\nx-b3-traceid: \xff\xfe\r\nx-request-id: \xfe\xff\r\n",
        b"GET /t HTTP/1.1\r\nhost: a\r\nauthorization: Bearer e30." + b"e30" * 20 + b".x\r\n",
    ]
    statuses = []
    for head in requests:
        reply = await asyncio.to_thread(raw_request, rig, head)
        statuses.append(int(reply.split(b" ")[1]))
    # Envoy's codec refuses invalid bytes in the path and the host (400, before any filter): the
    # access log still records them, flagged DPE (downstream protocol error), not audited.
    assert statuses == [400, 400, 200, 400, 200]  # /q: the upstream refuses a 30 KB header
    got = await records(rig, len(requests))
    assert len(got) == len(requests)
    assert all("error" not in r and r["subject"] is None and r["trace_id"] is None for r in got)
    codec = [r for r in got if r["flags"] == "DPE"]
    assert len(codec) == 2 and all(r["status"] == 400 and not r["audited"] for r in codec)
    filtered = [r for r in got if r["flags"] != "DPE"]
    assert [r["path"] for r in filtered] == ["/q", "/r", "/t"] and all(
        r["audited"] for r in filtered
    )
    assert filtered[0]["id"] == "i" * 128 and filtered[0]["truncated"] == ["id"]
    assert rig.trail.verify().ok


async def test_journal_rotation_with_envoy_reopen_logs(rig: Rig) -> None:
    """Rotate the journal under traffic the way the control plane would: rename it, POST Envoy's
    /reopen_logs. Every request is stored exactly once and the old file is deleted afterwards."""

    async def reopen() -> None:
        def post() -> int:
            request = urllib.request.Request(
                f"http://127.0.0.1:{rig.admin}/reopen_logs", method="POST"
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status)

        assert await asyncio.to_thread(post) == 200

    async def send(first: int, count: int) -> None:
        for i in range(first, first + count):
            status, _ = await asyncio.to_thread(rig.request, f"/r/{i}")
            assert status == 200

    await send(0, 30)
    traffic = asyncio.create_task(send(30, 60))
    await asyncio.sleep(0.2)
    old = await rig.collector.rotate("edge~0", reopen)
    await traffic
    for _ in range(300):
        if rig.store.count() >= 90 and not old.exists():
            break
        await asyncio.sleep(0.05)
    paths = sorted(r["path"] for r in rig.store.query(limit=None))
    assert paths == sorted(f"/r/{i}" for i in range(90))
    assert not old.exists() and rig.journal.exists()


def raw_token(jwt: Any, payload: bytes) -> str:
    """A validly signed RS256 token whose payload is exactly `payload` (bytes the JSON encoder
    would never produce)."""
    header = es._b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "k1"}).encode())
    signing_input = f"{header}.{es._b64(payload)}".encode()
    signature = jwt.key.sign(signing_input, es.padding.PKCS1v15(), es.hashes.SHA256())
    return f"{header}.{es._b64(payload)}.{es._b64(signature)}"


HOSTILE_TENANTS = [
    b'"t-\\ud800-x"',  # a lone surrogate: valid JSON, not valid UTF-8 once decoded
    b'"t-\xff\xfe-x"',  # invalid UTF-8 bytes in the payload itself
    b'"' + "\u00e9".encode() * 100 + b'"',  # 200 bytes: the 128-byte cap cuts no character
    b'"' + b"a" + "\u00e9".encode() * 100 + b'"',  # ... and here it would cut one in half
    b'"q\\"\\\\\\n\\u0001"',  # quote, backslash, control characters
    b"42",  # not a string
]


@pytest.mark.parametrize("rig", ["bare"], indirect=True)
async def test_hostile_tenants_in_the_access_log(rig: Rig) -> None:
    """Bare filter state: Envoy writes the tenant from jwt_authn's verified payload. Whatever
    the claim holds, every request makes exactly one record that parses (no unparsed line, no
    error) with the right subject."""
    subject = hmac.new(bytes.fromhex(SALT), b"eve", "sha256").hexdigest()
    statuses = []
    for tenant in HOSTILE_TENANTS:
        payload = b'{"iss":"%s","exp":4000000000,"sub":"eve","tenant":%s}' % (
            rig.jwt.issuer.encode(),
            tenant,
        )
        headers = {"authorization": f"Bearer {raw_token(rig.jwt, payload)}"}
        statuses.append((await asyncio.to_thread(rig.request, "/jwt/t", "GET", headers))[0])
    # jwt_authn refuses payloads that are not valid UTF-8 (a lone surrogate included): 401,
    # recorded, not audited; a newline in a claim is no problem (no claim header carries it)
    assert statuses == [401, 401, 200, 200, 200, 200]
    got = await records(rig, len(HOSTILE_TENANTS))
    assert len(got) == len(HOSTILE_TENANTS)
    assert all("error" not in r and "raw" not in r for r in got), got
    assert all(not r["audited"] and r["tenant"] is None for r in got[:2])
    ok = got[2:]
    (pseudonym,) = rig.store.pseudonyms(subject)
    assert all(r["audited"] and r["subject"] == pseudonym and r["salt_id"] == "k1" for r in ok)
    # not cut by Envoy (a byte cap through a character garbles the whole value in its JSON
    # writer): the record caps at 128 characters and says so
    assert [r["tenant"] for r in ok] == ["\u00e9" * 100, "a" + "\u00e9" * 100, 'q"\\\n\x01', "42"]
    assert all("truncated" not in r for r in ok)
    long = {"sub": "eve", "tenant": "\u00e9" * 300}
    auth = {"authorization": f"Bearer {rig.jwt.token(long)}"}
    assert (await asyncio.to_thread(rig.request, "/jwt/t", "GET", auth))[0] == 200
    last = (await records(rig, len(HOSTILE_TENANTS) + 1))[-1]
    assert last["tenant"] == "\u00e9" * 128 and last["truncated"] == ["tenant"]
    assert rig.trail.verify().ok
