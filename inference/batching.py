"""Dynamic batching (Triton's dynamic batcher, per function): concurrent requests with the same
parameters, requested outputs and trailing dimensions are merged along the first dimension
into one guest call, and the outputs are split back per request.

A batch is formed when a worker is free: the oldest queued request and every compatible one
after it, up to `maxBatchSize` rows. It goes at once when it is full or has a preferred size
(or can be cut to the largest preferred size); otherwise it waits for more requests until its
oldest member has waited `maxQueueDelay`. At most `slots` batches of one function run at once,
so under load the queue fills while the workers are busy and batches form by themselves.

Each request keeps its own outcome: a request whose deadline passes in the queue gets 504 and
is never run; if a merged call fails, or its outputs cannot be split, each member is retried
alone while its deadline allows, so only the request that caused the failure gets the error.
Admission, concurrency limits and statistics stay in dispatch.py, shared with unbatched calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from meshfn.contracts.function import FunctionBatching

from .host import CallResult, GuestRequest, Outcome
from .kserve import InferRequest, Input, KServeError, Output
from .pool import FunctionRuntime, Invocation
from .results import Completed, completed, deadline_error, failure
from .stats import ModelStats, Timing
from .tensors import TensorError, _in_order, element_count, frame, unframe

log = logging.getLogger("meshfn.inference")


@dataclass(slots=True, eq=False)
class Pending:
    request: InferRequest
    key: str
    rows: int
    timing: Timing
    deadline: float  # monotonic
    enqueued: float
    priority: int  # its tenant class's (QoSPolicy), 0 without one
    future: asyncio.Future[Completed] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Lane(Protocol):
    """What a batch runs through (dispatch.Lane): the one guest-call path and its records."""

    rt: FunctionRuntime
    stats: ModelStats

    async def call(
        self, text: GuestRequest, deadline: float | None, priority: int = 0
    ) -> Invocation: ...

    def executed(self, rows: int) -> None: ...


class Batcher:
    def __init__(self, lane: Lane, settings: FunctionBatching, slots: int) -> None:
        self.lane = lane
        self.max = settings.maxBatchSize
        self.preferred = frozenset(settings.preferredBatchSizes)
        self.delay = settings.maxQueueDelay.total_seconds()
        self.split = settings.oversize == "split"
        self.slots = slots
        self.running = 0
        self.queue: deque[Pending] = deque()
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        rt = lane.rt
        # A request may wait for its batch, then run: both within its deadline.
        self.allowance = self.delay + rt.spec.limits.timeout.total_seconds()

    def most(self) -> int:
        """Rows per guest call: maxBatchSize, or fewer where a compiled model's memory limit
        holds fewer (tensorio.py)."""
        tensors = self.lane.rt.tensors
        return self.max if tensors is None else max(1, min(self.max, tensors.max_rows))

    # ------------------------------------------------------------------ requests

    async def submit(
        self, request: InferRequest, timing: Timing, deadline: float | None, priority: int = 0
    ) -> Completed:
        rt = self.lane.rt
        rows = request.rows
        if any(t.shape[0] != rows for t in request.inputs):
            dims = ", ".join(f"{t.name} {t.shape[0]}" for t in request.inputs)
            raise KServeError(400, f"inputs of {rt.label} disagree on the batch dimension ({dims})")
        now = time.monotonic()
        own = now + self.allowance
        deadline = own if deadline is None else min(deadline, own)
        most = self.most()
        if rows <= most:
            return await self._enqueue(request, rows, timing, deadline, now, priority)
        if not self.split:
            raise KServeError(
                400,
                f"request has {rows} rows but {rt.label} takes at most {self.max} per call "
                "(its Function sets batching.maxBatchSize and oversize: refuse)",
            )
        chunks = [
            slice_rows(request, start, min(start + most, rows)) for start in range(0, rows, most)
        ]
        parts = await asyncio.gather(
            *(self._enqueue(c, c.rows, timing, deadline, now, priority) for c in chunks)
        )
        try:
            return join([p.parsed(rt.label) for p in parts])
        except TensorError as exc:
            raise KServeError(500, f"function {rt.label} returned {exc}") from None

    async def _enqueue(
        self,
        request: InferRequest,
        rows: int,
        timing: Timing,
        deadline: float,
        now: float,
        priority: int,
    ) -> Completed:
        pending = Pending(request, request.batch_key(), rows, timing, deadline, now, priority)
        self.queue.append(pending)
        self.changed.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(
                self._schedule(), name=f"meshfn-batcher-{self.lane.rt.label}"
            )
        return await pending.future

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()

    # ------------------------------------------------------------------ scheduling

    async def _schedule(self) -> None:
        while True:
            if not self.queue or self.running >= self.slots:
                if not self.queue and not self.running:
                    return  # idle: the next submit starts a new scheduler
                await self._wait(None)
                continue
            wait, batch = self._take(time.monotonic())
            if batch is None:
                await self._wait(wait)
                continue
            self.running += 1
            asyncio.get_running_loop().create_task(self._run_slot(batch))

    async def _wait(self, timeout: float | None) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)

    def _take(self, now: float) -> tuple[float | None, list[Pending] | None]:
        """The next batch, or how long to wait for it to fill."""
        self._drop_expired(now)
        if not self.queue:
            return None, None
        # highest priority first, oldest first within one (a stable sort keeps arrival order)
        ordered = sorted(self.queue, key=_by_priority) if self._prioritised() else self.queue
        chosen, ready = self._fill(ordered)
        waited = now - min(p.enqueued for p in chosen)  # its oldest member's wait
        if not ready and waited < self.delay:
            return self.delay - waited, None
        for p in chosen:
            self.queue.remove(p)
        return None, chosen

    def _drop_expired(self, now: float) -> None:
        """Forget requests whose client went away; fail those past their deadline."""
        for p in list(self.queue):
            if p.future.done():  # the client went away
                self.queue.remove(p)
            elif now >= p.deadline:
                self.queue.remove(p)
                p.future.set_exception(deadline_error(self.lane.rt, "while queued for a batch"))

    def _fill(self, ordered: Sequence[Pending]) -> tuple[list[Pending], bool]:
        """The head's batch: the requests compatible with the first, up to the maximum rows,
        cut to the largest preferred size it reaches; and whether it may run now (full, or
        at a preferred size)."""
        head = ordered[0]
        chosen: list[Pending] = []
        rows = 0
        most = self.most()
        for p in ordered:
            if p.key != head.key:
                continue
            if rows + p.rows > most and chosen:
                break
            chosen.append(p)
            rows += p.rows
            if rows >= most:
                break
        ready = rows >= most or rows in self.preferred
        if not ready and self.preferred:
            total, cut = 0, 0
            for i, p in enumerate(chosen):
                total += p.rows
                if total in self.preferred:
                    cut = i + 1
            if cut:
                chosen, ready = chosen[:cut], True
        return chosen, ready

    def _prioritised(self) -> bool:
        first = self.queue[0].priority
        return any(p.priority != first for p in self.queue)

    async def _run_slot(self, batch: list[Pending]) -> None:
        try:
            await self._run(batch)
        except Exception as exc:  # a bug here must not strand the callers
            log.exception("batch failed", extra={"function": self.lane.rt.label})
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(KServeError(500, f"batch failed: {exc}"))
        finally:
            self.running -= 1
            self.changed.set()

    async def _run(self, batch: list[Pending]) -> None:
        lane, rt = self.lane, self.lane.rt
        started = time.perf_counter_ns()
        rows = sum(p.rows for p in batch)
        request = batch[0].request if len(batch) == 1 else merge([p.request for p in batch])
        called = started
        try:
            text = rt.guest_request(request)  # a 400 here fails the batch's members alike
            called = time.perf_counter_ns()
            invocation = await lane.call(
                text,
                min(p.deadline for p in batch) if len(batch) == 1 else None,
                max(p.priority for p in batch),
            )
        except KServeError as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        returned = time.perf_counter_ns()
        for p in batch:  # the guest ran for each of them: its CPU time, shared by rows
            p.timing.guest_cpu_ns += invocation.cpu_ns * p.rows // rows
        infer_ns = round(invocation.seconds * 1e9)
        result = invocation.result
        shares = self._shares(batch, result) if result.outcome is Outcome.OK else None
        lane.stats.execution(rows, called - started, infer_ns, time.perf_counter_ns() - returned)
        lane.executed(rows)
        if shares is not None:
            for p, share in zip(batch, shares, strict=True):
                p.timing.started = called
                p.timing.compute_input = called - started
                p.timing.compute_infer = infer_ns
                if not p.future.done():
                    p.future.set_result(share)
            return
        await self._failed(batch, result)

    def _shares(self, batch: list[Pending], result: CallResult) -> list[Completed] | None:
        """Each member's part of a successful call's outputs; None when a merged call's
        outputs cannot be split by rows (each member then runs alone)."""
        rt = self.lane.rt
        if len(batch) == 1:
            return [completed(rt, result)]
        try:
            outputs, params = completed(rt, result).parsed(rt.label)
            return [Completed(None, o, params) for o in split(outputs, [p.rows for p in batch])]
        except (KServeError, TensorError, ValueError) as exc:
            log.warning(
                "batched outputs cannot be split; running each request alone",
                extra={"function": rt.label, "reason": str(exc)},
            )
            return None

    async def _failed(self, batch: list[Pending], result: CallResult) -> None:
        """A call that failed, or whose merged outputs could not be split: a lone request gets
        the failure; the members of a batch run alone, each to its own outcome (one member, or
        more, may have broken the merged call), unless their deadline has passed."""
        rt = self.lane.rt
        if len(batch) == 1:
            if not batch[0].future.done():
                batch[0].future.set_exception(failure(rt, result))
            return
        for p in batch:
            if p.future.done():
                continue
            if time.monotonic() >= p.deadline:
                p.future.set_exception(
                    failure(rt, result)
                    if result.outcome is Outcome.TIMEOUT
                    else deadline_error(rt, "after its batch failed")
                )
                continue
            await self._run([p])


def _by_priority(pending: Pending) -> int:
    return -pending.priority


# ---------------------------------------------------------------- merging and splitting


def merge(requests: list[InferRequest]) -> InferRequest:
    """Compatible requests (equal batch keys) as one, concatenated along the first dimension."""
    first = requests[0]
    rows = sum(r.rows for r in requests)
    inputs = [
        Input(
            t.name,
            t.dt,
            (rows, *t.shape[1:]),
            b"".join(r.inputs[i].raw for r in requests),
            t.parameters,
        )
        for i, t in enumerate(first.inputs)
    ]
    return InferRequest(None, inputs, first.parameters, first.outputs)


def slice_rows(request: InferRequest, start: int, stop: int) -> InferRequest:
    """Rows [start, stop) of a request (oversize requests are split with this)."""
    inputs = []
    for t in request.inputs:
        rows = t.shape[0]
        count = element_count(t.shape)
        per_row = count // rows if rows else 0
        if t.dt.kind == "bytes":
            elements = unframe(t.raw, count)
            raw = frame(elements[start * per_row : stop * per_row])
        else:
            step = per_row * t.dt.size
            raw = t.raw[start * step : stop * step]
        inputs.append(Input(t.name, t.dt, (stop - start, *t.shape[1:]), raw, t.parameters))
    return InferRequest(request.id, inputs, request.parameters, request.outputs)


def split(outputs: list[Output], rows: list[int]) -> list[list[Output]]:
    """A batch's outputs -> each member's share; every output's first dimension must be the
    batch's total rows (else ValueError: the function did not answer row by row)."""
    total = sum(rows)
    shares: list[list[Output]] = [[] for _ in rows]
    for out in outputs:
        if not out.shape or out.shape[0] != total:
            raise ValueError(f"output {out.name!r} has shape {out.shape}, not [{total}, ...]")
        if out.packed is not None:  # a compiled model's raw bytes (sized by the host)
            step = len(out.packed) // total if total else 0
            offset = 0
            for i, n in enumerate(rows):
                piece = out.packed[offset * step : (offset + n) * step]
                shares[i].append(
                    Output(out.name, out.datatype, [n, *out.shape[1:]], None, out.parameters, piece)
                )
                offset += n
            continue
        data = out.data if type(out.data) is list else [out.data]
        if data and type(data[0]) is list:
            data = _in_order(data)
        count = element_count(out.shape)
        if len(data) != count:
            raise ValueError(f"output {out.name!r} has {len(data)} elements for {out.shape}")
        per_row = count // total if total else 0
        offset = 0
        for i, n in enumerate(rows):
            part = data[offset * per_row : (offset + n) * per_row]
            shares[i].append(
                Output(out.name, out.datatype, [n, *out.shape[1:]], part, out.parameters)
            )
            offset += n
    return shares


def join(parts: list[tuple[list[Output], dict[str, object] | None]]) -> Completed:
    """The shares of a split request back into one response (outputs in the first's order)."""
    first, params = parts[0]
    joined = []
    for i, out in enumerate(first):
        pieces = [p[0][i] for p in parts]
        rows = sum(piece.shape[0] for piece in pieces)
        shape = [rows, *out.shape[1:]]
        if all(piece.packed is not None for piece in pieces):
            packed = b"".join(piece.packed or b"" for piece in pieces)
            joined.append(Output(out.name, out.datatype, shape, None, out.parameters, packed))
            continue
        data: list[object] = []
        for piece in pieces:
            values = piece.values()
            flat = values if type(values) is list else [values]
            data.extend(_in_order(flat) if flat and type(flat[0]) is list else flat)
        joined.append(Output(out.name, out.datatype, shape, data, out.parameters))
    return Completed(None, joined, dict(params) if params else None)
