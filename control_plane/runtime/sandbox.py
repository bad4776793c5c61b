"""The inference backends' sandbox as `meshfn up` runs it (docs/concepts/sandbox.md).

Landlock and seccomp are the backend's own doing (meshfn.inference applies them to itself and
writes what it applied to `<its state dir>/sandbox.json`); the eBPF egress control is this
module's: one cgroup per backend, joined before exec, whose programs let through only the peers
its Functions name. What `meshfn status` and the start-up lines say comes from the kernel where
the kernel can say it: the programs attached to the cgroup, the processes in it, a process's
seccomp mode in /proc. A layer is never reported on that is not.

Denials are counted per backend and reason in /metrics (`meshfn_egress_denied_total`) and
logged at most once per backend and reason every LOG_INTERVAL_S, with the count since the last
line and the last destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from meshfn.ebpf import Denial, EgressControl, EgressStatus

from .upstreams import UpstreamSpec, backend_state_dir

log = logging.getLogger("meshfn.sandbox")

LOG_INTERVAL_S = 10.0
POLL_INTERVAL_S = 1.0
LAYERS = ("landlock", "seccomp", "egress")


class BackendSandbox:
    def __init__(self, state_dir: Path, mode: str, parent: Path | None = None) -> None:
        self.state_dir = state_dir
        self.mode = mode
        # the backends running now (the mesh's upstreams serving functions), once it exists
        self.backends: Callable[[], Iterable[UpstreamSpec]] = list
        self.egress = EgressControl(state_dir, parent)
        self.status = EgressStatus(mode, False, "not set up")
        self._logged: dict[tuple[str, str], tuple[int, float]] = {}

    async def setup(self) -> EgressStatus:
        """Raises EgressUnavailable in mode "required" when it cannot attach."""
        self.status = await asyncio.to_thread(self.egress.setup, self.mode)  # type: ignore[arg-type]
        log.info("sandbox: %s", self.status.line())
        return self.status

    def preexec(self, spec: UpstreamSpec) -> Callable[[], None] | None:
        """Moves the backend's process into its egress cgroup before exec (None: egress off)."""
        if not self.egress.attached or not spec.functions:
            return None
        return self.egress.add_backend(spec.name, spec.egress)

    def release(self, spec: UpstreamSpec) -> None:
        """After the backend's processes have exited."""
        for problem in self.egress.remove_backend(spec.name):
            log.warning("egress control: %s", problem)

    async def shutdown(self) -> None:
        for problem in await asyncio.to_thread(self.egress.shutdown):
            log.error("detaching the egress control: %s", problem)

    # --- what confines each backend --------------------------------------------------------------

    def document(self) -> dict[str, Any]:
        denials = self.egress.denials()
        return {
            "egress": {
                "mode": self.mode,
                "attached": self.status.attached,
                "reason": self.status.reason,
            },
            "backends": [
                self._backend(spec, denials.get(spec.name, {}))
                for spec in self.backends()
                if spec.functions
            ],
        }

    def _backend(self, spec: UpstreamSpec, denied: dict[str, Denial]) -> dict[str, Any]:
        report = _report(backend_state_dir(self.state_dir, spec.address, spec.port))
        out: dict[str, Any] = {"backend": spec.name}
        for layer in ("landlock", "seccomp"):
            out[layer] = _own_layer(report, layer)
        out["egress"] = self._egress_layer(spec)
        out["denied"] = {
            reason: {"count": d.count, "last": _destination(d), "pid": d.pid}
            for reason, d in sorted(denied.items())
        }
        return out

    def _egress_layer(self, spec: UpstreamSpec) -> dict[str, str]:
        if not self.status.attached:
            return {"state": "off", "detail": self.status.reason}
        programs = self.egress.attached_programs(spec.name)
        cgroup = self.egress.backend_cgroup(spec.name)
        procs = _procs(cgroup) if cgroup is not None else []
        if not programs or not procs:
            what = "no program attached" if not programs else "no process in its cgroup"
            return {"state": "failed", "detail": f"{what} ({cgroup})"}
        peers = ", ".join(f"{a}:{p}" for a, p in spec.egress) or "none"
        detail = f"{len(programs)} programs on its cgroup, {len(procs)} process(es); peers: {peers}"
        if self.status.uncovered:
            detail += f"; not covered: {', '.join(self.status.uncovered)}"
        return {"state": "on", "detail": detail}

    def start_lines(self) -> list[str]:
        """What `meshfn up` prints once the backends are up: one line per backend."""
        lines = []
        for backend in self.document()["backends"]:
            parts = [f"{layer} {backend[layer]['state']}" for layer in LAYERS]
            lines.append(f"sandbox {backend['backend']}: {', '.join(parts)}")
            for layer in LAYERS:
                if backend[layer]["state"] != "on":
                    lines.append(f"  {layer}: {backend[layer]['detail']}")
        return lines

    # --- denials -----------------------------------------------------------------------------------

    async def log_denials_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_INTERVAL_S)
            try:
                denials = await asyncio.to_thread(self.egress.denials)
            except OSError as exc:
                log.debug("reading egress denials: %s", exc)
                continue
            self.log_denials(denials, time.monotonic())

    def log_denials(self, denials: dict[str, dict[str, Denial]], now: float) -> None:
        """One line per backend and reason at most every LOG_INTERVAL_S (rate limit)."""
        for backend, reasons in denials.items():
            for reason, d in reasons.items():
                logged_count, logged_at = self._logged.get((backend, reason), (0, -LOG_INTERVAL_S))
                if d.count <= logged_count or now - logged_at < LOG_INTERVAL_S:
                    continue
                self._logged[(backend, reason)] = (d.count, now)
                log.warning(
                    "egress denied: %s: %d %s attempt(s) since the last line, the last to %s "
                    "by pid %d",
                    backend,
                    d.count - logged_count,
                    reason,
                    _destination(d) or "(no address)",
                    d.pid,
                )


class EgressCollector(Collector):
    """/metrics: meshfn_egress_denied_total{backend, reason}, read from the kernel's map."""

    def __init__(self, sandbox: BackendSandbox) -> None:
        self.sandbox = sandbox

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "meshfn_egress_denied",
            "outbound connections and datagrams of inference backends refused by the eBPF "
            "egress control, by reason (ebpf/egress_programs.py REASONS)",
            labels=("backend", "reason"),
        )
        for backend, reasons in self.sandbox.egress.denials().items():
            for reason, denial in reasons.items():
                family.add_metric((backend, reason), denial.count)
        yield family


def _report(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / "sandbox.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _own_layer(report: dict[str, Any] | None, layer: str) -> dict[str, str]:
    """A layer the backend applied itself, as it reported it; seccomp checked in /proc."""
    if report is None:
        return {"state": "unknown", "detail": "the backend has not reported what confines it"}
    entry = report.get(layer) or {}
    state, detail = str(entry.get("state", "unknown")), str(entry.get("detail", ""))
    if layer == "seccomp" and state == "on":
        mode = _seccomp_mode(int(report.get("pid", 0)))
        if mode is not None and mode != 2:
            return {"state": "failed", "detail": f"reported on, but the kernel says mode {mode}"}
    return {"state": state, "detail": detail}


def _seccomp_mode(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Seccomp:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _procs(cgroup: Path) -> list[str]:
    try:
        return (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _destination(d: Denial) -> str:
    if not d.address:
        return ""
    host = f"[{d.address}]" if ":" in d.address else d.address
    return f"{host}:{d.port}"
