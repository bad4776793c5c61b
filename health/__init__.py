"""Health feedback: what Envoy reports about upstreams, fed back into the configuration."""
