"""eBPF acceleration for `meshfn up`: attach, put the mesh's processes in the cgroup, report.

The policy's `acceleration: ebpf | off | auto` decides; `auto` never fails the mesh, it logs one
line saying why acceleration is off. Children join the cgroup before exec (so every socket they
open is seen), and detaching happens only after they have stopped: deleting live sockets from
the map would drop redirected bytes in flight (see ebpf/accelerator.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from meshfn.ebpf import STATS_KEYS, AccelerationStatus, Accelerator

log = logging.getLogger("meshfn.ebpf")


class Acceleration:
    def __init__(self, state_dir: Path) -> None:
        self.accelerator = Accelerator(state_dir)
        self.status: AccelerationStatus | None = None

    async def setup(self, mode: str) -> AccelerationStatus:
        """Raises AccelerationUnavailable in mode "ebpf" when it cannot attach."""
        status = await asyncio.to_thread(self.accelerator.setup, mode)  # type: ignore[arg-type]
        log.info(status.line())
        self.status = status
        return status

    def preexec(self) -> Callable[[], None] | None:
        return self.accelerator.child_preexec()

    def document(self) -> dict[str, Any]:
        status = self.status
        return {
            "mode": status.mode if status else "off",
            "attached": bool(status and status.attached),
            "reason": status.reason if status else "",
            "counters": self.accelerator.stats(),
        }

    async def shutdown(self) -> None:
        problems = await asyncio.to_thread(self.accelerator.shutdown)
        for problem in problems:
            log.error("detaching eBPF: %s", problem)


class AccelerationCollector(Collector):
    """/metrics: the redirection counters, read at scrape time."""

    def __init__(self, acceleration: Acceleration) -> None:
        self.acceleration = acceleration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.acceleration.accelerator.stats()
        for key in STATS_KEYS:
            yield GaugeMetricFamily(
                f"meshfn_ebpf_{key}", f"eBPF socket redirection: {key}", value=stats.get(key, 0)
            )
