"""`meshfn up`'s audit trail: the retention of the Mesh policy is the signer's (a process of its
own), so a changed `audit.retentionDays` restarts the signer with it, and the signer witnesses
the change at its next checkpoint; an unchanged policy leaves the signer alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

from meshfn import ir
from meshfn.audit import FileWitness, layout
from meshfn.audit.signer import SignerClient
from meshfn.contracts.plugins import SubjectSalt
from meshfn.control_plane.runtime.audit import AuditTrail
from meshfn.xds.translate import ProxyHost


def model(retention_days: int) -> ir.MeshModel:
    audit = ir.Audit("all", retention_days, "tenant", False, 0)
    return ir.MeshModel("mesh", "td.local", 1, 2, (), (), audit=audit)


def signer_status(trail: AuditTrail) -> dict[str, object]:
    assert trail.signer_address is not None
    return SignerClient(trail.signer_address, timeout=5).request("status")


async def test_a_changed_retention_restarts_the_signer_with_it(tmp_path: Path) -> None:
    trail = AuditTrail(tmp_path)
    host = ProxyHost(tmp_path / "wasm", tmp_path, SubjectSalt("00" * 32))
    try:
        await trail.reconcile(model(30), host, {})
        assert trail.signer is not None and trail.store is not None
        first = trail.signer.pid
        assert signer_status(trail)["retention_days"] == 30
        trail.store.append([{"v": 2, "status": 200}], chain="edge")
        await asyncio.to_thread(SignerClient(str(trail.signer_address)).sign)
        await trail.reconcile(model(30), host, {})
        assert trail.signer.pid == first  # the same policy: the same signer
        await trail.reconcile(model(7), host, {})
        assert trail.signer.pid != first and trail.status()["retention_days"] == 7
        assert signer_status(trail)["retention_days"] == 7
        await asyncio.to_thread(SignerClient(str(trail.signer_address)).sign)
    finally:
        await trail.stop()
    witnessed = [c.retention_days for c in FileWitness(layout.witness_path(tmp_path)).read()[0]]
    assert witnessed == [30, 7]  # the change witnessed at once, with no new record
