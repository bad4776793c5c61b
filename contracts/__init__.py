"""Vocabulary that two stages share and neither owns (docs/concepts/architecture.md, "Contracts").

- `plugins`: the plugin-configuration JSON of the proxy-wasm filters (xDS translator, Istio
  renderer, the C filters);
- `journal`: where a proxy's audit journal lives (translator writes the path into Envoy's access
  log, the collector reads it);
- `function`: a Function's serving settings, one schema from the policy file to the inference
  backend's configuration.

Leaf modules: they import nothing else of meshfn.
"""
