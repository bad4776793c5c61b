"""The audit trail of `meshfn up`: one collector in the control plane's event loop that stores
every proxy's journal in state/audit/audit.db, rotating journals through Envoy's /reopen_logs.

Started by the first model with `Mesh.spec.audit`; stopped after the proxies (so it stores the
last lines they wrote). Turning audit off in the policies stops new records, not collection of
what the proxies already wrote.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from meshfn import ir
from meshfn.xds.translate import ProxyHost

from ..audit.collector import AuditCollector
from ..audit.store import AuditStore

log = logging.getLogger("meshfn.audit")

Reopen = Callable[[], Awaitable[None]]


def store_path(state_dir: Path) -> Path:
    return state_dir / "audit" / "audit.db"


class AuditTrail:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.store: AuditStore | None = None
        self.collector: AuditCollector | None = None

    async def reconcile(
        self, model: ir.MeshModel, host: ProxyHost, reopen: Mapping[str, Reopen]
    ) -> None:
        """Collect the journal of every proxy that records; `reopen` maps node clusters to
        their Envoy's /reopen_logs."""
        audit = model.audit
        if audit is None:
            return
        if self.collector is None:
            self.store = AuditStore(store_path(self.state_dir), retention_days=audit.retention_days)
            self.collector = AuditCollector(self.store)
            await self.collector.start()
            log.info("audit trail: %s", self.store.path)
        assert self.store is not None
        self.store.retention_days = audit.retention_days
        for workload in model.workloads:
            if audit.records(workload.kind):
                group = workload.node_cluster
                self.collector.watch(host.journal(group), group, reopen.get(group))

    def status(self) -> dict[str, Any]:
        if self.collector is None or self.store is None:
            return {"enabled": False}
        return {"enabled": True, "store": str(self.store.path), **self.collector.status()}

    async def stop(self) -> None:
        """Store what the (already stopped) proxies wrote, sign a final checkpoint, close."""
        if self.collector is not None:
            try:
                await self.collector.stop()
            finally:
                assert self.store is not None
                self.store.close()
                self.collector = self.store = None
