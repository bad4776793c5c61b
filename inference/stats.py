"""Triton's statistics extension: per model and version, counts and cumulative durations.

Per request: success/fail, queue (admitted until its guest call starts), compute_input
(building the guest request: merging a batch, encoding), compute_infer (the guest call),
compute_output (splitting a batch's outputs, encoding the response). A request that shares a
batch is charged that batch's compute durations, as Triton does; `batch_stats` has one entry
per batch size with the per-execution figures. `inference_count` counts rows (the batch
dimension) for functions with one, else requests; `execution_count` counts guest calls.
Event-loop only (durations measured on worker threads arrive with the call's result).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStat:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class Timing:
    """One request's path through the dispatcher, in perf_counter_ns."""

    admitted: int
    started: int = 0  # its guest call began
    compute_input: int = 0
    compute_infer: int = 0
    compute_output: int = 0
    guest_cpu_ns: int = 0  # the guest's CPU time on this request's behalf (QoS budgets)


_REQUEST_FIELDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(slots=True)
class ModelStats:
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: dict[int, BatchStat] = field(default_factory=dict)

    def request(self, timing: Timing, ok: bool, rows: int) -> None:
        now = time.perf_counter_ns()
        (self.success if ok else self.fail).add(now - timing.admitted)
        self.last_inference_ms = time.time_ns() // 1_000_000
        if not ok:
            return
        self.inference_count += rows
        if timing.started:
            self.queue.add(timing.started - timing.admitted)
        self.compute_input.add(timing.compute_input)
        self.compute_infer.add(timing.compute_infer)
        self.compute_output.add(timing.compute_output)

    def execution(self, size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.execution_count += 1
        stat = self.batches.get(size)
        if stat is None:
            stat = self.batches[size] = BatchStat()
        stat.compute_input.add(input_ns)
        stat.compute_infer.add(infer_ns)
        stat.compute_output.add(output_ns)

    def as_json(self, name: str, version: str) -> dict[str, Any]:
        """One entry of Triton's `model_stats` (the same fields as its gRPC message)."""
        zero = {"count": 0, "ns": 0}
        inference = {f: getattr(self, f).as_json() for f in _REQUEST_FIELDS}
        inference |= {"cache_hit": zero, "cache_miss": zero}
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": inference,
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": stat.compute_input.as_json(),
                    "compute_infer": stat.compute_infer.as_json(),
                    "compute_output": stat.compute_output.as_json(),
                }
                for size, stat in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }
