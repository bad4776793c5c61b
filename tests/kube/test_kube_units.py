"""Kubernetes mode without a cluster: CRDs from the models, the CR source's compile path and
verdicts, the applier's comparisons, owner references, the backends' manifests, the operator's
configuration, kubeconfigs, and the Helm chart (real `helm`, kubernetes-validate)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import psycopg
import pytest
import yaml
from typer.testing import CliRunner

from meshfn.audit import open_store, signing
from meshfn.audit.cli import audit_app
from meshfn.common.kube.api import KubeClient, KubeConfig
from meshfn.contracts.function import BackendConfig
from meshfn.contracts.kube import ANNOTATION_HASH, KINDS
from meshfn.contracts.plugins import BUILDS
from meshfn.istio import render
from meshfn.istio.options import RenderOptions
from meshfn.kube.apply import digest, mismatch
from meshfn.kube.controller import MANAGED, OperatorConfig, with_owners
from meshfn.kube.workloads import BackendSettings, Rendered, render_backends
from meshfn.policy import PolicyErrors, crds, load_policies
from meshfn.policy.kube_source import KubePolicySource, ObjectKey, compile_objects
from meshfn.policy.model import KINDS as MODELS
from meshfn.testing.postgres import PostgresServer

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "policies" / "examples"


def valid(obj: dict[str, Any]) -> None:
    """Kubernetes' own schemas, offline; strict: unknown fields are errors."""
    try:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{obj['kind']} {obj['metadata']['name']}: {exc}") from None


def examples_as_objects() -> dict[ObjectKey, dict[str, Any]]:
    """The example policies as the apiserver would return them (uid, generation, status)."""
    out = {}
    for i, path in enumerate(sorted(EXAMPLES.glob("*.yaml"))):
        for j, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d):
            doc["metadata"].update(uid=f"uid-{i}-{j}", generation=1, resourceVersion="7")
            doc["status"] = {"conditions": []}
            out[ObjectKey.of(doc)] = doc
    return out


# ---------------------------------------------------------------- CRDs


def test_crds_are_generated_from_the_models_and_current() -> None:
    files = crds.rendered()
    on_disk = {p.name: p.read_text() for p in (REPO / "manifests" / "crds").glob("*.yaml")}
    assert on_disk == files, "manifests/crds is stale: run `meshfn kube crds`"
    assert {k.kind for k in KINDS} == set(MODELS)


def _walk(node: Any, path: str = "") -> list[str]:
    """Nodes that break the structural-schema rules Kubernetes enforces."""
    bad = []
    if isinstance(node, dict):
        for forbidden in ("$ref", "anyOf", "oneOf", "patternProperties", "definitions", "$defs"):
            if forbidden in node:
                bad.append(f"{path}: {forbidden}")
        if "type" not in node and "x-kubernetes-int-or-string" not in node:
            bad.append(f"{path}: no type")
        if node.get("additionalProperties") is False:
            bad.append(f"{path}: additionalProperties: false")
        for name, sub in (node.get("properties") or {}).items():
            bad += _walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            bad += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            bad += _walk(node["additionalProperties"], f"{path}{{}}")
    return bad


@pytest.mark.parametrize("info", KINDS, ids=lambda k: k.kind)
def test_crd_schemas_are_structural_and_accept_the_examples(info: Any) -> None:
    crd = crds.crd(info)
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    assert version["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["categories"] == ["meshfn"]
    assert crd["spec"]["scope"] == info.scope
    # OpenAPI v3.0 is draft-4 JSON Schema (boolean exclusiveMinimum) plus `nullable`.
    validator = jsonschema.Draft4Validator(schema)
    for obj in examples_as_objects().values():
        if obj["kind"] == info.kind:
            assert list(validator.iter_errors(obj)) == []


def test_crd_schema_refuses_wrong_types_and_keeps_unknown_fields() -> None:
    schema = crds.object_schema("Service")
    validator = jsonschema.Draft4Validator(schema)
    bad = {"spec": {"port": "eighty", "protocol": "ftp"}}
    paths = sorted(".".join(map(str, e.path)) for e in validator.iter_errors(bad))
    assert paths == ["spec.port", "spec.protocol"]
    assert schema["properties"]["spec"]["x-kubernetes-preserve-unknown-fields"] is True
    threshold = crds.object_schema("FallbackPolicy")["properties"]["spec"]["properties"][
        "driftBreaker"
    ]["properties"]["threshold"]
    assert (threshold["minimum"], threshold["exclusiveMinimum"]) == (0, True)
    assert "Default: 40.0." in threshold["description"]


def test_meshfn_kube_crds_writes_the_same_files(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "meshfn"), "kube", "crds", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == crds.rendered()


# ---------------------------------------------------------------- the source


def test_custom_resources_compile_to_the_same_model_as_the_files() -> None:
    assert compile_objects(examples_as_objects()) == load_policies(EXAMPLES)


def source() -> KubePolicySource:
    return KubePolicySource(KubeClient(KubeConfig(server="https://127.0.0.1:1")))


def test_verdicts_name_the_field_and_keep_the_config_in_force() -> None:
    src = source()
    objects = examples_as_objects()
    first = src.build(objects)
    assert first.fresh and first.model is not None
    assert {v.state for v in first.verdicts.values()} == {"Accepted"}
    route = ObjectKey("Route", "default", "echo")
    broken = {k: json.loads(json.dumps(o)) for k, o in objects.items()}
    broken_route = broken[route]
    broken_route["spec"]["destination"]["service"] = "nope"
    broken_route["metadata"]["generation"] = 2
    new = {"apiVersion": "meshfn.io/v1alpha1", "kind": "Route"}
    new["metadata"] = {"name": "later", "namespace": "default", "uid": "u", "generation": 1}
    new["spec"] = {"gateway": "ingress/edge", "destination": {"service": "echo"}}
    new["spec"]["matches"] = [{"path": {"prefix": "/later"}}]
    broken[ObjectKey.of(new)] = new
    second = src.build({ObjectKey.of(o): o for o in broken.values()})
    assert not second.fresh and second.model == first.model  # the last good model stays
    verdict = second.verdicts[route]
    assert verdict.state == "Invalid" and verdict.generation == 2
    assert verdict.messages == (
        "spec.destination.service: unknown Service default/nope (did you mean default/models?)",
    )
    assert second.verdicts[ObjectKey("Route", "default", "later")].state == "Blocked"
    assert second.verdicts[ObjectKey("Service", "default", "models")].state == "Accepted"
    # The message is the one `meshfn validate` prints after `file:line:`.
    errors = [str(e) for e in second.errors]
    assert errors == [f"Route default/echo: {verdict.messages[0]}"]


def test_a_cluster_without_a_mesh_says_so() -> None:
    objects = {k: o for k, o in examples_as_objects().items() if k.kind != "Mesh"}
    with pytest.raises(PolicyErrors, match="no Mesh found"):
        compile_objects(objects)


# ---------------------------------------------------------------- delivery


def test_mismatch_ignores_omitted_zero_values_and_extra_fields() -> None:
    want = {"spec": {"readOnly": False, "ports": [{"port": 80}], "env": []}, "x": 1}
    live = {"spec": {"ports": [{"port": 80, "protocol": "TCP"}], "extra": True}, "x": 1}
    assert mismatch(live, want) is None
    assert mismatch({**live, "x": 2}, want) == ".x"
    assert mismatch({"spec": {"ports": []}, "x": 1}, want) == ".spec.ports"


def test_digest_ignores_its_own_annotation() -> None:
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "annotations": {}}}
    stamped = json.loads(json.dumps(obj))
    stamped["metadata"]["annotations"][ANNOTATION_HASH] = "whatever"
    assert digest(obj) == digest(stamped)
    assert digest(obj) != digest({**obj, "data": {"k": "v"}})


def test_owners_are_same_namespace_sources_or_the_mesh() -> None:
    objects = examples_as_objects()
    obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "x", "namespace": "default"},
    }
    owned, source = with_owners(
        Rendered((("Mesh", "", "demo"), ("Service", "default", "models")), obj), objects
    )
    refs = owned["metadata"]["ownerReferences"]
    assert [(r["kind"], r["controller"]) for r in refs] == [("Mesh", True), ("Service", False)]
    assert source == "Service default/models"
    # A source in another namespace cannot own it (the GC would delete it): the Mesh does.
    elsewhere = {**obj, "metadata": {"name": "x", "namespace": "other"}}
    owned, _ = with_owners(Rendered((("Service", "default", "models"),), elsewhere), objects)
    assert [r["kind"] for r in owned["metadata"]["ownerReferences"]] == ["Mesh"]


def test_the_chart_lets_the_operator_manage_every_kind_it_renders() -> None:
    rules = [r for d in chart() if d["kind"] == "ClusterRole" for r in d["rules"]]
    for res in MANAGED:
        verbs = {
            v
            for r in rules
            if res.group in r["apiGroups"] and res.plural in r["resources"]
            for v in r["verbs"]
        }
        assert verbs == {"list", "create", "patch", "delete"}, res


# ---------------------------------------------------------------- functions


def test_backends_are_rendered_from_the_function_schema() -> None:
    model = load_policies(EXAMPLES)
    rendered = render_backends(model, BackendSettings(), keda=False, hpa_version="v2")
    kinds = sorted(r.obj["kind"] for r in rendered)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "Service",
        "ServiceAccount",
    ]
    config_map = next(r.obj for r in rendered if r.obj["kind"] == "ConfigMap")
    config = BackendConfig.model_validate(yaml.safe_load(config_map["data"]["backend.yaml"]))
    by_name = {f.name: f for f in config.functions or []}
    for function in model.functions:
        served = by_name[function.name]
        assert {k: getattr(served, k) for k in type(function.settings).model_fields} == dict(
            function.settings
        )
    from meshfn.inference.config import parse_config

    assert parse_config(yaml.safe_load(config_map["data"]["backend.yaml"]), "cm").processes == 1
    many = render_backends(model, BackendSettings(processes=3, workers=1), keda=False)
    config_map = next(r.obj for r in many if r.obj["kind"] == "ConfigMap")
    config = parse_config(yaml.safe_load(config_map["data"]["backend.yaml"]), "configmap")
    assert (config.processes, config.workers) == (3, 1)  # Helm values backends.processes
    for item in rendered:
        valid(item.obj)
    pod = next(r.obj for r in rendered if r.obj["kind"] == "Deployment")["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # the examples' backend serves KServe gRPC too: the pod listens for it and the Service
    # offers it on the port the Istio gRPC routes name (ir.Service.grpc_service_port)
    backend = model.service(model.functions[0].backend)
    assert backend.grpc_service_port is not None
    assert "--grpc-port" in container["args"]
    service = next(r.obj for r in rendered if r.obj["kind"] == "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc-kserve"]["port"] == backend.grpc_service_port
    assert ports["grpc-kserve"]["targetPort"] == "grpc"


def test_backend_pods_are_what_the_istio_objects_select() -> None:
    """The rendered Istio objects select a Service's pods by `istio.labelKey` and authorize its
    SPIFFE identity's service account: the backends the operator deploys must carry that label
    and run as that account, or the audit plugin, the Telemetry, the EnvoyFilters and the
    repository guard never apply to them, and their principal is `default`."""
    model = load_policies(EXAMPLES)
    digests = {build: "0" * 64 for build in BUILDS}
    for key in ("app", "workload"):
        rendered = render_backends(model, BackendSettings(), keda=False, label_key=key)
        deployment = next(r.obj for r in rendered if r.obj["kind"] == "Deployment")
        pod = deployment["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (account,) = [r.obj for r in rendered if r.obj["kind"] == "ServiceAccount"]
        backend = model.service(model.functions[0].backend)
        assert account["metadata"]["name"] == backend.identity.rsplit("/sa/", 1)[1]
        assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
        assert account["automountServiceAccountToken"] is False
        valid(account)
        selectors = [
            o["spec"].get("selector") or o["spec"].get("workloadSelector")
            for objects in render(model, digests, RenderOptions(label_key=key)).objects.values()
            for o in objects
        ]
        chosen = [
            sel.get("matchLabels") or sel.get("labels")
            for sel in selectors
            if sel and (sel.get("matchLabels") or sel.get("labels")) == {key: backend.name}
        ]
        assert len(chosen) >= 3  # the audit WasmPlugin, its Telemetry, its EnvoyFilter, ...
        assert all(c.items() <= labels.items() for c in chosen)


def test_keda_scales_to_zero_and_artifacts_come_from_an_image() -> None:
    model = load_policies(EXAMPLES)
    settings = BackendSettings.model_validate({"artifacts": {"image": "registry.local/fns:1"}})
    rendered = render_backends(model, settings, keda=True)
    scaled = next(r.obj for r in rendered if r.obj["kind"] == "ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0
    assert "meshfn_fn_inflight" in scaled["spec"]["triggers"][0]["metadata"]["query"]
    pod = next(r.obj for r in rendered if r.obj["kind"] == "Deployment")["spec"]["template"]
    (init,) = pod["spec"]["initContainers"]
    assert init["image"] == "registry.local/fns:1"


# ---------------------------------------------------------------- configuration


def test_operator_config_refuses_unknown_keys_and_bad_timing(tmp_path: Path) -> None:
    path = tmp_path / "operator.yaml"
    path.write_text("leaseDurations: 3\n")
    with pytest.raises(ValueError, match="leaseDurations"):
        OperatorConfig.load(path)
    path.write_text("leaseDuration: 3\nrenewDeadline: 5\n")
    with pytest.raises(ValueError, match="renew deadline"):
        OperatorConfig.load(path)


def test_kubeconfig_with_embedded_certificates_and_exec(tmp_path: Path) -> None:
    data = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    document = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "n"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://10.9.8.7:6443/", "certificate-authority-data": data}}],
        "users": [{"name": "u", "user": {"exec": {"command": "get-token", "args": ["--x"]}}}],
    }  # fmt: skip
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(document))
    config = KubeConfig.from_file(path)
    assert config.server == "https://10.9.8.7:6443" and config.namespace == "n"
    assert config.exec_command == ["get-token", "--x"]
    assert config.ca_file is not None and Path(config.ca_file).read_bytes().startswith(b"-----")
    with pytest.raises(ValueError, match="no context named 'other'"):
        KubeConfig.from_file(path, "other")


# ---------------------------------------------------------------- the Helm chart


def helm() -> str:
    sys.path.insert(0, str(REPO / "e2e"))
    try:
        from kubecluster import helm_path
    finally:
        sys.path.pop(0)
    return str(helm_path())


def helm_template(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm(), "template", "meshfn", str(REPO / "manifests"), "-n", "meshfn-system", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def chart(*args: str) -> list[dict[str, Any]]:
    result = helm_template(*args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def assert_hardened(documents: list[dict[str, Any]]) -> None:
    """Every workload: non-root, read-only root, no privilege escalation, no capabilities,
    requests and limits."""
    for doc in documents:
        if doc["kind"] not in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]


PG_TRIAL = "auditCollector.enabled=true,auditStore.postgresql.trial.enabled=true"
PG_EXTERNAL = "auditCollector.enabled=true,auditStore.postgresql.existingSecret=ext-pg"


def test_helm_lint_is_clean() -> None:
    for extra in ([], ["--set", f"serviceMonitor.enabled=true,{PG_TRIAL}"]):
        result = subprocess.run(
            [helm(), "lint", str(REPO / "manifests"), *extra],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout
        assert "[INFO]" not in result.stdout, result.stdout


def test_rendered_chart_validates_and_is_hardened() -> None:
    documents = chart("--set", f"serviceMonitor.enabled=true,{PG_TRIAL}")
    for doc in documents:
        if doc["kind"] == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        valid(doc)
    assert_hardened(documents)
    operator = _by(documents, "Deployment")["meshfn"]  # (the audit signer is one too)
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(container)
    kinds = {d["kind"] for d in documents}
    assert {"PodDisruptionBudget", "NetworkPolicy", "ServiceAccount", "ServiceMonitor"} <= kinds
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    config = OperatorConfig.model_validate(yaml.safe_load(config_map["data"]["operator.yaml"]))
    assert config.backends.processes == 1
    two = next(d for d in chart("--set", "backends.processes=2") if d["kind"] == "ConfigMap")
    assert (
        OperatorConfig.model_validate(
            yaml.safe_load(two["data"]["operator.yaml"])
        ).backends.processes
        == 2
    )
    lease = next(d for d in documents if d["kind"] == "Role")["rules"][1]["resourceNames"]
    assert lease == [config.leaseName]
    services = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Service"}
    als = services[f"{config.service}-als"]
    assert als["spec"]["ports"][0]["port"] == config.alsPort
    assert als["spec"]["selector"]["meshfn.io/leader"] == "true"


def _by(documents: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"]["containers"][0])


def _secret_key(container: dict[str, Any], env: str) -> tuple[str, str]:
    ref = next(e for e in container["env"] if e["name"] == env)["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


@pytest.mark.parametrize("values", [PG_TRIAL, PG_EXTERNAL], ids=["trial", "external"])
def test_chart_audit_trail_on_postgresql(values: str, tmp_path: Path) -> None:
    """Collectors on every node write one PostgreSQL store (the chart's trial server or an
    external one) and ask one signer, the only pod holding the key, which writes the witness to
    its own volume; NetworkPolicies let only collectors reach the signer."""
    documents = chart("--set", values)
    for doc in documents:
        valid(doc)
    assert_hardened(documents)
    deployments, services = _by(documents, "Deployment"), _by(documents, "Service")
    collector = _container(_by(documents, "DaemonSet")["meshfn-audit"])
    signer_deployment = deployments["meshfn-audit-signer"]
    signer = _container(signer_deployment)
    # the collector: the store from the Secret, a chain per node, the signer's Service
    store_secret, key = _secret_key(collector, "MESHFN_AUDIT_STORE")
    assert key == "dsn" and "--store" not in collector["args"]
    assert collector["args"][collector["args"].index("--journal") + 1].startswith("$(NODE_NAME)=")
    address = collector["args"][collector["args"].index("--signer") + 1]
    host, port = address.removeprefix("tcp:").rsplit(":", 1)
    service = services[host.split(".")[0]]
    assert service["spec"]["ports"][0]["port"] == int(port)
    signer_labels = signer_deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects(service["spec"]["selector"], signer_labels)
    # the signer connects as its own role (it inserts checkpoints only), holds the key and the
    # retention
    assert _secret_key(signer, "MESHFN_AUDIT_STORE") == (store_secret, "signerDsn")
    assert signer["args"][signer["args"].index("--retention-days") + 1] == "730"
    assert signer_deployment["spec"]["replicas"] == 1
    assert signer_deployment["spec"]["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in signer_deployment["spec"]["template"]["spec"]["volumes"]}
    key_secret = volumes["key"]["secret"]["secretName"]
    witness_claim = volumes["witness"]["persistentVolumeClaim"]["claimName"]
    key_file = signer["args"][signer["args"].index("--key") + 1]
    mounts = {m["name"]: m["mountPath"] for m in signer["volumeMounts"]}
    assert key_file.startswith(mounts["key"] + "/")
    witness_file = signer["args"][signer["args"].index("--witness") + 1]
    assert witness_file.startswith(mounts["witness"] + "/")
    # no other pod mounts the key or the witness
    for doc in documents:
        if (
            doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet")
            and doc is not signer_deployment
        ):
            text = json.dumps(doc["spec"]["template"]["spec"].get("volumes", []))
            assert key_secret not in text and witness_claim not in text, doc["metadata"]["name"]
    # the chart's key is a key the signer loads
    secret = _by(documents, "Secret")[key_secret]
    (tmp_path / "checkpoint.key").write_bytes(base64.b64decode(secret["data"]["checkpoint.key"]))
    assert signing.load_private(tmp_path / "checkpoint.key")
    assert _by(documents, "PersistentVolumeClaim")[witness_claim]
    # the operator's selectors match no audit pod
    operator = deployments["meshfn"]
    for doc in documents:
        if doc["kind"] in ("DaemonSet", "StatefulSet") or doc is signer_deployment:
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert not _selects(operator["spec"]["selector"]["matchLabels"], labels)
            assert not _selects(services["meshfn"]["spec"]["selector"], labels)
    # only collectors reach the signer
    policy = _by(documents, "NetworkPolicy")["meshfn-audit-signer"]
    assert _selects(policy["spec"]["podSelector"]["matchLabels"], signer_labels)
    (rule,) = policy["spec"]["ingress"]
    collector_labels = _by(documents, "DaemonSet")["meshfn-audit"]["spec"]["template"]["metadata"]
    assert _selects(rule["from"][0]["podSelector"]["matchLabels"], collector_labels["labels"])
    # the owner's DSN goes to the init Job only (as the tables' owner it could drop triggers)
    (job,) = [d for d in documents if d["kind"] == "Job"]
    init = _container(job)
    assert _secret_key(init, "MESHFN_AUDIT_STORE") == (store_secret, "ownerDsn")
    assert {e["name"]: _secret_key(init, e["name"])[1] for e in init["env"]} == {
        "MESHFN_AUDIT_STORE": "ownerDsn",
        "MESHFN_AUDIT_COLLECTOR_DSN": "dsn",
        "MESHFN_AUDIT_SIGNER_DSN": "signerDsn",
        "MESHFN_AUDIT_READER_DSN": "readonlyDsn",
        "MESHFN_AUDIT_AUDITOR_DSN": "auditorDsn",  # optional: an external Secret may lack it
    }
    assert init["args"][:2] == ["audit", "init"]
    assert ("--create-roles" in init["args"]) == (values == PG_TRIAL)
    for doc in documents:
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            assert "ownerDsn" not in json.dumps(doc), doc["metadata"]["name"]
    init_labels = job["spec"]["template"]["metadata"]["labels"]
    init_policy = _by(documents, "NetworkPolicy")["meshfn-audit-init"]
    assert _selects(init_policy["spec"]["podSelector"]["matchLabels"], init_labels)
    statefulsets = _by(documents, "StatefulSet")
    if values == PG_TRIAL:
        database = statefulsets["meshfn-audit-postgresql"]
        dsns = _by(documents, "Secret")[store_secret]["stringData"]
        for key, user in (
            ("ownerDsn", "meshfn"),
            ("dsn", "meshfn_audit_collector"),
            ("signerDsn", "meshfn_audit_signer"),
            ("readonlyDsn", "meshfn_audit_reader"),
            ("auditorDsn", "meshfn_audit_auditor"),
        ):
            assert dsns[key].startswith(f"postgresql://{user}:"), key
            assert "@meshfn-audit-postgresql." in dsns[key]
        (rule,) = _by(documents, "NetworkPolicy")["meshfn-audit-postgresql"]["spec"]["ingress"]
        allowed = rule["from"][0]["podSelector"]["matchExpressions"][2]["values"]
        assert init_labels["app.kubernetes.io/component"] in allowed
        assert _selects(
            services["meshfn-audit-postgresql"]["spec"]["selector"],
            database["spec"]["template"]["metadata"]["labels"],
        )
    else:
        assert not statefulsets and store_secret == "ext-pg"
        assert store_secret not in _by(documents, "Secret")  # the user's


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("auditCollector.enabled=true,auditStore.type=mysql", '"mysql" is not postgresql'),
        ("auditCollector.enabled=true", "needs auditStore.postgresql.existingSecret"),
        # the per-node store had no signer and no witness: removed, and said so
        ("auditCollector.enabled=true,auditStore.type=sqlite", "sqlite (a store per node,"),
    ],
)
def test_chart_refuses_an_audit_store_it_cannot_wire(values: str, message: str) -> None:
    result = helm_template("--set", values)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_chart_trial_roles_hold_on_a_real_server(pg: PostgresServer) -> None:
    """The trial chart's init Job, run as rendered (its arguments, and its environment from
    the rendered Secret, pointed at a real server): each component's DSN is a role of its own;
    the signer's cannot insert a record, the collectors' cannot insert a checkpoint, and both
    work as the store's components."""
    documents = chart("--set", PG_TRIAL)
    secret = _by(documents, "Secret")["meshfn-audit-store"]["stringData"]
    (job,) = [d for d in documents if d["kind"] == "Job"]
    init = _container(job)
    database = pg.database()
    here = psycopg.conninfo.conninfo_to_dict(database)

    def local(dsn: str) -> str:  # the chart's host -> the test server (trust: passwords kept)
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        info.update(host=here["host"], port=here["port"], dbname=here["dbname"])
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})

    env = {e["name"]: local(secret[_secret_key(init, e["name"])[1]]) for e in init["env"]}
    done = CliRunner().invoke(audit_app, init["args"][1:], env=env)
    assert done.exit_code == 0, done.output
    assert "role signer meshfn_audit_signer: SELECT on meta" in " ".join(done.output.split())
    for key, table, sql in (
        ("signerDsn", "records", "INSERT INTO records (chain, seq, record, prev, hash)"
         " VALUES ('a', 1, '{}', '', '')"),
        ("dsn", "checkpoints", "INSERT INTO checkpoints (n, body, signature, key_id, created)"
         " VALUES (1, '{}', '', '', '')"),
    ):  # fmt: skip
        with (
            psycopg.connect(local(secret[key]), autocommit=True) as conn,
            pytest.raises(psycopg.errors.InsufficientPrivilege, match=table),
        ):
            conn.execute(sql.encode())
    collector = open_store(local(secret["dsn"]))
    reader = open_store(local(secret["readonlyDsn"]), readonly=True)
    try:
        collector.append([{"v": 2, "status": 200}], chain="node-1")
        assert reader.count() == 1
    finally:
        collector.close()
        reader.close()


def _resources(cell: str) -> set[str]:
    cell = re.sub(r"`[^`]*`|\(Role[^)]*\)|[a-z0-9.]+:", " ", cell)
    return set(re.findall(r"[a-z]+", cell))


def test_docs_rbac_table_lists_every_verb_of_the_chart() -> None:
    """docs/concepts/kubernetes.md justifies each verb; the table and the chart agree."""
    text = (REPO / "docs" / "concepts" / "kubernetes.md").read_text()
    table = text.split("RBAC, every verb", 1)[1].split("\n\n", 2)[1]
    documented: set[tuple[str, str]] = set()
    previous: set[str] = set()
    for line in table.splitlines()[2:]:
        verbs, resources, why = (c.strip() for c in line.strip("|").split("|"))
        assert why, line
        if resources.startswith("the same"):
            names = {f"{n}/status" for n in previous} if "/status" in resources else previous
        else:
            names = previous = _resources(resources)
        documented |= {(v.strip(), n) for v in verbs.split(",") for n in names}
    granted = {
        (verb, resource)
        for doc in chart()
        if doc["kind"] in ("ClusterRole", "Role")
        for rule in doc["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == documented, (sorted(granted - documented), sorted(documented - granted))
