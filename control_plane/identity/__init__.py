"""Workload identity in embedded mode: the mesh CA and SPIFFE certificates (`ca`, `spiffe`),
what a proxy receives and how it is kept fresh through rotations (`credentials`, `manager`), the
bootstrap tokens that bind an ADS stream to its workload (`bootstrap_token`), and the local JWT
issuer behind `meshfn token issue` (`issuer`)."""
