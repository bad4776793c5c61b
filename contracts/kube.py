"""Names every Kubernetes-facing stage shares: the meshfn API group, each kind's plural, short
name and scope, and the labels and annotations meshfn puts on what it creates.

Plain strings, no imports: the CRD generator, the policy source, the apply machinery and the CLI
read these, and none of them owns the others. A test checks the kinds against the policy models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GROUP = "meshfn.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "meshfn"
FIELD_MANAGER = "meshfn"


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    short: str
    scope: Literal["Namespaced", "Cluster"]

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


KINDS: tuple[Kind, ...] = (
    Kind("Mesh", "meshes", "mfmesh", "Cluster"),
    Kind("Gateway", "gateways", "mfgw", "Namespaced"),
    Kind("Service", "services", "mfsvc", "Namespaced"),
    Kind("Route", "routes", "mfroute", "Namespaced"),
    Kind("Function", "functions", "mffn", "Namespaced"),
    Kind("PeerAuthentication", "peerauthentications", "mfpa", "Namespaced"),
    Kind("RequestAuthentication", "requestauthentications", "mfra", "Namespaced"),
    Kind("AuthorizationPolicy", "authorizationpolicies", "mfap", "Namespaced"),
    Kind("FallbackPolicy", "fallbackpolicies", "mffp", "Namespaced"),
    Kind("QoSPolicy", "qospolicies", "mfqos", "Namespaced"),
    Kind("Rollout", "rollouts", "mfro", "Namespaced"),
)
BY_KIND = {k.kind: k for k in KINDS}

# On every object meshfn creates: who manages it (and prunes it), and which configuration.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "meshfn.io/part-of"  # the controller instance (Helm release) that owns it
ANNOTATION_HASH = "meshfn.io/applied-hash"  # sha256 of what meshfn last applied
ANNOTATION_SOURCE = "meshfn.io/source"  # "Kind namespace/name" of the meshfn object it renders

# Condition types and reasons on every meshfn object's status.
CONDITION_ACCEPTED = "Accepted"
CONDITION_INVALID = "Invalid"
