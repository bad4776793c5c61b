"""The collector against real journal files and real stores (SQLite, and PostgreSQL where it
matters): exactly-once across restarts, partial lines and racing collectors; a full, read-only
or unreachable store that must not lose anything; rotation; checkpoints through the signer."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshfn.audit import AuditCollector, AuditStore, SignerClient, open_store, verify
from meshfn.audit.sqlite import SqliteStore
from meshfn.audit.store import StoreError
from meshfn.testing.audit import Raw, Trail
from meshfn.testing.postgres import PostgresServer


def line(i: int) -> bytes:
    return (
        json.dumps(
            {"id": f"r{i}", "time": "2026-01-01T00:00:00.000000Z", "status": 200, "audit": None}
        )
        + "\n"
    ).encode()


def write(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def ids(store: AuditStore) -> list[str]:
    return [r["id"] for r in store.query(limit=None)]


def chain_intact(store: AuditStore) -> bool:
    """The hash chains alone (these collectors run without a signer)."""
    return verify(store, Ed25519PrivateKey.generate().public_key()).ok


async def until(what: str, condition: Callable[[], bool], timeout: float = 10) -> None:
    """Poll `condition` (the collector works in its own task) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.01)


async def collect(store: AuditStore, journal: Path, **kw: object) -> AuditCollector:
    collector = AuditCollector(store, poll_interval=0.01, checkpoint_interval=0.05, **kw)  # type: ignore[arg-type]
    collector.watch(journal, "edge~0")
    await collector.start()
    return collector


async def test_partial_lines_wait_and_restarts_resume_exactly_once(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    collector = await collect(store, journal)
    await asyncio.sleep(0.05)  # no journal yet: nothing happens, no error
    write(journal, line(1) + line(2) + line(3)[:10])
    await until(
        "the complete lines stored, the partial one pending",
        lambda: collector.status()["journals"][0]["pending_bytes"] == 10,
    )
    assert ids(store) == ["r1", "r2"]
    write(journal, line(3)[10:])
    await collector.drain()
    await collector.stop()
    assert ids(store) == ["r1", "r2", "r3"]

    write(journal, b"".join(line(i) for i in range(4, 100)))
    collector = await collect(store, journal)  # a restart: resumes at the stored offset
    await collector.drain()
    write(journal, line(100))
    await collector.drain()
    await collector.stop()
    assert ids(store) == [f"r{i}" for i in range(1, 101)]
    assert chain_intact(store)
    assert collector.status()["journals"][0]["pending_bytes"] == 0
    store.close()


async def test_unparseable_lines_are_stored_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    write(journal, line(1) + b"\xff garbage\n" + line(2))
    collector = await collect(store, journal)
    await collector.drain()
    await collector.stop()
    rows = store.query(limit=None)
    assert [r.get("id") for r in rows] == ["r1", None, "r2"]
    assert "not a JSON object" in rows[1]["error"]
    assert any("stored as an unparsed record" in m for m in caplog.messages)
    store.close()


async def test_full_store_keeps_records_pending_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    store = SqliteStore(tmp_path / "a.db", max_bytes=48 * 1024)
    journal = tmp_path / "j.jsonl"
    big = [
        (json.dumps({"id": f"r{i}", "path": "/" + "p" * 3000, "status": 200}) + "\n").encode()
        for i in range(300)
    ]
    write(journal, b"".join(big))
    collector = await collect(store, journal)
    for _ in range(200):
        await asyncio.sleep(0.02)
        if collector.status()["error"]:
            break
    status = collector.status()
    assert "full" in status["error"]
    assert status["journals"][0]["pending_bytes"] > 0
    assert any("AUDIT RECORDS NOT STORED" in m and "full" in m for m in caplog.messages)
    stored_while_full = store.count()
    assert stored_while_full < 300
    # what is stored is exactly what the committed journal offset says: nothing half-stored
    position = store.journal_position("edge~0")
    committed = position.offset if position is not None else 0
    assert committed == sum(len(b) for b in big[:stored_while_full])
    store.set_max_bytes(64 * 1024 * 1024)  # an operator makes room
    await collector.drain(timeout=20)
    await collector.stop()
    assert ids(store) == [f"r{i}" for i in range(300)]
    assert collector.status()["error"] is None
    assert any("writable again" in m for m in caplog.messages)
    assert chain_intact(store)
    store.close()


async def test_stop_with_a_full_store_reports_what_is_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteStore(tmp_path / "a.db", max_bytes=40 * 1024)
    journal = tmp_path / "j.jsonl"
    write(
        journal,
        b"".join((json.dumps({"id": i, "path": "x" * 4000}) + "\n").encode() for i in range(50)),
    )
    collector = await collect(store, journal)
    await until("the store full", lambda: "full" in (collector.status()["error"] or ""))
    await collector.stop()
    assert any("stopped with" in m and "not stored" in m for m in caplog.messages)
    count = store.count()
    store.close()
    store = SqliteStore(tmp_path / "a.db")  # next start, no cap: the rest arrives, once
    collector = await collect(store, journal)
    await collector.drain()
    await collector.stop()
    assert store.count() == 50 and count < 50
    assert [r["id"] for r in store.query(limit=None)] == [str(i) for i in range(50)]
    store.close()


async def test_rotation_is_followed(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    write(journal, line(1) + line(2))
    collector = await collect(store, journal)
    await collector.drain()
    write(journal, line(3))
    journal.rename(tmp_path / "j.jsonl.1")  # logrotate, then Envoy's /reopen_logs
    write(tmp_path / "j.jsonl.1", line(4))  # Envoy flushes into the old file before reopening
    write(journal, line(5))
    for _ in range(300):
        await asyncio.sleep(0.01)
        if store.count() == 5:
            break
    await collector.stop()
    assert ids(store) == ["r1", "r2", "r3", "r4", "r5"]
    position = store.journal_position("edge~0")
    assert position is not None and position.inode == os.stat(journal).st_ino
    store.close()


async def test_replaced_journal_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    write(journal, line(1))
    collector = await collect(store, journal)
    await collector.drain()
    await collector.stop()
    journal.unlink()
    write(journal, line(2))
    collector = await collect(store, journal)
    await collector.drain()
    await collector.stop()
    assert ids(store) == ["r1", "r2"]
    assert any("was replaced while the collector was away" in m for m in caplog.messages)
    store.close()


def test_watch_rejects_a_second_path_for_one_source(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "a.db")
    collector = AuditCollector(store)
    collector.watch(tmp_path / "a", "n")
    collector.watch(tmp_path / "a", "n")
    with pytest.raises(ValueError, match="already collected"):
        collector.watch(tmp_path / "b", "n")
    store.close()


# ------------------------------------------------------------------ a real small filesystem


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 320 KiB tmpfs: the disk really fills up and can really be made read-only."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"this test needs root to mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_disk_full_on_a_real_filesystem(
    tiny_fs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteStore(tiny_fs / "a.db")
    journal = tmp_path / "j.jsonl"
    records = [
        (json.dumps({"id": f"r{i}", "path": "/" + "q" * 2000}) + "\n").encode() for i in range(400)
    ]
    write(journal, b"".join(records))
    collector = await collect(store, journal)
    for _ in range(300):
        await asyncio.sleep(0.02)
        if collector.status()["error"]:
            break
    assert "full" in (collector.status()["error"] or ""), collector.status()
    write(journal, line(999))
    size = journal.stat().st_size

    def seen() -> dict[str, int]:
        journal_status: dict[str, int] = collector.status()["journals"][0]
        return journal_status

    await until("the new line seen", lambda: seen()["offset"] + seen()["pending_bytes"] == size)
    assert seen()["pending_bytes"] > len(line(999))  # seen, and kept pending while full
    assert any("AUDIT RECORDS NOT STORED" in m for m in caplog.messages)
    grown = await asyncio.to_thread(
        subprocess.run, ["mount", "-o", "remount,size=16m", str(tiny_fs)], check=False
    )
    assert grown.returncode == 0
    await collector.drain(timeout=30)
    await collector.stop()
    assert ids(store) == [f"r{i}" for i in range(400)] + ["r999"]
    assert chain_intact(store)
    store.close()


def test_store_on_a_read_only_filesystem_fails_clearly(tiny_fs: Path) -> None:
    SqliteStore(tiny_fs / "a.db").close()
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    with pytest.raises(StoreError, match=r"a\.db"):
        store = SqliteStore(tiny_fs / "a.db")
        store.append([{"v": 1}])


async def test_rotate_deletes_the_old_journal_once_stored(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    write(journal, line(1))
    collector = await collect(store, journal)
    await collector.drain()

    async def reopen() -> None:  # what Envoy does on /reopen_logs: flush, then a new file
        (old,) = tmp_path.glob("j.jsonl.*")
        write(old, line(2))
        write(journal, line(3))

    old = await collector.rotate("edge~0", reopen)
    for _ in range(300):
        await asyncio.sleep(0.01)
        if store.count() == 3 and not old.exists():
            break
    await collector.stop()
    assert ids(store) == ["r1", "r2", "r3"]
    assert not old.exists()
    store.close()


async def test_restart_during_rotation_finishes_the_old_journal_first(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    write(journal, line(1))
    collector = await collect(store, journal)
    await collector.drain()
    await collector.stop()  # the collector goes away; meanwhile the journal is rotated
    old = journal.with_name("j.jsonl.1700000000000")
    journal.rename(old)
    write(old, line(2) + line(3))
    write(journal, line(4))
    collector = await collect(store, journal)
    for _ in range(300):
        await asyncio.sleep(0.01)
        if store.count() == 4:
            break
    await collector.stop()
    assert ids(store) == ["r1", "r2", "r3", "r4"]
    assert not old.exists()
    store.close()


async def test_automatic_rotation_retries_a_failed_reopen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    attempts = []

    async def reopen() -> None:  # the first reopen fails (proxy restarting), the next works
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionRefusedError("admin port not up")
        write(journal, line(99))

    collector = AuditCollector(store, poll_interval=0.01, rotate_bytes=500)
    collector.watch(journal, "edge~0", reopen=reopen)
    write(journal, b"".join(line(i) for i in range(10)))  # > 500 bytes
    await collector.start()
    for _ in range(400):
        await asyncio.sleep(0.01)
        if store.count() == 11 and not list(tmp_path.glob("j.jsonl.*")):
            break
    await collector.stop()
    assert ids(store) == [f"r{i}" for i in range(10)] + ["r99"]
    assert len(attempts) == 2 and not list(tmp_path.glob("j.jsonl.*"))
    assert any("reopen failed" in m for m in caplog.messages)
    store.close()


# ------------------------------------------------------------------ signing, racing, outages


async def test_checkpoints_come_from_the_signer(tmp_path: Path) -> None:
    trail = Trail(tmp_path / "a.db", tmp_path)
    journal = tmp_path / "j.jsonl"
    write(journal, b"".join(line(i) for i in range(25)))
    collector = await collect(trail.store, journal, signer=trail.signer, checkpoint_every=10)
    await collector.drain()
    await collector.stop()
    report = trail.verify()
    assert report.ok and report.unsigned_tail == 0 and report.witnessed >= 1
    assert collector.status()["unsigned"] == 0 and collector.status()["signer_error"] is None
    trail.close()


async def test_an_idle_collector_makes_no_passes_and_still_sees_every_change(
    tmp_path: Path,
) -> None:
    """Once everything is stored and signed, a poll finds nothing to do with a few stat calls
    and makes no pass (no thread hop); a journal not written yet, a new line, a rotation and a
    journal that appears all end that at once, and nothing is lost."""
    trail = Trail(tmp_path / "a.db", tmp_path)
    journal, later = tmp_path / "j.jsonl", tmp_path / "later.jsonl"
    write(journal, line(1) + line(2))
    collector = await collect(trail.store, journal, signer=trail.signer, checkpoint_every=1)
    collector.watch(later, "late~0")  # nothing written there yet
    passes = [0]
    tick = collector._tick

    def counted() -> bool:
        passes[0] += 1
        return tick()

    collector._tick = counted  # type: ignore[method-assign]
    await until("stored and signed", lambda: collector.status()["unsigned"] == 0)
    await until("quiet", collector._quiet)
    before = passes[0]
    await asyncio.sleep(0.3)  # 30 polls
    assert passes[0] == before
    write(journal, line(3))
    await until("a new line", lambda: trail.store.count() == 3)
    journal.rename(tmp_path / "j.jsonl.1")  # a rotation while it is quiet
    write(journal, line(4))
    write(later, line(5))
    await until("the rotated file and the new journal", lambda: trail.store.count() == 5, 15)
    await collector.stop()
    assert sorted(ids(trail.store)) == ["r1", "r2", "r3", "r4", "r5"]
    assert trail.verify().ok
    trail.close()


async def test_retention_deletes_only_what_the_signer_witnessed(tmp_path: Path) -> None:
    """The collector's retention tick asks the signer (over its socket) to witness a prune;
    with the signer's retention at 0 days everything signed goes, and what the collector
    stores afterwards verifies from the witnessed start. Without a signer nothing goes."""
    trail = Trail(tmp_path / "a.db", tmp_path, retention_days=0)
    journal = tmp_path / "j.jsonl"
    write(journal, b"".join(line(i) for i in range(20)))
    with trail.serving(f"unix:{tmp_path / 'signer.sock'}") as address:
        collector = await collect(
            trail.store, journal, signer=SignerClient(address), retention_interval=0.05
        )
        await until(
            "signed and pruned",
            lambda: (
                [a.seq for a in trail.store.chains().values()] == [20] and trail.store.count() == 0
            ),
        )
        write(journal, b"".join(line(i) for i in range(20, 25)))
        await collector.drain()
        await collector.stop()
    report = trail.verify()
    assert report.ok, report.problems
    chain = report.chains["edge~0"]
    assert chain.pruned_seq == 20 and chain.last_seq == 25 and report.retention_days == 0
    trail.close()
    unsigned = SqliteStore(tmp_path / "b.db")
    collector = await collect(unsigned, journal, retention_interval=0.01)
    await collector.drain()
    await asyncio.sleep(0.05)
    await collector.stop()
    assert unsigned.count() == 25
    unsigned.close()


async def test_an_unreachable_signer_is_loud_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    write(journal, b"".join(line(i) for i in range(5)))
    signer = SignerClient(f"unix:{tmp_path / 'nobody.sock'}", timeout=1)
    collector = await collect(store, journal, signer=signer)
    await collector.drain()
    for _ in range(100):
        if collector.status()["signer_error"]:
            break
        await asyncio.sleep(0.02)
    status = collector.status()
    assert "nobody.sock" in status["signer_error"] and status["unsigned"] == 5
    assert any("AUDIT CHECKPOINT FAILED" in m for m in caplog.messages)
    await collector.stop()
    assert store.count() == 5
    store.close()


async def test_racing_collectors_store_every_line_exactly_once(
    location: str, tmp_path: Path
) -> None:
    """Two collectors on the same journal and store (a misconfiguration, or a handover): every
    line once, in journal order, in one chain that verifies."""
    journal = tmp_path / "j.jsonl"
    stores = [open_store(location), open_store(location)]
    collectors = [await collect(s, journal) for s in stores]
    for batch in range(20):
        write(journal, b"".join(line(batch * 50 + i) for i in range(50)))
        await asyncio.sleep(0.01)
    for collector in collectors:
        await collector.drain(timeout=30)
    for collector in collectors:
        await collector.stop()
    assert ids(stores[0]) == [f"r{i}" for i in range(1000)]
    assert [r["seq"] for r in stores[0].query(limit=None)] == list(range(1, 1001))
    assert chain_intact(stores[0])
    for store in stores:
        store.close()


async def test_a_batch_that_fails_mid_transaction_is_stored_once_later(
    location: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between the records and the commit (simulated: the insert fails after it ran):
    the transaction takes records and offset with it; the retry stores them once."""
    store = open_store(location)
    journal = tmp_path / "j.jsonl"
    write(journal, b"".join(line(i) for i in range(10)))
    real = store._insert_records
    failures = [1]

    def insert_then_die(rows: list[tuple[str, int, str, bytes, bytes]]) -> None:
        real(rows)
        if failures:
            failures.pop()
            raise StoreError("simulated crash before COMMIT")

    monkeypatch.setattr(store, "_insert_records", insert_then_die)
    collector = await collect(store, journal)
    await collector.drain(timeout=20)
    await collector.stop()
    assert not failures and ids(store) == [f"r{i}" for i in range(10)]
    assert chain_intact(store)
    store.close()


async def test_a_torn_last_line_of_a_rotated_journal_is_stored_as_such(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"
    write(journal, line(1) + line(2)[:15])  # Envoy died mid-write
    collector = await collect(store, journal)
    await asyncio.sleep(0.1)
    journal.rename(tmp_path / "j.jsonl.1")
    write(journal, line(3))  # the new Envoy writes a new journal
    for _ in range(400):
        await asyncio.sleep(0.01)
        if store.count() == 3:
            break
    await collector.stop()
    rows = store.query(limit=None)
    assert [r.get("id") for r in rows] == ["r1", None, "r3"]
    assert rows[1]["error"] == "truncated line at the end of a rotated journal"
    assert collector.status()["parse_errors"] == 1
    store.close()


@pytest.mark.parametrize("outage", ["read-only", "unreachable"])
async def test_postgres_outage_keeps_records_in_the_journal(
    pg: PostgresServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, outage: str
) -> None:
    dsn = pg.database()
    name = dsn.rsplit("/", 1)[1]
    store = open_store(dsn)
    journal = tmp_path / "j.jsonl"
    write(journal, line(0))
    collector = await collect(store, journal)
    await collector.drain()
    admin = Raw(pg.dsn("postgres"))
    setting = (
        f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'
        if outage == "read-only"
        else f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'
    )
    admin.run(setting)
    kick = f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
    admin.run(kick)
    write(journal, b"".join(line(i) for i in range(1, 20)))
    for _ in range(300):
        await asyncio.sleep(0.02)
        if collector.status()["error"]:
            break
    status = collector.status()
    assert status["error"] and status["journals"][0]["pending_bytes"] > 0, status
    assert any("AUDIT RECORDS NOT STORED" in m for m in caplog.messages)
    admin.run(
        f'ALTER DATABASE "{name}" RESET default_transaction_read_only'
        if outage == "read-only"
        else f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'
    )
    admin.run(kick)
    admin.close()
    await collector.drain(timeout=30)
    await collector.stop()
    assert ids(store) == [f"r{i}" for i in range(20)]
    assert collector.status()["error"] is None and chain_intact(store)
    store.close()


async def test_qos_refusals_are_counted_per_tenant_and_limit(tmp_path: Path) -> None:
    """A gateway's own QoS refusals (rate, shed at the gateway) are counted nowhere but in its
    audit records: the collector counts them for /metrics and `meshfn status`."""
    from prometheus_client import CollectorRegistry, generate_latest

    from meshfn.audit.collector import CollectorMetrics

    store = SqliteStore(tmp_path / "a.db")
    journal = tmp_path / "j.jsonl"

    def refusal(i: int, tenant: str, limit: str) -> bytes:
        record = {"id": f"q{i}", "time": "2026-01-01T00:00:00.000000Z", "status": 429,
                  "audit": json.dumps({"tenant": tenant}), "qos_limit": limit}  # fmt: skip
        return (json.dumps(record) + "\n").encode()

    write(journal, line(1) + refusal(2, "initech", "shed") + refusal(3, "initech", "shed"))
    write(journal, refusal(4, "globex", "rate"))
    collector = await collect(store, journal)
    await collector.drain()
    await collector.stop()
    assert collector.status()["qos_refusals"] == [
        {"source": "edge~0", "tenant": "globex", "limit": "rate", "count": 1},
        {"source": "edge~0", "tenant": "initech", "limit": "shed", "count": 2},
    ]
    registry = CollectorRegistry()
    classes = {"initech": "batch", "globex": "standard"}
    registry.register(CollectorMetrics(lambda: collector, classify=lambda _, t: classes[t]))
    text = generate_latest(registry).decode()
    assert (
        'meshfn_qos_proxy_refusals_total{class="batch",limit="shed",source="edge~0",'
        'tenant="initech"} 2.0' in text
    ), text
    store.close()


def subject_line(i: int, subject: str) -> bytes:
    state = json.dumps({"subject": subject, "salt_id": "s", "tenant": "t"})
    record = {"id": f"s{i}", "time": "2026-01-01T00:00:00.000000Z", "status": 200, "audit": state}
    return (json.dumps(record) + "\n").encode()


async def test_an_erasure_while_lines_arrive_leaves_no_copy_and_loses_nothing(
    location: str, tmp_path: Path
) -> None:
    """collector.erase while another writer keeps appending to the journal: afterwards neither
    the store nor the journal links anything to the subject, every line is stored exactly once
    (the subject's too, unlinkable), the chain verifies, and a restarted collector resumes where
    this one stopped (the redaction kept the stored fingerprint in step)."""
    import threading

    alice, bob = "5a" * 32, "6b" * 32
    store = open_store(location)
    journal = tmp_path / "journal" / "edge.jsonl"
    journal.parent.mkdir()
    write(journal, b"".join(subject_line(i, (alice, bob)[i % 2]) for i in range(40)))
    collector = await collect(store, journal)
    await collector.drain()
    write(journal, b"".join(subject_line(i, (alice, bob)[i % 2]) for i in range(40, 50)))
    stop = threading.Event()

    def others() -> None:  # bob keeps making requests through the erasure
        for i in range(50, 250):
            write(journal, subject_line(i, bob))
            if stop.wait(0.002):
                return

    writer = threading.Thread(target=others)
    writer.start()
    try:
        done, copies = await asyncio.to_thread(collector.erase, alice, "tester", "test")
    finally:
        writer.join()
    assert done is not None and done.records == 25 and copies == 25
    await collector.drain()
    await collector.stop()
    assert alice.encode() not in journal.read_bytes()
    assert journal.read_bytes().count(bob.encode()) == 225
    assert store.pseudonyms(alice) == [] and store.query(subject=alice, limit=None) == []
    rows = [r for r in store.query(limit=None) if r["chain"] == "edge~0"]
    assert sorted(int(r["id"][1:]) for r in rows) == list(range(250))  # each once
    assert len(store.query(subject=bob, limit=None)) == 225
    assert chain_intact(store)
    collector = await collect(store, journal)  # restarted: nothing read twice
    write(journal, subject_line(250, alice))  # alice, after her erasure: a new pseudonym
    await collector.drain()
    await collector.stop()
    assert len([r for r in store.query(limit=None) if r["chain"] == "edge~0"]) == 251
    assert len(store.query(subject=alice, limit=None)) == 1
    store.close()
