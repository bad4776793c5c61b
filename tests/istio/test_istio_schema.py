"""meshfn.istio.schema: every rendered object is refused or accepted exactly as Istio 1.31's CRDs
(vendored in istio/crds/, package data of meshfn.istio) say, with an apiserver's structural-schema
semantics and pruning turned into errors; the CRDs are read once per process."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from meshfn.istio import SchemaError, schema
from meshfn.istio.schema import validate
from meshfn.istio.structural import problems
from meshfn.testing.istio_cases import CASES, CRDS, rendering

Obj = dict[str, Any]


def first(case: str, kind: str) -> Obj:
    return copy.deepcopy(rendering(case).objects[kind][0])


def refusal(obj: Obj) -> str:
    with pytest.raises(SchemaError) as caught:
        validate(obj)
    message = str(caught.value)
    assert message.endswith("(schema: Istio 1.31 CRDs)"), message
    return message


def destination_rule() -> Obj:
    return first("basic", "DestinationRule")


# ---------------------------------------------------------------- what the CRDs refuse


def test_an_unknown_field_is_refused_with_its_path() -> None:
    """An apiserver would prune it silently: refused, with the field it was likely meant to be."""
    obj = destination_rule()
    obj["spec"]["trafficPolicy"]["connectionPool"]["tcp"]["maxConnectionz"] = 3
    assert refusal(obj).startswith(
        "DestinationRule default/echo: spec.trafficPolicy.connectionPool.tcp.maxConnectionz: "
        "unknown field (did you mean 'maxConnections'?)"
    )
    obj = destination_rule()
    obj["spec"]["trafficPolicyy"] = {}
    assert "DestinationRule default/echo: spec.trafficPolicyy: unknown field" in refusal(obj)
    obj = destination_rule()
    obj["specs"] = obj.pop("spec")
    assert "DestinationRule default/echo: specs: unknown field (did you mean 'spec'?)" in (
        refusal(obj)
    )


def test_metadata_is_checked_as_the_apiserver_keeps_it() -> None:
    """The CRDs leave metadata to the apiserver, which keeps only ObjectMeta's fields."""
    obj = destination_rule()
    obj["metadata"]["labelz"] = {"a": "b"}
    assert "metadata.labelz: unknown field (did you mean 'labels'?)" in refusal(obj)
    obj = destination_rule()
    obj["metadata"]["labels"]["replicas"] = 3
    assert "metadata.labels.replicas: must be of type string, got integer" in refusal(obj)
    obj = destination_rule()
    obj["metadata"]["annotations"] = {"meshfn.io/source": "policies/a.yaml"}
    obj["metadata"]["creationTimestamp"] = None
    validate(obj)


def test_a_wrong_type_is_refused() -> None:
    obj = destination_rule()
    tcp = obj["spec"]["trafficPolicy"]["connectionPool"]["tcp"]
    tcp["maxConnections"] = "3"
    assert (
        "spec.trafficPolicy.connectionPool.tcp.maxConnections: must be of type integer, got string"
        in refusal(obj)
    )
    tcp["maxConnections"] = True  # a boolean is never a number
    assert "must be of type integer, got boolean" in refusal(obj)
    tcp["maxConnections"] = 3.0  # a whole number is an integer to the apiserver's JSON decoding
    validate(obj)
    tcp["maxConnections"] = 3.5
    assert "must be of type integer, got number" in refusal(obj)


def test_a_value_outside_an_enum_is_refused() -> None:
    obj = first("basic", "PeerAuthentication")
    obj["spec"]["mtls"]["mode"] = "SOMETIMES"
    assert (
        "PeerAuthentication istio-system/meshfn-golden: spec.mtls.mode: unsupported value "
        '"SOMETIMES": supported values: "UNSET", "DISABLE", "PERMISSIVE", "STRICT"'
    ) in refusal(obj)


def test_required_fields_bounds_and_nulls() -> None:
    obj = destination_rule()
    del obj["spec"]["host"]
    assert "spec.host: required field is missing" in refusal(obj)
    obj = destination_rule()
    obj["spec"]["host"] = None  # not nullable: an apiserver would drop it
    assert "spec.host: must not be null" in refusal(obj)
    obj = destination_rule()
    obj["spec"]["trafficPolicy"]["outlierDetection"] = {"consecutive5xxErrors": None}
    validate(obj)  # nullable in the CRD
    obj["spec"]["trafficPolicy"]["outlierDetection"] = {"consecutive5xxErrors": -1}
    assert "consecutive5xxErrors: must be greater than or equal to 0, got -1" in refusal(obj)


def test_a_newer_field_is_checked_as_the_crds_say() -> None:
    """DestinationRule trafficPolicy.retryBudget (Istio 1.27): in the 1.31 CRDs, so accepted as
    they define it and refused where they refuse it."""
    obj = destination_rule()
    policy = obj["spec"]["trafficPolicy"]
    policy["retryBudget"] = {"percent": 20.5, "minRetryConcurrency": 2, "budgetInterval": "10s"}
    validate(obj)
    policy["retryBudget"] = {"percent": None}  # nullable
    validate(obj)
    policy["retryBudget"] = {"percent": 120}
    assert "spec.trafficPolicy.retryBudget.percent: must be less than or equal to 100, got 120" in (
        refusal(obj)
    )
    policy["retryBudget"] = {"minRetryConcurrency": 4294967296}
    assert "retryBudget.minRetryConcurrency: must be less than or equal to 4294967295" in (
        refusal(obj)
    )
    policy["retryBudget"] = {"percentage": 20}
    assert "retryBudget.percentage: unknown field (did you mean 'percent'?)" in refusal(obj)


def test_a_protobuf_oneof_names_its_fields() -> None:
    obj = destination_rule()
    obj["spec"]["trafficPolicy"]["loadBalancer"] = {
        "simple": "ROUND_ROBIN",
        "consistentHash": {"useSourceIp": True},
    }
    assert (
        "spec.trafficPolicy.loadBalancer: may set only one of simple, consistentHash, "
        "backendUtilization; sets simple, consistentHash"
    ) in refusal(obj)


def test_preserved_unknown_fields_are_kept() -> None:
    """x-kubernetes-preserve-unknown-fields: an EnvoyFilter patch's value and a WasmPlugin's
    pluginConfig are free-form."""
    obj = first("fallback", "EnvoyFilter")
    obj["spec"]["configPatches"][0]["patch"]["value"]["anything"] = {"at": ["all", 1, None]}
    validate(obj)
    obj["spec"]["configPatches"][0]["patch"]["valu"] = {}
    assert "spec.configPatches.0.patch.valu: unknown field (did you mean 'value'?)" in refusal(obj)
    obj = first("audit", "WasmPlugin")
    obj["spec"]["pluginConfig"]["nested"] = {"free": True}
    validate(obj)
    obj = destination_rule()
    obj["status"] = {"observedGeneration": "1", "phase": "x"}  # istiod's own, free-form
    validate(obj)


def test_list_map_keys_are_unique() -> None:
    """x-kubernetes-list-type: map (a ServiceEntry's ports by name): an apiserver refuses two
    items with one key."""
    obj = first("external", "ServiceEntry")
    obj["spec"]["ports"].append({**obj["spec"]["ports"][0], "number": 9})
    assert "spec.ports: duplicate value" in refusal(obj)


def test_string_formats_as_kubernetes_reads_them() -> None:
    obj = first("basic", "VirtualService")
    obj["spec"]["http"][0] = {"directResponse": {"status": 200, "body": {"bytes": "aGk="}}}
    validate(obj)
    obj["spec"]["http"][0]["directResponse"]["body"]["bytes"] = "not base64!"
    assert "spec.http.0.directResponse.body.bytes: must be a byte string" in refusal(obj)


def test_kind_and_api_version_must_be_served() -> None:
    obj = destination_rule()
    obj["apiVersion"] = "networking.istio.io/v1alpha3"  # served, not stored: accepted
    validate(obj)
    obj["apiVersion"] = "networking.istio.io/v2"
    assert "apiVersion: DestinationRule is not served as 'networking.istio.io/v2'" in refusal(obj)
    obj["kind"] = "DestinationRules"
    assert "kind: not a kind Istio's CRDs define: 'DestinationRules'" in refusal(obj)


@pytest.mark.parametrize(
    ("node", "value", "problem"),
    [
        ({"x-kubernetes-int-or-string": True}, 3, None),
        ({"x-kubernetes-int-or-string": True}, "50%", None),
        ({"x-kubernetes-int-or-string": True}, 3.5, "must be an integer or a string, got number"),
        ({"x-kubernetes-int-or-string": True}, True, "must be an integer or a string, got boolean"),
        ({"type": "integer", "format": "int32"}, 2**40, None),  # no range from a numeric format
        ({"type": "string", "format": "date-time"}, "2026-01-02T03:04:05Z", None),
        ({"type": "string", "format": "date-time"}, "yesterday", "must be a date-time string"),
        ({"type": "string", "format": "not-a-format"}, "anything", None),  # ignored, as there
        ({"type": "string", "pattern": "^[a-z]+$"}, "abc", None),
        ({"type": "string", "pattern": "[0-9]"}, "a1b", None),  # unanchored, as Go's regexp
        ({"type": "string", "pattern": "^[a-z]+$"}, "ABC", "must match the pattern"),
        ({"type": "string", "maxLength": 3}, "abcd", "must have at most 3 characters, has 4"),
        ({"type": "array", "items": {"type": "string"}, "maxItems": 1}, ["a", "b"], "at most 1"),
        ({"type": "array", "items": {}, "x-kubernetes-list-type": "set"}, [1, 1], "duplicate"),
        ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, 0, "must be greater than 0"),
        ({"type": "object"}, {"a": 1}, "unknown field"),  # no properties: everything is pruned
        ({"type": "object", "x-kubernetes-preserve-unknown-fields": True}, {"a": 1}, None),
        ({"type": "object", "additionalProperties": {"type": "integer"}}, {"a": "1"}, "integer"),
    ],
)
def test_structural_semantics(node: dict[str, Any], value: Any, problem: str | None) -> None:
    found = [p for _, p in problems(node, value)]
    if problem is None:
        assert found == []
    else:
        assert found and problem in found[0], found


def test_every_golden_object_validates() -> None:
    """(Rendering validates too: a refusal would fail every golden test first.)"""
    count = 0
    for case in CASES:
        for objects in rendering(case).objects.values():
            for obj in objects:
                validate(obj)
                count += 1
    assert count > 200


# ---------------------------------------------------------------- where the schemas come from


def test_the_renderer_reads_the_vendored_crds_as_package_data() -> None:
    """One copy: the file the tests read is the renderer's, shipped as package data with its
    licence."""
    assert schema.CRDS.read_bytes() == CRDS.read_bytes()
    assert (schema.CRDS_DIR / "LICENSE").is_file()
    assert (schema.CRDS_DIR / "README.md").is_file()
    assert "Istio 1.31" in CRDS.with_name("README.md").read_text()


def test_the_index_keeps_every_served_version_without_prose() -> None:
    index = schema.index()
    assert set(index["DestinationRule"]) == {
        "networking.istio.io/v1",
        "networking.istio.io/v1alpha3",
        "networking.istio.io/v1beta1",
    }
    for kind in ("PeerAuthentication", "EnvoyFilter", "WasmPlugin", "Telemetry", "WorkloadEntry"):
        assert kind in index

    def keys(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                yield from keys(value)
        elif isinstance(node, list):
            for value in node:
                yield from keys(value)

    found = set(keys(index["VirtualService"]["networking.istio.io/v1"]))
    # "description" may name a field (a property), never a schema's prose: none has one here
    assert "x-kubernetes-validations" not in found and "description" not in found


def test_the_index_is_built_once_per_process_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Parsed once (cached in the process); the renderer writes no file, not even a cache."""
    monkeypatch.setenv("MESHFN_CACHE", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    schema.index.cache_clear()
    built = schema.index()
    calls = []
    monkeypatch.setattr(schema, "build_index", lambda text: calls.append(text) or {})
    assert schema.index() is built and calls == []
    validate(destination_rule())
    assert list(tmp_path.iterdir()) == []
    schema.index.cache_clear()


def test_importing_the_renderer_reads_no_crds() -> None:
    """Lazily: only the first validation reads them."""
    code = (
        "import meshfn.istio\n"
        "from meshfn.istio import schema\n"
        "assert schema.index.cache_info().currsize == 0\n"
        "assert 'jsonschema' not in __import__('sys').modules\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
