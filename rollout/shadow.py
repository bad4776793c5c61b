"""Reading the backends' shadow comparisons (contracts.rollout.SHADOW_PATH), each once.

A backend process numbers its comparisons; the reader asks each one for those after the last it
saw (a restarted process starts again at 1: its `process` id changed). Only the backends of
Functions on a shadow step are asked. What a backend answers that is not a report is logged and
skipped: the step then lacks data, it never passes on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError

from meshfn.contracts.rollout import SHADOW_PATH, ShadowReport

from .figures import Pair

log = logging.getLogger("meshfn.rollout")

# GET a path of a backend (the composition knows how: a unix socket, an address); (status, body).
Fetch = Callable[[str], Awaitable[tuple[int, bytes]]]


@dataclass(frozen=True)
class Backend:
    """One serving process of a Function's backend Service, and how to reach it."""

    service: str  # Service.key: its functions are namespace/name in its namespace
    where: str  # for messages
    fetch: Fetch


@dataclass
class ShadowReader:
    seen: dict[str, tuple[str, int]] = field(default_factory=dict)  # where -> (process, seq)

    async def read(
        self, backends: Iterable[Backend], wanted: set[tuple[str, str]]
    ) -> dict[tuple[str, str], list[Pair]]:
        """New comparisons per (Function key, candidate) in `wanted`, with their times made
        monotonic like the gateways' samples."""
        out: dict[tuple[str, str], list[Pair]] = {}
        offset = time.time() - time.monotonic()
        namespaces = {key.split("/", 1)[0] for key, _ in wanted}
        for backend in backends:
            namespace = backend.service.split("/", 1)[0]
            if namespace not in namespaces:
                continue
            report = await self._report(backend)
            if report is None:
                continue
            for label, pairs in report.functions.items():
                name, _, candidate = label.partition("@")
                key = (f"{namespace}/{name}", candidate)
                if key in wanted:
                    out.setdefault(key, []).extend(
                        Pair(p.at - offset, p.candidate_s, p.stable_s, p.outcome) for p in pairs
                    )
        return out

    async def _report(self, backend: Backend) -> ShadowReport | None:
        known = self.seen.get(backend.where)
        report = await self._fetch(backend, known[1] if known else 0)
        if report is not None and known is not None and report.process != known[0] and known[1]:
            report = await self._fetch(backend, 0)  # a new process: from its first
        if report is None:
            return None
        newest = max((p.seq for pairs in report.functions.values() for p in pairs), default=0)
        if known is not None and known[0] == report.process:
            newest = max(newest, known[1])
        self.seen[backend.where] = (report.process, newest)
        if report.lost:
            log.warning(
                "backend %s dropped %d shadow comparisons unread", backend.where, report.lost
            )
        return report

    @staticmethod
    async def _fetch(backend: Backend, after: int) -> ShadowReport | None:
        try:
            status, body = await backend.fetch(f"{SHADOW_PATH}?after={after}")
        except (OSError, TimeoutError) as exc:
            log.warning("cannot read shadow comparisons from %s: %s", backend.where, exc)
            return None
        if status != 200:
            log.warning("backend %s answered %d for %s", backend.where, status, SHADOW_PATH)
            return None
        try:
            return ShadowReport.model_validate_json(body)
        except ValidationError as exc:
            log.warning("backend %s: not a shadow report: %s", backend.where, exc)
            return None
