"""Prometheus metrics of the backend (one registry per server, exposed at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "meshfn_fn_requests", "Inference requests by outcome", ["function", "code"], registry=r
        )
        self.latency = Histogram(
            "meshfn_fn_request_seconds",
            "Inference request latency inside the backend",
            ["function"],
            buckets=_LATENCY,
            registry=r,
        )
        self.cold_starts = Counter(
            "meshfn_fn_cold_starts",
            "Loads of a function from its artifact",
            ["function"],
            registry=r,
        )
        self.cold_start_seconds = Histogram(
            "meshfn_fn_cold_start_seconds",
            "Load (deserialize, or take from the code cache) + first instantiate of an unloaded "
            "function",
            ["function"],
            buckets=_LATENCY,
            registry=r,
        )
        self.code_cache_lookups = Counter(
            "meshfn_code_cache_lookups",
            "Loads of a function's code: hit (still deserialized in the process-wide code "
            "cache), miss (deserialized from its artifact)",
            ["function", "outcome"],
            registry=r,
        )
        self.code_cache_entries = Gauge(
            "meshfn_code_cache_entries",
            "Deserialized artifacts in the process-wide code cache: held by a loaded function, "
            "or free (kept for codeCache.ttl)",
            ["state"],
            registry=r,
        )
        self.resumes = Counter(
            "meshfn_fn_resumes",
            "First requests after the idle TTL dropped the instances but kept the code",
            ["function"],
            registry=r,
        )
        self.unloads = Counter(
            "meshfn_fn_unloads", "Idle functions unloaded (scale to zero)", ["function"], registry=r
        )
        self.trace_spans = Counter(
            "meshfn_fn_trace_spans",
            "Spans of traced requests: exported to the collector, or dropped (the export queue "
            "was full, or the collector failed or was too slow)",
            ["outcome"],
            registry=r,
        )
        self.traps = Counter(
            "meshfn_fn_instances_discarded",
            "Instances discarded after a trap, timeout or out-of-memory",
            ["function", "reason"],
            registry=r,
        )
        self.loaded = Gauge(
            "meshfn_fn_loaded",
            "1 while the function's artifact is loaded",
            ["function"],
            registry=r,
        )
        self.idle = Gauge(
            "meshfn_fn_idle_instances", "Pre-instantiated idle instances", ["function"], registry=r
        )
        self.inflight = Gauge(
            "meshfn_fn_inflight",
            "Requests running or waiting for a worker",
            ["function"],
            registry=r,
        )
        self.batch_size = Histogram(
            "meshfn_fn_batch_rows",
            "Rows per guest call (dynamic batching merges requests into one call)",
            ["function"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096),
            registry=r,
        )
        self.qos_requests = Counter(
            "meshfn_qos_requests",
            "Requests of functions with a QoSPolicy, per verified tenant and class, by outcome "
            "(admitted, limited: a tenant limit, shed: saturation)",
            ["function", "tenant", "tenant_class", "outcome"],
            registry=r,
        )
        self.qos_cpu = Counter(
            "meshfn_qos_guest_cpu_seconds",
            "Guest CPU time attributed to each tenant (batched calls split by rows)",
            ["function", "tenant", "tenant_class"],
            registry=r,
        )
        self.qos_budget = Gauge(
            "meshfn_qos_budget_used_ms",
            "Guest CPU milliseconds a tenant used in its current compute-budget window",
            ["function", "tenant", "tenant_class", "window"],
            registry=r,
        )
        self.cold_requests = Counter(
            "meshfn_fn_cold_requests",
            "Requests that found no idle instance and waited for one (load or instantiate)",
            ["function"],
            registry=r,
        )
        self.warm_seconds = Counter(
            "meshfn_fn_warm_instance_seconds",
            "Instance-seconds idle instances were kept warm (the memory cost of warmth)",
            ["function"],
            registry=r,
        )
        self.warmup_predictions = Counter(
            "meshfn_fn_warmup_predictions",
            "Predicted warm-ups that were started, or whose request came before they could be",
            ["function"],
            registry=r,
        )
        self.warmup_hits = Counter(
            "meshfn_fn_warmup_hits",
            "Requests that arrived in a predicted window to a warmed instance",
            ["function"],
            registry=r,
        )
        self.warmup_misses = Counter(
            "meshfn_fn_warmup_misses",
            "Predictions that failed: early (a request before the instance was ready), expired "
            "(no request in the window: released)",
            ["function", "reason"],
            registry=r,
        )
        self.warmup_skipped = Counter(
            "meshfn_fn_warmup_skipped",
            "Predicted warm-ups not started: budget (memory budget full), pressure (low memory)",
            ["function", "reason"],
            registry=r,
        )
        self.shadow_comparisons = Counter(
            "meshfn_fn_shadow_comparisons",
            "Mirrored requests of a rollout answered by the candidate and the stable version on "
            "the same input, by outcome (agree, disagree, candidate_error, stable_error)",
            ["function", "outcome"],
            registry=r,
        )
        self.refused = Gauge(
            "meshfn_fn_refused", "1 if the function failed verification", ["function"], registry=r
        )

    def trace_spans_counters(self) -> tuple[Counter, Counter]:
        """(exported, dropped): the tracer's exporter counts into them."""
        return self.trace_spans.labels("exported"), self.trace_spans.labels("dropped")
