"""Loss-free audit: 5000 requests through real Envoy with both wasm filters while the collector
(a separate process) is killed with SIGKILL once and restarted with SIGTERM once; afterwards the
store holds exactly one record per request Envoy answered, and the chain verifies against the
signer's witness (the signer is its own process, as under `meshfn up`)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from meshfn_e2e import http

from meshfn.audit import open_store
from meshfn.contracts.plugins import AuditSettings, DegradeRule, DegradeSettings
from meshfn.testing.envoy import argv as envoy_argv
from meshfn.testing.envoy import start as start_envoy
from meshfn.testing.envoy import stat as envoy_stat
from meshfn.testing.filters import audit_filter, degrade_filter, harness
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Processes, wait_for
from meshfn.xds.translate.wasm import access_log

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
TOTAL = 5000


es = harness("envoy_static")


def audit_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "meshfn.audit.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def load(port: int, total: int, progress: list[int], gate: asyncio.Event) -> list[int]:
    statuses: list[int] = []
    queue = iter(range(total))
    connector = aiohttp.TCPConnector(limit=16)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for i in queue:
                await gate.wait()
                async with session.get(f"http://127.0.0.1:{port}/load/{i}") as response:
                    await response.read()
                    statuses.append(response.status)
                    progress[0] += 1

        await asyncio.gather(*(worker() for _ in range(16)))
    return statuses


async def test_exactly_once_across_collector_restarts(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    port, admin, upstream = free_ports(3)
    journal = tmp_path / "journal" / "edge.jsonl"
    journal.parent.mkdir()
    store_path = tmp_path / "audit" / "audit.db"
    settings = AuditSettings(subject_salt="11" * 16, subject_source="header")
    filters = [
        es.to_dict(audit_filter(settings)),
        es.to_dict(
            degrade_filter(
                DegradeSettings(
                    rules=[DegradeRule(name="r", routes=["other"], mode="reject", depth=1)]
                )
            )
        ),
    ]
    listener = es.listener(
        port,
        filters,
        [es.route("load", "backend")],
        access_logs=[es.to_dict(access_log(journal, settings))],
    )
    config = tmp_path / "envoy.json"
    config.write_text(json.dumps(es.bootstrap(admin, {"backend": upstream}, listener)))
    open_store(store_path).close()  # the signer reads it: it must exist first
    signer_socket = f"unix:{tmp_path / 'signer.sock'}"
    signer = [
        sys.executable, "-P", "-m", "meshfn.audit.cli", "signer",
        "--store", str(store_path), "--key", str(tmp_path / "signer" / "checkpoint.key"),
        "--witness", str(tmp_path / "witness" / "checkpoints.jsonl"), "--listen", signer_socket,
    ]  # fmt: skip
    collect = [
        sys.executable, "-P", "-m", "meshfn.audit.cli", "collect",
        "--store", str(store_path), "--journal", f"edge~0={journal}",
        "--checkpoint-every", "500", "--signer", signer_socket,
    ]  # fmt: skip
    try:
        procs.upstream("upstream", "backend", upstream)
        start_envoy(procs, "envoy", envoy_argv(config, wasm=True), admin)
        wait_for("upstream", lambda: http(f"http://127.0.0.1:{upstream}/").status == 200)
        procs.start("signer", signer)
        wait_for("signer", (tmp_path / "signer.sock").exists)
        collector = procs.start("collector-1", collect)

        def stored() -> int:
            if not store_path.exists():
                return 0
            store = open_store(store_path, readonly=True)
            try:
                return store.count()
            finally:
                store.close()

        progress = [0]
        gate = asyncio.Event()
        gate.set()
        traffic = asyncio.create_task(load(port, TOTAL, progress, gate))
        seen_at_restart = []
        for threshold, sig, name in (
            (1500, signal.SIGKILL, "collector-2"),
            (3500, signal.SIGTERM, "collector-3"),
        ):
            before = stored()
            for _ in range(2000):
                if progress[0] >= threshold:
                    break
                assert not traffic.done(), "load finished before the collector restart"
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"the load did not reach {threshold} requests in 20 s")
            # a collector just (re)started may not have stored anything yet: hold the load
            # until it has, so the kill below really interrupts a working collector
            gate.clear()
            for _ in range(2000):
                if stored() > before:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"{name}'s predecessor stored nothing in 20 s")
            gate.set()
            flowing = progress[0]
            for _ in range(2000):  # requests flowing again
                if progress[0] > flowing:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the load did not resume in 20 s")
            seen_at_restart.append(stored())
            collector.send(sig)  # a crash, then an orderly restart
            await asyncio.to_thread(collector.wait, 20)
            collector = procs.start(name, collect)
        statuses = await traffic
        assert len(statuses) == TOTAL and set(statuses) == {200}

        assert envoy_stat(admin, "http.e2e.downstream_rq_completed") == TOTAL

        assert 0 < seen_at_restart[0] < seen_at_restart[1] < TOTAL, seen_at_restart
        for _ in range(300):
            if stored() >= TOTAL:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{stored()} of {TOTAL} records stored after 30 s")
        # An orderly stop stores every complete line left in the journal first (drain), so a
        # duplicate beyond TOTAL would be in the store counted below.
        assert collector.stop() == 0
    finally:
        procs.stop_all()

    store = open_store(store_path, readonly=True)
    try:
        rows = store.query(limit=None)
    finally:
        store.close()
    assert len(rows) == TOTAL
    assert sorted(r["path"] for r in rows) == sorted(f"/load/{i}" for i in range(TOTAL))
    assert all(r["audited"] and r["status"] == 200 and r["envoy_route"] == "load" for r in rows)
    assert [r["seq"] for r in rows] == list(range(1, TOTAL + 1))

    verify = audit_cli(
        "verify", "--store", str(store_path), "--json",
        "--public-key", str(tmp_path / "signer" / "checkpoint.key.pub"),
        "--witness", str(tmp_path / "witness" / "checkpoints.jsonl"),
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["ok"] and report["records"] == TOTAL and report["unsigned_tail"] == 0
    assert report["witnessed"] >= 2  # checkpoints while running and at the orderly stops
    log = (tmp_path / "logs" / "collector-2.log").read_text()
    assert "was replaced" not in log and "Traceback" not in log
