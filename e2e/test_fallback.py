"""Topology fallback with real Envoy and real upstream processes in different localities.

The control plane runs as `meshfn serve`, the gateway Envoy from `meshfn bootstrap`, and every
upstream is a process this test owns (so killing one is not undone by a supervisor).
"""

from __future__ import annotations

import http.client as httpc
import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm
from meshfn_e2e import Processes, admin_get, wait_for_synced

from meshfn.contracts.journal import journal_path
from meshfn.testing import envoy
from meshfn.testing import policies as p
from meshfn.testing.envoy import stat as envoy_stat
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN, Proc, meshfn, wait_for

UPSTREAMS = {  # name -> (service, locality)
    "a": ("model", "eu-west/eu-west-1a/n1"),
    "b": ("model", "eu-west/eu-west-1b/n2"),
    "c": ("model", "us-east/us-east-1a/n3"),
    "lite": ("model-lite", "eu-west/eu-west-1a/n1"),
    "static": ("model-static", "eu-west/eu-west-1a/n1"),
}


ISSUER = "https://drill.test"
SIGNING_KEY = ec.generate_private_key(ec.SECP256R1())


def jwks() -> str:
    jwk = json.loads(ECAlgorithm.to_jwk(SIGNING_KEY.public_key()))
    return json.dumps({"keys": [{**jwk, "kid": "k1", "alg": "ES256", "use": "sig"}]})


def bearer(sub: str) -> dict[str, str]:
    now = int(time.time())
    claims = {"iss": ISSUER, "sub": sub, "exp": now + 600, "nbf": now - 60}
    token = jwt.encode(claims, SIGNING_KEY, algorithm="ES256", headers={"kid": "k1"})
    return {"authorization": f"Bearer {token}"}


def policies(ports: dict[str, int], audit: bool = False, drill: bool = False) -> str:
    extra: dict[str, object] = {"audit": {"proxies": "gateways"}} if audit else {}
    if drill:
        extra["drill"] = {"requestPrincipals": [f"{ISSUER}/sre-oncall"]}

    def endpoints(*names: str) -> list[dict[str, object]]:
        return [p.endpoint(ports[name], UPSTREAMS[name][1]) for name in names]

    docs = [
        p.mesh("fb", "fb.local", ports["xds"], ports["admin"], **extra),
        p.gateway(
            ports["envoy_admin"], ports["listener"], locality=p.locality("eu-west/eu-west-1a/n1")
        ),
        p.service("model", 1, endpoints("a", "b", "c")),
        p.service("model-lite", 2, endpoints("lite")),
        p.service("model-static", 3, endpoints("static")),
        p.fallback_policy(
            "model",
            ["model-lite"],
            "200ms",
            ("500ms", "1s"),
            recover_after="2s",
            locality={"failover": [{"from": "eu-west", "to": "us-east"}]},
            maxFallbackDepth=1,
        ),
        p.doc(
            "FallbackPolicy",
            "model-lite",
            {
                "service": "model-lite",
                "outlierDetection": {"consecutiveGatewayErrors": 1, "interval": "200ms"},
                "healthCheck": {
                    "path": "/health",
                    "interval": "500ms",
                    "timeout": "1s",
                    "unhealthyThreshold": 2,
                },
                "chain": ["model-static"],
            },
        ),
        p.route(
            "model",
            "model",
            "/v2",
            timeout="5s",
            retries={"attempts": 3, "retryOn": [*p.RETRY_ON, "gateway-error"]},
        ),
        p.route("lite", "model-lite", "/lite", retries={"attempts": 2, "retryOn": p.RETRY_ON}),
    ]
    if drill:
        docs.append(p.jwt_authentication("drill-jwt", {"gateway": "edge"}, ISSUER, jwks=jwks()))
    return p.documents(*docs)


@dataclass
class Topology:
    ports: dict[str, int]
    procs: Processes
    tmp: Path
    upstreams: dict[str, Proc] = field(default_factory=dict)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    def admin_text(self, path: str) -> str:
        """GET the control plane's admin port as its owner."""
        reply = admin_get(self.admin, path, self.tmp / "state")
        assert reply.status == 200, (path, reply.status, reply.body[:300])
        return reply.body.decode()

    def delay(self, name: str, ms: float) -> None:
        (self.tmp / f"delay-{name}").write_text(str(ms))

    def kill(self, name: str) -> None:
        proc = self.upstreams.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def topology(
    procs: Processes, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Topology]:
    """param: "audit" (the Mesh also audits the gateway) or "drill" (a drill names a JWT
    caller, and the gateway verifies JWTs)."""
    ports = named_ports("xds", "admin", "envoy_admin", "listener", *UPSTREAMS)
    root = tmp_path / "policies"
    root.mkdir()
    option = getattr(request, "param", "")
    (root / "mesh.yaml").write_text(
        policies(ports, audit=option == "audit", drill=option == "drill")
    )
    topo = Topology(ports, procs, tmp_path)
    for name, (service, where) in UPSTREAMS.items():
        topo.delay(name, 0)
        topo.upstreams[name] = procs.upstream(
            f"upstream-{name}", f"default/{service}", ports[name],
            "--locality", where, "--delay-file", str(tmp_path / f"delay-{name}"),
        )  # fmt: skip
    state = tmp_path / "state"
    serve = procs.start(
        "serve", [MESHFN, "serve", "--policies", str(root), "--state-dir", str(state)]
    )
    wait_for("the control plane", lambda: "control plane ready" in serve.output(), timeout=30)
    config = tmp_path / "envoy.json"
    config.write_text(
        meshfn(
            "bootstrap", "edge.default", "--policies", str(root), "--state-dir", str(state)
        ).stdout
    )
    procs.start("envoy", envoy.argv(config, concurrency=2, file_flush_interval_ms=200))
    wait_for_synced(topo.admin, serve, state=state)
    wait_for("traffic", lambda: served(topo) is not None, timeout=20)
    yield topo


def served(
    topo: Topology, path: str = "/v2/x", headers: dict[str, str] | None = None
) -> dict[str, str] | None:
    conn = httpc.HTTPConnection("127.0.0.1", topo.ports["listener"], timeout=5)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    return json.loads(body) if response.status == 200 else None


class Load:
    """Steady request streams on kept-alive connections; records (time, status, answer)."""

    def __init__(self, topo: Topology, threads: int, rate_per_thread: float, path: str = "/v2/x"):
        self.topo, self.path = topo, path
        self.interval = 1 / rate_per_thread
        self.stop = threading.Event()
        self.results: list[tuple[float, int, str]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)

    def _run(self) -> None:
        conn = httpc.HTTPConnection("127.0.0.1", self.topo.ports["listener"], timeout=10)
        next_at = time.monotonic()
        while not self.stop.is_set():
            try:
                conn.request("GET", self.path)
                response = conn.getresponse()
                body = response.read()
                status = response.status
                who = json.loads(body).get("endpoint", "") if status == 200 else body.decode()[:200]
            except (OSError, httpc.HTTPException) as exc:
                status, who = 0, repr(exc)
                conn.close()
                conn = httpc.HTTPConnection("127.0.0.1", self.topo.ports["listener"], timeout=10)
            with self.lock:
                self.results.append((time.monotonic(), status, who))
            next_at += self.interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    def since(self, start: float) -> list[tuple[float, int, str]]:
        with self.lock:
            return [r for r in self.results if r[0] >= start]


def endpoint(topo: Topology, name: str) -> str:
    return f"127.0.0.1:{topo.ports[name]}"


def test_killing_the_local_upstream_moves_traffic_to_the_next_locality(topology: Topology) -> None:
    """(a): 0 failed requests of >= 1000 while the local endpoint dies."""
    with Load(topology, threads=4, rate_per_thread=60) as load:
        wait_for("100 answers before the kill", lambda: len(load.since(0)) >= 100, timeout=30)
        before = Counter(who for _, status, who in load.since(0) if status == 200)
        assert before.most_common(1)[0][0] == endpoint(topology, "a"), before  # local first
        killed_at = time.monotonic()
        topology.kill("a")
        # at least 1000 in all, and 300 answered more than a second after the kill
        wait_for(
            "1000 answers, 300 of them after the failover",
            lambda: len(load.results) >= 1000 and len(load.since(killed_at + 1.0)) >= 300,
            timeout=60,
        )
    results = load.results
    failures = [r for r in results if r[1] != 200]
    assert len(results) >= 1000, len(results)
    assert failures == [], f"{len(failures)} failed: {failures[:3]}"
    after = Counter(who for t, _, who in results if t > killed_at + 1.0)
    # Same region, next zone: b; never the other region while b is healthy.
    names = {endpoint(topology, n): n for n in UPSTREAMS}
    assert set(after) == {endpoint(topology, "b")}, {names.get(k, k): v for k, v in after.items()}


def baseline(load: Load, answers: int = 400) -> None:
    """Wait for a baseline of fast answers (the breaker's minSamples, many times over)."""
    wait_for(f"{answers} fast answers", lambda: len(load.since(0)) >= answers, timeout=60)


def degrade_and_recover(topology: Topology, load: Load) -> None:
    """Slow every primary endpoint until the breaker trips, then heal them until it resets.
    How fast it trips is bench/failover.py's breaker_trip_ms, not a test's assert."""
    lite = endpoint(topology, "lite")
    for name in ("a", "b", "c"):
        topology.delay(name, 150)

    def on_lite() -> bool:
        recent = load.since(time.monotonic() - 0.5)
        return bool(recent) and sum(who == lite for _, _, who in recent) / len(recent) > 0.7

    wait_for("traffic on the degraded service", on_lite, timeout=30)
    status = json.loads(topology.admin_text("/debug/status"))["routes"]["default/model"]
    assert status["state"] == "degraded"
    for name in ("a", "b", "c"):
        topology.delay(name, 0)
    wait_for(
        "traffic back on the primary",
        lambda: (r := load.since(time.monotonic() - 0.5)) and all(who != lite for _, _, who in r),
        timeout=30,
    )


def test_a_slow_upstream_trips_the_drift_breaker_and_traffic_returns(topology: Topology) -> None:
    """(b): latency injection -> the degraded service; back after recovery."""
    with Load(topology, threads=12, rate_per_thread=15) as load:
        baseline(load)
        degrade_and_recover(topology, load)
    assert all(status == 200 for _, status, _ in load.results)
    metrics = topology.admin_text("/metrics")
    # tripped and reset, and every trip reset (a loaded machine may trip it more than once)
    transitions = {
        to: float(value)
        for to, value in re.findall(
            r'meshfn_drift_transitions_total\{route="default/model",to="(\w+)"\} ([\d.]+)', metrics
        )
    }
    assert transitions.get("degraded", 0) >= 1, transitions
    assert transitions.get("healthy") == transitions["degraded"], transitions


@pytest.mark.parametrize("topology", ["audit"], indirect=True)
def test_audit_and_degrade_run_as_one_plugin(topology: Topology) -> None:
    """A gateway that audits and has a drift breaker runs both filters as ONE plugin over ECDS:
    the breaker trips and resets by pushing that plugin's configuration, and every answered
    request, degraded or not, is in the audit journal exactly once, with the filter's record."""
    dump = json.loads(http_get(f"http://127.0.0.1:{topology.ports['envoy_admin']}/config_dump"))
    text = json.dumps(dump)
    assert '"meshfn.plugin.http"' in text and "meshfn-lean.wasm" in text
    assert "meshfn.meshfn_audit" not in text and "meshfn.degrade.http" not in text
    vms_before = envoy_stat(topology.ports["envoy_admin"], "wasm.envoy.wasm.runtime.v8.active")
    path = "/v2/audited"  # tells the load's records from the fixture's first requests
    with Load(topology, threads=8, rate_per_thread=15, path=path) as load:
        baseline(load, 300)
        degrade_and_recover(topology, load)
    assert load.results and all(status == 200 for _, status, _ in load.results)
    # Each configuration runs in VMs of its own (lean build): those of replaced ones are freed.
    assert (
        envoy_stat(topology.ports["envoy_admin"], "wasm.envoy.wasm.runtime.v8.created") > vms_before
    )
    active: list[int] = []

    def released() -> bool:
        active.append(
            envoy_stat(topology.ports["envoy_admin"], "wasm.envoy.wasm.runtime.v8.active")
        )
        return active[-1] <= vms_before

    try:  # workers free them as their last streams on the old configuration end
        wait_for("VMs of replaced plugin configurations released", released, timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: active VMs {active[-5:]}, before {vms_before}") from None
    journal = journal_path(topology.tmp / "state", "edge.default")

    def records() -> list[dict[str, str]]:
        lines = journal.read_text().splitlines() if journal.exists() else []
        return [r for r in map(json.loads, lines) if r["path"] == path]

    wait_for("every request in the journal", lambda: len(records()) >= len(load.results))
    found = records()
    assert len(found) == len(load.results)
    assert len({r["id"] for r in found}) == len(found)
    routes = Counter(r["route"] for r in found)
    assert routes["default/model/0/degraded"] > 0 and routes["default/model/0"] > 0, routes
    for record in found:
        assert json.loads(record["audit"])["body"] == "off", record  # the audit part ran


@pytest.mark.parametrize("topology", ["drill"], indirect=True)
def test_a_drill_caller_can_force_the_degraded_route(topology: Topology) -> None:
    """Mesh.spec.drill names a JWT caller: its `x-meshfn-degrade: 1` takes the degraded route
    (the fallback service answers, but for the probe share) while the breaker is healthy; the same header from another
    verified caller, from a caller without a token, or with spoofed claim headers does not."""
    lite = endpoint(topology, "lite")
    drill = {"x-meshfn-degrade": "1"}

    def who(headers: dict[str, str]) -> str | None:
        answer = served(topology, headers=headers)
        return answer.get("endpoint") if answer else None

    # The drill takes the degraded route as a tripped breaker would, probe share included
    # (probePercent 10 keeps measuring the primary): P(fewer than 25 of 40 on lite) ~ 1e-8.
    forced = [who({**drill, **bearer("sre-oncall")}) for _ in range(40)]
    assert None not in forced and sum(w == lite for w in forced) >= 25, forced
    assert who(bearer("sre-oncall")) != lite  # no header: the primary
    assert who({**drill, **bearer("someone-else")}) not in (None, lite)
    assert who(drill) not in (None, lite)
    spoofed = {"x-meshfn-jwt-iss": ISSUER, "x-meshfn-jwt-sub": "sre-oncall"}
    assert who({**drill, **spoofed}) not in (None, lite)
    assert who({**drill, **spoofed, **bearer("someone-else")}) not in (None, lite)
    assert (
        envoy_stat(topology.ports["envoy_admin"], "wasmcustom.meshfn_degrade.trigger_honoured")
        == 40
    )
    assert (
        envoy_stat(topology.ports["envoy_admin"], "wasmcustom.meshfn_degrade.trigger_denied") == 4
    )


def test_clients_cannot_pick_the_degraded_route(topology: Topology) -> None:
    """The routing header the degrade filter sets is stripped before Envoy picks a route: a
    client sending it still reaches the primary (the fallback service never answers)."""
    lite = endpoint(topology, "lite")
    spoofed = {"x-meshfn-degrade-route": "default/model"}
    answers = [served(topology, headers=spoofed) for _ in range(40)]
    assert all(a is not None for a in answers)
    assert not [a for a in answers if a and a.get("endpoint") == lite]


def http_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def test_the_whole_chain_down_gives_a_prompt_json_503(topology: Topology) -> None:
    """(c) and (d): everything in the chain dead -> 503 naming the chain (answered, not timed
    out: the client's timeout is 10 s); the depth limit keeps model-static (model-lite's own
    fallback) out of model's chain."""
    for name in ("a", "b", "c", "lite"):
        topology.kill(name)
    deadline = time.monotonic() + 30
    while True:
        conn = httpc.HTTPConnection("127.0.0.1", topology.ports["listener"], timeout=10)
        conn.request("GET", "/v2/x")
        response = conn.getresponse()
        body = response.read()
        conn.close()
        if response.status == 503 or time.monotonic() > deadline:
            break
    assert response.status == 503, body
    assert response.getheader("content-type") == "application/json"
    document = json.loads(body)
    assert document["error"] == "no healthy upstream"
    assert document["route"] == "default/model/0"
    assert document["exhausted_chain"] == "model.default > model-lite.default"
    # model-lite's own chain (depth 1 from its policy) still reaches model-static.
    lite = served(topology, "/lite/x")
    assert lite is not None and lite["service"] == "default/model-static"
