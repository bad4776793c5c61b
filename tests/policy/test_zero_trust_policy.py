"""Zero-trust policy kinds: bad input gets file, line, field and a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshfn.policy import PolicyErrors, load_policies
from meshfn.testing.policies import documents, endpoint, gateway, mesh, service

BASE = documents(
    mesh("t", "t.local"),
    gateway(19000, 10000, namespace="ingress"),
    service("model", 8001, [endpoint(sidecar=15001)]),
    service("bare", 8002),
)

EC_KEY = '{"kty": "EC", "crv": "P-256", "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}'


def doc(kind: str, spec: str, name: str = "p", namespace: str = "default") -> str:
    return (
        f"apiVersion: meshfn.io/v1alpha1\nkind: {kind}\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\nspec:\n{spec}"
    )


def jwt_rule(extra: str) -> str:
    return doc("RequestAuthentication", f"  jwtRules:\n    - issuer: https://i\n{extra}")


CASES = [
    (jwt_rule("      jwks: 'not json'\n"), "jwtRules[0].jwks", "jwks is not valid JSON"),
    (jwt_rule("      jwks: '{\"keys\": []}'\n"), "jwtRules[0].jwks", 'non-empty "keys" list'),
    (
        jwt_rule('      jwks: \'{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}\'\n'),
        "jwtRules[0].jwks",
        "symmetric (oct) keys are not accepted",
    ),
    (
        jwt_rule(f'      jwks: \'{{"keys": [{EC_KEY[:-1]}, "alg": "HS256"}}]}}\'\n'),
        "jwtRules[0].jwks",
        "unsupported algorithm 'HS256'",
    ),
    (
        jwt_rule('      jwks: \'{"keys": [{"kty": "XYZ"}]}\'\n'),
        "jwtRules[0].jwks",
        "unknown key type 'XYZ'",
    ),
    (
        jwt_rule(f'      jwks: \'{{"keys": [{EC_KEY[:-1]}, "d": "private"}}]}}\'\n'),
        "jwtRules[0].jwks",
        "private key material",
    ),
    (
        jwt_rule("      jwksUri: ftp://keys.example.com/jwks\n"),
        "jwtRules[0].jwksUri",
        "not an http(s) URL",
    ),
    (jwt_rule(""), "jwtRules[0]", "set exactly one of: jwks, jwksUri"),
    (
        jwt_rule("      jwksUri: http://k/j\n      clockSkew: 1h\n"),
        "jwtRules[0]",
        "clockSkew must be between",
    ),
    (
        jwt_rule("      jwksUri: http://k/j\n      maxLifetime: 0s\n"),
        "jwtRules[0]",
        "maxLifetime must be between 1s and 365 days (8760h)",
    ),
    (
        jwt_rule(
            "      jwksUri: http://k/j\n      maxLifetime: 1h\n      requireExpiration: false\n"
        ),
        "jwtRules[0]",
        "it needs requireExpiration",
    ),
    (
        jwt_rule("      jwksUri: http://k/j\n      requireExpiration: 'no'\n"),
        "jwtRules[0].requireExpiration",
        "valid boolean",
    ),
    (
        doc(
            "AuthorizationPolicy",
            "  rules: [{from: [{source: {principals: [spiffe://t.local/ns/a/sa/b]}}]}]\n",
        ),
        "principals[0]",
        "must be a principal",
    ),
    (
        doc("AuthorizationPolicy", "  rules: [{from: [{source: {principals: [just-a-name]}}]}]\n"),
        "principals[0]",
        "must be a principal",
    ),
    (
        doc(
            "AuthorizationPolicy",
            "  rules: [{when: [{key: 'request.auth.claim[x]', values: [a]}]}]\n",
        ),
        "when[0].key",
        "must be request.auth.claims[NAME]",
    ),
    (
        doc("AuthorizationPolicy", "  rules: [{when: [{key: source.namespace}]}]\n"),
        "when[0]",
        "set values or notValues",
    ),
    (doc("AuthorizationPolicy", "  action: AUDIT\n"), "action", "'ALLOW' or 'DENY'"),
    (
        doc("AuthorizationPolicy", "  rules: [{to: [{operation: {paths: [no-slash]}}]}]\n"),
        "paths[0]",
        'must be "/exact"',
    ),
    (
        doc("AuthorizationPolicy", "  selector: {service: ghost}\n"),
        "selector.service",
        "no Service default/ghost",
    ),
    (
        doc("AuthorizationPolicy", "  selector: {gateway: edge}\n"),
        "selector.gateway",
        "no Gateway default/edge",
    ),
    (
        doc("PeerAuthentication", "  mtls: {mode: SOMETIMES}\n"),
        "mtls.mode",
        "'STRICT', 'PERMISSIVE' or 'DISABLE'",
    ),
    (
        doc("PeerAuthentication", "  selector: {gateway: x}\n  mtls: {mode: STRICT}\n"),
        "spec",
        "not gateways",
    ),
    (
        doc("PeerAuthentication", "  selector: {service: bare}\n  mtls: {mode: STRICT}\n"),
        "selector.service",
        "has no sidecars",
    ),
    (
        doc(
            "PeerAuthentication",
            "  selector: {service: model}\n  portLevelMtls: {'9999': {mode: DISABLE}}\n",
        ),
        "portLevelMtls.9999",
        "no endpoint on port 9999",
    ),
    (
        doc("PeerAuthentication", "  portLevelMtls: {'8001': {mode: DISABLE}}\n"),
        "spec",
        "needs a selector",
    ),
    (doc("PeerAuthentication", "  {}\n"), "spec", "set mtls or portLevelMtls"),
    (
        doc(
            "Service",
            "  port: 1\n  endpoints: [{address: 127.0.0.1, sidecar: {port: 15001}}, {address: 127.0.0.2}]\n",
            name="half",
        ),
        "spec",
        "every endpoint has a sidecar or none",
    ),
    (
        doc(
            "Service",
            "  port: 2\n  endpoints: [{address: 127.0.0.1, sidecar: {port: 10000}}]\n",
            name="clash",
        ),
        "spec.endpoints[0].sidecar.port",
        "clashes with listener http",
    ),
    (
        doc(
            "Mesh",
            "  trustDomain: t.local\n  identity: {certificateTTL: 1s}\n",
            name="m2",
            namespace="default",
        )
        .replace("namespace: default", "")
        .replace(", }", "}"),
        "spec",
        "certificateTTL must be between",
    ),
]


@pytest.mark.parametrize(("extra", "path", "fragment"), CASES)
def test_security_policy_errors(tmp_path: Path, extra: str, path: str, fragment: str) -> None:
    (tmp_path / "a-base.yaml").write_text(BASE)
    (tmp_path / "z-extra.yaml").write_text(extra)
    with pytest.raises(PolicyErrors) as caught:
        load_policies(tmp_path)
    found = [e for e in caught.value.errors if e.path.endswith(path) and fragment in e.message]
    assert found, f"no {path}: {fragment!r} in {[str(e) for e in caught.value.errors]}"
    assert found[0].file.endswith(("z-extra.yaml", "a-base.yaml")) and found[0].line > 0


def test_two_peer_authentications_for_one_service(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(BASE)
    pa = doc("PeerAuthentication", "  selector: {service: model}\n  mtls: {mode: STRICT}\n")
    (tmp_path / "b.yaml").write_text(pa + "---\n" + pa.replace("name: p,", "name: q,"))
    with pytest.raises(PolicyErrors, match="a second PeerAuthentication for Service default/model"):
        load_policies(tmp_path)


def test_effective_modes(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        BASE.replace(
            "sidecar: {port: 15001}}]",
            "sidecar: {port: 15001}}, {address: 127.0.0.1, port: 8009, sidecar: {port: 15009}}]",
        )
        + "---\n"
        + doc("PeerAuthentication", "  mtls: {mode: PERMISSIVE}\n", name="ns")
        + "---\n"
        + doc(
            "PeerAuthentication",
            "  selector: {service: model}\n  portLevelMtls: {'8009': {mode: DISABLE}}\n",
            name="port",
        )
    )
    model = load_policies(tmp_path)
    modes = {e.port: e.mtls for e in model.service("default/model").endpoints}
    assert modes == {8001: "PERMISSIVE", 8009: "DISABLE"}
    sidecars = [w for w in model.workloads if w.kind == "sidecar"]
    assert [w.node_cluster for w in sidecars] == ["model.default:15001", "model.default:15009"]
    assert {w.identity for w in sidecars} == {"spiffe://t.local/ns/default/sa/model"}
