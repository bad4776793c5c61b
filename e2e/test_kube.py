"""meshfn as a Kubernetes operator, against a real kube-apiserver + etcd + kube-controller-manager.

One cluster per module (it takes ~6 s to start). The operator runs as a real `meshfn kube run`
process with the Helm chart's RBAC and nothing more (its token is the chart's ServiceAccount),
so a missing permission fails these tests. Writes are counted from the apiserver's audit log.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubecluster import (
    CONTROLLER_NAMESPACE,
    CONTROLLER_USER,
    ISTIO_CRDS,
    REPO,
    KubeCluster,
    helm_path,
)

from meshfn.contracts.kube import KINDS
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import MESHFN, Proc, meshfn, wait_for

pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "policies" / "examples"
LEASE = {"duration": 4.0, "deadline": 3.0, "retry": 0.5}


def helm() -> str:
    return helm_path()


def chart(*args: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [
            helm(),
            "template",
            "meshfn",
            str(REPO / "manifests"),
            "--namespace",
            CONTROLLER_NAMESPACE,
            *args,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    kube = KubeCluster(tmp_path_factory.mktemp("kube")).start()
    try:
        for ns in (CONTROLLER_NAMESPACE, "ingress", "istio-system"):
            assert kube.kubectl("create", "namespace", ns).returncode == 0
        result = kube.kubectl("apply", "-f", str(REPO / "manifests" / "crds"))
        assert result.returncode == 0, result.stderr
        # Istio's CRDs carry CEL rules this kubectl's client-side check rejects for 1.20.
        result = kube.kubectl("apply", "--validate=false", "-f", str(ISTIO_CRDS))
        assert result.returncode == 0, result.stderr
        result = kube.kubectl(
            "wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"
        )
        assert result.returncode == 0, result.stderr
        kube.forget_discovery()
        # Only the chart's RBAC for the operator's identity.
        rbac = [
            d
            for d in chart()
            if d["kind"]
            in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
        ]
        kube.apply(yaml.safe_dump_all(rbac))
        yield kube
    finally:
        kube.stop()


class Operator:
    def __init__(self, cluster: KubeCluster, name: str) -> None:
        self.name = name
        # the apiserver's admin: TokenReview and SubjectAccessReview admit it to /debug/status
        self.token = cluster.tokens["admin"]
        self.admin, self.als = free_ports(2)
        salt = cluster.root / "salt"
        if not salt.exists():
            salt.write_text("ab" * 32)
        config = cluster.root / f"operator-{name}.yaml"
        # As in a cluster, every replica serves the modules at the same Service URL.
        wasm = {"baseUrl": "http://meshfn.meshfn-system.svc.cluster.local:9090/wasm/"}
        config.write_text(
            yaml.safe_dump({"saltFile": str(salt), "resyncSeconds": 30, "wasm": wasm})
        )
        self.proc = Proc(
            [
                MESHFN, "kube", "run",
                "--config", str(config),
                "--kubeconfig", str(cluster.kubeconfig("meshfn")),
                "--namespace", CONTROLLER_NAMESPACE,
                "--instance", "meshfn",
                "--identity", name,
                "--listen", "127.0.0.1",
                "--admin-port", str(self.admin),
                "--als-port", str(self.als),
                "--lease-duration", str(LEASE["duration"]),
                "--renew-deadline", str(LEASE["deadline"]),
                "--retry-period", str(LEASE["retry"]),
                "--log-format", "json",
            ],
            cluster.root / "logs" / f"operator-{name}.log",
        )  # fmt: skip

    def start(self) -> Operator:
        self.proc.start()
        wait_for(f"operator {self.name} ready", lambda: self.get("/readyz") == "ok\n", 30)
        return self

    def get(self, path: str, token: str | None = "") -> str:
        """GET on the admin port with the cluster admin's token (or `token`; None: none)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.admin}{path}")
        token = self.token if token == "" else token
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as r:
            return str(r.read().decode())

    def status(self) -> dict[str, Any]:
        return dict(json.loads(self.get("/debug/status")))

    def leading(self) -> bool:
        return bool(self.status()["kube"]["election"]["leader"])

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self.get("/metrics").splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.stop(sig)


@pytest.fixture
def operator(cluster: KubeCluster) -> Iterator[Operator]:
    op = Operator(cluster, "replica-a").start()
    wait_for("replica-a to lead", op.leading, 20)
    try:
        yield op
    finally:
        op.stop()


def get(cluster: KubeCluster, path: str) -> Any:
    try:
        return cluster.get_json(path)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def meshfn_object(cluster: KubeCluster, plural: str, name: str, ns: str | None = "default") -> Any:
    where = f"/namespaces/{ns}" if ns else ""
    return get(cluster, f"/apis/meshfn.io/v1alpha1{where}/{plural}/{name}")


def condition(obj: dict[str, Any], kind: str = "Accepted") -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def all_accepted(cluster: KubeCluster) -> bool:
    objects = json.loads(cluster.kubectl("get", "meshfn", "-A", "-o", "json").stdout)["items"]
    return bool(objects) and all(
        condition(o).get("status") == "True"
        and condition(o).get("observedGeneration") == o["metadata"]["generation"]
        for o in objects
    )


def events_for(cluster: KubeCluster, name: str, ns: str = "default") -> list[dict[str, Any]]:
    events = get(cluster, f"/api/v1/namespaces/{ns}/events")["items"]
    return [e for e in events if e["involvedObject"].get("name") == name]


def patch_spec(
    cluster: KubeCluster, kind: str, name: str, spec: dict[str, Any], ns: str = "default"
) -> None:
    result = cluster.kubectl(
        "-n", ns, "patch", kind, name, "--type", "merge", "-p", json.dumps({"spec": spec})
    )
    assert result.returncode == 0, result.stderr


def config_writes(cluster: KubeCluster, since: int) -> dict[str, int]:
    """The operator's writes after audit position `since`, Lease renewals left out."""
    return {k: v for k, v in cluster.writes(since=since).items() if "leases" not in k}


def logged_writes(cluster: KubeCluster, since: int, count: int) -> dict[str, int]:
    """config_writes once at least `count` are in the audit log: the apiserver writes a
    request's ResponseComplete event after its response, so a GET can see a change first."""

    def logged() -> dict[str, int] | None:
        writes = config_writes(cluster, since)
        return writes if sum(writes.values()) >= count else None

    return wait_for(f"{count} operator writes in the apiserver's audit log", logged, 5)


# ---------------------------------------------------------------- tests


def test_crds_schema_and_category(cluster: KubeCluster) -> None:
    result = cluster.kubectl("get", "meshfn", "-A")
    assert result.returncode == 0, result.stderr
    bad = """apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {name: broken, namespace: default}
spec: {port: 70000, protocol: ftp}
"""
    result = cluster.kubectl("apply", "-f", "-", stdin=bad)
    assert result.returncode != 0
    assert "spec.port" in result.stderr and "spec.protocol" in result.stderr, result.stderr
    assert "Unsupported value" in result.stderr or "must be" in result.stderr
    crd = get(cluster, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/services.meshfn.io")
    assert crd["spec"]["names"]["shortNames"] == ["mfsvc"]
    assert crd["spec"]["names"]["categories"] == ["meshfn"]


def test_examples_applied_updated_and_status(cluster: KubeCluster, operator: Operator) -> None:
    cluster.apply(Path(EXAMPLES).joinpath("mesh.yaml").read_text())
    for name in sorted(p.name for p in EXAMPLES.glob("*.yaml")):
        cluster.apply((EXAMPLES / name).read_text())
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    deployment = wait_for(
        "the models backend",
        lambda: get(cluster, "/apis/apps/v1/namespaces/default/deployments/models"),
        15,
    )
    owner = deployment["metadata"]["ownerReferences"][0]
    service = meshfn_object(cluster, "services", "models")
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Service",
        "models",
        service["metadata"]["uid"],
    )
    owned = {(r["kind"], r["name"]) for r in service["status"]["resources"]}
    assert {
        ("Deployment", "models"),
        ("ConfigMap", "models-backend"),
        ("Service", "models"),
    } <= owned
    config = get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")
    backend = yaml.safe_load(config["data"]["backend.yaml"])
    assert {f["name"] for f in backend["functions"]} == {
        "iris", "embedder", "digits", "cancer", "digits-cnn", "tiny-lm",
    }  # fmt: skip

    # An update rewrites only what changed: the backend's ConfigMap and its Deployment's
    # config hash, plus the Function's status (its observedGeneration).
    time.sleep(1)
    mark = len(cluster.audit())
    patch_spec(cluster, "functions.meshfn.io", "iris", {"limits": {"maxConcurrency": 12}})
    wait_for(
        "the new limit",
        lambda: (
            "maxConcurrency: 12"
            in get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")["data"][
                "backend.yaml"
            ]
        ),
        15,
    )
    wait_for("iris status", lambda: all_accepted(cluster), 15)
    time.sleep(1.5)
    writes = config_writes(cluster, mark)
    assert writes == {
        "patch configmaps": 1,
        "patch deployments": 1,
        "patch functions/status": 1,
    }, writes
    # Nothing changed: nothing written.
    mark = len(cluster.audit())
    patch_spec(cluster, "functions.meshfn.io", "iris", {"limits": {"maxConcurrency": 12}})
    time.sleep(1.5)
    assert config_writes(cluster, mark) == {}


def test_a_burst_of_changes_is_one_build(cluster: KubeCluster, operator: Operator) -> None:
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    time.sleep(1)
    builds = operator.metric("meshfn_kube_policy_builds_total")
    burst = []
    for name in ("iris", "embedder", "digits"):
        obj = meshfn_object(cluster, "functions", name)
        burst.append(
            {
                "apiVersion": obj["apiVersion"],
                "kind": "Function",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {**obj["spec"], "idleTtl": "7m"},
            }
        )
    cluster.apply(yaml.safe_dump_all(burst))  # three changes, milliseconds apart
    wait_for(
        "the burst applied",
        lambda: (
            get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")["data"][
                "backend.yaml"
            ].count("idleTtl: 420s")
            == 3
        ),
        15,
    )
    assert operator.metric("meshfn_kube_policy_builds_total") - builds == 1


def wait_invalid(cluster: KubeCluster, plural: str, name: str) -> dict[str, Any]:
    """The object once its Invalid condition is True."""

    def probe() -> dict[str, Any] | None:
        obj = meshfn_object(cluster, plural, name)
        return obj if obj and condition(obj, "Invalid").get("status") == "True" else None

    return wait_for(f"{name} Invalid", probe, 15)


def test_invalid_objects_keep_the_config_in_force(cluster: KubeCluster, operator: Operator) -> None:
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    before = get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")
    mark = len(cluster.audit())
    # The schema accepts it; the reference check does not.
    patch_spec(cluster, "functions.meshfn.io", "digits", {"backend": "nowhere"})
    digits = wait_invalid(cluster, "functions", "digits")
    message = condition(digits)["message"]
    assert condition(digits)["reason"] == "Invalid"
    assert message.startswith("spec.backend:") and "nowhere" in message, message
    assert condition(digits)["observedGeneration"] == digits["metadata"]["generation"]
    # The same message `meshfn validate` prints for the same objects in files.
    folder = as_files(cluster, cluster.root / "as-files")
    validated = meshfn("validate", str(folder))
    assert validated.returncode == 1 and message in validated.stderr, (message, validated.stderr)
    warning = wait_for(
        "an Invalid Event",
        lambda: [
            e
            for e in events_for(cluster, "digits")
            if e["reason"] == "Invalid" and "nowhere" in e["message"]
        ],
        10,
    )
    assert warning[0]["type"] == "Warning"
    # An unknown field is kept by the schema (not pruned) and refused by the model.
    patch_spec(cluster, "services.meshfn.io", "models", {"prot": 1})
    models = wait_invalid(cluster, "services", "models")
    assert "unknown field 'prot'" in condition(models)["message"]
    # The last good configuration stays: nothing rendered was written, only statuses and Events.
    time.sleep(1)
    writes = config_writes(cluster, mark)
    assert set(writes) <= {"patch functions/status", "patch services/status", "create events"}, (
        writes
    )
    assert (
        get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")["metadata"][
            "resourceVersion"
        ]
        == before["metadata"]["resourceVersion"]
    )
    # Fixed: accepted again, a Normal Event.
    result = cluster.kubectl(
        "patch",
        "services.meshfn.io",
        "models",
        "--type",
        "json",
        "-p",
        '[{"op":"remove","path":"/spec/prot"}]',
    )
    assert result.returncode == 0, result.stderr
    patch_spec(cluster, "functions.meshfn.io", "digits", {"backend": "models"})
    wait_for("every example Accepted again", lambda: all_accepted(cluster), 20)
    assert wait_for(
        "an Accepted Event",
        lambda: [
            e
            for e in events_for(cluster, "digits")
            if e["reason"] == "Accepted" and e["type"] == "Normal"
        ],
        10,
    )


def test_apply_conflict_is_reported_not_forced(cluster: KubeCluster, operator: Operator) -> None:
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    # Another field manager takes the backend's configuration over (forcing, as a person might).
    theirs = """apiVersion: v1
kind: ConfigMap
metadata: {name: models-backend, namespace: default}
data: {backend.yaml: "registry: /elsewhere\\n"}
"""
    result = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager", "someone", "-f", "-",
        stdin=theirs,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # meshfn's next change to it conflicts: reported on the policy it comes from, not forced.
    patch_spec(cluster, "functions.meshfn.io", "iris", {"limits": {"maxConcurrency": 13}})
    models = wait_for(
        "models ApplyFailed",
        lambda: (
            (o := meshfn_object(cluster, "services", "models"))
            and condition(o).get("reason") == "ApplyFailed"
            and o
        ),
        20,
    )
    message = condition(models)["message"]
    assert "ConfigMap default/models-backend: conflict" in message and "someone" in message, message
    config = get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")
    assert config["data"]["backend.yaml"] == "registry: /elsewhere\n"
    assert wait_for(
        "an ApplyFailed Event",
        lambda: [e for e in events_for(cluster, "models") if e["reason"] == "ApplyFailed"],
        10,
    )
    # The owner gives it back: meshfn applies again and the policy is Accepted.
    result = cluster.kubectl(
        "apply", "--server-side", "--field-manager", "someone", "-f", "-",
        stdin="apiVersion: v1\nkind: ConfigMap\nmetadata: {name: models-backend, namespace: default}\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    patch_spec(cluster, "functions.meshfn.io", "iris", {"limits": {"maxConcurrency": 14}})
    wait_for("every example Accepted again", lambda: all_accepted(cluster), 20)
    config = get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")
    assert "maxConcurrency: 14" in config["data"]["backend.yaml"]


def test_apiserver_restart_resumes_watches_without_a_resync_storm(
    cluster: KubeCluster, operator: Operator
) -> None:
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    time.sleep(1)
    mark = len(cluster.audit())
    relists = operator.metric("meshfn_kube_relists_total")
    operator.status()  # someone watching: the apiserver has admitted their token lately
    cluster.stop_apiserver()
    # Down: the operator says so, in its status document and through `meshfn status`.
    wait_for(
        "the operator to notice",
        lambda: any(k["error"] for k in operator.status()["kube"]["source"]["kinds"].values()),
        20,
    )
    shown = meshfn(  # authenticated by the apiserver that is down: the last decision holds
        "status",
        "--admin",
        f"http://127.0.0.1:{operator.admin}",
        env={"MESHFN_ADMIN_TOKEN": operator.token},
    )
    assert shown.returncode == 0, shown.stderr
    assert "apiserver unreachable" in shown.stdout, shown.stdout
    assert operator.metric("meshfn_kube_apiserver_reachable") == 0
    cluster.start_apiserver()
    wait_for(
        "every watch re-opened",
        lambda: all(k["watching"] for k in operator.status()["kube"]["source"]["kinds"].values()),
        30,
    )
    time.sleep(3)
    # No resync storm: nothing rendered, no status, no Event was written again.
    assert config_writes(cluster, mark) == {}
    restarts = operator.metric("meshfn_kube_watch_restarts_total", cause="unreachable")
    after = operator.metric("meshfn_kube_relists_total") - relists
    print(f"apiserver restart: {restarts:.0f} watch restarts, {after:.0f} relists, 0 writes")
    assert after <= len(KINDS)  # at most one list per kind (only after a 410 Gone)
    # And changes flow again.
    patch_spec(cluster, "functions.meshfn.io", "iris", {"limits": {"maxConcurrency": 15}})
    wait_for(
        "the change after the restart",
        lambda: (
            "maxConcurrency: 15"
            in get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")["data"][
                "backend.yaml"
            ]
        ),
        20,
    )


def test_leader_killed_during_updates(cluster: KubeCluster, operator: Operator) -> None:
    follower = Operator(cluster, "replica-b").start()
    try:
        assert not follower.leading()
        wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
        updates = list(range(100, 130))
        killed_at: list[float] = []

        def stream() -> None:
            for i, value in enumerate(updates):
                cluster.merge_patch(
                    "/apis/meshfn.io/v1alpha1/namespaces/default/functions/iris",
                    {"spec": {"limits": {"maxConcurrency": value}}},
                )
                if i == len(updates) // 3:
                    operator.proc.send(signal.SIGKILL)
                    killed_at.append(time.monotonic())
                time.sleep(0.1)

        writer = threading.Thread(target=stream)
        writer.start()
        wait_for("the kill", lambda: killed_at, 30)
        # The lease protocol's deadline: the dead leader's lease expires `duration` after its
        # last renewal (at most `retry` before the kill), and the follower looks every `retry`,
        # so it leads within duration + retry of the kill. The 2 s more are the margin for a
        # loaded machine: a functional deadline with a wide margin (a follower that waited for
        # a second lease period, 8 s, or never saw the expiry, fails it).
        deadline = LEASE["duration"] + LEASE["retry"] + 2
        wait_for("replica-b to lead", follower.leading, deadline + 1, every=0.05)
        takeover = time.monotonic() - killed_at[0]
        writer.join(60)
        print(
            f"leader killed: replica-b took over after {takeover:.2f}s (lease {LEASE['duration']}s)"
        )
        assert takeover <= deadline, takeover
        # No update lost: the last one is what the cluster holds, and the status says so.
        last = updates[-1]
        wait_for(
            "the last update applied",
            lambda: (
                f"maxConcurrency: {last}"
                in get(cluster, "/api/v1/namespaces/default/configmaps/models-backend")["data"][
                    "backend.yaml"
                ]
            ),
            20,
        )
        wait_for("every example Accepted", lambda: all_accepted(cluster), 20)
        lease = get(
            cluster,
            f"/apis/coordination.k8s.io/v1/namespaces/{CONTROLLER_NAMESPACE}/leases/meshfn-leader",
        )
        assert lease["spec"]["holderIdentity"] == "replica-b"
    finally:
        follower.stop()


def send_latencies(
    port: int, route: str, cluster_name: str, millis: float, count: int, status: int = 0
) -> None:
    """Envoy's side of the access-log stream: `count` requests of `millis` on `route`, each
    sent on an upstream connection (the only ones the gateway's filter streams); with
    `status`, inferences answered with it (what the rollout controller judges)."""
    import grpc
    from envoy.service.accesslog.v3 import als_pb2

    from meshfn.xds.names import LATENCY_LOG

    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.node.id = "edge-http~0"
    message.identifier.log_name = LATENCY_LOG
    for _ in range(count):
        entry = message.http_logs.log_entry.add()
        entry.common_properties.route_name = route
        entry.common_properties.upstream_cluster = cluster_name
        entry.common_properties.duration.FromMilliseconds(int(millis))
        entry.common_properties.upstream_local_address.socket_address.address = "10.0.0.1"
        if status:
            entry.request.path = "/v2/models/digits/infer"
            entry.response.response_code.value = status
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_unary(
            "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=als_pb2.StreamAccessLogsResponse.FromString,
        )
        call(iter([message]), timeout=10)


def test_drift_trip_patches_the_degrade_plugin_and_recovery_reverts_it(
    cluster: KubeCluster, operator: Operator
) -> None:
    patch_spec(
        cluster,
        "fallbackpolicies.meshfn.io",
        "models",
        {
            "driftBreaker": {
                "minSamples": 5,
                "window": "1s",
                "baselineWindow": "5s",
                "recoverAfter": "2s",
            }
        },
    )
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    path = (
        "/apis/extensions.istio.io/v1alpha1/namespaces/ingress/wasmplugins/meshfn-degrade-edge-http"
    )
    time.sleep(1)
    before = get(cluster, path)
    mark = len(cluster.audit())
    port = meshfn_object(cluster, "services", "models")["spec"]["port"]
    upstream = f"outbound|{port}||models.default.svc.cluster.local"
    send_latencies(operator.als, "default/function-iris/0", upstream, 5, 20)
    time.sleep(1.2)  # the baseline is what came before the window
    send_latencies(operator.als, "default/function-iris/0", upstream, 250, 20)
    tripped = wait_for(
        "the trip to reach the cluster",
        lambda: (o := get(cluster, path))["spec"] != before["spec"] and o,
        10,
    )
    assert tripped["spec"]["pluginConfig"] != before["spec"]["pluginConfig"]
    assert {k: v for k, v in tripped["spec"].items() if k != "pluginConfig"} == {
        k: v for k, v in before["spec"].items() if k != "pluginConfig"
    }
    assert "function-iris" in json.dumps(tripped["spec"]["pluginConfig"])
    assert logged_writes(cluster, mark, 1) == {"patch wasmplugins": 1}
    assert operator.status()["routes"]["default/function-iris"]["state"] == "degraded"
    # The probe share is fast again: recovery reverts the plugin, byte for byte.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and get(cluster, path)["spec"] != before["spec"]:
        send_latencies(operator.als, "default/function-iris/0", upstream, 5, 10)
        time.sleep(0.2)
    assert get(cluster, path)["spec"] == before["spec"]
    assert logged_writes(cluster, mark, 2) == {"patch wasmplugins": 2}


ROLLOUT = """apiVersion: meshfn.io/v1alpha1
kind: Rollout
metadata: {name: digits-v2, namespace: default}
spec:
  function: digits
  stable: "1"
  candidate: "2"
  interval: 300ms
  canary:
    minRequests: 5
    minTime: 1s
    steps: [{weight: 10}, {weight: 50}, {weight: 100}]
  slo: {minSamples: 5}
"""


def send_answers(port: int, cluster_name: str, status: int, count: int) -> None:
    """Inferences of digits answered by one version (its subset's cluster) with `status`."""
    send_latencies(port, "default/function-digits/1", cluster_name, 5, count, status)


def _digits_split(cluster: KubeCluster) -> list[tuple[str, int]]:
    """(subset, weight) of the split route of digits in the gateway's VirtualService."""
    vs = get(
        cluster, "/apis/networking.istio.io/v1/namespaces/ingress/virtualservices/edge-http.any"
    )
    route = next(
        h
        for h in vs["spec"]["http"]
        if h["name"] == "default/function-digits/0" and "mirror" not in h
    )
    return [(d["destination"]["subset"], d["weight"]) for d in route["route"]]


def test_a_rollout_moves_step_by_step_in_the_cluster(
    cluster: KubeCluster, operator: Operator
) -> None:
    """The leader steps the Rollout on the access-log stream: each step patches the
    VirtualService's weights (and nothing else of what it renders), writes the Rollout's
    status (where it is, and its Progressing condition) and records an Event; a breach rolls it
    back; only the leader acts, and a new leader resumes from the status."""
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    cluster.apply(ROLLOUT)
    wait_for(
        "step 1 applied",
        lambda: _digits_split(cluster) == [("version-1", 90), ("version-2", 10)],
        20,
    )
    port = meshfn_object(cluster, "services", "models")["spec"]["port"]
    stable, candidate = (
        f"outbound|{port}|version-{v}|models.default.svc.cluster.local" for v in ("1", "2")
    )
    time.sleep(1)
    mark = len(cluster.audit())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _digits_split(cluster)[1][1] != 50:
        send_answers(operator.als, stable, 200, 20)
        send_answers(operator.als, candidate, 200, 5)
        time.sleep(0.3)
    assert _digits_split(cluster) == [("version-1", 50), ("version-2", 50)]
    wait_for(  # the audit log has the patch once its response went out (see logged_writes)
        "the patch in the audit log",
        lambda: config_writes(cluster, mark).get("patch virtualservices"),
        5,
    )
    writes = config_writes(cluster, mark)
    # one step: the VirtualService patched once, nothing else of what meshfn renders
    assert writes.get("patch virtualservices") == 1, writes
    assert set(writes) <= {"patch virtualservices", "patch rollouts/status", "create events"}, (
        writes
    )
    rollout = meshfn_object(cluster, "rollouts", "digits-v2")
    assert (rollout["status"]["rollout"]["phase"], rollout["status"]["rollout"]["step"]) == (
        "Progressing", 1,
    )  # fmt: skip
    progressing = wait_for(
        "Progressing condition",
        lambda: condition(meshfn_object(cluster, "rollouts", "digits-v2"), "Progressing"),
        10,
    )
    assert (progressing["status"], progressing["reason"]) == ("True", "Progressing")
    reasons = [e["reason"] for e in events_for(cluster, "digits-v2")]
    assert "RolloutStarted" in reasons and "RolloutStep" in reasons, reasons

    # A follower neither acts nor takes actions; the leader does.
    follower = Operator(cluster, "replica-b").start()
    try:
        refused = meshfn(
            "rollout", "pause", "digits-v2", "--admin", f"http://127.0.0.1:{follower.admin}",
            env={"MESHFN_ADMIN_TOKEN": follower.token},
        )  # fmt: skip
        assert refused.returncode == 1 and "does not lead" in refused.stderr, refused.stderr
        # A breach: the candidate fails; every request back to the stable version.
        send_answers(operator.als, stable, 200, 20)
        send_answers(operator.als, candidate, 500, 5)
        wait_for(
            "the rollback applied",
            lambda: _digits_split(cluster) == [("version-1", 100), ("version-2", 0)],
            10,
        )
        rolled = wait_for(
            "RolledBack condition",
            lambda: (
                (
                    c := condition(meshfn_object(cluster, "rollouts", "digits-v2"), "Progressing")
                ).get("reason")
                == "RolledBack"
                and c
            ),
            10,
        )
        assert rolled["status"] == "False" and "error ratio" in rolled["message"]
        warning = [
            e for e in events_for(cluster, "digits-v2") if e["reason"] == "RolloutRolledBack"
        ]
        assert warning and warning[0]["type"] == "Warning"
        # The leader goes; the follower leads and resumes from the status.
        operator.stop()
        wait_for("replica-b to lead", follower.leading, LEASE["duration"] + 5)
        (doc,) = json.loads(follower.get("/rollouts"))["rollouts"]
        assert (doc["phase"], doc["weight"]) == ("RolledBack", 0)
        promoted = meshfn(
            "rollout", "promote", "digits-v2", "--admin", f"http://127.0.0.1:{follower.admin}",
            env={"MESHFN_ADMIN_TOKEN": follower.token},
        )  # fmt: skip
        assert promoted.returncode == 0, promoted.stderr
        wait_for(
            "the promotion applied",
            lambda: _digits_split(cluster) == [("version-1", 0), ("version-2", 100)],
            10,
        )
        assert "RolloutPromoted" in [e["reason"] for e in events_for(cluster, "digits-v2")]
    finally:
        follower.stop()
        assert (
            cluster.kubectl("delete", "rollouts.meshfn.io", "digits-v2", "-n", "default").returncode
            == 0
        )


def as_files(cluster: KubeCluster, folder: Path) -> Path:
    """The cluster's meshfn objects as policy files (what `meshfn validate` would read)."""
    folder.mkdir(exist_ok=True)
    items = json.loads(cluster.kubectl("get", "meshfn", "-A", "-o", "json").stdout)["items"]
    documents = [
        {
            "apiVersion": o["apiVersion"],
            "kind": o["kind"],
            "metadata": {k: v for k, v in o["metadata"].items() if k in ("name", "namespace")},
            "spec": o["spec"],
        }
        for o in items
    ]
    (folder / "all.yaml").write_text(yaml.safe_dump_all(documents))
    return folder


def test_cli_status_and_render_from_cluster(cluster: KubeCluster, operator: Operator) -> None:
    wait_for("every example Accepted", lambda: all_accepted(cluster), 30)
    kubeconfig = str(cluster.kubeconfig("admin"))
    shown = meshfn("status", "--kube", "--kubeconfig", kubeconfig)
    assert shown.returncode == 0, shown.stderr
    assert "Function default/iris" in shown.stdout and "Deployment default/models" in shown.stdout
    assert "True" in shown.stdout and "False" not in shown.stdout, shown.stdout
    # The same IR from the cluster as from files: the same Istio objects, byte for byte.
    state = ["--state-dir", str(cluster.root / "render-state")]
    from_cluster = meshfn(
        "render",
        "istio",
        "--from-cluster",
        "--kubeconfig",
        kubeconfig,
        "-o",
        str(cluster.root / "a"),
        *state,
    )
    assert from_cluster.returncode == 0, from_cluster.stderr
    files = as_files(cluster, cluster.root / "b-policies")
    from_files = meshfn(
        "render", "istio", "--policies", str(files), "-o", str(cluster.root / "b"), *state
    )
    assert from_files.returncode == 0, from_files.stderr
    a = {p.name: p.read_text() for p in (cluster.root / "a").iterdir()}
    b = {p.name: p.read_text() for p in (cluster.root / "b").iterdir()}
    assert a == b and "virtualservices.yaml" in a
    # Unreachable apiserver: a clear error, no traceback.
    bad = cluster.root / "nowhere.kubeconfig"
    bad.write_text(cluster.kubeconfig_text("admin").replace(cluster.server, "https://127.0.0.1:1"))
    failed = meshfn("status", "--kube", "--kubeconfig", str(bad))
    assert failed.returncode == 1 and "cannot reach the apiserver" in failed.stdout, failed.stdout
    assert "Traceback" not in failed.stdout + failed.stderr


def test_the_admin_port_asks_the_apiserver_who_may_read_it(
    cluster: KubeCluster, operator: Operator
) -> None:
    """TokenReview says who calls, SubjectAccessReview on the chart's roles says what they may:
    the cluster's RBAC decides. Probes, the filter modules and /metrics (the NetworkPolicy's to
    scope) are open; /debug/status needs the viewer role."""
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "vera-views-meshfn"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "meshfn-console-viewer"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "vera"}],
    }  # fmt: skip
    cluster.apply(yaml.safe_dump(binding))

    def status_of(token: str | None) -> int:
        try:
            operator.get("/debug/status", token)
        except urllib.error.HTTPError as exc:
            return exc.code
        return 200

    wait_for("vera's binding to count", lambda: status_of(cluster.tokens["vera"]) == 200, 20)
    assert status_of(None) == 401
    assert status_of("not-a-token") == 401
    assert status_of(cluster.tokens["nora"]) == 403  # authenticated, no role
    assert status_of(cluster.tokens["meshfn"]) == 403  # the operator's own identity neither
    assert operator.get("/healthz", None) == "ok\n" and operator.get("/readyz", None) == "ok\n"
    assert "meshfn_kube_apiserver_reachable" in operator.get("/metrics", None)
    reviews = [
        e for e in cluster.audit(None)
        if e.get("objectRef", {}).get("resource") in ("tokenreviews", "subjectaccessreviews")
    ]  # fmt: skip
    assert reviews and {e["user"]["username"] for e in reviews} == {CONTROLLER_USER}


def test_chart_passes_a_server_side_dry_run(cluster: KubeCluster) -> None:
    rendered = chart("--kube-version", "1.20.2", "--set", "serviceMonitor.enabled=false")
    kinds = sorted({d["kind"] for d in rendered})
    assert "PodDisruptionBudget" in kinds and "NetworkPolicy" in kinds
    assert (
        next(d for d in rendered if d["kind"] == "PodDisruptionBudget")["apiVersion"]
        == "policy/v1beta1"
    )
    result = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(rendered)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == len(rendered), result.stdout
    # the audit trail on the trial PostgreSQL: its roles' Secret, the init Job, the signer...
    audit = chart(
        "--kube-version", "1.20.2", "--set", "serviceMonitor.enabled=false",
        "--set", "auditCollector.enabled=true,auditStore.postgresql.trial.enabled=true",
    )  # fmt: skip
    assert {"Job", "StatefulSet", "DaemonSet"} <= {d["kind"] for d in audit}
    result = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(audit)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == len(audit), result.stdout


def test_deleting_a_policy_garbage_collects_what_it_owns(cluster: KubeCluster) -> None:
    """No operator runs here: the garbage collector alone acts, on the owner references."""
    core = "/api/v1/namespaces/default"
    owned_by_service = [
        "/apis/apps/v1/namespaces/default/deployments/models",
        f"{core}/configmaps/models-backend",
        f"{core}/services/models",
        "/apis/autoscaling/v2beta2/namespaces/default/horizontalpodautoscalers/models",
    ]
    rule = "/apis/networking.istio.io/v1/namespaces/default/destinationrules/models"
    for path in [*owned_by_service, rule]:
        assert get(cluster, path) is not None, path
    owners = {o["kind"] for o in get(cluster, rule)["metadata"]["ownerReferences"]}
    assert owners == {"Service", "FallbackPolicy"}
    assert cluster.kubectl("delete", "services.meshfn.io", "models").returncode == 0
    for path in owned_by_service:
        wait_for(f"{path} collected", lambda p=path: get(cluster, p) is None, 30, every=0.2)
    # Still owned by the FallbackPolicy: it stays until that goes too.
    assert get(cluster, rule) is not None
    assert cluster.kubectl("delete", "fallbackpolicies.meshfn.io", "models").returncode == 0
    wait_for("the DestinationRule collected", lambda: get(cluster, rule) is None, 30, every=0.2)
