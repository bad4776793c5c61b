"""Prometheus metrics of the backend (one registry per server, exposed at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshfn.contracts import genai

_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
# OpenTelemetry's GenAI conventions' advisory buckets (token counts, and seconds)
_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
         0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
_GEN_DURATION = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
                 81.92)  # fmt: skip


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
        self.qos_tokens = Gauge(
            "meshfn_qos_tokens_used",
            "Tokens (prompt + completion) a tenant's generative requests used in its current "
            "token-budget window",
            ["function", "tenant", "tenant_class", "window"],
            registry=r,
        )
        self.qos_ledger_errors = Counter(
            "meshfn_qos_ledger_errors",
            "Calls to the control plane's token ledger that failed (call: reserve, settle)",
            ["call"],
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
        self._generation(r)

    def trace_spans_counters(self) -> tuple[Counter, Counter]:
        """(exported, dropped): the tracer's exporter counts into them."""
        return self.trace_spans.labels("exported"), self.trace_spans.labels("dropped")

    def _generation(self, r: CollectorRegistry) -> None:
        """Generative functions: OpenTelemetry's GenAI metrics (names: contracts.genai), and
        what the decode loop does."""

        def histogram(
            name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
        ) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.gen_tokens = histogram(
            genai.PROM_TOKEN_USAGE,
            f"{genai.TOKEN_USAGE}: tokens per request, input (prompt) or output (completion), "
            "as the model counts them",
            genai.TOKEN_LABELS,
            _TOKENS,
        )
        self.gen_ttft = histogram(
            genai.PROM_TIME_TO_FIRST_TOKEN,
            f"{genai.TIME_TO_FIRST_TOKEN}: from a generation's start to its first token",
            genai.LABELS,
            _TTFT,
        )
        self.gen_tpot = histogram(
            genai.PROM_TIME_PER_OUTPUT_TOKEN,
            f"{genai.TIME_PER_OUTPUT_TOKEN}: a generation's time per output token after the first",
            genai.LABELS,
            _TPOT,
        )
        self.gen_duration = histogram(
            genai.PROM_REQUEST_DURATION,
            f"{genai.REQUEST_DURATION}: a generative request from its start to its end "
            "(error_type set when it failed or was cancelled)",
            genai.DURATION_LABELS,
            _GEN_DURATION,
        )
        self.gen_finished = Counter(
            "meshfn_gen_streams",
            "Generations by how they ended (finish: stop, length, budget, deadline, cancelled, "
            "error)",
            ["function", "finish"],
            registry=r,
        )
        self.gen_step_rows = Histogram(
            "meshfn_gen_step_rows",
            "Streams per decode-step call (continuous batching puts several in one)",
            ["function"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
