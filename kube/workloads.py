"""Functions in Kubernetes: the inference backends as Deployments, Services and autoscalers.

A pure renderer beside the Istio one: IR in, plain Kubernetes objects out. Each Service that
serves Functions gets
  - a ConfigMap holding the backend's configuration, written from the same model the `Function`
    policy validates against (meshfn.contracts.function.BackendConfig/ServedFunction: no field
    mapping, the backend refuses at start-up exactly what `meshfn validate` refuses);
  - a Deployment running `python -m meshfn.inference serve` on that file. The signed artifacts
    come from an OCI image (copied into an emptyDir by an init container: image volumes are not
    in Kubernetes 1.20) or from a volume; the backend verifies their signatures against the
    trusted keys as it does outside Kubernetes;
  - a Kubernetes Service with the policy's name and port (what the Istio routes point at);
  - the ServiceAccount the pods run as: the policy's (its SPIFFE identity's) account, the
    principal Istio's AuthorizationPolicies name; the pods also carry the label the rendered
    Istio selectors match (`istio.labelKey`, `app: <name>`), so the audit WasmPlugin, the
    Telemetry, the EnvoyFilters and the repository guard select them;
  - a KEDA ScaledObject (minimum 0 pods) when the cluster has KEDA, else an
    HorizontalPodAutoscaler (autoscaling/v2beta2, the version 1.20 serves), both on the
    backend's own `meshfn_fn_inflight`. Inside a pod, instances still scale to zero by idleTtl.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from meshfn import ir
from meshfn.contracts.function import BackendConfig
from meshfn.contracts.tracing import BackendTracing

Obj = dict[str, Any]

CONFIG_DIR = "/etc/meshfn/backend"
# how often a backend looks for a new ConfigMap (the kubelet itself syncs it within ~a minute)
WATCH_CONFIG_S = 5
KEYS_DIR = "/etc/meshfn/keys"
REGISTRY_DIR = "/var/lib/meshfn/functions"
PORT = 8080
GRPC_PORT = 8081  # the backend container's KServe v2 gRPC port, when the Service speaks gRPC


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Artifacts(_Strict):
    """Where the signed function registry comes from (exactly one of image or volume)."""

    image: str | None = Field(
        None, description="OCI image holding the registry (copied from `path` at pod start)"
    )
    path: str = Field("/functions", description="the registry's folder inside that image")
    volume: dict[str, Any] | None = Field(
        None, description="a volume source instead, e.g. {persistentVolumeClaim: {claimName: x}}"
    )
    keysConfigMap: str = Field(
        "meshfn-function-keys", description="ConfigMap with the trusted ed25519 public keys"
    )


class Autoscaling(_Strict):
    minReplicas: Annotated[int, Field(ge=1)] = Field(1, description="HPA minimum (KEDA: 0)")
    maxReplicas: Annotated[int, Field(ge=1)] = 10
    targetInflight: Annotated[int, Field(ge=1)] = Field(
        4, description="average in-flight requests per pod (meshfn_fn_inflight) to scale at"
    )
    prometheus: str = Field(
        "http://prometheus.monitoring:9090",
        description="KEDA reads meshfn_fn_inflight from this Prometheus",
    )


class BackendSettings(_Strict):
    """How the operator runs inference backends (Helm values `backends`)."""

    image: str = "meshfn:0.1.0"
    imagePullPolicy: str = "IfNotPresent"
    workers: Annotated[int, Field(ge=1, le=64)] = 2
    processes: Annotated[int, Field(ge=1, le=64)] = Field(
        1,
        description="serving processes per pod sharing its port (size with the pod's CPU; each "
        "process keeps its own pools and /metrics, so the autoscaler's in-flight figure is one "
        "process's: prefer more pods unless a pod has several cores)",
    )
    resources: dict[str, Any] = Field(
        default_factory=lambda: {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        }
    )
    artifacts: Artifacts = Field(default_factory=Artifacts)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)


@dataclass(frozen=True)
class Rendered:
    """A Kubernetes object and the policy objects it comes from: (kind, namespace, name),
    namespace "" for the Mesh. They become its owners."""

    sources: tuple[tuple[str, str, str], ...]
    obj: Obj


def backend_config(
    functions: list[ir.Function], settings: BackendSettings, tracing: BackendTracing | None = None
) -> BackendConfig:
    return BackendConfig(
        registry=Path(REGISTRY_DIR),
        trustedKeys=[Path(KEYS_DIR)],
        workers=settings.workers,
        processes=settings.processes,
        functions=[v for f in functions for v in f.served_versions()],
        tracing=tracing,
    )


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "inference-backend"}


def _restart_hash(config: BackendConfig) -> str:
    """The pod template's `meshfn.io/config-hash`: a change rolls the pods. The tracing's
    sampling and tags are not in it, since the backends watch their ConfigMap and take a new
    `tracing` in place (--watch-config), as SIGHUP does under `meshfn up`; where the spans go
    is, since the sandbox fixes the peers a backend may reach when it starts."""
    kept = config.model_dump(mode="json", exclude={"tracing"})
    kept["tracing.endpoint"] = config.tracing.endpoint if config.tracing is not None else None
    text = json.dumps(kept, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _pod(
    name: str,
    config_hash: str,
    settings: BackendSettings,
    grpc: bool,
    labels: dict[str, str],
    account: str,
) -> Obj:
    art = settings.artifacts
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": f"{name}-backend"}},
        {"name": "keys", "configMap": {"name": art.keysConfigMap}},
        {"name": "tmp", "emptyDir": {}},
    ]
    init: list[Obj] = []
    if art.volume is not None:
        volumes.append({"name": "functions", **art.volume})
    else:
        volumes.append({"name": "functions", "emptyDir": {}})
        if art.image is not None:
            init.append(
                {
                    "name": "artifacts",
                    "image": art.image,
                    "imagePullPolicy": settings.imagePullPolicy,
                    "command": ["cp", "-R", f"{art.path.rstrip('/')}/.", REGISTRY_DIR],
                    "volumeMounts": [{"name": "functions", "mountPath": REGISTRY_DIR}],
                    "securityContext": _container_security(),
                }
            )
    probe = {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 5}
    container = {
        "name": "backend",
        "image": settings.image,
        "imagePullPolicy": settings.imagePullPolicy,
        "command": ["python", "-P", "-m", "meshfn.inference", "serve"],
        "args": [
            "--config",
            f"{CONFIG_DIR}/backend.yaml",
            "--host",
            "0.0.0.0",
            "--port",
            str(PORT),
            *(("--grpc-port", str(GRPC_PORT)) if grpc else ()),
            "--watch-config",
            str(WATCH_CONFIG_S),
        ],
        "ports": [
            {"name": "http", "containerPort": PORT, "protocol": "TCP"},
            *([{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}] if grpc else []),
        ],
        "readinessProbe": probe,
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": settings.resources,
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
            {"name": "functions", "mountPath": REGISTRY_DIR, "readOnly": art.image is None},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    return {
        "metadata": {
            "labels": labels,
            "annotations": {
                "meshfn.io/config-hash": config_hash,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(PORT),
            },
        },
        "spec": {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "fsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "serviceAccountName": account,
            "automountServiceAccountToken": False,
            "initContainers": init,
            "containers": [container],
            "volumes": volumes,
        },
    }


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def render_backends(
    model: ir.MeshModel,
    settings: BackendSettings,
    keda: bool,
    hpa_version: str = "v2",
    label_key: str = "app",
    collector: ir.TraceCollector | None = None,
) -> list[Rendered]:
    """Every Kubernetes object the model's Functions need, each with the policy it comes from
    (the backend's meshfn Service: deleting it garbage-collects them). `label_key`: the pod
    label the Istio renderer's selectors match (RenderOptions.label_key); `collector`: the
    cluster's trace collector where the Mesh traces without naming one."""
    by_backend: dict[str, list[ir.Function]] = {}
    for function in model.functions:
        by_backend.setdefault(function.backend, []).append(function)
    out: list[Rendered] = []
    for key in sorted(by_backend):
        service = model.service(key)
        if getattr(service, "external", False):
            continue  # runs outside the cluster: nothing to deploy
        functions = sorted(by_backend[key], key=lambda f: f.name)
        ns, name = service.namespace, service.name
        source = (("Service", ns, name),)
        # the Istio routes send KServe gRPC to this Service port (ir.Service.grpc_service_port)
        grpc_port = service.grpc_service_port if service.protocol == "http" else None
        tracing = model.tracing.backend(key, collector) if model.tracing is not None else None
        config = backend_config(functions, settings, tracing)
        text = yaml.safe_dump(
            config.model_dump(mode="json", exclude_none=True), sort_keys=False, width=100
        )
        config_hash = _restart_hash(config)
        meta = {"name": name, "namespace": ns, "labels": _labels(name)}
        account = service.identity.rsplit("/sa/", 1)[1]
        out.append(
            Rendered(
                source,
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {**meta, "name": account},
                    "automountServiceAccountToken": False,
                },
            )
        )
        out.append(
            Rendered(
                source,
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {**meta, "name": f"{name}-backend"},
                    "data": {"backend.yaml": text},
                },
            )
        )
        # No replicas: the autoscaler owns them (applying a count would fight it).
        deployment: Obj = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "selector": {"matchLabels": _labels(name)},
                "template": _pod(
                    name,
                    config_hash,
                    settings,
                    grpc_port is not None,
                    {**_labels(name), label_key: name},
                    account,
                ),
            },
        }
        out.append(Rendered(source, deployment))
        out.append(
            Rendered(
                source,
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": meta,
                    "spec": {
                        "selector": _labels(name),
                        "ports": [
                            {
                                "name": "http" if service.protocol == "http" else "grpc",
                                "port": service.port,
                                "targetPort": "http",
                                "protocol": "TCP",
                            },
                            *(
                                [
                                    {
                                        "name": "grpc-kserve",
                                        "port": grpc_port,
                                        "targetPort": "grpc",
                                        "protocol": "TCP",
                                    }
                                ]
                                if grpc_port is not None
                                else []
                            ),
                        ],
                    },
                },
            )
        )
        out.append(Rendered(source, _scaler(name, ns, settings, keda, hpa_version)))
    return out


def _scaler(name: str, ns: str, settings: BackendSettings, keda: bool, hpa_version: str) -> Obj:
    scale = settings.autoscaling
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    meta = {"name": name, "namespace": ns, "labels": _labels(name)}
    if keda:
        query = f'sum(meshfn_fn_inflight{{namespace="{ns}",app_kubernetes_io_name="{name}"}})'
        return {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": meta,
            "spec": {
                "scaleTargetRef": {"name": name},
                "minReplicaCount": 0,
                "maxReplicaCount": scale.maxReplicas,
                "triggers": [
                    {
                        "type": "prometheus",
                        "metadata": {
                            "serverAddress": scale.prometheus,
                            "query": query,
                            "threshold": str(scale.targetInflight),
                        },
                    }
                ],
            },
        }
    return {
        "apiVersion": f"autoscaling/{hpa_version}",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": target,
            "minReplicas": scale.minReplicas,
            "maxReplicas": scale.maxReplicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "meshfn_fn_inflight"},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(scale.targetInflight),
                        },
                    },
                }
            ],
        },
    }
