"""Zero-trust overhead through the same two Envoys (gateway -> sidecar) in one run.

`meshfn up` runs a gateway Envoy and one sidecar Envoy in front of an upstream. The policy set
alternates between "secure" (mTLS STRICT between the Envoys, JWT validated and RBAC evaluated at
the sidecar) and "plain" (mTLS DISABLE, no RequestAuthentication or AuthorizationPolicy); each
switch is a hot policy reload, so the very same Envoy processes serve both, and the order
alternates (secure first in even rounds, plain first in odd ones) so neither always runs second.
Per round: sequential requests on one kept-alive connection (latency), and the CPU both Envoys
spent (schedstat run time of every thread, in ns: /proc/stat's 10 ms ticks are ~3 us per request
at 3000 requests, the size of the figure). Overheads are medians of the per-round paired
differences. Also measures how many workload certificates the CA issues per second.

Prints one line:
  zero_trust: p50_overhead_us=… p99_overhead_us=… cpu_per_req_us=… certs_per_s=…
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from meshfn.control_plane.identity.ca import CertificateAuthority
from meshfn.control_plane.identity.spiffe import SpiffeId
from meshfn.testing import policies as p
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN, Processes, cpu_ns, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from xds_push import percentile

HERE = Path(__file__).resolve().parent
ISSUER = "https://issuer.meshfn.local"


def base(ports: dict[str, int]) -> str:
    return p.documents(
        p.mesh("zt-bench", "bench.local", ports["xds"], ports["admin"]),
        p.gateway(ports["envoy_admin"], ports["listener"], namespace="ingress"),
        p.service("model", ports["app"], [p.endpoint(sidecar=ports["sidecar"])]),
        p.route("model", "model", gateway="ingress/edge"),
    )


def secure(jwks: str) -> str:
    source = {
        "principals": ["bench.local/ns/ingress/sa/edge"],
        "requestPrincipals": [f"{ISSUER}/*"],
    }
    rule = {
        "from": [{"source": source}],
        "to": [{"operation": {"methods": ["GET"], "paths": ["/v2/*"]}}],
        "when": [{"key": "request.auth.claims[tenant]", "values": ["acme"]}],
    }
    model = {"service": "model"}
    return p.documents(
        p.jwt_authentication("jwt", model, ISSUER, audiences=["meshfn"], jwks=jwks),
        p.authorization("allow", model, [rule]),
    )


PLAIN = p.doc(
    "PeerAuthentication",
    "plaintext",
    {"selector": {"service": "model"}, "mtls": {"mode": "DISABLE"}},
)


def measure(port: int, token: str, requests: int, pids: list[int]) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    headers = {"authorization": f"Bearer {token}"}
    for _ in range(200):  # warm the connections (client->gateway, gateway->sidecar)
        conn.request("GET", "/v2/warm", headers=headers)
        conn.getresponse().read()
    latencies = []
    cpu_before = sum(map(cpu_ns, pids))
    for _ in range(requests):
        started = time.perf_counter()
        conn.request("GET", "/v2/models/m/infer", headers=headers)
        response = conn.getresponse()
        response.read()
        latencies.append((time.perf_counter() - started) * 1e6)
        if response.status != 200:
            raise RuntimeError(f"request failed: {response.status}")
    cpu = (sum(map(cpu_ns, pids)) - cpu_before) / 1e9
    conn.close()
    return {
        "p50_us": statistics.median(latencies),
        "p99_us": percentile(latencies, 99),
        "cpu_per_req_us": cpu / requests * 1e6,
    }


def certs_per_second(work: Path, seconds: float = 2.0) -> float:
    ca = CertificateAuthority(work / "bench-ca", "bench.local")
    identity = SpiffeId("bench.local", "default", "model")
    issued = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        ca.issue(identity, dt.timedelta(hours=1))
        issued += 1
    return issued / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000, help="per round")
    parser.add_argument("--rounds", type=int, default=3, help="secure/plain pairs")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "zero_trust.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="meshfn-zt-") as tmp:
        work = Path(tmp)
        ports = named_ports("xds", "admin", "envoy_admin", "listener", "app", "sidecar")
        policies = work / "policies"
        policies.mkdir()
        (policies / "base.yaml").write_text(base(ports))
        state = work / "state"
        from meshfn.control_plane.identity.issuer import LocalIssuer

        issuer = LocalIssuer(state / "issuer")
        token = issuer.issue("bench", ["meshfn"], {"tenant": "acme"}, dt.timedelta(hours=2))
        secured = secure(json.dumps(issuer.jwks()))
        p.write(policies / "security.yaml", secured)
        procs = Processes(work)
        try:
            up = procs.start(
                "up",
                [MESHFN, "up", "--policies", str(policies), "--state-dir", str(state),
                 "--envoy-concurrency", "1", "--log-level", "warning"],
            )  # fmt: skip
            wait_for("meshfn up", (state / "state.json").exists, 60, proc=up)
            children = json.loads((state / "state.json").read_text())["children"]
            pids = [pid for name, pid in children.items() if name.startswith("envoy")]
            assert len(pids) == 2, children

            def answers(expected_tls: bool) -> bool:
                conn = http.client.HTTPConnection("127.0.0.1", ports["listener"], timeout=2)
                conn.request("GET", "/v2/x", headers={"authorization": f"Bearer {token}"})
                response = conn.getresponse()
                body = json.loads(response.read())
                conn.close()
                return response.status == 200 and bool(body["client_cert"]) == expected_tls

            rounds: dict[str, list[dict[str, float]]] = {"secure": [], "plain": []}
            for index in range(args.rounds):
                order = ("secure", "plain") if index % 2 == 0 else ("plain", "secure")
                for mode in order:
                    p.write(policies / "security.yaml", secured if mode == "secure" else PLAIN)
                    wait_for(f"{mode} config", lambda m=mode: answers(m == "secure"), 30)
                    time.sleep(0.3)
                    rounds[mode].append(measure(ports["listener"], token, args.requests, pids))
        finally:
            procs.stop_all()
        certs = certs_per_second(work)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[mode])

    def paired(key: str) -> float:
        """Median over rounds of secure minus plain (the two halves of one round)."""
        return statistics.median(
            s[key] - q[key] for s, q in zip(rounds["secure"], rounds["plain"], strict=True)
        )

    result = {
        "rounds": rounds,
        "secure": {k: med("secure", k) for k in ("p50_us", "p99_us", "cpu_per_req_us")},
        "plain": {k: med("plain", k) for k in ("p50_us", "p99_us", "cpu_per_req_us")},
        "certs_per_s": certs,
        "requests_per_round": args.requests,
    }
    result["p50_overhead_us"] = paired("p50_us")
    result["p99_overhead_us"] = paired("p99_us")
    result["cpu_overhead_us"] = paired("cpu_per_req_us")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(
        f"zero_trust: p50_overhead_us={result['p50_overhead_us']:.0f} "
        f"p99_overhead_us={result['p99_overhead_us']:.0f} "
        f"cpu_per_req_us={result['secure']['cpu_per_req_us']:.0f} "
        f"certs_per_s={certs:.0f} "
        f"cpu_overhead_us={result['cpu_overhead_us']:.0f} "
        f"secure_p50_us={result['secure']['p50_us']:.0f} plain_p50_us={result['plain']['p50_us']:.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
