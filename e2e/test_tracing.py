"""Distributed tracing for real, through `meshfn up` with real Envoys and real backends:
one request is one trace with the gateway's, the sidecar's and the backend's spans, parented;
sampling is honoured within statistical bounds; a client's traceparent is restarted at the
external gateway and honoured at a gateway that trusts its clients; a malformed one is
ignored; the audit record carries the trace; the console's service graph shows live rates and
opens a trace from an edge (headless Chromium, screenshots in build/artifacts/console/); a
collector that hangs never delays or fails a request.

`-k "trac or graph"` selects every test here."""

from __future__ import annotations

import http.client as httpclient
import json
import os
import random
import re
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import openai
import pytest
from meshfn_e2e import Processes, Reply, admin_get, http, remap_examples

from meshfn.common.adminauth import admin_headers
from meshfn.control_plane.runtime.bootstrap import RUNTIME
from meshfn.testing import policies as p
from meshfn.testing.browser import ARTIFACTS, chromium, sign_in, wait_panel_text
from meshfn.testing.envoy import admin_json, admin_request, admin_socket
from meshfn.testing.ports import free_ports, hanging_server
from meshfn.testing.processes import MESHFN, Proc, descendants, meshfn, wait_for

IRIS = "/v2/models/iris/infer"
FLOWER = json.dumps(
    {
        "inputs": [
            {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}
        ]
    }
).encode()
DIGIT = json.dumps(
    {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
).encode()
PARTNER = """\
# A second gateway for trusted clients (another traced proxy in front of it): it honors their
# trace context. It runs as the edge's identity, which the services' authorization admits.
apiVersion: meshfn.io/v1alpha1
kind: Gateway
metadata: {name: partner, namespace: ingress}
spec:
  serviceAccount: edge
  listeners: [{name: http, port: 10100}]
  tracing: {clientContext: honor}
---
apiVersion: meshfn.io/v1alpha1
kind: Route
metadata: {name: partner-echo, namespace: default}
spec:
  gateway: ingress/partner
  matches: [{path: {prefix: /echo}}]
  destination: {service: echo}
---
apiVersion: meshfn.io/v1alpha1
kind: Route
metadata: {name: partner-iris, namespace: default}
spec:
  gateway: ingress/partner
  matches: [{path: {prefix: /v2/models/iris}}]
  destination: {service: models}
"""


@dataclass
class Mesh:
    up: Proc
    admin: str
    edge: int
    partner: int
    state: Path
    token: str

    def headers(self, **extra: str) -> dict[str, str]:
        return {
            "authorization": f"Bearer {self.token}",
            "content-type": "application/json",
            **extra,
        }

    def admin_get(self, path: str) -> Reply:
        """The admin port as its owner (the token `meshfn up` wrote into its state)."""
        return http(self.admin + path, headers=admin_headers(self.state))

    def traces(self, **query: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.json("/debug/traces", limit="500", **query)["traces"]
        return found

    def trace(self, trace_id: str) -> dict[str, Any]:
        found: dict[str, Any] = self.json(f"/debug/traces/{trace_id}")
        return found

    def json(self, path: str, **query: str) -> Any:
        reply = self.admin_get(path + ("?" + urlencode(query) if query else ""))
        assert reply.status == 200, reply.body
        return reply.json()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("tracing")
    partner = tmp / "partner.yaml"
    partner.write_text(PARTNER)
    mapping = remap_examples(tmp / "examples", partner)
    examples = tmp / "examples"
    # every new trace at the gateways, but the echo route's at 20% (a Route's own sampling)
    mesh_yaml = examples / "mesh.yaml"
    mesh_yaml.write_text(mesh_yaml.read_text().replace("sampling: 10", "sampling: 100"))
    routes = examples / "routes.yaml"
    text = routes.read_text()
    assert "  destination: {service: echo}\n" in text
    routes.write_text(
        text.replace(
            "  destination: {service: echo}\n",
            "  destination: {service: echo}\n  tracing: {sampling: 20}\n",
            1,
        )
    )
    yield from _up(tmp, mapping)


def _up(tmp: Path, mapping: dict[int, int]) -> Iterator[Mesh]:
    """`meshfn up` on tmp/examples (`mapping`: policies.remap's ports) and a tenant's token."""
    state = tmp / "state"
    procs = Processes(tmp)
    try:
        up = procs.start(
            "up",
            [MESHFN, "up", "--policies", str(tmp / "examples"), "--state-dir", str(state),
             "--functions-registry", str(tmp / "functions"), "--publish-examples",
             "--envoy-concurrency", "1"],
            env={**os.environ, "MESHFN_CALLER_DIR": str(tmp)},
        )  # fmt: skip
        wait_for("the traced mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
        token = meshfn(
            "token", "issue", "--state-dir", str(state), "--sub", "tracer", "--aud", "meshfn",
            "--claim", "tenant=acme",
        ).stdout.strip()  # fmt: skip
        yield Mesh(
            up,
            f"http://127.0.0.1:{mapping[18001]}",
            mapping[10000],
            mapping.get(10100, 0),
            state,
            token,
        )
    finally:
        procs.stop_all()


def _spans(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for span in trace["span_list"]:
        out.setdefault(span["service"], []).append(span)
    return out


def _complete(mesh: Mesh, trace_id: str, services: int = 3) -> dict[str, Any] | None:
    reply = mesh.admin_get(f"/debug/traces/{trace_id}")
    if reply.status != 200:
        return None
    trace: dict[str, Any] = reply.json()
    return trace if len(trace["services"]) >= services else None


Span = dict[str, Any]


def _new_trace(
    mesh: Mesh, model: str, seen: set[str]
) -> tuple[dict[str, Any], tuple[Span, Span, dict[str, Span]]]:
    """The one trace of `model` not in `seen`, once all three hops are in: it, the gateway's
    span, the sidecar's, and the backend's by name."""

    def arrived() -> dict[str, Any] | None:
        new = [t for t in mesh.traces(model=model) if t["trace_id"] not in seen]
        return _complete(mesh, new[0]["trace_id"]) if len(new) == 1 else None

    trace = wait_for("the request's trace with all its hops", arrived, timeout=30, every=0.5)
    spans = _spans(trace)
    assert set(spans) == {"edge.ingress", "models.default", "models.default inference"}
    (gateway,) = spans["edge.ingress"]
    (sidecar,) = spans["models.default"]
    return trace, (gateway, sidecar, {s["name"]: s for s in spans["models.default inference"]})


def test_tracing_one_request_is_one_trace_through_gateway_sidecar_and_backend(mesh: Mesh) -> None:
    seen = {t["trace_id"] for t in mesh.traces(model="iris")}
    reply = http(
        f"http://127.0.0.1:{mesh.edge}/v2/models/iris/infer", "POST", mesh.headers(), FLOWER
    )
    assert reply.status == 200, reply.body
    trace, (gateway, sidecar, backend) = _new_trace(mesh, "iris", seen)
    spans = _spans(trace)
    server = backend["infer iris"]
    # correctly parented: gateway (root) > sidecar > backend server span > its steps
    assert gateway["parent_id"] is None and gateway["kind"] == "server"
    assert sidecar["parent_id"] == gateway["span_id"] and sidecar["kind"] == "server"
    assert server["parent_id"] == sidecar["span_id"] and server["kind"] == "server"
    assert {"admission", "queue", "guest call"} <= set(backend)
    own = {s["span_id"] for s in spans["models.default inference"]}
    assert all(s["parent_id"] in own for n, s in backend.items() if n != "infer iris")
    # custom tags from verified data: the route and model (route table), the tenant (the
    # sidecar's verified JWT), the caller's SPIFFE ID (the sidecar's mTLS handshake)
    assert gateway["attributes"]["meshfn.route"] == "default/function-iris"
    assert gateway["attributes"]["meshfn.model"] == "iris"
    assert sidecar["attributes"]["meshfn.tenant"] == "acme"
    assert sidecar["attributes"]["meshfn.principal"] == "spiffe://meshfn.local/ns/ingress/sa/edge"
    assert server["attributes"]["meshfn.model"] == "iris"
    assert server["attributes"]["http.response.status_code"] == 200
    for outer, inner in ((gateway, sidecar), (sidecar, server)):  # nested in time as well
        assert (
            outer["start_ns"] <= inner["start_ns"]
            and inner["end_ns"] <= outer["end_ns"] + 1_000_000
        )
    # joined up: the sidecar's audit record carries the trace, and the CLI finds it
    (row,) = _audit_records(mesh, trace["trace_id"])
    assert row["path"] == "/v2/models/iris/infer" and row["trace_id"] == trace["trace_id"]
    shown = meshfn("trace", "show", trace["trace_id"], "--state-dir", str(mesh.state))
    assert shown.returncode == 0, shown.stderr
    for name in ("infer iris", "guest call", "models.default", "edge.ingress"):
        assert name in shown.stdout, shown.stdout
    listed = meshfn(
        "trace", "list", "--route", "default/function-iris", "--state-dir", str(mesh.state)
    )
    assert trace["trace_id"] in listed.stdout
    # the backend pushed nothing: meshfn up collected its spans (over its own socket)
    status = meshfn("status", "--json", "--state-dir", str(mesh.state))
    assert json.loads(status.stdout)["tracing"]["backend_collections"] >= 1, status.stdout
    text = meshfn("status", "--state-dir", str(mesh.state)).stdout
    assert "collected by meshfn up" in text and "collection(s) from the backends" in text, text
    # ... with its egress control on (it refuses every unix-socket connect) and no peer or TCP
    # port opened for tracing
    sandboxed = r"^sandbox default/models \S+: landlock on, seccomp on, egress on\n"
    connects = r"  landlock: .*TCP connect: none.*\n  seccomp: .*\n  egress: .*peers: none$"
    assert re.search(sandboxed + connects, text, re.M), text


def test_tracing_the_envoys_export_their_spans_in_batches(mesh: Mesh) -> None:
    """Every Envoy `meshfn up` runs batches its spans as the bootstrap's runtime says (an
    export per 128 spans or per second, not Envoy's default of one per 5 spans): the
    gateway's spans of a burst go in few exports, and all of them arrive."""
    gateway = admin_socket(mesh.state, "edge.ingress")
    for sock in sorted((mesh.state / "envoy").glob("*.sock")):
        entries = admin_json(sock, "/runtime")["entries"]
        for key, value in RUNTIME.items():
            assert entries[key]["final_value"] == str(value), (sock.name, key, entries.get(key))

    def stat(name: str) -> int:
        text = admin_request(gateway, f"/stats?filter=^{re.escape(name)}$")
        return int(text.split(b":")[1]) if text.strip() else 0

    spans, exports = "tracing.opentelemetry.spans_sent", "cluster.meshfn-otlp.upstream_rq_total"
    sent, exported = stat(spans), stat(exports)
    _send(mesh.edge, "/v2/models/iris/ready", 40, [mesh.headers()])
    wait_for("the burst's spans sent", lambda: stat(spans) >= sent + 40, timeout=15)
    # 40 spans, fewer than a batch: the one-second timer sends them (Envoy's default: 8 exports)
    assert stat(exports) - exported <= 3, stat(exports) - exported


def test_tracing_a_cold_start_is_split_and_a_batch_links_its_members(mesh: Mesh) -> None:
    """digits has no warm pool: its first request loads it (lookup, deserialize, instantiate);
    iris batches concurrent requests into one guest call."""
    reply = http(
        f"http://127.0.0.1:{mesh.edge}/v2/models/digits/infer", "POST", mesh.headers(), DIGIT
    )
    assert reply.status == 200, reply.body

    def cold() -> dict[str, Any] | None:
        for summary in mesh.traces(model="digits"):
            trace = mesh.trace(summary["trace_id"])
            names = {s["name"]: s for s in trace["span_list"]}
            if "cold start" in names and "deserialize" in names:
                return names
        return None

    names = wait_for("a split cold start", cold, timeout=30, every=0.5)
    start = names["cold start"]
    for step in ("code-cache lookup", "deserialize", "instantiate"):
        assert names[step]["parent_id"] == start["span_id"], step
    assert names["cold start"]["attributes"]["meshfn.code_loaded"] is True
    assert names["guest call"]["start_ns"] >= names["instantiate"]["end_ns"]
    # a batch: eight concurrent requests share guest calls; each trace links the others
    url = f"http://127.0.0.1:{mesh.edge}/v2/models/iris/infer"
    threads = [
        threading.Thread(target=lambda: http(url, "POST", mesh.headers(), FLOWER)) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    def linked() -> tuple[dict[str, Any], dict[str, Any]] | None:
        for summary in mesh.traces(model="iris"):
            trace = mesh.trace(summary["trace_id"])
            for span in trace["span_list"]:
                if span["name"] == "batch" and span["links"]:
                    return trace, span
        return None

    trace, batch = wait_for("a batch span with links", linked, timeout=30, every=0.5)
    assert batch["attributes"]["meshfn.batch.requests"] >= 2
    other = batch["links"][0]["trace_id"]
    assert other != trace["trace_id"]
    linked_trace = wait_for(
        "the linked trace", lambda: _complete(mesh, other, 1), timeout=20, every=0.5
    )
    assert any(s["name"] == "batch" for s in linked_trace["span_list"])
    guest = next(s for s in trace["span_list"] if s["name"] == "guest call")
    assert guest["parent_id"] == batch["span_id"]


def test_tracing_a_streamed_generation_is_one_trace_to_its_last_token(mesh: Mesh) -> None:
    """The unchanged openai SDK streams a chat completion through the gateway (the model router
    picks tiny-lm from the body): one trace, gateway > sidecar > the backend's `chat tiny-lm`
    (the GenAI conventions' name and usage attributes, the usage the client got), whose
    time to first token and decode loop follow each other and end with the stream; the
    sidecar's audit record of the stream carries the trace."""
    seen = {t["trace_id"] for t in mesh.traces(model="tiny-lm")}
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{mesh.edge}/v1", api_key=mesh.token, max_retries=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-lm",
            messages=[{"role": "user", "content": "The with statement"}],
            max_tokens=12,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0
    trace, (gateway, sidecar, backend) = _new_trace(mesh, "tiny-lm", seen)
    server = backend["chat tiny-lm"]
    assert gateway["attributes"]["meshfn.route"] == "default/openai-tiny-lm"
    assert sidecar["parent_id"] == gateway["span_id"] and server["parent_id"] == sidecar["span_id"]
    attrs = server["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "tiny-lm"
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens
    first, loop = backend["time to first token"], backend["decode loop"]
    assert backend["admission"]["end_ns"] <= first["start_ns"] <= first["end_ns"]
    assert first["end_ns"] <= loop["start_ns"] and loop["end_ns"] <= server["end_ns"]
    assert [e["name"] for e in server["events"]] == ["first token"]
    rows = _audit_records(mesh, trace["trace_id"])
    assert {row["trace_id"] for row in rows} == {trace["trace_id"]}
    shown = meshfn("trace", "show", trace["trace_id"], "--state-dir", str(mesh.state))
    for name in ("chat tiny-lm", "time to first token", "decode loop"):
        assert name in shown.stdout, shown.stdout
    assert (
        f"generation chat tiny-lm: {usage.prompt_tokens} prompt + {usage.completion_tokens} "
        "completion tokens, first token after "
    ) in shown.stdout, shown.stdout


def _audit_records(mesh: Mesh, trace_id: str) -> list[dict[str, Any]]:
    """The audit records of a trace, as `meshfn audit query --trace` finds them, once there."""
    store = mesh.state / "audit" / "audit.db"

    def records() -> list[dict[str, Any]] | None:
        out = meshfn("audit", "query", "--store", str(store), "--trace", trace_id, "--json")
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        return rows or None

    found: list[dict[str, Any]] = wait_for(
        "the trace's audit records", records, timeout=30, every=0.5
    )
    return found


def _send(port: int, path: str, count: int, headers: list[dict[str, str]]) -> None:
    """`count` GETs over one keep-alive connection, each with its own headers."""
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for i in range(count):
            conn.request("GET", path, headers=headers[i % len(headers)])
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 200, reply.status
    finally:
        conn.close()


def _echo_traces(mesh: Mesh, route: str) -> list[dict[str, Any]]:
    return mesh.traces(route=route)


def test_tracing_sampling_is_honoured_within_statistical_bounds(mesh: Mesh) -> None:
    """The echo route samples 20% (its own sampling; the gateway's is 100%). 600 requests: 120
    expected, sd 9.8; the bounds are four sd. Every sampled trace has the sidecar's span too
    (the sidecar follows the gateway's decision), and the sidecar starts none of its own."""
    before = {t["trace_id"] for t in _echo_traces(mesh, "default/echo")}
    _send(mesh.edge, "/echo", 600, [{"authorization": f"Bearer {mesh.token}"}])
    time.sleep(3)  # the Envoys send their spans every second (bootstrap.RUNTIME)
    ids = {t["trace_id"] for t in _echo_traces(mesh, "default/echo")} - before
    assert 81 <= len(ids) <= 159, len(ids)
    for trace_id in ids:
        services = set(mesh.trace(trace_id)["services"])
        assert services == {"edge.ingress", "echo.default"}, (trace_id, services)
    lone = [t for t in mesh.traces(service="echo.default") if "edge.ingress" not in t["services"]]
    assert lone == []


def _client_parent() -> tuple[str, str]:
    return f"{random.getrandbits(128):032x}", f"{random.getrandbits(64) | 1:016x}"


def test_tracing_a_client_forced_traceparent_at_the_external_gateway_is_restarted(
    mesh: Mesh,
) -> None:
    """At the external gateway (clientContext restart) a client cannot force sampling or join
    its trace: with every header Envoy could read as a decision forced, the echo route still
    samples its 20% (300 requests: 60 expected, bounds four sd), under trace ids of its own."""
    parents = [_client_parent() for _ in range(300)]
    forced = [
        {
            "authorization": f"Bearer {mesh.token}",
            "traceparent": f"00-{t}-{s}-01",
            "tracestate": "vendor=1",
            "x-client-trace-id": t,
            "x-envoy-force-trace": "1",
            "x-request-id": "00000000-0000-a000-8000-000000000000",
        }
        for t, s in parents
    ]
    before = {t["trace_id"] for t in _echo_traces(mesh, "default/echo")}
    _send(mesh.edge, "/echo", 300, forced)
    time.sleep(7)
    new = {t["trace_id"] for t in _echo_traces(mesh, "default/echo")} - before
    assert 32 <= len(new) <= 88, len(new)
    assert not new & {t for t, _ in parents}
    for trace_id in list(new)[:20]:
        (gateway,) = _spans(mesh.trace(trace_id))["edge.ingress"]
        assert gateway["parent_id"] is None  # a root: the client's span is not its parent


def test_tracing_a_trusted_gateway_honors_the_clients_context(mesh: Mesh) -> None:
    """The partner gateway (clientContext honor): a sampled client trace continues under the
    client's trace id and parent; an unsampled one stays unsampled."""
    sampled = [_client_parent() for _ in range(20)]
    unsampled = [_client_parent() for _ in range(20)]
    auth = {"authorization": f"Bearer {mesh.token}"}
    _send(
        mesh.partner, "/echo", 20, [{**auth, "traceparent": f"00-{t}-{s}-01"} for t, s in sampled]
    )
    _send(
        mesh.partner, "/echo", 20, [{**auth, "traceparent": f"00-{t}-{s}-00"} for t, s in unsampled]
    )

    def continued() -> list[dict[str, Any]] | None:
        found = [_complete(mesh, t, 2) for t, _ in sampled]
        return None if None in found else found  # type: ignore[return-value]

    traces = wait_for("the clients' traces", continued, timeout=30, every=0.5)
    for (trace_id, span_id), trace in zip(sampled, traces, strict=True):
        (gateway,) = _spans(trace)["partner.ingress"]
        assert trace["trace_id"] == trace_id and gateway["parent_id"] == span_id
        assert trace["route"] == "default/partner-echo"
    for trace_id, _ in unsampled:
        assert mesh.admin_get(f"/debug/traces/{trace_id}").status == 404


def test_tracing_a_malformed_traceparent_is_ignored_and_the_backend_restarts(mesh: Mesh) -> None:
    """Through the partner gateway (which would honor a good one) Envoy cannot read it and
    passes it on untouched; the backend ignores it and starts a trace of its own. Never a 400."""
    url = f"http://127.0.0.1:{mesh.partner}/v2/models/iris/infer"
    bad = ["00-zz-yy-01", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "x" * 300, "00-AB-CD"]
    before = {t["trace_id"] for t in mesh.traces(model="iris")}
    for value in bad:
        reply = http(url, "POST", mesh.headers(traceparent=value, tracestate="=,=;"), FLOWER)
        assert reply.status == 200, (value, reply.body)

    def restarted() -> list[dict[str, Any]] | None:
        new = [t for t in mesh.traces(model="iris") if t["trace_id"] not in before]
        alone = [t for t in new if t["services"] == ["models.default inference"]]
        return alone if len(alone) >= len(bad) else None

    traces = wait_for("the backend's own traces", restarted, timeout=30, every=0.5)
    for summary in traces:
        root = next(
            s for s in mesh.trace(summary["trace_id"])["span_list"] if s["name"] == "infer iris"
        )
        assert root["parent_id"] is None


def test_graph_shows_live_rates_and_opens_a_trace_from_an_edge(mesh: Mesh) -> None:
    """The console's service graph in headless Chromium: live rates on the edge from the gateway
    to the models, its padlock, and a click on the edge that opens its traces, one trace's
    waterfall and its audit record. Screenshots: console-graph.png, console-trace.png."""
    stop = threading.Event()
    url = f"http://127.0.0.1:{mesh.edge}/v2/models/iris/infer"

    def traffic() -> None:
        while not stop.is_set():
            http(url, "POST", mesh.headers(), FLOWER)
            time.sleep(0.05)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    edge = "gw:ingress/edge>svc:default/models"
    try:
        with chromium(viewport=(1500, 1000)) as browser:
            page = browser.page
            sign_in(browser, mesh.admin, mesh.state)  # an auditor: the trace's audit record shows
            page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
            wait_panel_text(page, "graph", "default/models", timeout=20)
            # the rate shows from the second sample, the latency once the gateway's Envoy has
            # flushed its histograms (every 5 s): the first tests of a fresh mesh wait for both
            page.wait_for_function(
                "(edge) => { const c = document.querySelector("
                '`#panel-graph tr[data-edge="${edge}"] td.rps`);'
                " return c !== null && Number(c.innerText) > 1"
                ' && c.parentElement.innerText.includes(" ms"); }',
                arg=edge,
                timeout=30_000,
            )
            row = page.locator(f'#panel-graph tr[data-edge="{edge}"]').inner_text()
            assert "mTLS" in row and "ms" in row, row
            assert page.locator(f'#panel-graph svg a[data-edge="{edge}"] .lock-mtls').count() == 1
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.locator("#graph").screenshot(path=str(ARTIFACTS / "console-graph.png"))
            page.locator(f'#panel-graph svg a[data-edge="{edge}"]').click()
            page.wait_for_url("**/ui/traces?service=edge.ingress&peer=models.default")
            page.wait_for_selector("table.traces tbody a", timeout=15_000)
            page.locator("table.traces tbody a").first.click()
            page.wait_for_selector("svg.waterfall", timeout=15_000)

            def complete() -> bool:
                """Every hop's spans (the backend's and the proxies' arrive within seconds of
                each other) and the sidecar's audit record, on the trace's page."""
                page.reload()
                page.wait_for_selector("svg.waterfall")
                spans = page.inner_text("table.spans")
                return (
                    "infer iris" in spans
                    and "guest call" in spans
                    and "POST models.default" in spans
                    and "/v2/models/iris/infer" in page.inner_text("table.audit-records")
                )

            wait_for("the whole trace and its audit record", complete, timeout=30, every=0.5)
            page.screenshot(path=str(ARTIFACTS / "console-trace.png"), full_page=True)
            assert browser.problems == []
    finally:
        stop.set()
        sender.join(timeout=5)


# ---------------------------------------------------------------- a collector that hangs


def _backends(mesh: Mesh) -> dict[int, str]:
    assert mesh.up.pid is not None
    found = descendants(mesh.up.pid)
    return {pid: label for pid, label in found.items() if "meshfn.inference" in label}


def _reloads(mesh: Mesh) -> dict[str, list[Any]]:
    """Per inference backend's log: the tracing it took on each SIGHUP, in order."""
    out: dict[str, list[Any]] = {}
    for log in sorted((mesh.state / "logs").glob("upstream-*.log")):
        text = log.read_text()
        if '"logger": "meshfn.inference"' not in text:
            continue  # a placeholder upstream
        lines = [ln for ln in text.splitlines() if '"tracing reloaded"' in ln]
        out[log.name] = [json.loads(ln)["tracing"] for ln in lines]
    return out


def _edits(mesh: Mesh) -> list[tuple[Path, str, str]]:
    """(file, as the fixture wrote it, without tracing): the Mesh's, and the two overrides
    that must go with it (a Route's and a Gateway's tracing need the Mesh's)."""
    examples = mesh.state.parent / "examples"
    out = []
    for name, block in (
        ("routes.yaml", "  tracing: {sampling: 20}\n"),
        ("partner.yaml", "  tracing: {clientContext: honor}\n"),
        ("mesh.yaml", "  tracing:\n    sampling: 100\n"),
    ):
        text = (examples / name).read_text()
        assert block in text, name
        out.append((examples / name, text, text.replace(block, "")))
    return out


def test_tracing_turned_off_and_on_reloads_the_backends_without_restarting_them(
    mesh: Mesh,
) -> None:
    """Tracing off in the Mesh, then on again: the Envoys take it over xDS, the backends by
    reloading their tracing (SIGHUP) with no restart, so no function cold-starts again. Off,
    requests make no trace anywhere; on, a request is one whole trace again. (Last to use the
    module's mesh: its policies are put back at the end.)"""
    edits = _edits(mesh)
    backends = _backends(mesh)
    before = {name: len(taken) for name, taken in _reloads(mesh).items()}
    assert before

    def took(n: int, want: Any) -> bool:
        now = _reloads(mesh)
        return all(len(now[k]) == before[k] + n and now[k][-1] == want for k in before)

    try:
        for path, _, off in edits:  # the overrides first: every step is a valid mesh
            path.write_text(off)
        wait_for("every backend off", lambda: took(1, None), timeout=60, every=0.5)
        time.sleep(2)  # the Envoys have theirs (pushed before the backends were told)
        seen = {t["trace_id"] for t in mesh.traces()}
        for _ in range(20):
            reply = http(f"http://127.0.0.1:{mesh.edge}{IRIS}", "POST", mesh.headers(), FLOWER)
            assert reply.status == 200, reply.body
        time.sleep(3)  # the Envoys would send their spans every second (bootstrap.RUNTIME)
        assert {t["trace_id"] for t in mesh.traces()} == seen
        for path, traced, _ in reversed(edits):
            path.write_text(traced)

        def on() -> bool:
            now = _reloads(mesh)
            last = [now[k][-1] for k in before if len(now[k]) == before[k] + 2]
            return len(last) == len(before) and all(t and t["sampling"] == 100 for t in last)

        wait_for("every backend on again", on, timeout=60, every=0.5)
        seen = {t["trace_id"] for t in mesh.traces(model="iris")}

        def traced_again() -> bool:
            http(f"http://127.0.0.1:{mesh.edge}{IRIS}", "POST", mesh.headers(), FLOWER)
            new = [t for t in mesh.traces(model="iris") if t["trace_id"] not in seen]
            return any(_complete(mesh, t["trace_id"]) for t in new)

        wait_for("a whole iris trace again", traced_again, timeout=30, every=0.5)
        assert _backends(mesh) == backends  # the same processes all along
        logs = [log.read_text() for log in (mesh.state / "logs").glob("upstream-*.log")]
        assert not any("takes tracing only" in text for text in logs)  # nothing else changed
    finally:
        for path, traced, _ in reversed(edits):
            path.write_text(traced)


def _latencies(port: int, count: int) -> list[float]:
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            conn.request("GET", "/v1")
            reply = conn.getresponse()
            reply.read()
            out.append(time.perf_counter() - started)
            assert reply.status == 200, reply.status
    finally:
        conn.close()
    return out


def _statuses(
    port: int,
    stop: threading.Event,
    out: list[int | str],
    request: tuple[str, str, bytes | None, dict[str, str]] = ("GET", "/v1", None, {}),
) -> None:
    """`request` (method, path, body, headers) on one keep-alive connection until `stop`, each
    one's status (or the error that failed it) appended to `out`; a connection the gateway
    closed is reopened."""
    method, path, body, headers = request
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        while not stop.is_set():
            try:
                conn.request(method, path, body=body, headers=headers)
                reply = conn.getresponse()
                reply.read()
                out.append(reply.status)
            except (OSError, httpclient.HTTPException) as exc:
                out.append(repr(exc))
                conn.close()
    finally:
        conn.close()


def test_tracing_a_hanging_collector_never_delays_or_fails_requests(tmp_path: Path) -> None:
    """Every request traced, the collector accepting but never answering: the same latency as
    with tracing off, every request answered, and the failed exports counted in meshfn
    status and the control plane's /metrics."""
    server, collector = hanging_server()
    policies = p.Policies(tmp_path / "p")
    ports = policies.ports
    sidecar = free_ports(1)[0]
    traced = {
        "sampling": 100,
        "collector": {
            "protocol": "http",
            "host": "127.0.0.1",
            "port": collector,
            "timeout": "200ms",
        },
    }

    def write_mesh(tracing: dict[str, Any] | None) -> None:
        extra = {"tracing": tracing} if tracing else {}
        policies.write(
            "mesh.yaml",
            p.documents(
                p.mesh("e2e", "e2e.local", ports["xds"], ports["admin"], **extra),
                p.gateway(ports["envoy_admin"], ports["listener"]),
            ),
        )

    write_mesh(traced)
    policies.write(
        "services.yaml",
        p.documents(
            p.service("alpha", ports["alpha"], [p.endpoint(sidecar=sidecar)]),
            p.service("beta", ports["beta"]),
        ),
    )
    procs = Processes(tmp_path)
    try:
        up = procs.up(policies)
        wait_for("the mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=120)
        _latencies(ports["listener"], 50)  # warm up
        dead = _latencies(ports["listener"], 300)

        def failures() -> int | None:
            status = json.loads(
                meshfn("status", "--json", "--state-dir", str(policies.state)).stdout
            )
            found = sum(
                x["failed_exports"] for x in (status.get("tracing") or {}).get("proxies", [])
            )
            return found or None

        assert wait_for("failed exports in meshfn status", failures, timeout=30, every=0.5) >= 1
        shown = meshfn("status", "--state-dir", str(policies.state)).stdout
        assert "export(s) failed" in shown, shown
        # /metrics: the same counts, as meshfn status last read them (a scrape fetches nothing)
        metrics = admin_get(policies, "/metrics").body.decode()
        failed = re.findall(
            r'^meshfn_proxy_trace_exports_failed_total\{proxy="([^"]+)"\} (\S+)$', metrics, re.M
        )
        assert sum(float(count) for _, count in failed) >= 1, metrics
        assert {"edge.default", f"alpha.default:{sidecar}"} <= {proxy for proxy, _ in failed}

        def untraced() -> bool:
            """The gateway's and the sidecar's Envoys run their listeners without the tracer
            (their own active config; the old filter chains still drain)."""
            for node in ("edge.default", f"alpha.default:{sidecar}"):
                admin = admin_socket(policies.state, node)
                dump = admin_json(admin, "/config_dump?resource=dynamic_listeners")
                if "opentelemetry" in json.dumps([c.get("active_state") for c in dump["configs"]]):
                    return False
            return True

        # Tracing off (the baseline) while requests flow: the gateway's and the sidecar's
        # connection managers lose their tracer, an LDS update after which each Envoy drains
        # the connections of the old filter chain (runtime.envoy.DRAIN_STRATEGY). Not one
        # request may fail, neither at the switch nor a while after it (where the old chain's
        # connections used to be closed under the gateway: a 503 now and then).
        stop, during = threading.Event(), list[int | str]()
        sender = threading.Thread(target=_statuses, args=(ports["listener"], stop, during))
        sender.start()
        try:
            write_mesh(None)
            wait_for("tracing removed from both Envoys", untraced, timeout=30, every=0.5)
            time.sleep(2)
        finally:
            stop.set()
            sender.join(timeout=15)
        assert len(during) >= 50 and set(during) == {200}, [s for s in during if s != 200]
        _latencies(ports["listener"], 50)
        off = _latencies(ports["listener"], 300)
    finally:
        procs.stop_all()
        server.close()
    dead_p50, off_p50 = statistics.median(dead), statistics.median(off)
    assert dead_p50 <= off_p50 * 1.5 + 0.002, (dead_p50, off_p50)
    assert max(dead) < 1.0, max(dead)  # no request waited for an export


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The examples as they ship: 10% at their one gateway, which restarts its clients' trace
    context. Every caller samples little, so each sidecar traces on an internal listener that
    only the requests it traces take (meshfn.xds.translate.httpfilters.tracing)."""
    tmp = tmp_path_factory.mktemp("tracing-split")
    yield from _up(tmp, remap_examples(tmp / "examples"))


# the requests that crossed a split sidecar's internal listener (its connection manager's prefix)
CROSSED = "^http\\.inbound_traced_.*\\.downstream_rq_total$"


def _envoy_counter(mesh: Mesh, pattern: str) -> int:
    """Counters matching `pattern`, summed over every Envoy of the mesh."""
    total = 0
    for sock in sorted((mesh.state / "envoy").glob("*.sock")):
        text = admin_request(sock, f"/stats?filter={pattern}").decode()
        total += sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if ":" in line)
    return total


def _listeners(sock: Path) -> dict[str, dict[str, Any]]:
    """A proxy's active listeners (not those draining away) by name: the first filter
    chain's connection manager (typed_config, as JSON)."""
    dump = admin_json(sock, "/config_dump?resource=dynamic_listeners")
    out = {}
    for entry in dump["configs"]:
        if "active_state" not in entry:
            continue
        listener = entry["active_state"]["listener"]
        chain = (listener.get("filter_chains") or [listener.get("default_filter_chain")])[0]
        out[listener["name"]] = chain["filters"][0]["typed_config"]
    return out


def _sidecars(mesh: Mesh) -> list[dict[str, dict[str, Any]]]:
    """Every sidecar's active listeners (_listeners): the proxies that have `inbound`."""
    proxies = [_listeners(sock) for sock in sorted((mesh.state / "envoy").glob("*.sock"))]
    return [listeners for listeners in proxies if "inbound" in listeners]


def test_tracing_at_a_low_rate_a_sidecar_traces_only_the_sampled_requests(split: Mesh) -> None:
    """The sidecar's own listener has no tracer; an internal listener has it. 400 requests at
    the gateway's 10%: 40 expected, sd 6, bounds four sd. Exactly the sampled ones cross the
    internal listener, and each is one trace, gateway > sidecar > backend, with the sidecar's
    tags from its verified facts (the tenant of its JWT, its mTLS peer) carried across, never
    from a client's header of the same name."""
    sidecars = _sidecars(split)
    assert len(sidecars) == 4, sidecars  # models (2), models-lite, echo
    for listeners in sidecars:
        assert set(listeners) == {"inbound", "meshfn-traced-inbound"}, sorted(listeners)
        assert "tracing" not in listeners["inbound"], listeners["inbound"].get("tracing")
        assert listeners["meshfn-traced-inbound"]["tracing"]["random_sampling"]["value"] == 100
    before_crossed = _envoy_counter(split, CROSSED)
    before = {t["trace_id"] for t in split.traces(model="iris")}
    forged = split.headers(**{"x-meshfn-span-meshfn-principal": "spiffe://meshfn.local/ns/x/sa/x"})
    conn = httpclient.HTTPConnection("127.0.0.1", split.edge, timeout=10)
    try:
        for _ in range(400):
            conn.request("POST", IRIS, body=FLOWER, headers=forged)
            reply = conn.getresponse()
            assert reply.status == 200, reply.read()
            reply.read()
    finally:
        conn.close()
    time.sleep(3)  # the Envoys send their spans every second (bootstrap.RUNTIME)

    def complete() -> list[dict[str, Any]] | None:
        new = [t["trace_id"] for t in split.traces(model="iris") if t["trace_id"] not in before]
        found = [_complete(split, t) for t in new]
        return None if None in found else found  # type: ignore[return-value]

    traces = wait_for("the sampled requests' traces", complete, timeout=30, every=0.5)
    assert 16 <= len(traces) <= 64, len(traces)
    assert _envoy_counter(split, CROSSED) - before_crossed == len(traces)
    for trace in traces:
        spans = _spans(trace)
        (gateway,) = spans["edge.ingress"]
        (sidecar,) = spans["models.default"]
        server = next(s for s in spans["models.default inference"] if s["name"] == "infer iris")
        assert sidecar["parent_id"] == gateway["span_id"] and sidecar["kind"] == "server"
        assert server["parent_id"] == sidecar["span_id"]
        assert sidecar["attributes"]["meshfn.tenant"] == "acme"
        principal = sidecar["attributes"]["meshfn.principal"]
        assert principal == "spiffe://meshfn.local/ns/ingress/sa/edge"
    # the sidecar's audit record carries the trace (its access log reads the parent's header)
    (row,) = _audit_records(split, traces[0]["trace_id"])
    assert row["path"] == IRIS


def test_tracing_at_a_low_rate_the_application_sees_the_same_request_either_way(
    split: Mesh,
) -> None:
    """300 requests to the echo application, about 30 of them sampled at the gateway and
    through the sidecar's internal listener: it receives the same headers either way (none of
    the tags' crossing, even when a client sends one, nor the gateway's unsampled mark), but
    the trace context, which only the sampled ones carry, and the caller's verified identity
    (x-forwarded-client-cert) each time."""
    before = _envoy_counter(split, CROSSED)
    headers = {
        "authorization": f"Bearer {split.token}",
        "x-meshfn-span-meshfn-tenant": "evil",
        "x-meshfn-unsampled": "1",  # a client's mark changes nothing: the gateway draws
    }
    names: list[tuple[str, ...]] = []
    conn = httpclient.HTTPConnection("127.0.0.1", split.edge, timeout=10)
    try:
        for _ in range(300):
            conn.request("GET", "/echo", headers=headers)
            reply = conn.getresponse()
            body = reply.read()
            assert reply.status == 200, body
            assert "x-meshfn-trace-id" not in reply.headers
            got = json.loads(body)
            names.append(tuple(got["headers"]))
            assert "URI=spiffe://meshfn.local/ns/ingress/sa/edge" in got["client_cert"], got
    finally:
        conn.close()
    crossed = _envoy_counter(split, CROSSED) - before
    assert crossed >= 5  # P(fewer than 5 of 300 at 10%) < 1e-7
    assert sum("traceparent" in seen for seen in names) == crossed
    context = {"traceparent", "tracestate"}
    others = {tuple(n for n in seen if n not in context) for seen in names}
    assert len(others) == 1, set.union(*map(set, others)) - set.intersection(*map(set, others))
    (seen,) = others
    assert not [n for n in seen if n.startswith("x-meshfn-span-") or n == "x-meshfn-unsampled"]


def test_tracing_at_a_low_rate_streams_through_the_internal_listener_keep_their_usage(
    split: Mesh,
) -> None:
    """150 streams, about 15 of them sampled, which take the internal listener: every stream
    ends with its usage (the backend's record crosses the sidecar as an HTTP/1.1 trailer), and
    the sampled ones' audit records have it too."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{split.edge}/v1", api_key=split.token, max_retries=0
    )
    before = {t["trace_id"] for t in split.traces(model="tiny-lm")}
    before_crossed = _envoy_counter(split, CROSSED)
    for n in range(150):
        chunks = list(
            client.completions.create(
                model="tiny-lm",
                prompt="The with statement",
                max_tokens=3,
                seed=n,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    crossed = _envoy_counter(split, CROSSED) - before_crossed
    assert crossed > 0, "no stream of 150 sampled at 10%"  # P = 0.9**150, 1.4e-7

    def arrived() -> list[str] | None:
        traces = split.traces(model="tiny-lm")
        new = [t["trace_id"] for t in traces if t["trace_id"] not in before]
        return new if len(new) >= crossed else None

    new = wait_for("a trace of each stream sampled", arrived, timeout=30, every=0.5)
    assert len(new) == crossed
    for trace_id in new:
        rows = _audit_records(split, trace_id)
        assert [r["generation"]["completion_tokens"] for r in rows if r.get("generation")], rows


def test_tracing_at_a_low_rate_the_gateways_audit_records_carry_the_sampled_requests_traces(
    tmp_path: Path,
) -> None:
    """The examples at their 10% with the audit trail on every proxy: the split gateway has no
    tracer on its own listener, yet its record of each sampled request carries the trace and
    the cluster the request went to (from its internal listener's answer, moved into
    metadata), as the sidecar's does; its records of the others carry no trace, and no client
    ever sees the header that brought the id back."""
    mapping = remap_examples(tmp_path / "examples")
    mesh_yaml = tmp_path / "examples" / "mesh.yaml"
    text = mesh_yaml.read_text()
    assert "    proxies: sidecars\n" in text
    mesh_yaml.write_text(text.replace("    proxies: sidecars\n", "    proxies: all\n", 1))
    running = _up(tmp_path, mapping)
    mesh = next(running)
    try:
        before = {t["trace_id"] for t in mesh.traces(model="iris")}
        conn = httpclient.HTTPConnection("127.0.0.1", mesh.edge, timeout=10)
        try:
            for _ in range(200):
                conn.request("POST", IRIS, body=FLOWER, headers=mesh.headers())
                reply = conn.getresponse()
                assert reply.status == 200, reply.read()
                assert "x-meshfn-trace-id" not in reply.headers
                reply.read()
        finally:
            conn.close()
        time.sleep(3)  # the Envoys send their spans every second (bootstrap.RUNTIME)
        traced = {t["trace_id"] for t in mesh.traces(model="iris")} - before
        assert 2 <= len(traced) <= 50, len(traced)  # 20 expected at 10%
        store = mesh.state / "audit" / "audit.db"

        def records() -> list[dict[str, Any]] | None:
            out = meshfn(
                "audit", "query", "--store", str(store), "--route", "default/function-iris",
                "--limit", "10000", "--json",
            )  # fmt: skip
            rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
            return rows if len(rows) >= 400 else None

        rows = wait_for("both proxies' records of every request", records, timeout=30, every=1)
        by_source: dict[str, dict[str, Any]] = {}
        for row in rows:
            by_source.setdefault(row["source"], {})[row["id"]] = row["trace_id"]
        gateway = next(v for k, v in by_source.items() if k.startswith("edge.ingress"))
        # a sampled request went through the internal listener, yet names its real cluster
        clusters = {r["upstream_cluster"] for r in rows if r["source"].startswith("edge.ingress")}
        assert clusters and not [c for c in clusters if c and c.startswith("meshfn-traced")]
        sidecars = {
            i: t for k, v in by_source.items() if not k.startswith("edge") for i, t in v.items()
        }
        assert {t for t in gateway.values() if t} == traced
        # the sidecar names the same request by the same id, and the same trace
        assert len(gateway.keys() & sidecars.keys()) >= 200
        assert {i: t for i, t in gateway.items() if i in sidecars} == {
            i: sidecars[i] for i in gateway if i in sidecars
        }
    finally:
        running.close()  # stops what it started


def _gateway_draws(mesh: Mesh) -> set[int]:
    """The split gateways' draws, per ten thousand (the RuntimeFraction matchers of the route
    tables every proxy of the mesh has)."""
    found: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if str(node.get("@type", "")).endswith(".RuntimeFraction"):
                found.add(int(node["runtime_fraction"]["default_value"].get("numerator", 0)))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for sock in sorted((mesh.state / "envoy").glob("*.sock")):
        walk(admin_json(sock, "/config_dump?resource=dynamic_route_configs"))
    return found


def test_tracing_at_a_low_rate_each_gateway_route_keeps_its_own_rate(split: Mesh) -> None:
    """The echo route at 20% of its own, the others at the Mesh's 10%: the gateway's one draw
    at 20% sends a request to the twins, where a 10% route's twin draws again (half of that)
    before its route. 600 GETs each to /echo and to the KServe server's readiness: 120 and 60
    traced expected (sd 9.8 and 7.3; the bounds are four sd), every one answered."""
    routes = split.state.parent / "examples" / "routes.yaml"
    original = routes.read_text()
    marker = "  destination: {service: echo}\n"
    assert marker in original
    names = ("default/echo", "default/kserve-server")
    routes.write_text(original.replace(marker, marker + "  tracing: {sampling: 20}\n", 1))
    try:
        wait_for("a draw at 20%", lambda: _gateway_draws(split) == {2000}, timeout=60, every=0.5)
        before = {name: {t["trace_id"] for t in split.traces(route=name)} for name in names}
        _send(split.edge, "/echo", 600, [split.headers()])
        _send(split.edge, "/v2/health/ready", 600, [split.headers()])
        time.sleep(3)  # the Envoys send their spans every second (bootstrap.RUNTIME)
        new = {
            name: {t["trace_id"] for t in split.traces(route=name)} - before[name] for name in names
        }
    finally:
        routes.write_text(original)
        wait_for("a draw at 10%", lambda: _gateway_draws(split) == {1000}, timeout=60, every=0.5)
    assert 81 <= len(new["default/echo"]) <= 159, len(new["default/echo"])
    assert 31 <= len(new["default/kserve-server"]) <= 89, len(new["default/kserve-server"])


def _split_sidecars(mesh: Mesh) -> list[bool]:
    """Per sidecar: whether it is split (no tracer on its own listener)."""
    return ["tracing" not in listeners["inbound"] for listeners in _sidecars(mesh)]


def test_tracing_a_sidecar_leaves_and_rejoins_its_split_without_failing_a_request(
    split: Mesh,
) -> None:
    """The Mesh at 50% (the sidecars' tracer back on their own listeners), then at 10% again
    (split again), while iris requests keep coming: every one is answered, those on a
    connection still on the older configuration too. (Last to use the split mesh.)"""
    mesh_yaml = split.state.parent / "examples" / "mesh.yaml"
    original = mesh_yaml.read_text()
    assert "    sampling: 10\n" in original
    statuses: list[int | str] = []
    stop = threading.Event()
    iris = ("POST", IRIS, FLOWER, split.headers())
    sender = threading.Thread(target=_statuses, args=(split.edge, stop, statuses, iris))
    sender.start()
    try:
        for sampling, split_now in ((50, False), (10, True)):
            mesh_yaml.write_text(
                original.replace("    sampling: 10\n", f"    sampling: {sampling}\n")
            )
            wait_for(
                f"every sidecar at {sampling}%",
                lambda split_now=split_now: set(_split_sidecars(split)) == {split_now},
                timeout=60,
                every=0.5,
            )
            time.sleep(2)  # requests through the new configuration
    finally:
        stop.set()
        sender.join(timeout=30)
        mesh_yaml.write_text(original)
    assert len(statuses) > 50 and set(statuses) == {200}, [s for s in statuses if s != 200]
