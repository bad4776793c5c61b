"""The mesh route in audit records, with real Envoys under `meshfn up`: client -> gateway ->
(mTLS) -> sidecar. Records name the mesh route the gateway matched (`default/model`), a
client cannot make the gateway or the sidecar record another one, and a mesh peer that is not a
gateway cannot either: its claim is recorded as untrusted, never as the route. The trail
verifies against the signer's witness afterwards; `meshfn status` shows the trail while up."""

from __future__ import annotations

import datetime as dt
import http.client as httpc
import json
import ssl
from pathlib import Path
from typing import Any

import pytest
from meshfn_e2e import Processes

from meshfn.control_plane.identity.ca import CertificateAuthority
from meshfn.control_plane.identity.spiffe import SpiffeId
from meshfn.testing import policies as p
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import meshfn, wait_for

pytestmark = pytest.mark.e2e
TD = "route.local"


def _get(host: str, path: str, headers: dict[str, str]) -> int:
    conn = httpc.HTTPConnection(host, timeout=5)
    try:
        conn.request("GET", path, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def _direct(tmp: Path, state: Path, port: int, account: str, headers: dict[str, str]) -> int:
    """HTTPS straight to the sidecar with a valid mesh certificate of `account`."""
    ca = CertificateAuthority(state / "ca" / TD, TD)
    cert = ca.issue(SpiffeId(TD, "default", account), dt.timedelta(hours=1))
    crt, key = tmp / f"{account}.crt", tmp / f"{account}.key"
    crt.write_text(cert.certificate_pem)
    key.write_text(cert.private_key_pem)
    bundle = tmp / "bundle.pem"
    bundle.write_text(ca.trust_bundle_pem())
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(bundle))
    context.check_hostname = False
    context.load_cert_chain(crt, key)
    conn = httpc.HTTPSConnection(f"127.0.0.1:{port}", context=context, timeout=5)
    try:
        conn.request("GET", "/direct", headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def test_records_name_the_mesh_route_and_resist_spoofing(procs: Processes, tmp_path: Path) -> None:
    ports = named_ports("xds", "admin", "envoy_admin", "listener", "app", "sidecar")
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "mesh.yaml").write_text(
        p.documents(
            p.mesh("rt", TD, ports["xds"], ports["admin"], audit={"proxies": "all"}),
            p.gateway(ports["envoy_admin"], ports["listener"], namespace="ingress"),
            p.service("model", ports["app"], [p.endpoint(sidecar=ports["sidecar"])]),
            p.route("model", "model", gateway="ingress/edge"),
        )
    )
    state = tmp_path / "state"
    up = procs.up_at(policies, state, timeout=60)
    gateway = f"127.0.0.1:{ports['listener']}"
    wait_for("a first answer", lambda: _get(gateway, "/warmup", {}) == 200, timeout=20)
    # 1. a client spoofs the header at the gateway
    assert _get(gateway, "/spoofed", {"x-meshfn-route": "default/admin-route"}) == 200
    # 2. a mesh workload that is no gateway calls the sidecar directly and claims a route
    claim = {"x-meshfn-route": "default/model"}
    assert _direct(tmp_path, state, ports["sidecar"], "intruder", claim) == 200
    status = meshfn("status", "--state-dir", str(state))
    assert "audit trail" in status.stdout and "witness" in status.stdout, status.stdout
    assert up.stop() == 0

    store = str(state / "audit" / "audit.db")
    verified = meshfn("audit", "verify", "--store", store, "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert report["witnessed"] >= 1 and report["unsigned_tail"] == 0, report

    def query(*args: str) -> list[dict[str, Any]]:
        out = meshfn("audit", "query", "--store", store, "--json", "--limit", "1000", *args)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    by_path: dict[str, dict[str, dict[str, Any]]] = {}
    for row in query():
        kind = "gateway" if row["source"] == "edge.ingress" else "sidecar"
        by_path.setdefault(row["path"], {})[kind] = row
    spoofed = by_path["/spoofed"]
    for kind, source in (("gateway", "proxy"), ("sidecar", "gateway")):
        assert spoofed[kind]["route"] == "default/model", spoofed[kind]
        assert spoofed[kind]["route_source"] == source, spoofed[kind]
    assert spoofed["gateway"]["envoy_route"] == "default/model/0"
    assert spoofed["sidecar"]["envoy_route"] == "local"
    assert spoofed["sidecar"]["principal"] == f"spiffe://{TD}/ns/ingress/sa/edge"
    (direct,) = by_path["/direct"].values()
    assert direct["principal"] == f"spiffe://{TD}/ns/default/sa/intruder"
    assert direct["route"] is None and direct["route_source"] == "untrusted"
    assert direct["route_claimed"] == "default/model"
    routed = {r["path"] for r in query("--route", "default/model")}
    assert routed == {"/warmup", "/spoofed"}  # never the intruder's claim
    assert query("--route", "default/admin-route") == []
