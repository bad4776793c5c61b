"""Audit store benchmark: records per second stored by real collectors from real journal files,
and `verify` time per million records, in one run.

- sqlite_rps: one collector process into the embedded SQLite store;
- pg_rps: one collector process into PostgreSQL (Debian's server, its default durability:
  fsync and synchronous_commit on);
- pg4_rps: four collector processes at once, each with its own journal, into ONE PostgreSQL
  store (what a cluster does; on this 2-core VM they share the cores with the server);
- verify_s_per_m: `verify` (every chain, every checkpoint, the witness) as the CLI runs it,
  scaled to a million records: the worse of the SQLite store and the four-chain PostgreSQL store
  (chains walked in parallel); verify_s_per_m_pg1: the one-chain PostgreSQL store (one core).

Each run has the checkpoint signer as its own process (`meshfn audit signer`), asked every 1000
records or 5 s, as in production; on PostgreSQL the collectors, the signer and verify connect
as their own least-privilege roles (`meshfn audit init`), as in a cluster. Journal lines are the
sidecar's access-log lines (the bare filter state, a mesh route, a tenant; 1000 subjects). rps =
records / wall time, from the moment the first collector is told to start until the last has
stored its journal (measured here, the parent of the collectors; each collector's own elapsed
time is in the JSON). Each collector must have stored every line of its journal, without
conflicts, and `verify` must count every line sent; otherwise the run fails. Prints one line:
  audit: sqlite_rps=… pg_rps=… pg4_rps=… verify_s_per_m=… …
Goals (issue 15), reported as met or not: pg4_rps >= 20,000 (the store never limits the mesh),
verify_s_per_m <= 10.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshfn.audit import FileWitness, open_store, signing, verify
from meshfn.audit.collector import AuditCollector
from meshfn.audit.signer import SignerClient, wait_ready
from meshfn.audit.stores import is_postgres
from meshfn.testing.postgres import PostgresServer, role_dsns

HERE = Path(__file__).resolve().parent
SUBJECTS = [hashlib.sha256(f"subject-{i}".encode()).hexdigest() for i in range(1000)]
EDGE = "spiffe://meshfn.local/ns/ingress/sa/edge"
GOAL_PG4_RPS = 20_000
GOAL_VERIFY_S_PER_M = 10.0


def journal_line(i: int, source: int) -> bytes:
    entry = {
        "id": f"{source:08x}{i:024x}",
        "time": f"2026-12-01T10:{i // 60000 % 60:02d}:{i // 1000 % 60:02d}.{i % 1000:03d}000Z",
        "method": "POST",
        "authority": "models",
        "path": f"/v2/models/{('iris', 'digits', 'embedder')[i % 3]}/infer",
        "status": "200" if i % 50 else "503",
        "duration_us": str(700 + i % 500),
        "duration_ms": "0",
        "upstream_cluster": "inbound|9101",
        "route": "local",
        "principal": EDGE,
        "flags": "-",
        "traceparent": f"00-{i:032x}-00f067aa0ba902b7-01",
        "b3_trace_id": None,
        "audit": SUBJECTS[i % len(SUBJECTS)],
        "audit_v": "1",
        "salt_id": "s-0123456789ab",
        "subject_source": "jwt_headers",
        "tenant": "acme",
        "mesh_route": "default/function-iris",
        "mesh_route_from": EDGE,
    }
    return json.dumps(entry).encode() + b"\n"


def write_journal(path: Path, records: int, source: int) -> None:
    with path.open("wb") as out:
        for start in range(0, records, 10000):
            out.write(
                b"".join(journal_line(i, source) for i in range(start, min(records, start + 10000)))
            )


def worker(location: str, journal: str, source: str, signer: str) -> None:
    """One collector process: wait for `go` on stdin, store the journal, report."""
    store = open_store(location)

    async def run() -> dict[str, Any]:
        collector = AuditCollector(store, poll_interval=0.01, signer=SignerClient(signer))
        collector.watch(Path(journal), source)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        started, cpu = time.perf_counter(), time.process_time()
        await collector.start()
        await collector.drain(timeout=3600)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        await collector.stop()
        status = collector.status()
        return {
            "elapsed_s": elapsed,
            "cpu_s": cpu,
            "records": status["journals"][0]["stored"],
            "conflicts": status["conflicts"],
            "signer_error": status["signer_error"],
        }

    print(json.dumps(asyncio.run(run())), flush=True)
    store.close()


def run_collectors(location: str, journals: list[Path], signer: str, tmp: Path) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-P", __file__, "--worker", location, str(j), f"bench-{n}", signer],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(tmp / f"collector-{n}.log").open("wb"),
            text=True,
        )
        for n, j in enumerate(journals)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        started = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            assert proc.stdout is not None
            results.append(json.loads(proc.stdout.readline()))
        wall = time.perf_counter() - started
        for proc in procs:
            proc.wait(60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # Every journal line stored, once: a collector that stopped early, skipped lines or hit
    # conflicts would otherwise make its run look faster.
    for journal, result in zip(journals, results, strict=True):
        sent = journal_lines(journal)
        if result["records"] != sent or result["conflicts"]:
            raise SystemExit(
                f"audit: {journal.name}: {result['records']} of {sent} lines stored, "
                f"{result['conflicts']} conflicts"
            )
    records = sum(r["records"] for r in results)
    slowest = max(r["elapsed_s"] for r in results)
    cpu = sum(r["cpu_s"] for r in results)
    return {
        "collector_cpu_us_per_record": round(cpu / records * 1e6, 1),
        "load_average_1m": os.getloadavg()[0],
        "collectors": len(journals),
        "records": records,
        "elapsed_s": round(slowest, 3),  # the slowest collector's own clock, from its `go`
        "wall_s": round(wall, 3),
        "rps": round(records / wall),  # wall: from the first `go` until the last is stored
        "workers": results,
    }


def journal_lines(path: Path) -> int:
    with path.open("rb") as journal:
        return sum(1 for _ in journal)


def scenario(location: str, journals: list[Path], tmp: Path, name: str) -> dict[str, Any]:
    """Signer process + collectors; then verify the store against the witness."""
    open_store(location).close()  # created by its owner before anyone else opens it
    roles = role_dsns(location) if is_postgres(location) else {}
    key = tmp / name / "signer" / "checkpoint.key"
    witness = tmp / name / "witness" / "checkpoints.jsonl"
    address = f"unix:{tmp / f'{name}.sock'}"
    signer = subprocess.Popen(
        [sys.executable, "-P", "-m", "meshfn.audit.cli", "signer", "--store",
         roles.get("signer", location), "--key", str(key), "--witness", str(witness),
         "--listen", address],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / f"{name}-signer.log").open("wb"),
    )  # fmt: skip
    try:
        wait_ready(address, timeout=30)
        result = run_collectors(roles.get("collector", location), journals, address, tmp)
    finally:
        signer.terminate()
        signer.wait(30)
    store = open_store(roles.get("reader", location), readonly=True)
    try:
        started = time.perf_counter()
        public = signing.load_public(signing.public_path(key))
        report = verify(store, public, FileWitness(witness), workers=None)  # as the CLI
        verify_s = time.perf_counter() - started
    finally:
        store.close()
    assert report.ok, report.problems[:5]
    # what verify walked is what was sent: every line of every journal
    sent = sum(journal_lines(j) for j in journals)
    assert report.records == result["records"] == sent, (report.records, result["records"], sent)
    result.update(
        verify_s=round(verify_s, 3),
        verify_s_per_m=round(verify_s / report.records * 1e6, 2),
        checkpoints=report.witnessed,
        unsigned_tail=report.unsigned_tail,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=250_000, help="per collector")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "audit.json")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    with tempfile.TemporaryDirectory(prefix="meshfn-bench-audit-") as name:
        tmp = Path(name)
        journals = [tmp / f"journal-{n}.jsonl" for n in range(4)]
        for n, path in enumerate(journals):
            write_journal(path, args.records, n)
        fresh = [tmp / "journal-sqlite.jsonl", tmp / "journal-pg1.jsonl"]
        for path in fresh:
            path.write_bytes(journals[0].read_bytes())
        sqlite = scenario(str(tmp / "sqlite" / "audit.db"), [fresh[0]], tmp, "sqlite")
        with PostgresServer(settings={}) as server:
            pg = scenario(server.database("one"), [fresh[1]], tmp, "pg")
            pg4 = scenario(server.database("four"), journals, tmp, "pg4")
    verify_s_per_m = max(s["verify_s_per_m"] for s in (sqlite, pg4))
    goals = {
        "pg4_rps>=20000": pg4["rps"] >= GOAL_PG4_RPS,
        "verify_s_per_m<=10": verify_s_per_m <= GOAL_VERIFY_S_PER_M,
    }
    result = {
        "goals": goals,
        "records_per_collector": args.records,
        "cpus": os.cpu_count(),
        "sqlite": sqlite,
        "pg": pg,
        "pg4": pg4,
        "verify_s_per_m": verify_s_per_m,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    verdicts = ",".join(f"{k}:{'met' if v else 'NOT-met'}" for k, v in goals.items())
    print(
        f"audit: sqlite_rps={sqlite['rps']} pg_rps={pg['rps']} pg4_rps={pg4['rps']}"
        f" verify_s_per_m={result['verify_s_per_m']}"
        f" verify_s_per_m_sqlite={sqlite['verify_s_per_m']}"
        f" verify_s_per_m_pg={pg4['verify_s_per_m']} verify_s_per_m_pg1={pg['verify_s_per_m']}"
        f" pg4_records={pg4['records']}"
        f" goals={verdicts}"
    )


if __name__ == "__main__":
    main()
