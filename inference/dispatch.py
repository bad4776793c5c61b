"""The one way into a function's guest, shared by the REST and gRPC front ends and by dynamic
batching: admission (draining, refusals, protocol switches, repository unloads, the concurrency
limit), deadlines, the worker-thread hand-off, outcome -> status mapping, statistics, metrics.

A front end resolves the function, then calls `Dispatcher.serve` with two callables of its own
protocol: `parse` (body -> InferRequest, raising KServeError) and `encode` (Completed -> its
response). Nothing protocol-specific happens here, and nothing here is duplicated there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Literal, TypeVar

from meshfn.common import env
from meshfn.common.logs import trace_context

from .batching import Batcher
from .engine import EPOCH_TICK_S, deadline_ticks
from .gate import WorkerGate
from .host import GuestRequest, Outcome
from .kserve import InferRequest, KServeError
from .ledger import TokenLedger
from .metrics import Metrics
from .pool import FunctionRuntime, Invocation, Refused
from .qos import Admission, Ticket
from .results import Completed, completed, deadline_error, failure
from .stats import ModelStats, Timing
from .tracing import RequestSpan, Tracer, record_call
from .warmup import WarmBudget, Warmer

log = logging.getLogger("meshfn.inference")

Protocol = Literal["rest", "grpc"]
T = TypeVar("T")

# A loaded core function first runs on the event loop itself, with a deadline of this many
# epoch ticks (5-10 ms): the call (2-30 us) costs less than the two thread hand-offs (~70-130
# us each). The slice bounds how long the loop is held (the ticker thread advances the epoch
# while ctypes has released the GIL). A call the slice interrupts runs again, from the start
# on a fresh instance, on a worker thread with what is left of its deadline: core guests import
# nothing, so a call has no effect outside its instance, and the interrupted instance is
# discarded. A deadline shorter than the slice is simply the deadline.
INLINE_SLICE_TICKS = 2
SLICE_SECONDS = INLINE_SLICE_TICKS * EPOCH_TICK_S
# A Python function runs there too while its recent guest calls took at most this long and an
# idle instance is ready: the hand-off costs it more than the hop saves, because the guest
# thread and the event loop then trade the GIL on every host call (measured, bench/coldstart.py:
# 650-820 us of backend CPU per iris request with the hop, 400-640 us inline; two processes
# 2,576-2,764 -> 3,381-4,733 req/s). Its calls (0.4-1 ms) stay far inside the slice, so the
# loop is held briefly and an interrupted call is rare. A component's only imports are WASI
# with nothing preopened, no environment and stdio discarded, so re-running one from the start
# on a fresh instance has no effect outside it either. A cold call (no idle instance) and a
# function whose calls grew longer stay on the worker threads.
INLINE_PYTHON_MAX_S = 0.002
# MESHFN_INLINE_CORE=0 / MESHFN_INLINE_PYTHON=0 turn them off (the levers in bench/coldstart.py),
# read when a Dispatcher is made (meshfn.common.env).
_CALL_EWMA_WEIGHT = 0.2  # of the newest call in a Python function's recent call time


class Lane:
    """The event-loop side of one served function: its statistics and, with batching, its
    batch queue. (FunctionRuntime is the worker-thread side: instances and code.)"""

    def __init__(self, dispatcher: Dispatcher, rt: FunctionRuntime) -> None:
        self.rt = rt
        # The label children, looked up once: `labels()` costs ~5 us a call, several per request.
        metrics = dispatcher.metrics
        self.latency = metrics.latency.labels(rt.label)
        # read when /metrics is scraped: no gauge update per request (the count itself is
        # rt.inflight, kept by the dispatcher either way)
        metrics.inflight.labels(rt.label).set_function(lambda: rt.inflight)
        self.batch_rows = metrics.batch_size.labels(rt.label)
        self._requests = metrics.requests
        self._by_status: dict[int, Any] = {}
        self.stats = ModelStats()
        settings = rt.spec.batching
        self.batcher = Batcher(self, settings, dispatcher.slots) if settings is not None else None
        qos = rt.spec.qos
        self.admission = (
            Admission(
                rt.label, qos, rt.spec.limits.maxConcurrency, metrics, rt.name, dispatcher.ledger
            )
            if qos is not None
            else None
        )
        self._dispatcher = dispatcher
        self.recent_call_s: float | None = None  # Python functions: see INLINE_PYTHON_MAX_S
        self.warmer = (
            Warmer(
                rt,
                rt.spec.warmup,
                dispatcher.warm_budget,
                dispatcher.prewarm_executor,
                metrics,
                dispatcher.under_pressure,
            )
            if rt.spec.warmup.mode == "predictive" and dispatcher.prewarm_executor is not None
            else None
        )

    @property
    def inline(self) -> bool:
        """Run the guest call on the event loop first (see INLINE_SLICE_TICKS): a loaded core
        function (its load, a file read, stays on a worker thread), or a Python function with
        an idle instance whose recent calls were short (INLINE_PYTHON_MAX_S)."""
        rt = self.rt
        if not rt.loaded or rt.verified is None:
            return False
        if rt.verified.kind != "python":  # core modules: ABI v1 and compiled models (v2)
            return self._dispatcher.inline_core
        recent = self.recent_call_s
        return (
            self._dispatcher.inline_python
            and recent is not None
            and recent <= INLINE_PYTHON_MAX_S
            and rt.idle_instances > 0
        )

    def _observed(self, invocation: Invocation, sliced: bool) -> Invocation:
        """Keep a Python function's recent call time; a call the slice interrupted counts as
        the whole slice, so the next calls go to the worker threads until they are short."""
        if self.rt.verified is not None and self.rt.verified.kind == "python":
            took = SLICE_SECONDS if sliced else invocation.seconds
            last = self.recent_call_s
            self.recent_call_s = took if last is None else last + _CALL_EWMA_WEIGHT * (took - last)
        return invocation

    def _ticks_left(self, deadline: float | None) -> int | None:
        """Epoch ticks until `deadline` (None without one); a deadline already past is the
        504 of a call that found no worker in time."""
        if deadline is None:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise deadline_error(self.rt, "before a worker was free")
        return deadline_ticks(remaining)

    async def call(
        self, text: GuestRequest, deadline: float | None, priority: int = 0
    ) -> Invocation:
        """One guest call on a worker thread, never past `deadline` (monotonic seconds); a
        call that waits for a thread waits behind this function's higher `priority` (gate.py)."""
        ticks = self._ticks_left(deadline)
        try:
            if self.inline:
                full = min(ticks, self.rt.ticks) if ticks else self.rt.ticks
                started = time.monotonic()
                invocation = self.rt.invoke(
                    text, min(full, INLINE_SLICE_TICKS), full > INLINE_SLICE_TICKS
                )
                if full <= INLINE_SLICE_TICKS or invocation.result.outcome is not Outcome.TIMEOUT:
                    return self._observed(invocation, sliced=False)
                self._observed(invocation, sliced=True)
                if deadline is None:
                    deadline = started + self.rt.spec.limits.timeout.total_seconds()
                remaining = deadline - time.monotonic()
                if remaining <= 0:  # the slice was all the deadline had left: a timeout
                    self.rt.metrics.traps.labels(self.rt.label, Outcome.TIMEOUT.value).inc()
                    return invocation
                ticks = deadline_ticks(remaining)
            gate = self._dispatcher.gate
            wait = None if deadline is None else deadline - time.monotonic()
            try:
                await gate.acquire(self, priority, wait)
            except TimeoutError:
                raise deadline_error(self.rt, "before a worker was free") from None
            try:
                ticks = self._ticks_left(deadline)  # what is left of it once a thread is free
                loop = asyncio.get_running_loop()
                invocation = await loop.run_in_executor(
                    self._dispatcher.executor, self.rt.invoke, text, ticks
                )
            finally:
                gate.release()
            return self._observed(invocation, sliced=False)
        except Refused as exc:
            raise KServeError(exc.status, str(exc)) from None
        except KServeError:
            raise
        except Exception as exc:
            log.exception("invoke failed", extra={"function": self.rt.label})
            raise KServeError(500, f"function {self.rt.label} could not run: {exc}") from None

    def executed(self, rows: int) -> None:
        """A guest call of `rows` rows ran (the metric; statistics record it with durations)."""
        self.batch_rows.observe(rows)

    def answered(self, status: int, seconds: float) -> None:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self._requests.labels(self.rt.label, str(status))
        counter.inc()
        self.latency.observe(seconds)
        self.rt.latencies.append(seconds)  # the status endpoint's recent p50/p99

    async def alone(
        self,
        request: InferRequest,
        timing: Timing,
        deadline: float | None,
        priority: int = 0,
        span: RequestSpan | None = None,
    ) -> Completed:
        """The request as its own guest call (its execution statistics are recorded once its
        response is encoded)."""
        started = time.perf_counter_ns()
        text = self.rt.guest_request(request)
        timing.started = time.perf_counter_ns()
        timing.compute_input = timing.started - started
        invocation = await self.call(text, deadline, priority)
        timing.compute_infer = round(invocation.seconds * 1e9)
        timing.guest_cpu_ns += invocation.cpu_ns
        if span is not None and span.sampled:
            made = invocation.cold_start
            span.child("queue", timing.admitted, made.begin if made else invocation.started_ns)
            record_call(span, invocation)
        self.executed(request.rows)
        if invocation.result.outcome is not Outcome.OK:
            raise failure(self.rt, invocation.result)
        return completed(self.rt, invocation.result)


class Dispatcher:
    def __init__(
        self,
        executor: Executor,
        metrics: Metrics,
        slots: int,
        prewarm_executor: Executor | None = None,
        warm_budget: WarmBudget | None = None,
        under_pressure: Callable[[], bool] = lambda: False,
        tracer: Tracer | None = None,
    ) -> None:
        self.executor = executor
        self.tracer = tracer or Tracer(None)
        self.metrics = metrics
        self.slots = slots  # guest calls one function may run at once (the worker threads)
        self.gate = WorkerGate(slots)  # who gets the next free worker thread
        self.prewarm_executor = prewarm_executor  # predicted warm-ups (None: none)
        self.warm_budget = warm_budget or WarmBudget(0)
        self.under_pressure = under_pressure
        self.ledger: TokenLedger | None = None  # the mesh's token budgets (None: local)
        # guest calls on the event loop first (see INLINE_SLICE_TICKS), unless turned off
        self.inline_core = env.INLINE_CORE.enabled()
        self.inline_python = env.INLINE_PYTHON.enabled()
        self.lanes: dict[str, Lane] = {}
        self.inflight = 0
        self.draining = False
        self.drained = asyncio.Event()  # set whenever no request is in flight
        self.drained.set()

    def lane(self, rt: FunctionRuntime) -> Lane:
        lane = self.lanes.get(rt.label)
        if lane is None:
            lane = self.lanes[rt.label] = Lane(self, rt)
        return lane

    def admit(self, rt: FunctionRuntime, protocol: Protocol) -> None:
        if self.draining:
            raise KServeError(503, "the inference backend is shutting down")
        if rt.refusal is not None:
            raise KServeError(rt.refusal.status, str(rt.refusal))
        if rt.signature is None:  # still being verified (start-up): come back, not a refusal
            raise KServeError(503, f"function {rt.label} is being verified (starting up)")
        if not getattr(rt.spec.protocols, protocol):
            raise KServeError(
                404,
                f"model {rt.name} is not served over {protocol.upper() if protocol == 'rest' else 'gRPC'} "
                f"(its Function sets protocols.{protocol}: false)",
            )
        if not rt.available:
            raise KServeError(
                503, f"model {rt.label} is unloaded (POST /v2/repository/models/{rt.name}/load)"
            )

    async def serve(
        self,
        rt: FunctionRuntime,
        protocol: Protocol,
        parse: Callable[[], InferRequest],
        encode: Callable[[Completed, InferRequest], T],
        tenant: str = "",
        span: RequestSpan | None = None,
    ) -> T:
        """Admit, parse, run (alone or batched), encode; errors are KServeError. `tenant`: the
        verified tenant (qos.tenant_of), for functions a QoSPolicy binds. The concurrency
        limit and QoS admission come before parsing, so a refused (shed) request costs no
        decoding of its tensors. `span`: the request's trace (tracing.Tracer.begin), finished
        here, its ids on every log line meanwhile."""
        token = trace_context.set(span.ids) if span is not None else None
        started = time.perf_counter()
        status = 500
        lane = self.lane(rt)
        try:
            self.admit(rt, protocol)
            # QoS first: at saturation a low-priority request is shed by name (limit "shed"),
            # not refused as anyone's excess by the function's own limit
            admission = lane.admission
            ticket = admission.admit(tenant) if admission is not None else None
            try:
                limit = rt.spec.limits.maxConcurrency
                if rt.inflight >= limit:
                    raise KServeError(
                        429, f"function {rt.label} is at its concurrency limit ({limit})"
                    )
                request = parse()
                if rt.tensors is not None:  # a compiled model's batch checks, before any queue
                    rt.tensors.rows(request, lane.batcher is not None and lane.batcher.split)
            except BaseException:
                if ticket is not None:
                    ticket.done(0)
                raise
            if span is not None:
                span.child("admission", span.start, time.perf_counter_ns())
            result = await self._run(rt, lane, request, encode, ticket, span)
            status = 200
            return result
        except KServeError as exc:
            status = exc.status
            raise
        finally:
            lane.answered(status, time.perf_counter() - started)
            if span is not None and span.sampled:
                self.finish_span(span, rt, protocol, status, tenant)
            if token is not None:
                trace_context.reset(token)

    def finish_span(
        self, span: RequestSpan, rt: FunctionRuntime, protocol: Protocol, status: int, tenant: str
    ) -> None:
        """A request's server span ends with what every request's has (a generation's too)."""
        span.attrs.update(
            {
                "meshfn.model": rt.name,
                "meshfn.version": rt.version,
                "meshfn.protocol": protocol,
                "http.response.status_code": status,
            }
        )
        if tenant and rt.spec.qos is not None:  # the sidecar's verified claim
            span.attrs["meshfn.tenant"] = tenant
        self.tracer.finish(span, status)

    async def _run(
        self,
        rt: FunctionRuntime,
        lane: Lane,
        request: InferRequest,
        encode: Callable[[Completed, InferRequest], T],
        ticket: Ticket | None,
        span: RequestSpan | None = None,
    ) -> T:
        timing = Timing(time.perf_counter_ns())
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        priority = ticket.state.priority if ticket is not None else 0
        if lane.warmer is not None:
            lane.warmer.arrived(rt.inflight)
        rt.inflight += 1
        self.inflight += 1
        self.drained.clear()
        ok = False
        try:
            batched = lane.batcher is not None
            if lane.batcher is not None:
                completed = await lane.batcher.submit(request, timing, deadline, priority, span)
            else:
                completed = await lane.alone(request, timing, deadline, priority, span)
            before = time.perf_counter_ns()
            result = encode(completed, request)
            timing.compute_output += time.perf_counter_ns() - before
            if not batched:
                lane.stats.execution(
                    request.rows,
                    timing.compute_input,
                    timing.compute_infer,
                    timing.compute_output,
                )
            ok = True
            return result
        finally:
            if ticket is not None:
                ticket.done(timing.guest_cpu_ns)
            rt.inflight -= 1
            self.inflight -= 1
            if not self.inflight:
                self.drained.set()
            rt.last_used = time.monotonic()
            if lane.warmer is not None:
                lane.warmer.finished(rt.inflight)
            lane.stats.request(timing, ok, request.rows if rt.batch_dimension else 1)
