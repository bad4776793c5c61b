"""What a guest call comes to, as the front ends and the batcher see it: a request's result
(`Completed`) or the KServe error its outcome maps to."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .host import CallResult, Outcome
from .kserve import KServeError, Output, parse_guest_outputs
from .pool import FunctionRuntime

log = logging.getLogger("meshfn.inference")


@dataclass(slots=True)
class Completed:
    """A request's result: the guest's whole response text when the request had its call to
    itself, or its share of a batch's outputs."""

    text: str | None
    outputs: list[Output] | None = None
    parameters: dict[str, Any] | None = None

    def parsed(self, label: str) -> tuple[list[Output], dict[str, Any] | None]:
        if self.outputs is not None:
            return self.outputs, self.parameters
        assert self.text is not None
        return parse_guest_outputs(self.text, label)


def completed(rt: FunctionRuntime, result: CallResult) -> Completed:
    """A successful guest call's result: a compiled model's raw outputs (ABI v2), or the
    guest's response text."""
    if rt.tensors is not None:
        return Completed(None, rt.tensors.outputs_of(result))
    return Completed(result.body)


def failure(rt: FunctionRuntime, result: CallResult) -> KServeError:
    """A failed guest call as the client sees it (the instance was already dealt with)."""
    outcome = result.outcome
    if outcome is Outcome.BAD_REQUEST:
        return KServeError(400, f"model {rt.label} rejected the input: {result.body}")
    if outcome is Outcome.TIMEOUT:
        log.warning("function interrupted at deadline", extra={"function": rt.label})
        ms = round(rt.spec.limits.timeout.total_seconds() * 1000)
        return KServeError(
            504, f"function {rt.label} exceeded its {ms} ms deadline and was interrupted"
        )
    if outcome is Outcome.OUT_OF_MEMORY:
        log.warning("function out of memory", extra={"function": rt.label})
        return KServeError(
            500,
            f"function {rt.label} exceeded its memory limit of {rt.spec.limits.memoryMiB} MiB: "
            f"{result.body}",
        )
    if outcome is Outcome.TRAP:
        log.warning("function trapped", extra={"function": rt.label, "trap": result.body})
        return KServeError(500, f"function {rt.label} trapped: {result.body}")
    return KServeError(500, f"function {rt.label} failed: {result.body}")


def deadline_error(rt: FunctionRuntime, where: str) -> KServeError:
    return KServeError(504, f"request to {rt.label} reached its deadline {where}; not run")
