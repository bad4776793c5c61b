"""Multi-tenant QoS without processes: QoSPolicy errors at file:line, what the gateway's Envoy
gets (tenant from verified metadata only, the tenant header stripped from clients), and the
backend's admission (per-tenant concurrency, compute budgets per calendar window, priority
shedding) with a fake clock."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshfn import ir
from meshfn.contracts.qos import TENANT_HEADER, FunctionQoS, orca_text, window_bounds
from meshfn.inference.metrics import Metrics
from meshfn.inference.qos import Admission, Load, Refusal, tenant_of
from meshfn.policy import PolicyErrors, load_policies
from meshfn.xds.translate import OFFLINE_HOST, translate

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_QOS = ROOT / "tests" / "golden" / "qos" / "in.yaml"


def _policy_files(tmp_path: Path, qos: str, base: str | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = base if base is not None else GOLDEN_QOS.read_text()
    # The golden case without its QoSPolicies, then the one under test.
    docs = [d for d in text.split("\n---\n") if "kind: QoSPolicy" not in d]
    (tmp_path / "base.yaml").write_text("\n---\n".join(docs) + "\n")
    (tmp_path / "zz-qos.yaml").write_text(qos)
    return tmp_path


def errors(tmp_path: Path, qos: str, base: str | None = None) -> list[str]:
    with pytest.raises(PolicyErrors) as caught:
        load_policies(_policy_files(tmp_path, qos, base))
    return [str(e).split("zz-qos.yaml:", 1)[-1] for e in caught.value.errors]


def qos_policy(spec: str) -> str:
    return (
        "apiVersion: meshfn.io/v1alpha1\nkind: QoSPolicy\nmetadata: {name: q}\nspec:\n"
        "  targetRefs: [{kind: Gateway, name: edge}]\n" + spec
    )


BAD = [
    (
        "  defaultClass: a\n  classes:\n    - name: a\n      rate: {requests: 10, burst: 5}\n",
        "9: spec.classes[0].rate: burst (5) is below requests (10)",
    ),
    (
        "  defaultClass: a\n  classes:\n    - name: a\n      compute:\n"
        "        - {cpuMs: 100, per: minute}\n        - {cpuMs: 50, per: day}\n",
        "8: spec.classes[0]: compute: 50 ms per day is less than 100 ms per minute",
    ),
    (
        "  defaultClass: a\n  classes:\n    - name: a\n      compute:\n"
        "        - {cpuMs: 100, per: hour}\n        - {cpuMs: 200, per: hour}\n",
        "8: spec.classes[0]: compute: two budgets per hour",
    ),
    (
        "  defaultClass: b\n  classes:\n    - {name: a, concurrency: 2}\n",
        "6: spec.defaultClass: 'b' is not one of the classes (a)",
    ),
    (
        "  defaultClass: a\n  classes:\n    - {name: a, concurrency: 2}\n    - {name: a}\n",
        "9: spec.classes[1].name: class 'a' is defined twice",
    ),
    (
        "  defaultClass: a\n  classes:\n    - {name: a, concurrency: 2}\n"
        "  tenants:\n    - {name: acme, class: gold}\n",
        "10: spec.tenants[0].class: class 'gold' is not defined (a)",
    ),
    (
        "  defaultClass: a\n  classes:\n    - {name: a, concurrency: 2}\n"
        "  tenants:\n    - {name: acme, concurrency: 1}\n    - {name: acme, concurrency: 3}\n",
        "11: spec.tenants[1].name: 'acme' is listed twice",
    ),
    (
        "  defaultClass: a\n  classes:\n    - {name: a}\n",
        "7: spec.classes: no limit and one priority: it would change nothing",
    ),
    (
        "  defaultClass: a\n  classes:\n    - {name: a, rate: {requests: 1, per: 1500ms}}\n",
        "8: spec.classes[0].rate: per must be a whole number of seconds",
    ),
]


@pytest.mark.parametrize(("spec", "expected"), BAD, ids=[b[1].split(",")[-1][:40] for b in BAD])
def test_contradictory_limits_are_file_line_errors(
    tmp_path: Path, spec: str, expected: str
) -> None:
    found = errors(tmp_path, qos_policy(spec))
    assert any(e.startswith(expected) for e in found), found


def test_binding_errors(tmp_path: Path) -> None:
    spec = "  defaultClass: a\n  classes:\n    - {name: a, concurrency: 2}\n"
    unknown = qos_policy(spec).replace("name: edge}", "name: nowhere}")
    assert errors(tmp_path / "1", unknown) == [
        "5: spec.targetRefs[0].name: unknown Gateway default/nowhere"
    ]
    twice = qos_policy(spec) + "---\n" + qos_policy(spec).replace("{name: q}", "{name: r}")
    (found,) = errors(tmp_path / "2", twice)
    assert found.startswith("14: spec.targetRefs[0].name: Gateway default/edge is already bound")
    # No JWT verified at the gateway: a tenant could only come from a header, refused.
    base = "\n---\n".join(
        d for d in GOLDEN_QOS.read_text().split("\n---\n") if "RequestAuthentication" not in d
    )
    (found,) = errors(tmp_path / "3", qos_policy(spec), base)
    assert "Gateway default/edge verifies no JWT" in found and found.startswith("5: ")
    # Two claims on one gateway.
    route = qos_policy(spec + "  tenantClaim: team\n").replace(
        "kind: Gateway, name: edge", "kind: Route, name: batch"
    )
    (found,) = errors(
        tmp_path / "4", qos_policy(spec) + "---\n" + route.replace("{name: q}", "{name: r}")
    )
    assert "the policies of one gateway read one tenant claim" in found


@pytest.fixture(scope="module")
def golden() -> ir.MeshModel:
    return load_policies(GOLDEN_QOS)


def _edge(model: ir.MeshModel) -> dict[str, Any]:
    out = translate(model, "edge.default", host=OFFLINE_HOST)
    assert out is not None
    from google.protobuf import json_format

    return {
        kind: {name: json_format.MessageToDict(m) for name, m in resources.items()}
        for kind, resources in out.items()
    }


def test_the_gateway_reads_the_tenant_only_from_verified_metadata(golden: ir.MeshModel) -> None:
    text = json.dumps(_edge(golden))
    # The client's copy is removed before routing; jwt_authn writes the verified claim.
    assert f'"remove": "{TENANT_HEADER}"' in text
    edge = _edge(golden)
    (manager,) = [
        f["typedConfig"]
        for listener in edge["type.googleapis.com/envoy.config.listener.v3.Listener"].values()
        if "internalListener" not in listener  # where a split gateway traces: no filters
        for chain in listener["filterChains"]
        for f in chain["filters"]
    ]
    (jwt,) = [f for f in manager["httpFilters"] if f["name"] == "envoy.filters.http.jwt_authn"]
    (provider,) = jwt["typedConfig"]["providers"].values()
    assert {"claimName": "org", "headerName": TENANT_HEADER} in provider["claimToHeaders"]
    # Descriptors come from jwt_authn's dynamic metadata, never from a request header.
    assert '"requestHeaders"' not in text and '"headerName": "x-tenant"' not in text
    assert '"metadataKey": {"key": "envoy.filters.http.jwt_authn", "path"' in text
    assert '"source": "ROUTE_ENTRY"' not in text and '"skipIfAbsent": true' in text
    # The default bucket is only for requests without the claim.
    assert '"alwaysConsumeDefaultTokenBucket": false' in text


def test_qos_policy_lowering(golden: ir.MeshModel) -> None:
    (batch, tenants) = golden.qos
    assert tenants.class_named("premium").limits.compute == (
        ir.Budget(1000, "second"),
        ir.Budget(1000000, "month"),
    )
    assert tenants.limits_of("globex") == ("standard", ir.TenantLimits(ir.Bucket(20, 10, 20), 8))
    assert (
        tenants.limits_of("")
        == tenants.limits_of("unlisted")
        == (
            "standard",
            ir.TenantLimits(ir.Bucket(50, 1, 100), 8),
        )
    )
    (iris,) = golden.functions
    assert iris.qos is not None and iris.qos.policy == "default/tenants"
    assert batch.key == "default/batch-jobs"
    assert {s.name: s.load_balancer for s in golden.services} == {
        "jobs": "weighted-round-robin",
        "models": "weighted-round-robin",  # the default for a service serving Functions
    }


# ---------------------------------------------------------------- the backend's admission

QOS = FunctionQoS.model_validate(
    yaml.safe_load(
        """
policy: ns/q
tenantClaim: tenant
defaultClass: standard
classes:
  - {name: premium, priority: 100}
  - {name: standard, priority: 10, concurrency: 3}
  - name: batch
    priority: 0
    compute: [{cpuMs: 5, per: minute}, {cpuMs: 8, per: month}]
tenants:
  - {name: acme, class: premium}
  - {name: initech, class: batch}
"""
    )
)
DEC_31 = datetime(2026, 12, 31, 23, 59, 30, tzinfo=UTC).timestamp()


def admission(limit: int = 16) -> Admission:
    return Admission("iris@1", QOS, limit, Metrics())


def test_shedding_starts_with_the_lowest_priority() -> None:
    a = admission(16)
    assert a.thresholds == {100: 16, 10: 12, 0: 8}
    tickets = [a.admit("initech") for _ in range(8)]
    with pytest.raises(Refusal) as shed:
        a.admit("initech")
    assert shed.value.limit == "shed" and shed.value.status == 429
    body = json.loads(shed.value.body())
    assert body["class"] == "batch" and body["tenant"] == "initech" and body["scope"] == "backend"
    assert dict(shed.value.headers)[b"retry-after"] == b"1"
    tickets += [a.admit("acme") for _ in range(8)]  # premium: the whole limit
    assert a.inflight == 16
    with pytest.raises(Refusal):
        a.admit("acme")
    tickets.pop().done(0)
    a.admit("acme")
    text = a.metrics.registry.get_sample_value(
        "meshfn_qos_requests_total",
        {"function": "iris@1", "tenant": "initech", "tenant_class": "batch", "outcome": "shed"},
    )
    assert text == 1


def test_per_tenant_concurrency_and_the_anonymous_tenant() -> None:
    a = admission()
    held = [a.admit("") for _ in range(3)]  # no claim: the default class, one tenant
    with pytest.raises(Refusal) as limited:
        a.admit("")
    assert limited.value.limit == "concurrency"
    assert json.loads(limited.value.body())["class"] == "standard"
    a.admit("hooli")  # another unlisted tenant: its own count
    held.pop().done(0)
    a.admit("")


def test_compute_budgets_per_calendar_window() -> None:
    a = admission()
    ticket = a.admit("initech", now=DEC_31)
    ticket.done(6_000_000)  # 6 ms of guest CPU: over the per-minute 5 ms
    with pytest.raises(Refusal) as over:
        a.admit("initech", now=DEC_31 + 1)
    assert over.value.limit == "compute"
    headers = dict(over.value.headers)
    assert headers[b"retry-after"] == b"29" and headers[b"x-ratelimit-limit"] == b"5"
    assert json.loads(over.value.body())["window"] == "minute"
    # The next minute is also the next calendar month: both windows start again.
    late = DEC_31 + 31
    a.admit("initech", now=late).done(3_000_000)
    a.admit("initech", now=late + 61).done(3_000_000)
    a.admit("initech", now=late + 122).done(3_000_000)  # 9 ms this month: over its 8 ms
    with pytest.raises(Refusal) as month:
        a.admit("initech", now=late + 183)
    assert json.loads(month.value.body())["window"] == "month"
    # (the refused request found a new minute: that window starts from nothing)
    assert a.snapshot()[0]["budget_used_ms"] == {"minute": 0, "month": 9}
    assert a.metrics.registry.get_sample_value(
        "meshfn_qos_guest_cpu_seconds_total",
        {"function": "iris@1", "tenant": "initech", "tenant_class": "batch"},
    ) == pytest.approx(0.015)


def test_window_bounds() -> None:
    assert window_bounds("minute", 125.5) == (120, 180)
    start, end = window_bounds("month", DEC_31)
    assert datetime.fromtimestamp(start, UTC) == datetime(2026, 12, 1, tzinfo=UTC)
    assert datetime.fromtimestamp(end, UTC) == datetime(2027, 1, 1, tzinfo=UTC)
    start, end = window_bounds("month", datetime(2028, 2, 10, tzinfo=UTC).timestamp())
    assert (end - start) / 86400 == 29  # a leap February


def test_tenant_header_values() -> None:
    assert tenant_of(None) == "" and tenant_of(b"acme") == "acme"
    assert tenant_of(b"ac\x01me") == "" and tenant_of("x" * 129) == ""


def test_orca_report() -> None:
    assert orca_text(3, 2, 40) == (
        "TEXT application_utilization=1.500, cpu_utilization=1.000, rps_fractional=40.0, "
        "named_metrics.inflight=3"
    )
    load = Load(2)
    load.header(1, now=10.0)
    name, value = load.header(1, now=10.5)
    assert name == b"endpoint-load-metrics" and b"rps_fractional=2.0" in value
    assert b"rps_fractional=1.0" in load.header(0, now=12.0)[1]


def test_backend_sidecars_must_verify_the_tenant(tmp_path: Path) -> None:
    """Where sidecars front a backend with QoS, they must verify the JWT too: they rewrite the
    tenant header the backend reads."""
    for path in (ROOT / "policies" / "examples").glob("*.yaml"):
        text = path.read_text()
        if path.name == "security.yaml":
            text = "\n---\n".join(d for d in text.split("\n---\n") if "local-issuer" not in d)
        (tmp_path / path.name).write_text(text)
    (tmp_path / "zz-qos.yaml").write_text((ROOT / "policies" / "qos" / "tenants.yaml").read_text())
    with pytest.raises(PolicyErrors) as caught:
        load_policies(tmp_path)
    found = [str(e).split("zz-qos.yaml:", 1)[-1] for e in caught.value.errors]
    # one per example Function: iris, embedder, digits, cancer, digits-cnn, tiny-lm
    assert len(found) == 6 and all(
        e.startswith("19: spec.targetRefs: the backend of Function default/")
        and "sidecars of Service default/models verify no JWT" in e
        for e in found
    ), found
