"""meshfn's composition root for embedded mode: what wires the stages together and runs them.

- `cli`: the `meshfn` command, one module per command group (the audit trail's, the operator's
  and the inference backend's own sub-apps are mounted there).
- `runtime`: the processes of `meshfn up` and `meshfn serve`: Envoys, inference backends and
  placeholder upstreams, supervised by PID; the admin port and its web console; eBPF.
- `service`: the reload loop (policies -> MeshModel -> snapshots -> ADS, hot reload), and
  `analyze`, the findings of `meshfn analyze`.
- `identity`: who a proxy is and what it may hold: the mesh CA, workload certificates, xDS
  bootstrap tokens, the local JWT issuer.

The stages it composes live beside it: the policy model and compiler (meshfn.policy), the IR
(meshfn.ir), the Envoy and Istio renderers (meshfn.xds, meshfn.istio), the audit trail
(meshfn.audit), the drift breaker (meshfn.health), the inference backend (meshfn.inference) and
the Kubernetes operator (meshfn.kube, Kubernetes mode's composition root).
"""
