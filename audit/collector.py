"""The audit collector: tails Envoy's audit journals into the store, exactly once.

Why a file journal and not the gRPC access-log service (ALS): ALS is a one-way client stream
without acknowledgements. Envoy buffers entries while the stream is down and drops them when the
buffer fills, and entries already written to a dying stream are gone with it; no reconciliation
can recover them without a second, durable copy. Envoy's file access log is that durable copy:
Envoy appends one line per finished request and never waits for us. The collector reads complete
lines and stores the records together with the byte offset it has read up to, in ONE SQLite
transaction. Crash anywhere and the next run resumes at the last committed offset: each line is
stored exactly once, whether the collector was restarted, crashed, or the store was full.

A store that is full, read-only or unreachable is never a reason to drop anything: the collector
stops advancing, logs an error (again every 30 s while it lasts) with how much is waiting,
exports it as `meshfn_audit_pending_bytes`, and retries with backoff; the lines stay in the
journal. Many collectors may write one store (PostgreSQL): each journal is its own chain, and a
collector that finds its journal's stored position moved by another (a race, or a restart of
the other) re-reads the position and goes on from there (store.StoreConflict): no line is stored
twice or skipped.

Checkpoints come from the signer (signer.py), which the collector asks every `checkpoint_every`
records or `checkpoint_interval` seconds, in the background; the signer stores them itself (the
collector's role may not insert checkpoints). The records stored since the last checkpoint are
the ones a writer of the store could still remove undetected: at most `checkpoint_every`
records, or `checkpoint_interval` seconds of traffic, per collector (plus one signing round
trip); lower either to shrink that bound.

Retention: every `retention_interval` the collector asks the signer to witness a prune (the
signer decides how far, from its own retention setting) and deletes up to the witnessed points;
without a signer nothing is ever deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .record import from_log_line, unparsed
from .redact import FINGERPRINT_BYTES, fingerprint_length, journal_files, redact_file
from .redact import fingerprint as _fingerprint
from .signer import CheckpointSigner, SignerError
from .store import AuditStore, Erasure, JournalPosition, StoreConflict, StoreError

log = logging.getLogger("meshfn.audit")

_MAX_BATCH = 1 << 20  # bytes of journal per transaction
_REPEAT_ERROR_S = 30.0
_ROTATION_QUIET_S = 1.0
_FINGERPRINT = FINGERPRINT_BYTES
_REOPEN_TIMEOUT_S = 10.0


@dataclass
class _Journal:
    source: str
    path: Path
    fd: int | None = None
    inode: int = 0
    offset: int = 0
    size: int = 0
    stored: int = 0
    quiet_since: float = 0.0
    fingerprint: str = ""
    rotated_to: Path | None = None  # set by rotate(): delete it once fully stored
    reopen: Callable[[], Awaitable[None]] | None = None  # automatic rotation (see watch)
    reopen_pending: bool = False  # renamed, but the proxy has not confirmed the reopen yet

    def position(self) -> JournalPosition:
        return JournalPosition(
            self.source, str(self.path), self.inode, self.offset, self.fingerprint
        )


def _unchanged(j: _Journal) -> bool:
    """Fully read and still the file at its path, or not written yet; nothing in between."""
    if j.rotated_to is not None or j.quiet_since or j.reopen_pending:
        return False
    try:
        if j.fd is None:
            return not os.path.exists(j.path)
        return os.fstat(j.fd).st_size == j.offset and os.stat(j.path).st_ino == j.inode
    except OSError:
        return False


class AuditCollector:
    """Run it in the control plane's event loop: `watch()` each journal, `await start()`,
    `await stop()` at shutdown (drains what is complete and signs a final checkpoint)."""

    def __init__(
        self,
        store: AuditStore,
        *,
        poll_interval: float = 0.05,
        checkpoint_every: int = 1000,
        checkpoint_interval: float = 5.0,
        retention_interval: float = 3600.0,
        rotate_bytes: int = 64 << 20,
        signer: CheckpointSigner | None = None,
    ) -> None:
        self.store = store
        self.signer = signer
        self.poll_interval = poll_interval
        self.checkpoint_every = checkpoint_every
        self.checkpoint_interval = checkpoint_interval
        self.retention_interval = retention_interval
        self.rotate_bytes = rotate_bytes
        self._journals: dict[str, _Journal] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._mutex = threading.Lock()  # one tick at a time (loop task vs. final drain)
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        self._last_retention = 0.0
        self.last_error: str | None = None
        self.error_since: float | None = None
        self._last_error_log = 0.0
        self.signer_error: str | None = None
        self._last_signer_log = 0.0
        self.refused: list[str] = []
        self.conflicts = 0
        self.parse_errors = 0
        self.store_errors = 0
        self.signer_errors = 0
        # QoS refusals the proxies recorded (qos_limit), per (source, tenant, limit): a
        # gateway's own (rate, shed) are counted nowhere else.
        self.qos_refusals: Counter[tuple[str, str, str]] = Counter()
        self.last_checkpoint: int | None = None
        self._sign_task: asyncio.Task[None] | None = None
        self._sign_due = False
        self._counting = threading.Lock()  # _since_checkpoint: ticks add, checkpoints subtract

    # ------------------------------------------------------------------ public API

    def watch(
        self, path: Path, source: str, reopen: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Collect `path` (an Envoy file access log written with `filters.access_log`) as the
        records of `source` (the proxy's node id). With `reopen` (POST the proxy's admin
        /reopen_logs), the journal is rotated whenever `rotate_bytes` of it are stored."""
        if source in self._journals and self._journals[source].path != Path(path):
            raise ValueError(f"audit source {source!r} is already collected from another file")
        journal = self._journals.setdefault(source, _Journal(source, Path(path)))
        journal.reopen = reopen

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("collector already started")
        self._stopping = False
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="audit-collector")

    async def stop(self) -> None:
        """Store every complete line written so far (if the store lets us), checkpoint, close."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            # not cancelled: a tick running in a worker thread finishes before we go on
            await self._task
            self._task = None
        if self._sign_task is not None:
            await self._sign_task
            self._sign_task = None
        try:
            await asyncio.to_thread(self._final)
        finally:
            for journal in self._journals.values():
                if journal.fd is not None:
                    os.close(journal.fd)
                    journal.fd = None

    async def rotate(self, source: str, reopen: Callable[[], Awaitable[None]]) -> Path:
        """Keep a journal from growing forever: rename it, have Envoy reopen its access logs
        (`reopen` should POST the proxy's admin /reopen_logs), keep reading the renamed file
        until it is complete and quiet, then delete it and follow the new one. Nothing is lost:
        Envoy flushes into the old file before it reopens, and the old file is only deleted
        after every line in it is stored."""
        journal = self._journals[source]
        target = await asyncio.to_thread(self._begin_rotation, journal)
        # on failure Envoy keeps writing the renamed file (nothing lost); the loop retries
        await asyncio.wait_for(reopen(), _REOPEN_TIMEOUT_S)
        journal.reopen_pending = False
        return target

    def _begin_rotation(self, journal: _Journal) -> Path:
        with self._mutex:  # not while a tick is looking at this journal
            if journal.rotated_to is not None:
                raise RuntimeError(f"audit journal {journal.path} is already being rotated")
            target = journal.path.with_name(f"{journal.path.name}.{int(time.time() * 1000)}")
            journal.path.rename(target)
            journal.rotated_to = target
            journal.reopen_pending = True
            return target

    def appended(self, records: int) -> None:
        """Records someone else appended through this collector's store (the control chain's
        access records): counted, so the next checkpoint signs them soon."""
        with self._counting:
            self._since_checkpoint += records

    def erase(
        self, subject: str, principal: str | None = None, via: str | None = None
    ) -> tuple[Erasure | None, int]:
        """Erase a subject (store.erase) and every copy of its HMAC in the journals: store
        every complete line first (so no line of the subject is stored after the erasure with
        a pseudonym of its own), erase, then redact the journals in place (redact.py), keeping
        each stored position's fingerprint in step. Call it from a worker thread, after the
        proxies have flushed what they buffered (Envoy's file flush interval). Returns the
        erasure (None: the store knew no such subject, and nothing was redacted) and how many
        copies of the HMAC were overwritten."""
        with self._mutex:  # no tick runs meanwhile: nothing is read or stored under us
            for journal in self._journals.values():
                while self._ingest(journal):
                    pass
            done = self.store.erase(subject, principal=principal, via=via)
            if done is None:
                return None, 0
            with self._counting:
                self._since_checkpoint += 1  # the erasure record
            self._sign_due = True
            return done, self._redact(done.hashes)

    def _redact(self, hashes: tuple[str, ...]) -> int:
        files: set[Path] = set()
        for journal in self._journals.values():
            files |= set(journal_files(journal.path.parent))
        count = 0
        for path in sorted(files):
            written = redact_file(path, hashes)
            count += len(written)
            if not written:
                continue
            for journal in self._journals.values():
                # the file this journal's collector reads (and whose fingerprint is stored)
                if journal.fd is None or os.stat(path).st_ino != journal.inode:
                    continue
                length = fingerprint_length(journal.fingerprint)
                if written[0] >= length:
                    continue
                journal.fingerprint = _fingerprint(journal.fd, length)
                self.store.append([], journal.position())
        if count:
            log.info("audit erasure: %d copies of the subject's HMAC redacted in journals", count)
        return count

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait until every complete line currently in the journals is stored (for tests and
        orderly shutdowns). Raises TimeoutError with the reason if the store refuses."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # a tick may be switching files right now
                if all(
                    j.fd is not None and j.offset >= self._complete_size(j)
                    for j in self._journals.values()
                ):
                    return
            await asyncio.sleep(self.poll_interval)
        raise TimeoutError(f"audit journals not drained: {self.status()}")

    def status(self) -> dict[str, Any]:
        return {
            "journals": [
                {
                    "source": j.source,
                    "path": str(j.path),
                    "offset": j.offset,
                    "size": j.size,
                    "pending_bytes": max(0, j.size - j.offset),
                    "stored": j.stored,
                }
                for j in self._journals.values()
            ],
            "error": self.last_error,
            "error_since": self.error_since,
            "signer_error": self.signer_error,
            "refused": self.refused,
            "unsigned": self._since_checkpoint,
            "last_checkpoint": self.last_checkpoint,
            "conflicts": self.conflicts,
            "parse_errors": self.parse_errors,
            "store_errors": self.store_errors,
            "signer_errors": self.signer_errors,
            "qos_refusals": [
                {"source": source, "tenant": tenant, "limit": limit, "count": count}
                for (source, tenant, limit), count in sorted(self.qos_refusals.items())
            ],
        }

    # ------------------------------------------------------------------ loop

    async def _run(self) -> None:
        backoff = self.poll_interval
        while not self._stopping:
            try:
                progressed = False if self._quiet() else await asyncio.to_thread(self._tick)
                backoff = self.poll_interval
                self._start_signing()
                await self._rotate_big_journals()
                if progressed:
                    continue
            except StoreError as exc:
                self._store_failed(exc)
                backoff = min(max(backoff * 2, 0.25), 5.0)
            except OSError as exc:
                log.error("audit journal error: %s", exc)
                backoff = min(max(backoff * 2, 0.25), 5.0)
            except Exception:  # a bug must not stop collection silently: say it, keep trying
                log.exception("audit collector error; retrying")
                backoff = min(max(backoff * 2, 0.25), 5.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), backoff)

    async def _rotate_big_journals(self) -> None:
        for journal in self._journals.values():
            if journal.reopen is None:
                continue
            try:
                if journal.reopen_pending:
                    await asyncio.wait_for(journal.reopen(), _REOPEN_TIMEOUT_S)
                    journal.reopen_pending = False
                elif journal.rotated_to is None and journal.offset >= self.rotate_bytes:
                    await self.rotate(journal.source, journal.reopen)
            except Exception as exc:  # the proxy may be restarting: try again next time
                log.warning("rotating audit journal %s: reopen failed: %s", journal.path, exc)

    def _start_signing(self) -> None:
        if (
            self._sign_due
            and self.signer is not None
            and (self._sign_task is None or self._sign_task.done())
        ):
            self._sign_due = False
            self._sign_task = asyncio.create_task(asyncio.to_thread(self._checkpoint))

    def _checkpoint(self) -> None:
        """Ask the signer for a checkpoint (it stores it, after its witness has it)."""
        if self.signer is None:
            return
        pending = self._since_checkpoint
        try:
            result = self.signer.sign()
            for checkpoint in result.checkpoints:
                self.last_checkpoint = checkpoint.n
        except (SignerError, StoreError) as exc:
            self.signer_errors += 1
            message = str(exc)
            now = time.monotonic()
            if message != self.signer_error or now - self._last_signer_log > _REPEAT_ERROR_S:
                log.error(
                    "AUDIT CHECKPOINT FAILED: %s; %d record(s) stored since the last checkpoint"
                    " are not signed yet (retried)",
                    message,
                    self._since_checkpoint,
                )
                self._last_signer_log = now
            self.signer_error = message
            self._sign_due = True
            return
        if self.signer_error is not None:
            log.warning("audit signer reachable again after: %s", self.signer_error)
        self.signer_error = None
        self.refused = result.refused
        for refusal in result.refused:
            log.error("AUDIT SIGNER REFUSED TO SIGN %s (the store was changed under it)", refusal)
        with self._counting:
            self._since_checkpoint = max(0, self._since_checkpoint - pending)

    def _final(self) -> None:
        try:
            while self._tick():
                pass
            self._checkpoint()
        except StoreError as exc:
            self._store_failed(exc)
        pending = sum(max(0, j.size - j.offset) for j in self._journals.values())
        if pending:
            log.error(
                "audit collector stopped with %d journal bytes not stored; they stay in the"
                " journal and are stored on the next start",
                pending,
            )

    def _quiet(self) -> bool:
        """Nothing for a pass to do, as far as a few stat calls on the loop can tell: every
        journal fully read and still the file at its path (or not written yet), no checkpoint
        or retention due. An idle collector then makes no thread hop per poll (they were most
        of an idle control plane's wake-ups). Racing a pass elsewhere is harmless: a wrong
        answer only runs or skips one pass, and the next poll looks again."""
        retention_due = (
            self.signer is not None
            and self.retention_interval
            and time.monotonic() - self._last_retention >= self.retention_interval
        )
        if self._since_checkpoint or self._sign_due or retention_due:
            return False
        return all(_unchanged(j) for j in self._journals.values())

    def _tick(self) -> bool:
        """One pass over every journal; True if records were stored."""
        with self._mutex:
            progressed = False
            for journal in self._journals.values():
                try:
                    if self._ingest(journal):
                        progressed = True
                except StoreConflict as exc:
                    self._resync(journal, exc)
                    progressed = True
            if self.last_error is not None and progressed:
                log.warning("audit store writable again after: %s", self.last_error)
                self.last_error = self.error_since = None
            self._maybe_checkpoint()
            return progressed

    def _resync(self, j: _Journal, exc: StoreConflict) -> None:
        """Another collector stored this journal's lines first: continue from its position."""
        self.conflicts += 1
        log.warning("audit journal %s: %s; re-reading the stored position", j.path, exc)
        if j.fd is not None:
            os.close(j.fd)
            j.fd = None

    def _store_failed(self, exc: StoreError) -> None:
        self.store_errors += 1
        message = str(exc)
        now = time.monotonic()
        if message != self.last_error or now - self._last_error_log > _REPEAT_ERROR_S:
            pending = {j.source: max(0, j.size - j.offset) for j in self._journals.values()}
            log.error(
                "AUDIT RECORDS NOT STORED: %s; kept in the journals and retried (pending bytes"
                " per source: %s)",
                message,
                pending,
            )
            self._last_error_log = now
        if message != self.last_error:
            self.error_since = time.time()
        self.last_error = message

    # ------------------------------------------------------------------ one journal

    def _rotated_leftover(self, j: _Journal, position: JournalPosition) -> int | None:
        """A rotated journal (`<name>.<n>`) still holding unstored lines from before a restart:
        opened so it is finished first (and then deleted)."""
        for candidate in sorted(j.path.parent.glob(f"{j.path.name}.*")):
            try:
                fd = os.open(candidate, os.O_RDONLY)
            except OSError:
                continue
            length = int(position.fingerprint.split(":", 1)[0]) if position.fingerprint else 0
            if os.fstat(fd).st_ino == position.inode and (
                not position.fingerprint or _fingerprint(fd, length) == position.fingerprint
            ):
                j.rotated_to = candidate
                return fd
            os.close(fd)
        return None

    def _open(self, j: _Journal) -> bool:
        position = self.store.journal_position(j.source)
        fd: int | None = None
        if position is not None:
            fd = self._rotated_leftover(j, position)
        if fd is None:
            try:
                fd = os.open(j.path, os.O_RDONLY)
            except FileNotFoundError:
                return False  # Envoy has not written its first line yet
        inode = os.fstat(fd).st_ino
        offset, fingerprint = 0, ""
        same = position is not None and position.inode == inode
        if same and position is not None and position.fingerprint:
            length = int(position.fingerprint.split(":", 1)[0])
            same = _fingerprint(fd, length) == position.fingerprint
        if same and position is not None:
            offset, fingerprint = position.offset, position.fingerprint
        elif position is not None:
            log.error(
                "audit journal %s was replaced while the collector was away (stored position:"
                " inode %d offset %d); reading the new file from its start",
                j.path,
                position.inode,
                position.offset,
            )
        j.fd, j.inode, j.offset, j.fingerprint = fd, inode, offset, fingerprint
        j.size = os.fstat(fd).st_size
        if j.size < offset:
            log.error(
                "audit journal %s shrank below the stored offset; reading it from its start", j.path
            )
            j.offset = 0
        return True

    def _complete_size(self, j: _Journal) -> int:
        """How far the journal holds complete lines (what `drain` waits for)."""
        if j.fd is None:
            return 0 if not j.path.exists() else 1 << 62
        size = os.fstat(j.fd).st_size
        if size <= j.offset:
            return j.offset
        start = max(j.offset, size - 65536)  # the end first: cheap while far behind
        newline = os.pread(j.fd, size - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        if start == j.offset:
            return j.offset
        tail = os.pread(j.fd, min(size - j.offset, _MAX_BATCH), j.offset)
        return j.offset + tail.rfind(b"\n") + 1 if b"\n" in tail else j.offset

    def _ingest(self, j: _Journal) -> bool:
        if j.fd is None and not self._open(j):
            return False
        assert j.fd is not None
        j.size = os.fstat(j.fd).st_size
        if j.size < j.offset:
            log.error(
                "audit journal %s was truncated by someone; reading it from its start", j.path
            )
            j.offset = 0
        if j.size == j.offset:
            self._maybe_rotated(j)
            return False
        chunk = os.pread(j.fd, min(j.size - j.offset, _MAX_BATCH), j.offset)
        end = chunk.rfind(b"\n")
        torn = False
        if end < 0:
            if len(chunk) >= _MAX_BATCH:  # a single line over 1 MiB: store it as unparsed
                end = len(chunk) - 1
            elif self._abandoned(j):  # a rotated journal that ends mid-line (a crash)
                end, torn = len(chunk), True
            else:
                return False  # Envoy is mid-line
        lines = chunk[:end].split(b"\n")
        tail = lines.pop() if torn else b""
        records = [from_log_line(line, j.source) for line in lines if line.strip()]
        if torn:
            records.append(
                unparsed(tail, j.source, "truncated line at the end of a rotated journal")
            )
        for record in records:
            if record.get("qos_limit"):
                key = (j.source, str(record.get("tenant") or ""), str(record["qos_limit"]))
                self.qos_refusals[key] += 1
            if "error" in record:
                self.parse_errors += 1
                log.error(
                    "audit journal %s: %s (stored as an unparsed record)", j.path, record["error"]
                )
        new_offset = j.offset + end + (0 if torn else 1)
        fingerprint = j.fingerprint
        if not fingerprint or int(fingerprint.split(":", 1)[0]) < _FINGERPRINT:
            fingerprint = _fingerprint(j.fd, new_offset)
        self.store.append(
            records, JournalPosition(j.source, str(j.path), j.inode, new_offset, fingerprint)
        )
        j.offset, j.fingerprint = new_offset, fingerprint
        j.stored += len(records)
        j.quiet_since = 0.0
        with self._counting:
            self._since_checkpoint += len(records)
        return True

    def _abandoned(self, j: _Journal) -> bool:
        """The file was rotated away and has been quiet for a while: Envoy writes the new one,
        so a partial last line here will never be finished."""
        try:
            current = os.stat(j.path).st_ino
        except FileNotFoundError:
            return False
        if current == j.inode:
            return False
        now = time.monotonic()
        if not j.quiet_since:
            j.quiet_since = now
        return now - j.quiet_since >= _ROTATION_QUIET_S

    def _maybe_rotated(self, j: _Journal) -> None:
        """Follow a rotation (journal renamed, Envoy told to reopen its logs): once the old file
        has been quiet for a second and is fully read, continue with the new file at offset 0."""
        try:
            current = os.stat(j.path).st_ino
        except FileNotFoundError:
            return
        if current == j.inode:
            return
        now = time.monotonic()
        if not j.quiet_since:
            j.quiet_since = now
            return
        if now - j.quiet_since < _ROTATION_QUIET_S:
            return
        assert j.fd is not None
        os.close(j.fd)
        j.fd = None
        if j.rotated_to is not None:
            j.rotated_to.unlink(missing_ok=True)
            j.rotated_to = None
        fd = os.open(j.path, os.O_RDONLY)
        j.fd, j.inode, j.offset, j.quiet_since, j.fingerprint = fd, os.fstat(fd).st_ino, 0, 0.0, ""
        self.store.append([], j.position())
        log.info("audit journal %s rotated; following the new file", j.path)

    def _maybe_checkpoint(self) -> None:
        now = time.monotonic()
        if self._since_checkpoint and (
            self._since_checkpoint >= self.checkpoint_every
            or now - self._last_checkpoint >= self.checkpoint_interval
        ):
            self._sign_due = True
            self._last_checkpoint = now
        if (
            self.signer is not None
            and self.retention_interval
            and now - self._last_retention >= self.retention_interval
        ):
            self._last_retention = now
            self._prune(self.signer)

    def _prune(self, signer: CheckpointSigner) -> None:
        """Retention: the signer witnesses what may go, then the store deletes that much."""
        try:
            result = signer.prune()
        except SignerError as exc:
            log.error("audit retention: the signer witnessed no prune: %s", exc)
            return
        deleted = self.store.apply_prune(result.points)
        if deleted:
            log.info(
                "audit retention (%d days, witnessed by the signer) removed %d records",
                result.retention_days,
                deleted,
            )


class CollectorMetrics(Collector):
    """/metrics for one or more collectors, read from their status at scrape time (register it
    in the registry that serves /metrics: the control plane's, or `collect --metrics-port`)."""

    def __init__(
        self,
        *collectors: Callable[[], AuditCollector | None],
        classify: Callable[[str, str], str] | None = None,
    ) -> None:
        """`classify(source, tenant)`: the tenant's QoS class at that proxy (a label)."""
        self.collectors = collectors
        self.classify = classify

    def collect(self) -> Iterator[Metric]:
        stored = CounterMetricFamily(
            "meshfn_audit_records_stored", "Audit records committed to the store", labels=["source"]
        )
        pending = GaugeMetricFamily(
            "meshfn_audit_pending_bytes",
            "Journal bytes Envoy wrote that are not in the store yet",
            labels=["source"],
        )
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "store_errors": CounterMetricFamily(
                "meshfn_audit_store_errors", "Failed attempts to write the audit store"
            ),
            "signer_errors": CounterMetricFamily(
                "meshfn_audit_signer_errors",
                "Failed checkpoint requests (signer unreachable or failing)",
            ),
            "conflicts": CounterMetricFamily(
                "meshfn_audit_conflicts",
                "Batches another collector had stored first (re-read, never stored twice)",
            ),
            "parse_errors": CounterMetricFamily(
                "meshfn_audit_parse_errors",
                "Journal lines that were not audit lines (stored as unparsed records)",
            ),
            "unsigned": GaugeMetricFamily(
                "meshfn_audit_unsigned_records", "Records stored since the last checkpoint"
            ),
        }
        store_up = GaugeMetricFamily(
            "meshfn_audit_store_up", "1 while the last write to the audit store succeeded"
        )
        signer_up = GaugeMetricFamily(
            "meshfn_audit_signer_up", "1 while the last checkpoint request succeeded"
        )
        refusals = CounterMetricFamily(
            "meshfn_qos_proxy_refusals",
            "QoS refusals the proxies' audit records name (qos_limit): a gateway's own rate "
            "limits and priority shedding, and the backends' refusals they passed on",
            labels=["source", "tenant", "class", "limit"],
        )
        totals = dict.fromkeys(families, 0)
        store_ok = signer_ok = 1
        for get in self.collectors:
            collector = get()
            if collector is None:
                continue
            status = collector.status()
            for journal in status["journals"]:
                stored.add_metric([journal["source"]], journal["stored"])
                pending.add_metric([journal["source"]], journal["pending_bytes"])
            for key in totals:
                totals[key] += int(status[key])
            for row in status["qos_refusals"]:
                cls = self.classify(row["source"], row["tenant"]) if self.classify else ""
                refusals.add_metric([row["source"], row["tenant"], cls, row["limit"]], row["count"])
            store_ok &= status["error"] is None
            signer_ok &= status["signer_error"] is None
        for key, family in families.items():
            family.add_metric([], totals[key])
        store_up.add_metric([], store_ok)
        signer_up.add_metric([], signer_ok)
        yield from (stored, pending, *families.values(), store_up, signer_up, refusals)
