"""Render options: how meshfn's names map onto a cluster (labels, namespaces, hosts, URLs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshfn import ir
from meshfn.contracts.plugins import SubjectSalt

# For offline rendering and golden files only: `meshfn render istio` passes the state
# directory's salt (the same one the control plane uses).
OFFLINE_SALT = SubjectSalt("00" * 32)


@dataclass(frozen=True)
class RenderOptions:
    """Defaults fit the Helm chart (manifests/) installed as release `meshfn-control-plane` in
    `meshfn-system` (its Services `meshfn-control-plane`, admin port 9090 serving /wasm/, and
    `meshfn-control-plane-als`), and workloads that carry `app: <name>`."""

    # meshfn selects a Service (its sidecars) or a Gateway by name; Istio by pod labels.
    label_key: str = "app"
    # Mesh-wide policies (the Mesh's mTLS default) go to Istio's root namespace.
    root_namespace: str = "istio-system"
    # Hosts are <service>.<namespace>.svc.<cluster domain>.
    cluster_domain: str = "cluster.local"
    # Filter modules are fetched from <base><sha256>.wasm (http(s)://, checked against sha256)
    # or <base>/<build>:<sha256> (oci://); the Kubernetes control plane serves the first,
    # content-addressed, on its admin port.
    wasm_base_url: str = "http://meshfn-control-plane.meshfn-system.svc:9090/wasm/"
    # The control plane's in-cluster access-log Service: the drift breaker's stream.
    control_plane_host: str = "meshfn-control-plane-als.meshfn-system.svc.cluster.local"
    # Where istio-proxy writes the audit journal (a volume the audit collector reads).
    journal_path: str = "/var/run/meshfn/journal/audit.jsonl"
    # The audit filter's subject salt (a secret: it ends up in the WasmPlugins' pluginConfig).
    salt: SubjectSalt = field(default=OFFLINE_SALT, repr=False)
    # The OTLP collector where Mesh.spec.tracing names none (the Helm value tracing.collector).
    collector: ir.TraceCollector | None = None

    def host(self, service_key: str) -> str:
        namespace, name = service_key.split("/", 1)
        return f"{name}.{namespace}.svc.{self.cluster_domain}"

    def labels(self, workload: str) -> dict[str, str]:
        return {self.label_key: workload}

    def wasm_url(self, build: str, sha256: str) -> str:
        base = self.wasm_base_url
        if base.startswith("oci://"):
            return f"{base.rstrip('/')}/{build}:{sha256}"
        return f"{base if base.endswith('/') else base + '/'}{sha256}.wasm"


DEFAULT = RenderOptions()
