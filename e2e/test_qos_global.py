"""A global rate limit through real Envoys: two gateways bound by one QoSPolicy with `global`
share each tenant's bucket in the control plane's rate-limit service (Envoy's RLS protocol on
the ADS port), so the total admitted across both stays within the limit; a third gateway's
policy fails open. With the control plane frozen (SIGSTOP: the limit service cannot answer),
the fail-closed gateways answer 503 within the policy's timeout and the fail-open one admits:
no request hangs. The limit service answers only the gateways a policy binds, proven by the
limit-service token the control plane renders into each one's ratelimit filter: a raw gRPC
client without it, with another node's, or as a gateway the policy does not bind spends nothing
and is counted."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from meshfn_e2e import Processes, Reply, admin_get, http

from meshfn.contracts.qos import DESCRIPTOR_POLICY, DESCRIPTOR_TENANT, LIMIT_SERVICE_NODE_HEADER
from meshfn.control_plane.identity.bootstrap_token import LIMIT_SERVICE_PURPOSE, BootstrapTokens
from meshfn.testing import policies as p
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN, Proc, issue_token, meshfn, wait_for

BURST = 6  # acme's requests per minute across both shared gateways
POLICY_TIMEOUT_MS = 200  # how long a gateway waits for the limit service


@dataclass
class Rig:
    ports: dict[str, int]
    state: Path
    procs: Processes
    argv: list[str]
    up: Proc = field(init=False)

    def start(self, probe_tenant: str) -> None:
        """`meshfn up` (again), until every gateway serves `probe_tenant`."""
        self.up = up = self.procs.start("up", self.argv)
        wait_for("meshfn up", lambda: "Ctrl-C stops everything" in up.output(), 120, proc=up)
        probe = self.token(probe_tenant)
        for gateway in ("a", "b", "c"):
            wait_for(f"gateway {gateway}", lambda g=gateway: self.ready(g, probe), proc=up)

    def token(self, tenant: str) -> str:
        return issue_token(self.state, "alice", tenant)

    def get(self, gateway: str, bearer: str) -> Reply:
        url = f"http://127.0.0.1:{self.ports[gateway]}/v1/x"
        return http(url, headers={"authorization": f"Bearer {bearer}"})

    def ready(self, gateway: str, bearer: str) -> bool:
        reply = self.get(gateway, bearer)
        if reply.status != 200:
            raise ValueError(f"{reply.status} {reply.body[:200]!r}")  # "not yet", with why
        return True

    def stat(self, gateway: str, suffix: str) -> int:
        """The sum of a gateway Envoy's counters whose names end with `suffix`."""
        text = http(f"http://127.0.0.1:{self.ports[gateway + '_admin']}/stats").body.decode()
        return sum(
            int(value)
            for name, _, value in (line.partition(": ") for line in text.splitlines())
            if name.endswith(suffix) and value.isdigit()
        )

    def metric(self, outcome: str, policy: str) -> float:
        pattern = (
            rf'^meshfn_qos_global_requests_total\{{[^}}]*outcome="{outcome}"[^}}]*'
            rf'policy="{policy}"[^}}]*\}} (\S+)$'
        )
        return self._sum(pattern)

    def errors(self, reason: str) -> float:
        return self._sum(rf'^meshfn_qos_global_errors_total\{{reason="{reason}"\}} (\S+)$')

    def _sum(self, pattern: str) -> float:
        admin = f"http://127.0.0.1:{self.ports['admin']}"
        text = admin_get(admin, "/metrics", self.state).body.decode()
        return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("qos-global")
    ports = named_ports("xds", "admin", "a_admin", "a", "b_admin", "b", "c_admin", "c", "alpha")
    root = tmp / "policies"
    root.mkdir()
    policies = p.gateways_mesh(
        "e2e",
        ports,
        {"a": "edge-a", "b": "edge-b", "c": "edge-c"},
        p.qos_policy(
            "shared",
            ["edge-a", "edge-b"],
            {"requests": BURST, "per": "60s"},
            "deny",
            f"{POLICY_TIMEOUT_MS}ms",
        ),
        p.qos_policy("open", ["edge-c"], {"requests": 1000}, "allow", f"{POLICY_TIMEOUT_MS}ms"),
        prefix="/v1",
    )
    p.write(root / "mesh.yaml", policies)
    procs = Processes(tmp)
    state = tmp / "state"
    try:
        argv = [MESHFN, "up", "--policies", str(root), "--state-dir", str(state)]
        rig = Rig(ports, state, procs, [*argv, "--envoy-concurrency", "1"])
        rig.start("probe")
        yield rig
    finally:
        procs.stop_all()


def test_two_gateways_share_one_global_limit(rig: Rig) -> None:
    acme = rig.token("acme")
    replies = [(g, rig.get(g, acme)) for _ in range(BURST * 2) for g in ("a", "b")]
    admitted = [g for g, r in replies if r.status == 200]
    refused = [r for _, r in replies if r.status != 200]
    # Each gateway alone would admit BURST; together they admit BURST (plus at most the
    # one token a minute's refill adds while the test runs).
    assert BURST <= len(admitted) <= BURST + 1, [r.status for _, r in replies]
    assert set(admitted) == {"a", "b"}
    assert {r.status for r in refused} == {429}
    limited = refused[-1]
    body = json.loads(limited.body)
    assert body["error"] == "rate limit exceeded" and body["limit"] == "rate"
    assert body["policy"] == "default/shared" and body["tenant"] == "acme"
    assert body["scope"] == "global"
    headers = {k.lower(): v for k, v in limited.headers.items()}
    assert int(headers["retry-after"]) >= 1
    assert headers["x-meshfn-qos-limit"] == "rate"
    assert headers["x-ratelimit-limit"].startswith(str(BURST))
    assert headers["x-ratelimit-remaining"] == "0"
    # Another tenant has a bucket of its own.
    assert rig.get("a", rig.token("globex")).status == 200
    assert rig.metric("over_limit", "default/shared") >= len(refused)
    assert rig.metric("allowed", "default/shared") >= len(admitted)
    status = meshfn("status", "--state-dir", str(rig.state))
    assert status.returncode == 0, status.stderr
    assert "global rate limits" in status.stdout
    row = next(
        line for line in status.stdout.splitlines() if "default/shared" in line and "acme" in line
    )
    assert [c.strip() for c in row.split("│")[3:5]] == [str(len(admitted)), str(len(refused))]


def _ask(rig: Rig, metadata: tuple[tuple[str, str], ...], tenant: str) -> rls_pb2.RateLimitResponse:
    """One RLS call on the control plane's ADS port, as a raw client sending `metadata`."""
    entries = [(DESCRIPTOR_POLICY, "default/shared"), (DESCRIPTOR_TENANT, tenant)]
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
    )
    request = rls_pb2.RateLimitRequest(domain="default/shared", descriptors=[descriptor])
    with grpc.insecure_channel(f"127.0.0.1:{rig.ports['xds']}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        reply: rls_pb2.RateLimitResponse = stub.ShouldRateLimit(
            request, metadata=metadata, timeout=5
        )
        return reply


def test_limit_service_answers_only_the_gateways_a_policy_binds(rig: Rig) -> None:
    # The real gateways' calls (the test above) all proved themselves.
    assert rig.errors("unauthenticated") == 0 and rig.errors("permission_denied") == 0
    tokens = BootstrapTokens(rig.state / "xds-token.key")

    def gateway(
        name: str, token_of: str | None = None, purpose: str = LIMIT_SERVICE_PURPOSE
    ) -> tuple[tuple[str, str], ...]:
        header = tokens.header(f"{token_of or name}.default", purpose)
        return ((LIMIT_SERVICE_NODE_HEADER, f"{name}.default"), ("authorization", header))

    hostile = [
        ((), grpc.StatusCode.UNAUTHENTICATED),  # no credentials
        (gateway("edge-a", token_of="edge-c"), grpc.StatusCode.UNAUTHENTICATED),  # another's
        (gateway("edge-a", purpose="xds"), grpc.StatusCode.UNAUTHENTICATED),  # its ADS token
        (gateway("edge-c"), grpc.StatusCode.PERMISSION_DENIED),  # proven, not bound to "shared"
    ]
    for metadata, code in hostile:
        for _ in range(BURST + 1):  # more than the bucket holds: none of it was spent
            with pytest.raises(grpc.RpcError) as caught:
                _ask(rig, metadata, "mallory")
            assert caught.value.code() == code, metadata  # type: ignore[attr-defined]
    assert rig.errors("unauthenticated") == 3 * (BURST + 1)
    assert rig.errors("permission_denied") == BURST + 1
    # mallory's bucket is whole: the bound gateway's own call is the first to spend it.
    reply = _ask(rig, gateway("edge-b"), "mallory")
    assert reply.overall_code == rls_pb2.RateLimitResponse.OK
    assert reply.statuses[0].limit_remaining == BURST - 1
    assert rig.get("a", rig.token("mallory")).status == 200


def test_limit_service_unreachable_fails_as_the_policy_says(rig: Rig) -> None:
    initech = rig.token("initech")
    took: list[float] = []

    def timed(gateway: str) -> Reply:
        started = time.monotonic()
        reply = rig.get(gateway, initech)
        took.append(time.monotonic() - started)
        return reply

    rig.up.send(signal.SIGSTOP)
    try:
        closed = [timed(g) for g in ("a", "b")]
        opened = [timed("c") for _ in range(3)]
    finally:
        rig.up.send(signal.SIGCONT)
    assert [r.status for r in closed] == [503, 503]  # onLimitServiceError: deny
    assert json.loads(closed[0].body) == {
        "error": "rate limit service unavailable", "limit": "rate", "scope": "global",
        "policy": "default/shared", "onLimitServiceError": "deny",
    }  # fmt: skip
    assert [r.status for r in opened] == [200, 200, 200]  # onLimitServiceError: allow
    # Each waited for the policy's timeout (so the gateway did ask the limit service), and none
    # hung: a functional deadline with a wide margin (the timeout + 2 s; a hung request would
    # wait for the client's own 5 s).
    timeout = POLICY_TIMEOUT_MS / 1000
    assert all(0.95 * timeout <= t < timeout + 2 for t in took), took
    # Each gateway counted its failures (Envoy's ratelimit stats, per route cluster).
    assert rig.stat("a", "ratelimit.meshfn_qos.error") >= 1
    assert rig.stat("a", "ratelimit.meshfn_qos.failure_mode_allowed") == 0
    assert rig.stat("c", "ratelimit.meshfn_qos.failure_mode_allowed") >= 3
    # Back: the shared gateways ask the service again.
    wait_for("the limit service again", lambda: rig.get("a", initech).status == 200)


def test_a_restart_hands_out_no_fresh_burst(rig: Rig) -> None:
    """The limit service's buckets are in the state directory: a drained tenant stays drained
    across a control-plane restart (SIGTERM, then `meshfn up` again on the same state)."""
    hooli = rig.token("hooli")
    replies = [rig.get("a", hooli).status for _ in range(BURST + 2)]
    assert replies == [200] * BURST + [429, 429], replies
    rig.up.stop()
    rig.start("probe-after-restart")
    # A minute's refill of 6 for the seconds the restart took: a token or two, not a burst.
    again = [rig.get(g, hooli).status for g in ("a", "b") for _ in range(BURST // 2)]
    assert again.count(200) <= 2 and again.count(429) >= BURST - 2, again
