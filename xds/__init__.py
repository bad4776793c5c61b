"""meshfn xDS: MeshModel -> Envoy resources, the snapshot cache and the ADS server."""
