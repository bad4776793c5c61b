"""`meshfn analyze`: each finding of the catalogue on a policy set that has it (code, severity,
file:line, fix), none on the examples, and the CLI's exit status."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

from meshfn.control_plane.analyze import CATALOGUE, Finding, analyze
from meshfn.control_plane.identity.ca import CertificateAuthority
from meshfn.policy import PolicyLoader
from meshfn.testing import policies as p
from meshfn.testing.processes import meshfn

ROOT = Path(__file__).resolve().parents[2]
JWKS = json.dumps({"keys": [{"kty": "EC", "crv": "P-256", "kid": "k1", "alg": "ES256",
                             "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
                             "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]})  # fmt: skip
CLEAN = [
    p.mesh("t", "t.local"),
    p.gateway(19000, 10000, namespace="ingress"),
    p.service("model", 8001, [p.endpoint(sidecar=15001)]),
    p.service("lite", 8002),
    p.route("model", "model", gateway="ingress/edge",
            retries={"attempts": 2, "perTryTimeout": "1s"}),
    p.authorization("allow", {"service": "model"},
                    [{"from": [{"source": {"principals": ["t.local/ns/ingress/sa/edge"]}}]}]),
    p.jwt_authentication("jwt", {"service": "model"}, "https://i", jwks=JWKS, audiences=["m"]),
]  # fmt: skip


def run(
    tmp_path: Path, *docs: str, state: Path | None = None, drift: dict | None = None
) -> list[Finding]:
    policies = tmp_path / "policies"
    policies.mkdir(exist_ok=True)
    (policies / "p.yaml").write_text(p.documents(*docs))
    model, items = PolicyLoader(policies).load_with_sources()
    return analyze(items, model, state, drift)


def only(findings: list[Finding], code: str) -> Finding:
    matching = [f for f in findings if f.code == code]
    assert len(matching) == 1, findings
    return matching[0]


def line_of(tmp_path: Path, needle: str) -> int:
    lines = (tmp_path / "policies" / "p.yaml").read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if needle in text)


def test_a_clean_set_and_the_examples_have_no_findings(tmp_path: Path) -> None:
    assert run(tmp_path, *CLEAN) == []
    model, items = PolicyLoader(ROOT / "policies" / "examples").load_with_sources()
    findings = analyze(items, model)
    # only: the drift breaker is not checked without a running control plane (Info)
    assert [(f.code, f.severity) for f in findings] == [("MF0203", "Info")]


@pytest.mark.parametrize(("mode", "code", "severity"), [("DISABLE", "MF0101", "Error"),
                                                        ("PERMISSIVE", "MF0102", "Warning")])  # fmt: skip
def test_weak_mtls_anywhere(tmp_path: Path, mode: str, code: str, severity: str) -> None:
    peer = p.doc("PeerAuthentication", "weak", {"selector": {"service": "model"},
                                                "portLevelMtls": {"8001": {"mode": mode}}})  # fmt: skip
    found = only(run(tmp_path, *CLEAN, peer), code)
    assert found.severity == severity and "service model port 8001" in found.message
    assert found.where == f"{tmp_path}/policies/p.yaml:{line_of(tmp_path, 'kind: PeerAuth') + 2}"
    assert found.fix.startswith("set mode: STRICT")
    mesh_wide = only(run(tmp_path, p.mesh("t", "t.local", mtls={"mode": mode}), *CLEAN[1:]), code)
    assert "the whole mesh" in mesh_wide.message and mesh_wide.resource == "Mesh t"


def test_a_service_with_sidecars_and_no_allow_policy(tmp_path: Path) -> None:
    deny_only = p.authorization("deny", {"service": "model"}, [{"to": [{"operation": {"paths": ["/x"]}}]}], action="DENY")  # fmt: skip
    found = only(run(tmp_path, *CLEAN[:5], deny_only), "MF0103")
    assert found.resource == "Service default/model"
    assert found.where.endswith(f":{line_of(tmp_path, 'metadata: {name: model}')}")
    assert "selector: {service: model}" in found.fix
    # a namespace-wide ALLOW (no selector) counts; a service without sidecars needs none
    wide = p.doc("AuthorizationPolicy", "all", {"rules": [{}]})
    assert not [f for f in run(tmp_path, *CLEAN[:5], wide) if f.code == "MF0103"]


def test_an_allow_rule_shadowed_by_a_deny_rule(tmp_path: Path) -> None:
    allow = p.authorization("allow", {"service": "model"}, [
        {"to": [{"operation": {"paths": ["/v2/admin/users"], "methods": ["GET"]}}]},
        {"to": [{"operation": {"paths": ["/v2/models/*"]}}]},
    ])  # fmt: skip
    deny = p.authorization("deny", {"service": "model"}, [
        {"to": [{"operation": {"paths": ["/v2/admin*"]}}]},
    ], action="DENY")  # fmt: skip
    found = only(run(tmp_path, *CLEAN[:5], allow, deny), "MF0104")
    assert (
        "rule 0 " in found.message
        and "DENY rule 0 of AuthorizationPolicy default/deny" in found.message
    )
    assert found.resource == "AuthorizationPolicy default/allow"
    # a DENY with a condition the ALLOW rule does not have does not shadow it
    narrow = p.authorization("deny", {"service": "model"}, [
        {"to": [{"operation": {"paths": ["/v2/admin*"]}}],
         "when": [{"key": "request.auth.claims[role]", "values": ["banned"]}]},
    ], action="DENY")  # fmt: skip
    assert not [f for f in run(tmp_path, *CLEAN[:5], allow, narrow) if f.code == "MF0104"]


def test_jwt_rules_without_audiences_or_exp(tmp_path: Path) -> None:
    loose = p.jwt_authentication("loose", {"service": "model"}, "https://legacy", jwks=JWKS,
                                 requireExpiration=False)  # fmt: skip
    findings = run(tmp_path, *CLEAN, loose)
    assert "(https://legacy) has no audiences" in only(findings, "MF0105").message
    no_exp = only(findings, "MF0106")
    assert no_exp.where.endswith(f":{line_of(tmp_path, 'https://legacy')}")  # flow style: one line


def test_loose_key_files_and_expiring_certificates(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ca = CertificateAuthority(state / "ca" / "t.local", "t.local")
    assert ca.root_fingerprints()
    key = next((state / "ca" / "t.local").glob("*.key"))
    assert run(tmp_path, *CLEAN, state=state) == []  # meshfn writes them 0600, valid 10 years
    os.chmod(key, 0o644)
    found = only(run(tmp_path, *CLEAN, state=state), "MF0107")
    assert found.severity == "Error" and found.where == str(key) and "0644" in found.message
    assert found.fix == f"chmod 600 {key}"
    crt = next((state / "ca" / "t.local").glob("*.crt"))
    soon = analyze([], None, state, None, now=dt.datetime.now(dt.UTC) + dt.timedelta(days=3640))  # type: ignore[arg-type]
    assert (
        only(soon, "MF0109").where == str(crt) and only(soon, "MF0109").resource == "CA certificate"
    )
    late = analyze([], None, state, None, now=dt.datetime.now(dt.UTC) + dt.timedelta(days=4000))  # type: ignore[arg-type]
    assert only(late, "MF0108").fix.startswith("meshfn ca rotate")


def test_a_fallback_chain_without_an_endpoint(tmp_path: Path) -> None:
    empty = p.service("empty", 8003, [])
    chain = p.doc("FallbackPolicy", "fb", {"service": "model", "chain": ["empty"]})
    found = only(run(tmp_path, *CLEAN, empty, chain), "MF0201")
    assert found.severity == "Error" and "(empty)" in found.message
    ok = p.doc("FallbackPolicy", "fb", {"service": "model", "chain": ["empty", "lite"]})
    assert not [f for f in run(tmp_path, *CLEAN, empty, ok) if f.code == "MF0201"]


def test_a_drift_breaker_without_enough_traffic(tmp_path: Path) -> None:
    breaker = p.doc("FallbackPolicy", "fb", {"service": "model", "chain": ["lite"],
                    "driftBreaker": {"minSamples": 50, "window": "3s", "baselineWindow": "57s"}})  # fmt: skip
    # 200 samples over the 60 s horizon: 10 per 3 s window, under minSamples 50
    found = only(
        run(tmp_path, *CLEAN, breaker, drift={"default/model": {"samples": 200}}), "MF0202"
    )
    assert "~10 answers per 3 s window" in found.message and "at most 10" in found.fix
    busy = run(tmp_path, *CLEAN, breaker, drift={"default/model": {"samples": 6000}})
    assert not [f for f in busy if f.code == "MF0202"]
    assert only(run(tmp_path, *CLEAN, breaker), "MF0203").severity == "Info"


def test_retries_without_a_per_try_timeout(tmp_path: Path) -> None:
    bare = p.route("model", "model", gateway="ingress/edge", retries={"attempts": 3}, timeout="10s")
    found = only(run(tmp_path, *CLEAN[:4], bare, *CLEAN[5:]), "MF0204")
    assert "3 retries without perTryTimeout" in found.message and "0:00:10" in found.message
    assert found.fix == "set retries.perTryTimeout below the route's timeout"


def test_every_code_is_in_the_docs() -> None:
    """One page per code in the reference (generated from the catalogue; tests/docs checks
    that the pages are current), listed on the index."""
    index = (ROOT / "docs" / "reference" / "analyze" / "index.md").read_text()
    assert all(f"[{code}]({code}.md)" in index for code in CATALOGUE)
    assert all(
        (ROOT / "docs" / "reference" / "analyze" / f"{code}.md").is_file() for code in CATALOGUE
    )


def test_cli_exit_status_and_validate_analyze(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    peer = p.doc("PeerAuthentication", "off", {"selector": {"service": "model"}, "mtls": {"mode": "DISABLE"}})  # fmt: skip
    (policies / "p.yaml").write_text(p.documents(*CLEAN, peer))
    state = ["--state-dir", str(tmp_path / "state")]
    done = meshfn("analyze", str(policies), *state)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Error [MF0101] (PeerAuthentication default/off" in done.stderr
    as_json = meshfn("analyze", str(policies), *state, "--json")
    assert [f["code"] for f in json.loads(as_json.stdout)] == ["MF0101"]
    validated = meshfn("validate", str(policies), "--analyze", *state)
    assert (
        validated.returncode == 1
        and "ok: mesh t" in validated.stdout
        and "MF0101" in validated.stderr
    )
    assert meshfn("validate", str(policies), *state).returncode == 0  # without --analyze: valid
    (policies / "p.yaml").write_text(p.documents(*CLEAN, peer.replace("DISABLE", "PERMISSIVE")))
    assert (
        meshfn("analyze", str(policies), *state).returncode == 0
    )  # a warning: below the threshold
    strict = meshfn("analyze", str(policies), *state, "--failure-threshold", "warning")
    assert strict.returncode == 1 and "Warning [MF0102]" in strict.stdout
