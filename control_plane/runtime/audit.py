"""The audit trail of `meshfn up`: the checkpoint signer as its own process, and one collector in
the control plane's event loop that stores every proxy's journal in STATE/audit/audit.db,
rotating journals through Envoy's /reopen_logs.

The control plane writes the store and never holds the signing key: the signer process
(`meshfn audit signer`) keeps it in STATE/audit-signer/, reads the store, and writes every
checkpoint to the witness (STATE/audit-witness/ or $MESHFN_AUDIT_WITNESS) before it inserts it.
The retention (the Mesh policy's audit.retentionDays) is the signer's: it signs it into every
checkpoint and witnesses every prune, so the collector here deletes only what the signer let
go; a changed retention restarts the signer with it (and is witnessed).

Started by the first model with `Mesh.spec.audit`; stopped after the proxies (so it stores the
last lines they wrote), the signer last (so the final checkpoint is signed). Turning audit off in
the policies stops new records, not collection of what the proxies already wrote.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from meshfn import ir
from meshfn.audit import layout
from meshfn.audit.access import access_event, record_access
from meshfn.audit.collector import AuditCollector
from meshfn.audit.signer import SignerClient, SignerError
from meshfn.audit.sqlite import SqliteStore
from meshfn.audit.store import DEFAULT_RETENTION_DAYS, StoreError
from meshfn.common.adminauth import Principal
from meshfn.xds.translate import ProxyHost

from .process import SupervisedProcess

log = logging.getLogger("meshfn.audit")

Reopen = Callable[[], Awaitable[None]]
# How long an erasure waits before it stores what the journals hold: Envoy writes its access logs
# every 200 ms (envoy.py: file_flush_interval_ms), so a request finished before the erasure began
# is in its journal by then.
FLUSH_WAIT_S = 0.5


def store_path(state_dir: Path) -> Path:
    return layout.store_path(state_dir)


def signer_process(
    state_dir: Path, store: Path, retention_days: int = DEFAULT_RETENTION_DAYS
) -> tuple[SupervisedProcess, str]:
    address = layout.signer_socket(state_dir)

    async def ready() -> bool:
        try:
            await asyncio.to_thread(SignerClient(address, timeout=1).request, "status")
        except SignerError:
            return False
        return True

    argv = [
        sys.executable,
        "-P",
        "-m",
        "meshfn.audit.cli",
        "signer",
        "--store",
        str(store),
        "--key",
        str(layout.key_path(state_dir)),
        "--witness",
        str(layout.witness_path(state_dir)),
        "--listen",
        address,
        "--retention-days",
        str(retention_days),
    ]
    log_path = state_dir / "logs" / "audit-signer.log"
    return SupervisedProcess("audit-signer", argv, log_path, ready=ready), address


class AuditTrail:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.store: SqliteStore | None = None
        self.collector: AuditCollector | None = None
        self.signer: SupervisedProcess | None = None
        self.signer_address: str | None = None
        self.retention_days: int | None = None  # the running signer's
        self.model: ir.MeshModel | None = None  # the last reconciled: tenants' QoS classes

    async def reconcile(
        self, model: ir.MeshModel, host: ProxyHost, reopen: Mapping[str, Reopen]
    ) -> None:
        """Collect the journal of every proxy that records; `reopen` maps node clusters to
        their Envoy's /reopen_logs."""
        self.model = model
        audit = model.audit
        if audit is None:
            return
        if self.collector is None:
            path = store_path(self.state_dir)
            # created (or migrated) before the signer starts: the signer only opens it
            self.store = await asyncio.to_thread(SqliteStore, path)
            await self._start_signer(audit.retention_days)
            assert self.signer_address is not None
            self.collector = AuditCollector(self.store, signer=SignerClient(self.signer_address))
            await self.collector.start()
            log.info(
                "audit trail: %s, signer %s, witness %s",
                path,
                self.signer_address,
                layout.witness_path(self.state_dir),
            )
        elif audit.retention_days != self.retention_days:
            assert self.signer is not None
            await self.signer.stop()
            await self._start_signer(audit.retention_days)
        for workload in model.workloads:
            if audit.records(workload.kind):
                group = workload.node_cluster
                self.collector.watch(host.journal(group), group, reopen.get(group))

    async def _start_signer(self, retention_days: int) -> None:
        path = store_path(self.state_dir)
        self.signer, self.signer_address = signer_process(self.state_dir, path, retention_days)
        await self.signer.start()
        self.retention_days = retention_days

    def status(self) -> dict[str, Any]:
        if self.collector is None or self.store is None:
            return {"enabled": False}
        status = self.collector.status()
        return {
            "enabled": True,
            "store": self.store.location,
            "signer": self.signer_address,
            "witness": str(layout.witness_path(self.state_dir)),
            "retention_days": self.retention_days,
            **status,
            "qos_refusals": [
                {**row, "class": self.tenant_class(row["source"], row["tenant"])}
                for row in status["qos_refusals"]
            ],
        }

    async def record_access(
        self,
        principal: Principal,
        action: str,
        pseudonyms: list[str],
        records: int,
        via: str = "console",
    ) -> int:
        """Append an access record (meshfn.audit.access) to the control chain; its seq.
        StoreError when the trail is off or refuses: the caller must not show the data."""
        store, collector = self.store, self.collector
        if store is None or collector is None:
            raise StoreError("the audit trail is not running: nowhere to record this access")
        event = access_event(
            principal=principal.name,
            role=principal.role,
            action=action,
            via=via,
            pseudonyms=pseudonyms,
            records=records,
        )
        seq = await asyncio.to_thread(record_access, store, event)
        collector.appended(1)
        return seq

    async def erase(self, subject: str, principal: Principal, via: str = "api") -> dict[str, Any]:
        """Erase a subject from the store and every journal (collector.erase), after the
        proxies' buffered lines reached the journals. The answer of POST /audit/erase."""
        collector = self.collector
        if collector is None:
            raise StoreError("the audit trail is not running: nothing to erase")
        await asyncio.sleep(FLUSH_WAIT_S)
        done, copies = await asyncio.to_thread(collector.erase, subject, principal.name, via)
        if done is None:
            await self.record_access(principal, "erase", [], 0, via)
            return {"erased": False}
        log.info(
            "audit erasure by %s: %d record(s) unlinked, %d journal copies overwritten",
            principal.name,
            done.records,
            copies,
        )
        return {
            "erased": True,
            "records": done.records,
            "seq": done.seq,
            "pseudonyms": list(done.pseudonyms),
            "journal_copies": copies,
            "residue": list(done.residue),
        }

    def tenant_class(self, source: str, tenant: str) -> str:
        """The QoS class of `tenant` at the gateway `source` (its own QoSPolicy's; "" for a
        sidecar or a gateway without one)."""
        model = self.model
        for workload in model.workloads if model is not None else ():
            if workload.node_cluster == source and workload.qos is not None:
                return workload.qos.limits_of(tenant)[0]
        return ""

    async def stop(self) -> None:
        """Store what the (already stopped) proxies wrote, sign a final checkpoint, close."""
        try:
            if self.collector is not None:
                await self.collector.stop()
        finally:
            if self.signer is not None:
                await self.signer.stop()
            if self.store is not None:
                self.store.close()
            self.collector = self.store = self.signer = None
