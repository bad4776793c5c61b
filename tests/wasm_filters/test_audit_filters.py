"""The Envoy config builders: the plugin JSON the Python models emit is exactly what the C
filters accept (checked with the native build), invalid settings are refused in Python too,
and Envoy itself validates the generated config."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from pydantic import ValidationError
from rich.console import Console

from meshfn import wasm_filters as build
from meshfn.common.progress import RichReporter
from meshfn.contracts import plugins
from meshfn.contracts.plugins import AuditSettings, BodyHash, DegradeRule, DegradeSettings, Trigger
from meshfn.testing import filters as built
from meshfn.testing.envoy import validate
from meshfn.testing.filters import harness
from meshfn.xds.fragments import plugins as plugin_fragments
from meshfn.xds.translate import wasm

ROOT = Path(__file__).resolve().parents[2]


def host(kind: str) -> Any:
    module = harness("fakehost")
    return module.FakeHost(built.wasm_dir(native=True) / f"{kind}_native.so")


AUDITS = [
    AuditSettings(subject_salt="00" * 16),
    AuditSettings(subject_salt="12" * 20, subject_source="jwt_headers", sub_header="x-s"),
    AuditSettings(
        subject_salt="ff" * 64,
        salt_id="2026-q1",
        subject_source="header",
        token_header="x-token",
        tenant_claim="",
        body_hash=BodyHash(enabled=True, max_bytes=1 << 30),
    ),
]
DEGRADES = [
    DegradeSettings(rules=[]),
    DegradeSettings(
        routing_header="x-route",
        trigger=Trigger(header="x-drill", principals=["spiffe://a/b", "spiffe://c/d"]),
        rules=[
            DegradeRule(
                name="r1", routes=["a", "b"], mode="reroute", fallbacks=["f1", "f2"], depth=2
            ),
            DegradeRule(name="r2", clusters=["c"], mode="reject", depth=1),
            DegradeRule(name="r3", routes=["z"], clusters=["y"], mode="reject"),
        ],
    ),
]


COMBINED = [
    plugins.MeshfnSettings(audit=AUDITS[1], degrade=DEGRADES[1]),
    plugins.MeshfnSettings(degrade=DEGRADES[0]),
]


@pytest.mark.parametrize("settings", AUDITS + DEGRADES + COMBINED)
def test_python_settings_are_accepted_by_the_filter(
    settings: AuditSettings | DegradeSettings | plugins.MeshfnSettings,
) -> None:
    kinds = {AuditSettings: "audit", DegradeSettings: "degrade", plugins.MeshfnSettings: "meshfn"}
    kind = kinds[type(settings)]
    h = host(kind)
    root, ok = h.configure(plugins.plugin_json(settings).encode())
    assert ok, h.logs()
    h.delete(root)


@pytest.mark.parametrize(
    ("model", "data"),
    [
        (AuditSettings, {}),
        (AuditSettings, {"subject_salt": "00" * 8}),
        (AuditSettings, {"subject_salt": "00" * 16, "token_header": "Authorization"}),
        (AuditSettings, {"subject_salt": "00" * 16, "extra": 1}),
        (DegradeSettings, {"rules": [{"name": "x", "routes": ["r"], "mode": "reroute"}]}),
        (
            DegradeSettings,
            {"rules": [{"name": "x", "routes": ["r"], "mode": "reject", "fallbacks": ["f"]}]},
        ),
        (DegradeSettings, {"rules": [{"name": "x", "mode": "reject"}]}),
        (DegradeSettings, {"rules": [{"name": "a,b", "routes": ["r"], "mode": "reject"}]}),
        (DegradeSettings, {"rules": [], "trigger": {"principals": []}}),
        (
            DegradeSettings,
            {"rules": [], "trigger": {"principals": ["p"], "header": "x-meshfn-degrade-route"}},
        ),
        (plugins.MeshfnSettings, {}),
    ],
)
def test_invalid_settings_are_refused_in_python(model: type[Any], data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(data)


def test_salt_is_not_in_repr() -> None:
    assert "00000000" not in repr(AuditSettings(subject_salt="00" * 16))


def envoy_validate(tmp_path: Path, http_filters: list[Any], **listener: Any) -> str:
    """`envoy --mode validate` on one listener with these filters (it runs each plugin's
    configure); returns Envoy's output when it refuses the configuration, "" when it accepts."""
    es = harness("envoy_static")
    config = tmp_path / "envoy.json"
    built = es.listener(
        10000, [es.to_dict(f) for f in http_filters], [es.route("r", "backend")], **listener
    )
    config.write_text(json.dumps(es.bootstrap(9901, {"backend": 8080}, built)))
    done = validate(config)
    return "" if done.returncode == 0 else done.stdout[-3000:] + done.stderr[-3000:]


def test_envoy_validates_the_generated_config(tmp_path: Path) -> None:
    es = harness("envoy_static")
    degrade = DEGRADES[1]
    refused = envoy_validate(
        tmp_path,
        [
            built.audit_filter(AUDITS[1]),
            built.audit_filter(AUDITS[2]),  # body hashing: the full build
            built.degrade_filter(degrade),
            built.meshfn_filter(AUDITS[0], degrade),
            built.meshfn_filter(AUDITS[2], degrade),
        ],
        access_logs=[
            es.to_dict(wasm.access_log(tmp_path / f"journal-{i}.jsonl", settings))
            for i, settings in enumerate(AUDITS)
        ],
        early=[es.to_dict(wasm.early_header_mutation(degrade, AUDITS[1]))],
    )
    assert not refused, refused


def _plugin(entry: Any) -> dict[str, Any]:
    plugin: dict[str, Any] = json_format.MessageToDict(entry, preserving_proto_field_name=True)[
        "typed_config"
    ]["config"]
    return plugin


def test_filter_entries_are_fail_closed_wasm_filters() -> None:
    entry = json_format.MessageToDict(
        built.audit_filter(AUDITS[0]), preserving_proto_field_name=True
    )
    config = entry["typed_config"]["config"]
    assert entry["name"] == "meshfn.meshfn_audit"
    assert config["failure_policy"] == "FAIL_CLOSED"
    assert config["vm_config"]["runtime"] == "envoy.wasm.runtime.v8"
    assert config["vm_config"]["code"]["local"]["filename"].endswith("/audit-lean.wasm")
    assert json.loads(config["configuration"]["value"])["subject_salt"] == "00" * 16
    log = json_format.MessageToDict(
        wasm.access_log(Path("/j"), AUDITS[0]), preserving_proto_field_name=True
    )
    assert (
        log["typed_config"]["log_format"]["json_format"]["audit"]
        == "%FILTER_STATE(wasm.meshfn_audit:PLAIN)%"
    )


def test_lean_build_unless_body_hashing_with_a_vm_per_configuration() -> None:
    """The lean build serves one configuration per VM: its vm_id names the configuration, so
    Envoy shares a VM only between identical configurations; body hashing needs the full
    build, which keeps per-request contexts and one shared VM."""
    lean = [_plugin(built.audit_filter(a)) for a in AUDITS[:2]]
    for plugin in lean:
        assert plugin["vm_config"]["code"]["local"]["filename"].endswith("/audit-lean.wasm")
        assert plugin["vm_config"]["vm_id"].startswith("meshfn_audit.")
    assert lean[0]["vm_config"]["vm_id"] != lean[1]["vm_config"]["vm_id"]
    again = _plugin(built.audit_filter(AUDITS[0].model_copy()))
    assert again["vm_config"]["vm_id"] == lean[0]["vm_config"]["vm_id"]
    full = _plugin(built.audit_filter(AUDITS[2]))
    assert full["vm_config"]["code"]["local"]["filename"].endswith("/audit.wasm")
    assert full["vm_config"]["vm_id"] == "meshfn_audit"
    combined = _plugin(built.meshfn_filter(AUDITS[2], DEGRADES[1]))
    assert combined["vm_config"]["code"]["local"]["filename"].endswith("/meshfn.wasm")
    for degrade in DEGRADES:
        plugin = _plugin(built.degrade_filter(degrade))
        assert plugin["vm_config"]["code"]["local"]["filename"].endswith("/degrade-lean.wasm")
    assert plugins.needs_full_build(plugins.MeshfnSettings(audit=AUDITS[2]))
    assert not plugins.needs_full_build(
        plugins.MeshfnSettings(audit=AUDITS[0], degrade=DEGRADES[0])
    )


def test_access_log_writes_what_a_bare_filter_state_leaves_out() -> None:
    """jwt_headers mode without body hashing: the filter publishes only the subject; the access
    log adds the record version, salt_id, subject_source and the verified tenant."""
    route = plugin_fragments.mesh_route_fields(())
    for settings in (AUDITS[0], AUDITS[2]):
        assert not plugins.bare_filter_state(settings)
        assert (
            plugin_fragments.access_log_format(settings)
            == plugin_fragments.ACCESS_LOG_FORMAT | route
        )
    bare = AuditSettings(
        subject_salt="12" * 20, subject_source="jwt_headers", salt_id="k%1", tenant_claim="org"
    )
    assert plugins.bare_filter_state(bare) and plugins.bare_filter_state(AUDITS[1])
    fields = plugin_fragments.access_log_format(bare)
    assert {
        k: v for k, v in fields.items() if k not in plugin_fragments.ACCESS_LOG_FORMAT | route
    } == {
        "audit_v": "1",
        "salt_id": "k%%1",  # a literal % in an Envoy format string
        "subject_source": "jwt_headers",
        "tenant": "%DYNAMIC_METADATA(envoy.filters.http.jwt_authn:jwt_payload:org)%",
    }
    no_tenant = bare.model_copy(update={"tenant_claim": ""})
    assert "tenant" not in plugin_fragments.access_log_format(no_tenant)
    hashing = bare.model_copy(update={"body_hash": BodyHash(enabled=True)})
    assert plugin_fragments.access_log_format(hashing) == plugin_fragments.ACCESS_LOG_FORMAT | route


def test_access_log_names_the_mesh_route() -> None:
    """A gateway from its own route metadata; a sidecar copies the gateway's header and the
    gateway identities it may believe (record.mesh_route decides)."""
    assert plugin_fragments.mesh_route_fields(None) == {
        "mesh_route": "%METADATA(ROUTE:meshfn:route)%",
        "mesh_route_by": "proxy",
    }
    assert plugin_fragments.mesh_route_fields(
        ("spiffe://td/ns/i/sa/edge", "spiffe://td/ns/i/sa/b")
    ) == {
        "mesh_route": "%REQ(X-MESHFN-ROUTE):256%",
        "mesh_route_from": "spiffe://td/ns/i/sa/edge spiffe://td/ns/i/sa/b",
    }


@pytest.mark.parametrize("field", ["tenant_claim", "jwt_metadata_key"])
@pytest.mark.parametrize("value", ["a:b", "a)b", "a(b", "a%b"])
def test_bare_state_needs_metadata_path_safe_names(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match="dynamic metadata"):
        AuditSettings(subject_salt="12" * 20, subject_source="jwt_headers", **{field: value})
    # fine where the filter publishes the tenant itself
    AuditSettings(subject_salt="12" * 20, subject_source="header", **{field: value})
    AuditSettings(
        subject_salt="12" * 20,
        subject_source="jwt_headers",
        body_hash=BodyHash(enabled=True),
        **{field: value},
    )


def test_schema_files_are_current(tmp_path: Path) -> None:
    """Regenerate with: python -P -c 'from pathlib import Path; from meshfn.contracts import
    plugins; plugins.write_schemas(Path("wasm_filters/schema"))'"""
    for fresh in plugins.write_schemas(tmp_path):
        committed = ROOT / "wasm_filters" / "schema" / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale"


def test_schemas_cover_both_filters() -> None:
    schemas = plugins.schemas()
    assert set(schemas["audit"]["properties"]) == set(AuditSettings.model_fields)
    assert set(schemas["degrade"]["properties"]) == {
        "routing_header",
        "listener_strips_routing_header",
        "trigger",
        "rules",
    }
    assert set(schemas["meshfn"]["properties"]) == {"audit", "degrade", "route"}


def test_prebuilt_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MESHFN_WASM_DIR", str(tmp_path))
    with pytest.raises(build.BuildError, match=r"has no audit\.wasm"):
        build.build()
    with pytest.raises(build.BuildError, match=r"has no audit\.wasm"):
        build.locate()
    monkeypatch.delenv("MESHFN_WASM_DIR")
    assert (build.build() / "audit.wasm").is_file()


def test_internal_headers_and_claim_headers() -> None:
    fast = AuditSettings(subject_salt="00" * 16, subject_source="jwt_headers")
    assert plugins.internal_headers(DEGRADES[1], fast) == [
        "x-route",
        "x-meshfn-jwt-sub",
        "x-meshfn-jwt-tenant",
    ]
    assert plugins.internal_headers(None, AUDITS[0]) == []
    with pytest.raises(ValueError, match="needs degrade settings"):
        wasm.early_header_mutation(None, AUDITS[0])
    hashing = fast.model_copy(update={"body_hash": BodyHash(enabled=True)})
    claims = [(c.header_name, c.claim_name) for c in wasm.jwt_claim_headers(hashing)]
    assert claims == [("x-meshfn-jwt-sub", "sub"), ("x-meshfn-jwt-tenant", "tenant")]
    # bare filter state: the access log takes the tenant from jwt_authn's metadata instead
    claims = [(c.header_name, c.claim_name) for c in wasm.jwt_claim_headers(fast)]
    assert claims == [("x-meshfn-jwt-sub", "sub")]
    no_tenant = AuditSettings(subject_salt="00" * 16, subject_source="jwt_headers", tenant_claim="")
    assert len(wasm.jwt_claim_headers(no_tenant)) == 1


def test_filter_build_reports_each_module() -> None:
    """`./dev.sh setup` built every module: each is reported from the cache by name."""
    from meshfn.contracts.plugins import BUILDS

    out = io.StringIO()
    with RichReporter(Console(file=out, width=300), "proxy-wasm filters") as progress:
        build.build(progress=progress)  # built by ./dev.sh setup: every module from the cache
    line = out.getvalue().strip()
    assert line.startswith(f"proxy-wasm filters: all {len(BUILDS)} cached ("), line
    assert all(f"{name}.wasm" in line for name in BUILDS)
