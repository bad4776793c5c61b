"""meshfn control plane: policies, the MeshModel IR, the CLI and process supervision."""
