"""Envoy configuration fragments built from the IR, one builder per piece for both renderers:
the xDS translator (meshfn.xds.translate) and the Istio renderer's EnvoyFilter patches and
WasmPlugin settings (meshfn.istio) build the same piece here, so the two cannot drift apart.

- routes: a route's match, the degraded twin's match and weighted clusters, its retry policy;
  messages (the translator builds them per route; the Istio renderer writes them with
  messages.envoy_json);
- qos: multi-tenant QoS at a gateway (rate limits, their local replies, shedding), as Envoy's
  JSON (the translator parses it once per policy);
- plugins: the settings of meshfn's proxy-wasm filters and the audit access log's fields;
- headers: the early removal of headers a client may not send (internal, trace context);
- messages: protobuf helpers (an Any, a Duration, a message as Envoy's JSON).

Pure: IR and contracts in, configuration out; nothing here knows a renderer.
"""
