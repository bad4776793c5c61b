"""Generation through the mesh, with real Envoy: `meshfn up` on the example mesh (the edge
gateway, the backends' sidecars with audit, the degrade filter, eBPF acceleration where the
kernel allows) and the unchanged `openai` SDK with base_url=http://GATEWAY/v1 and a tenant's
token as its api key.

What it proves: the first token reaches the client while generation goes on (nothing buffers
on the way), a stream longer than any request timeout is not cut while a stuck one is (the
routes' idle timeout), a client that leaves stops the generation, every request leaves one
audit record with its generation (tokens, TTFT, how it ended) and no text, OpenAI's errors come
back as OpenAI's error objects with the right status from every hop, the body's model picks
the route and cannot be played against the path or an internal header, and a tenant's token
budget is kept by its verified claim, whatever header it sends."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from meshfn_e2e import admin_get, http, remap_examples

from meshfn.common.unix import unix_request
from meshfn.control_plane.runtime.upstreams import backend_socket
from meshfn.inference.examples import publish_examples
from meshfn.testing.processes import MESHFN, Processes, meshfn, metric_sum, wait_for

# Beside the examples: the test's generator function (slow on request), the edge verifying
# tokens (a Function's QoSPolicy needs its gateway to), tiny-lm's token budget, and globex
# denied chaos-gen by a rule on chaos-gen's own path (which OpenAI's requests reach through
# the model named in their body).
EXTRA = """\
apiVersion: meshfn.io/v1alpha1
kind: Function
metadata: {name: chaos-gen, namespace: default}
spec:
  backend: models
  gateway: ingress/edge
  limits: {maxConcurrency: 32}
  generation: {maxTokens: 64, timeout: 20s, tokenTimeout: 1s, idleTimeout: 3s}
---
apiVersion: meshfn.io/v1alpha1
kind: RequestAuthentication
metadata: {name: edge-tokens, namespace: ingress}
spec:
  jwtRules:
    - issuer: https://issuer.meshfn.local
      audiences: [meshfn]
      jwksUri: http://127.0.0.1:18001/.well-known/jwks.json
      forwardOriginalToken: true
---
apiVersion: meshfn.io/v1alpha1
kind: QoSPolicy
metadata: {name: llm-tokens, namespace: default}
spec:
  targetRefs: [{kind: Function, name: tiny-lm}]
  defaultClass: standard
  classes:
    - name: standard
      tokens: [{tokens: 700, per: month}]
---
apiVersion: meshfn.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: globex-no-chaos, namespace: default}
spec:
  action: DENY
  rules:
    - to: [{operation: {paths: [/v2/models/chaos-gen/*]}}]
      when: [{key: "request.auth.claims[tenant]", values: [globex]}]
"""


@dataclass
class Mesh:
    gateway: str  # http://127.0.0.1:PORT
    admin: str
    state: Path
    backends: list[Path]  # the models backends' own unix sockets (behind their sidecars)

    def token(self, tenant: str) -> str:
        out = meshfn(
            "token", "issue", "--state-dir", str(self.state), "--sub", f"user-{tenant}",
            "--aud", "meshfn", "--claim", f"tenant={tenant}",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def client(self, tenant: str = "acme", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.gateway}/v1",
            api_key=self.token(tenant),
            max_retries=0,
            timeout=60,
            **kwargs,
        )

    def backend_metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for backend in self.backends:
            status, body = unix_request(backend, "/metrics")
            assert status == 200, status
            total += metric_sum(body.decode(), name, **labels)
        return total

    def records(self, *args: str) -> list[dict[str, Any]]:
        store = str(self.state / "audit" / "audit.db")
        out = meshfn("audit", "query", "--store", store, "--json", "--limit", "100000", *args)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("genmesh")
    procs = Processes(tmp)
    try:
        _, key = publish_examples(tmp / "functions", include_testing=True)
        extra = tmp / "zz-generative.yaml"
        extra.write_text(EXTRA)
        mapping = remap_examples(tmp / "policies", extra)
        mesh_file = tmp / "policies" / "mesh.yaml"
        # both kinds of proxy record: the gateway's records too
        mesh_file.write_text(mesh_file.read_text().replace("proxies: sidecars", "proxies: all"))
        state = tmp / "state"
        up = procs.start(
            "up",
            [MESHFN, "up", "--policies", str(tmp / "policies"), "--state-dir", str(state),
             "--functions-registry", str(tmp / "functions"), "--trusted-key", str(key)],
        )  # fmt: skip
        wait_for("the mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240, proc=up)
        found = Mesh(
            f"http://127.0.0.1:{mapping[10000]}",
            f"http://127.0.0.1:{mapping[18001]}",
            state,
            [backend_socket(state, "127.0.0.1", mapping[p]) for p in (9101, 9102)],
        )
        wait_for(
            "tiny-lm through the gateway",
            lambda: found.client().models.retrieve("tiny-lm").id == "tiny-lm",
            timeout=60,
        )
        yield found
    finally:
        procs.stop_all()


def _events(mesh: Mesh, tenant: str, body: dict[str, Any], path: str = "/v1/completions",
            leave_after: int | None = None) -> list[tuple[float, bytes]]:  # fmt: skip
    """A request over a plain socket through the gateway: each SSE event with the seconds
    since the request was sent (leaving after `leave_after` events)."""
    data = json.dumps(body).encode()
    host, port = mesh.gateway.removeprefix("http://").split(":")
    out: list[tuple[float, bytes]] = []
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        start = time.monotonic()
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {mesh.token(tenant)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        buffer = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                line = event.rsplit(b"\r\n", 1)[-1]  # after a chunk-size line
                out.append((time.monotonic() - start, line))
                if line == b"data: [DONE]" or (leave_after and len(out) >= leave_after):
                    return out


def test_the_official_sdk_works_through_the_gateway(mesh: Mesh) -> None:
    client = mesh.client()
    models = {m.id for m in client.models.list()}
    assert {"tiny-lm", "embedder", "chaos-gen"} <= models and "iris" not in models
    reply = client.chat.completions.create(
        model="tiny-lm", messages=[{"role": "user", "content": "The class"}], max_tokens=20, seed=1
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 20
    chunks = list(
        client.chat.completions.create(
            model="tiny-lm", messages=[{"role": "user", "content": "The class"}], max_tokens=20,
            seed=1, stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        reply.choices[0].message.content
    )
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
    embedded = client.embeddings.create(model="embedder", input=["hello mesh"])
    assert len(embedded.data[0].embedding) == 32
    # KServe's spelling, through the gateway too
    kserve = openai.OpenAI(base_url=f"{mesh.gateway}/openai/v1", api_key=mesh.token("acme"),
                           max_retries=0)  # fmt: skip
    assert kserve.completions.create(model="tiny-lm", prompt="x", max_tokens=3).usage


def test_the_first_token_arrives_while_generation_goes_on(mesh: Mesh) -> None:
    """Nothing on the way buffers: gateway, sidecar, the audit and degrade plugin, eBPF."""
    events = _events(
        mesh, "acme", {"model": "chaos-gen", "prompt": "slow 1500000 a b c", "max_tokens": 12,
                       "stream": True},
    )  # fmt: skip
    data = [(t, e) for t, e in events if e.startswith(b"data: {")]
    assert len(data) >= 12 and events[-1][1] == b"data: [DONE]"
    # Each piece takes the function tens of milliseconds: a hop that buffered would deliver
    # them in one lump (gaps near zero) instead of as they are made.
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(data)]
    assert data[-1][0] - data[0][0] > 0.2, gaps
    assert sorted(gaps)[len(gaps) // 2] > 0.01, gaps
    status = admin_get(mesh.admin, "/debug/status", mesh.state).json()
    if status["acceleration"]["attached"]:  # the loopback hops were eBPF's
        assert status["acceleration"]["counters"]["messages_redirected"] > 0


def test_a_stream_longer_than_any_request_timeout_is_not_cut(mesh: Mesh) -> None:
    """A non-generative function's routes time out after its deadline plus 2 s (3 s here);
    a generative one's route timeout is its generation's deadline (20 s) plus 2 s."""
    started = time.monotonic()
    pieces = list(
        mesh.client().completions.create(
            model="chaos-gen", prompt="slow 6000000 a", max_tokens=30, stream=True
        )
    )
    took = time.monotonic() - started
    assert sum(1 for p in pieces if p.choices[0].text) == 30  # then one with finish_reason
    assert pieces[-1].choices[0].finish_reason == "length"
    assert took > 3.5, f"the stream took {took:.1f} s: too short to show it"


def _backend_pids(mesh: Mesh) -> list[int]:
    children = json.loads((mesh.state / "state.json").read_text())["children"]
    return [pid for name, pid in children.items() if name.startswith("inference default/models ")]


def test_a_stuck_stream_is_cut_by_the_idle_timeout(mesh: Mesh) -> None:
    """A backend that stops answering mid-stream (SIGSTOP: no byte, no close): the gateway's
    route idle timeout (chaos-gen's generation.idleTimeout, 3 s) ends the stream."""
    pids = _backend_pids(mesh)
    assert len(pids) == 2
    data = json.dumps({"model": "chaos-gen", "prompt": "slow 1500000 a", "max_tokens": 60,
                       "stream": True}).encode()  # fmt: skip
    host, port = mesh.gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{mesh.token('acme')}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        first = b""
        while b"data: {" not in first:  # the headers and the first chunk may come apart
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            rest = b""
            while chunk := sock.recv(65536):
                rest += chunk
                if rest.endswith(b"0\r\n\r\n"):
                    break
            cut_after = time.monotonic() - stopped
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    assert b"data: [DONE]" not in rest  # it did not complete: it was cut
    assert 2.0 < cut_after < 10.0, cut_after
    # the backends go on afterwards
    wait_for(
        "the backends again",
        lambda: mesh.client().completions.create(model="tiny-lm", prompt="x", max_tokens=2),
        timeout=30,
    )


def test_a_client_that_leaves_stops_the_generation(mesh: Mesh) -> None:
    labels = {"function": "chaos-gen@1", "finish": "cancelled"}
    before = mesh.backend_metric("meshfn_gen_streams_total", **labels)
    output = {"gen_ai_request_model": "chaos-gen", "gen_ai_token_type": "output"}
    tokens = mesh.backend_metric("gen_ai_client_token_usage_sum", **output)
    events = _events(
        mesh, "acme", {"model": "chaos-gen", "prompt": "slow 3000000 a", "max_tokens": 60,
                       "stream": True}, leave_after=2,
    )  # fmt: skip
    assert len(events) == 2
    wait_for(
        "the generation to stop",
        lambda: mesh.backend_metric("meshfn_gen_streams_total", **labels) == before + 1,
        timeout=10,
    )
    generated = mesh.backend_metric("gen_ai_client_token_usage_sum", **output) - tokens
    assert generated < 10, generated  # a few pieces, not 60


def test_each_request_has_one_audit_record_with_its_generation_and_no_text(mesh: Mesh) -> None:
    client = mesh.client()
    marker = "sentinel-prompt-text"
    reply = client.completions.create(model="tiny-lm", prompt=marker, max_tokens=8)
    streamed = list(
        client.completions.create(model="tiny-lm", prompt=marker, max_tokens=8, stream=True)
    )
    assert reply.usage and streamed

    def found() -> list[dict[str, Any]] | None:
        records = [
            r for r in mesh.records()
            if (r.get("generation") or {}).get("prompt_tokens") == 1 + len(marker)
        ]  # fmt: skip
        return records if len(records) >= 4 else None

    # one record per request and proxy (the gateway's and a sidecar's), each with the client's
    # path and the whole generation, never the text
    records = wait_for("the records", found, timeout=30)
    sources = sorted(r["source"].split(":")[0] for r in records)
    assert sources == ["edge.ingress"] * 2 + ["models.default"] * 2, sources
    for record in records:
        generation = record["generation"]
        assert record["path"] == "/v1/completions" and record["tenant"] == "acme"
        assert generation["model"] == "tiny-lm" and generation["outcome"] == "completed"
        assert generation["finish_reason"] in ("stop", "length") and generation["note"] is None
        assert 0 < generation["completion_tokens"] <= 8
        assert generation["ttft_ms"] > 0 and generation["proxy_ttft_us"] > 0
    assert marker not in json.dumps(mesh.records())  # no prompt text anywhere in the trail


def test_openai_errors_have_openai_shape_from_every_hop(mesh: Mesh) -> None:
    client = mesh.client()
    with pytest.raises(openai.NotFoundError) as unknown:  # the gateway's model router
        client.completions.create(model="gpt-4o", prompt="x")
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:  # the backend
        client.completions.create(model="tiny-lm", prompt="x", max_tokens=100_000)
    assert bad.value.body["param"] == "max_tokens"
    anonymous = openai.OpenAI(base_url=f"{mesh.gateway}/v1", api_key="not-a-jwt", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as unauthenticated:  # jwt_authn
        anonymous.completions.create(model="tiny-lm", prompt="x")
    assert unauthenticated.value.body["type"] == "authentication_error"
    with pytest.raises(openai.PermissionDeniedError) as denied:  # a sidecar's RBAC
        mesh.client("globex").completions.create(model="chaos-gen", prompt="a b", max_tokens=2)
    assert denied.value.body["type"] == "permission_error"
    # globex may use tiny-lm: the rule names chaos-gen's path only
    assert mesh.client("globex").completions.create(model="tiny-lm", prompt="x", max_tokens=2)
    raw = http(f"{mesh.gateway}/v1/chat/completions", "POST",
               {"authorization": f"Bearer {mesh.token('acme')}"}, b"{broken")  # fmt: skip
    assert raw.status == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_the_body_model_cannot_be_played_against_the_path_or_a_header(mesh: Mesh) -> None:
    """globex may not reach chaos-gen: not by naming it in the body beside another model's path,
    nor by sending the internal model header beside another model in the body."""
    auth = {"authorization": f"Bearer {mesh.token('globex')}", "content-type": "application/json"}
    body = json.dumps({"model": "chaos-gen", "prompt": "a b", "max_tokens": 2}).encode()
    sneaky = http(f"{mesh.gateway}/v2/models/tiny-lm/openai/v1/completions", "POST", auth, body)
    assert sneaky.status == 400 and sneaky.json()["error"]["param"] == "model"
    other = json.dumps({"model": "tiny-lm", "prompt": "a b", "max_tokens": 2}).encode()
    spoofed = http(f"{mesh.gateway}/v1/completions", "POST",
                   {**auth, "x-meshfn-model": "chaos-gen"}, other)  # fmt: skip
    assert spoofed.status == 200 and spoofed.json()["model"] == "tiny-lm"
    twice = b'{"model": "tiny-lm", "model": "chaos-gen", "prompt": "a"}'
    assert http(f"{mesh.gateway}/v1/completions", "POST", auth, twice).status == 400


def test_token_budgets_follow_the_verified_tenant(mesh: Mesh) -> None:
    """tiny-lm's QoSPolicy: 700 tokens a month per tenant. The tenant is the token's claim; a
    tenant header the client sends is removed before the backend could read it."""

    def remaining(client: openai.OpenAI, max_tokens: int) -> int:
        raw = client.completions.with_raw_response.create(
            model="tiny-lm", prompt="ab", max_tokens=max_tokens, temperature=0
        )
        return int(raw.headers["x-ratelimit-remaining-tokens"])

    acme = mesh.client("acme")
    acme_before = remaining(acme, 1)
    client = mesh.client("globex", default_headers={"x-meshfn-tenant": "acme"})
    left = [remaining(client, 100) for _ in range(3)]
    assert left[0] > left[1] > left[2]
    with pytest.raises(openai.RateLimitError) as caught:
        for _ in range(10):
            client.completions.create(model="tiny-lm", prompt="ab", max_tokens=100)
    assert caught.value.body["code"] == "insufficient_quota"
    assert caught.value.body["tenant"] == "globex"
    # acme, whose name globex sent, was not charged: only its own two small requests count
    assert 0 < acme_before - remaining(acme, 1) <= 6
    # one book for both backends: the control plane's ledger
    status = admin_get(mesh.admin, "/debug/status", mesh.state).json()
    globex = [r for r in status["token_budgets"] if r["tenant"] == "globex"]
    assert globex and globex[0]["function"] == "tiny-lm" and globex[0]["window"] == "month"
    assert 9 <= globex[0]["used"] <= 700
