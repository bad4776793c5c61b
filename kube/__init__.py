"""meshfn in Kubernetes: CRDs from the policy models, the custom-resource policy source, the
apply machinery (server-side apply of what the Istio renderer produces), leader election and
the operator that wires them together. Each module sits in its own layer (pyproject.toml)."""
