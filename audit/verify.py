"""`verify`: every chain of the store against the signed checkpoints, in the store and in the
witness, with each problem named by kind, journal (chain) and record.

Kinds: `edited` (a record no longer matches its hash, or its query columns say something else
than it), `deleted` / `inserted` / `reordered` (the chain's order is broken there; `deleted`
also for records gone from a chain's start that no prune the signer witnessed covers),
`rewritten` (a record differs from what a checkpoint
signed: the chain up to it was recomputed), `truncated` (a checkpoint signed records the store no
longer has: a deleted tail, or a whole journal gone), `resigned` (the store's checkpoint differs
from the witness's: history was re-signed), `signature` (a checkpoint not signed by the trusted
key), `unwitnessed` (a checkpoint the witness never saw), `retention` (a chain starting where no
witnessed prune says, or a witnessed prune its own signed retention did not allow), `witness`
(the witness itself is damaged or missing), `unlinked` (records whose pseudonym no longer
leads to its subject beyond what the erasure records account for: a subject hidden from
`--subject` queries without an erasure).

Retention is read from the signed checkpoints only (retention.py), never from the store.

The witness is read before the store: the signer only signs records that are already stored,
so everything it witnessed before this run started must be found.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from queue import Queue
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from . import offline, retention
from .checkpoint import Checkpoint
from .retention import PrunePoint
from .store import Anchor, AuditStore, VerifyRow
from .stores import open_store
from .witness import Witness, WitnessError

if TYPE_CHECKING:
    from collections.abc import Iterable

_MAX_PROBLEMS = 100


@dataclass(frozen=True)
class Problem:
    kind: str
    chain: str | None
    seq: int | None
    detail: str


@dataclass
class ChainReport:
    records: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    anchor_seq: int = 0
    signed_seq: int = 0  # newest record a checkpoint signed
    pruned_seq: int = 0  # newest witnessed prune point (records up to it may be gone)

    @property
    def unsigned(self) -> int:
        return max(0, (self.last_seq or self.anchor_seq) - max(self.signed_seq, self.anchor_seq))


@dataclass
class VerifyReport:
    records: int = 0
    chains: dict[str, ChainReport] = field(default_factory=dict)
    checkpoints: int = 0  # valid ones in the store
    witnessed: int = 0  # valid ones in the witness
    witness: str | None = None
    last_checkpoint: int | None = None
    last_checkpoint_time: str | None = None
    retention_days: int | None = None  # as the newest checkpoint signed it
    problems: list[Problem] = field(default_factory=list)
    truncated_problems: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsigned_tail(self) -> int:
        """Records after their chain's newest checkpoint: intact as far as the chain shows, but
        a deleted tail this short could not be detected until a checkpoint covers it."""
        return sum(c.unsigned for c in self.chains.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records": self.records,
            "chains": {
                name: {**asdict(c), "unsigned": c.unsigned} for name, c in self.chains.items()
            },
            "checkpoints": self.checkpoints,
            "witnessed": self.witnessed,
            "witness": self.witness,
            "last_checkpoint": self.last_checkpoint,
            "last_checkpoint_time": self.last_checkpoint_time,
            "retention_days": self.retention_days,
            "unsigned_tail": self.unsigned_tail,
            "problems": [asdict(p) for p in self.problems],
            "more_problems_not_shown": self.truncated_problems,
            "notes": self.notes,
        }


@dataclass(frozen=True)
class _Signed:
    hash: str
    n: int
    time: str


class Verifier:
    def __init__(
        self,
        store: AuditStore,
        key: Ed25519PublicKey,
        witness: Witness | None,
        now: float | None,
        workers: int | None = 1,
    ) -> None:
        self.store = store
        self.workers = workers
        self.key = key
        self.key_id = offline.key_id(key)
        self.witness = witness
        self.now = time.time() if now is None else now
        self.report = VerifyReport(witness=witness.location if witness is not None else None)
        self.legacy = False  # only version-2 checkpoints: prunes were not witnessed yet

    def problem(self, kind: str, chain: str | None, seq: int | None, detail: str) -> None:
        if len(self.report.problems) >= _MAX_PROBLEMS:
            self.report.truncated_problems = True
            return
        self.report.problems.append(Problem(kind, chain, seq, detail))

    # ------------------------------------------------------------------ checkpoints

    def run(self) -> VerifyReport:
        authority = self.authority()
        signed: dict[str, dict[int, _Signed]] = {}
        for checkpoint in authority:
            for chain, (seq, digest) in checkpoint.heads.items():
                signed.setdefault(chain, {})[seq] = _Signed(digest, checkpoint.n, checkpoint.time)
        points = retention.prune_points(authority)
        self.check_retention(authority)
        anchors = self.store.chains()
        chains = sorted(set(anchors) | set(signed))
        starts = {c: self.start(c, anchors.get(c), points.get(c, [])) for c in chains}
        walks = self.walk_chains([(c, starts[c], signed.get(c, {})) for c in chains])
        for chain, walked in zip(chains, walks, strict=True):
            self.check_chain(chain, signed.get(chain, {}), *walked)
            pruned = points.get(chain)
            self.report.chains[chain].pruned_seq = pruned[-1].seq if pruned else 0
        self.check_subjects()
        return self.report

    def check_subjects(self) -> None:
        """What `query --subject` finds goes through the subjects table, which no hash covers:
        only an erasure may remove a subject's pseudonym, and it records how many records it
        unlinked; more unlinked records than that is a pseudonym deleted or changed by hand."""
        count, sample = self.store.unlinked()
        erased = self.store.erased()
        if count > erased:
            where = ", ".join(f"journal {c} record {q}" for c, q in sample)
            self.problem(
                "unlinked",
                sample[0][0] if sample else None,
                sample[0][1] if sample else None,
                f"{count} record(s) carry a pseudonym the store no longer links to its subject"
                f" (e.g. {where}), but the erasure records account for {erased}: a subject was"
                " unlinked without an erasure (hidden from --subject queries)",
            )

    def authority(self) -> list[Checkpoint]:
        """The checkpoints verify holds the store to: the witness's (read first: see the module
        docstring), each compared with the store's; the store's own without a witness."""
        witnessed = self.read_witness()
        stored = self.valid(self.store.checkpoints(), "store")
        self.report.checkpoints = len(stored)
        if witnessed is not None:
            self.compare(stored, witnessed)
            authority = witnessed
        else:
            authority = stored
            self.report.notes.append(
                "no witness checked: a tail deleted together with its checkpoints, or a history"
                " re-signed with the key, cannot be told apart from a short trail"
            )
        if authority:
            self.report.last_checkpoint = authority[-1].n
            self.report.last_checkpoint_time = authority[-1].time
        return authority

    def compare(self, stored: list[Checkpoint], witnessed: list[Checkpoint]) -> None:
        seen = {c.n: c for c in witnessed}
        for checkpoint in sorted(stored, key=lambda c: c.n):
            n = checkpoint.n
            other = seen.get(n)
            if other is None:
                self.problem(
                    "unwitnessed",
                    None,
                    None,
                    f"checkpoint {n} is in the store but not in the witness: it was not"
                    " made by the signer (or the witness lost it)",
                )
            elif other.body != checkpoint.body:
                self.problem(
                    "resigned",
                    None,
                    None,
                    f"checkpoint {n} in the store differs from the witnessed checkpoint {n}:"
                    " the history was re-signed",
                )

    def check_retention(self, authority: list[Checkpoint]) -> None:
        """The retention as signed (a change is a note), and every witnessed prune against the
        retention signed with it."""
        days: int | None = None
        for checkpoint in authority:
            if checkpoint.retention_days is not None and checkpoint.retention_days != days:
                if days is not None:
                    self.report.notes.append(
                        f"the signer's retention changed from {days} to"
                        f" {checkpoint.retention_days} day(s) at checkpoint {checkpoint.n}"
                        f" ({checkpoint.time})"
                    )
                days = checkpoint.retention_days
        self.report.retention_days = days
        self.legacy = bool(authority) and days is None
        for point, why in retention.early(authority):
            self.problem(
                "retention",
                point.chain,
                point.seq,
                f"journal {point.chain}: checkpoint {point.n} ({point.time}) witnessed a prune up"
                f" to record {point.seq}, but {why}",
            )

    def start(self, chain: str, anchor: Anchor | None, points: list[PrunePoint]) -> Anchor | None:
        """Where the chain's walk starts (None: its genesis): the store's anchor, held to the
        prunes the signer witnessed (a start no witnessed prune names is reported)."""
        if anchor is None or anchor.seq == 0:
            return None
        if any(p.seq == anchor.seq and p.hash == anchor.hash.hex() for p in points):
            return anchor
        reach = points[-1].seq if points else 0
        if anchor.seq <= reach:
            self.problem(
                "retention",
                chain,
                anchor.seq,
                f"journal {chain}: the chain starts after record {anchor.seq}, which no witnessed"
                f" prune names as it is (the witnessed prunes reach record {reach})",
            )
        elif self.legacy:
            self.problem(
                "retention",
                chain,
                anchor.seq,
                f"journal {chain}: records 1-{anchor.seq} were pruned before prunes were"
                " witnessed (checkpoints of version 2): the signer of this meshfn witnesses"
                " such a start at its first checkpoint if its retention allows it; run it"
                " (`meshfn up`, or `meshfn audit signer`) and verify again",
            )
        else:
            since = (
                f"the newest witnessed prune reaches record {reach}"
                if points
                else ("the signer never witnessed a prune of this journal")
            )
            self.problem(
                "deleted",
                chain,
                reach + 1,
                f"journal {chain}: records {reach + 1}-{anchor.seq} were removed, but no prune"
                f" the signer witnessed covers them ({since}): deleted, not retention",
            )
        return anchor

    def walk_chains(self, jobs: list[_Job]) -> Iterator[tuple[ChainReport, list[Problem]]]:
        """Each chain's walk, in order: in worker processes when there are several chains
        with enough records to pay for starting them (chains share nothing, so verification
        then uses every core), else here."""
        heads = self.store.heads()
        sizes = [heads.get(chain, (0, b""))[0] - (a.seq if a else 0) for chain, a, _ in jobs]
        workers = min(self.workers or os.cpu_count() or 1, sum(s > 0 for s in sizes))
        if workers < 2 or sum(sizes) < _PARALLEL_RECORDS:
            for job in jobs:
                yield _walk(self.store, *job)
            return
        # spawn: a forked child of a threaded process (the control plane) may deadlock
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = [pool.submit(_walk_in_worker, self.store.open_location, *j) for j in jobs]
            for future in futures:
                yield future.result()

    def valid(self, checkpoints: Iterable[Checkpoint], where: str) -> list[Checkpoint]:
        out = []
        for checkpoint in checkpoints:
            try:
                doc = checkpoint.doc
            except ValueError as exc:
                self.problem(
                    "signature", None, None, f"a checkpoint in the {where} is malformed: {exc}"
                )
                continue
            n = doc["n"]
            if doc.get("store") != self.store.store_id:
                self.problem(
                    "signature", None, None, f"checkpoint {n} in the {where} is for another store"
                )
                continue
            if not offline.signature_ok(self.key, checkpoint.signature, checkpoint.body):
                other = checkpoint.key_id != self.key_id
                self.problem(
                    "resigned" if other else "signature",
                    None,
                    None,
                    f"checkpoint {n} in the {where} is signed by key {checkpoint.key_id}, not by"
                    f" the trusted key {self.key_id}: the history was re-signed"
                    if other
                    else f"checkpoint {n} in the {where} has an invalid signature",
                )
                continue
            out.append(checkpoint)
        return out

    def read_witness(self) -> list[Checkpoint] | None:
        if self.witness is None:
            return None
        try:
            found, bad = self.witness.read()
        except WitnessError as exc:
            self.problem("witness", None, None, str(exc))
            return []
        for line in bad:
            self.problem("witness", None, None, f"unreadable witness entry: {line}")
        checkpoints = self.valid(found, "witness")
        self.report.witnessed = len(checkpoints)
        if not found and not bad:
            self.report.notes.append(f"the witness {self.witness.location} holds no checkpoint")
        previous: Checkpoint | None = None
        for checkpoint in checkpoints:
            if previous is None:
                if (
                    checkpoint.n == 1
                    and checkpoint.doc["prev"]
                    != offline.checkpoint_genesis(self.store.store_id).hex()
                ):
                    self.problem("witness", None, None, "witnessed checkpoint 1 has a wrong origin")
            elif checkpoint.n != previous.n + 1 or checkpoint.doc["prev"] != previous.digest:
                self.problem(
                    "witness",
                    None,
                    None,
                    f"witnessed checkpoint {checkpoint.n} does not follow checkpoint"
                    f" {previous.n}: witness entries {previous.n + 1}-{checkpoint.n - 1} are"
                    " missing or out of order",
                )
            previous = checkpoint
        return checkpoints

    # ------------------------------------------------------------------ one chain

    def check_chain(
        self,
        chain: str,
        signed: dict[int, _Signed],
        report: ChainReport,
        walked: list[Problem],
    ) -> None:
        self.report.chains[chain] = report
        for problem in walked:
            self.problem(problem.kind, problem.chain, problem.seq, problem.detail)
        self.report.records += report.records
        end = report.last_seq if report.last_seq is not None else report.anchor_seq
        report.signed_seq = max((s for s in signed if s <= end), default=0)
        if signed:
            top = max(signed)
            if top > end:
                what = (
                    f"records {end + 1}-{top} are missing from its end"
                    if report.records or report.anchor_seq
                    else f"all its records (up to {top}) are gone"
                )
                self.problem(
                    "truncated",
                    chain,
                    end + 1,
                    f"journal {chain}: {what}; checkpoint {signed[top].n} ({signed[top].time})"
                    f" signed record {top}",
                )


_Job = tuple[str, "Anchor | None", dict[int, _Signed]]
# Below this many records in all, worker processes cost more than they save (~0.5 s to start).
_PARALLEL_RECORDS = 200_000


def _walk(
    store: AuditStore, chain: str, anchor: Anchor | None, signed: dict[int, _Signed]
) -> tuple[ChainReport, list[Problem]]:
    report = ChainReport(anchor_seq=anchor.seq if anchor else 0)
    return report, _ChainWalk(store, chain, anchor, signed, report).run()


def _walk_in_worker(
    location: str, chain: str, anchor: Anchor | None, signed: dict[int, _Signed]
) -> tuple[ChainReport, list[Problem]]:
    """`_walk` in a worker process, on its own read-only connection."""
    store = open_store(location, readonly=True)
    try:
        return _walk(store, chain, anchor, signed)
    finally:
        store.close()


def _prefetched(batches: Iterator[list[VerifyRow]]) -> Iterator[VerifyRow]:
    """The rows of `batches`, the next batch fetched in a thread while this one is checked
    (the database and the hashing then use both cores)."""
    queue: Queue[list[VerifyRow] | BaseException | None] = Queue(2)

    def fetch() -> None:
        try:
            for rows in batches:
                queue.put(rows)
            queue.put(None)
        except BaseException as exc:  # handed to the consumer
            queue.put(exc)

    thread = threading.Thread(target=fetch, name="audit-verify-fetch", daemon=True)
    thread.start()
    while (item := queue.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield from item
    thread.join()


class _ChainWalk:
    """The records of one chain in seq order against their links and the signed heads."""

    def __init__(
        self,
        store: AuditStore,
        chain: str,
        anchor: Anchor | None,
        signed: dict[int, _Signed],
        report: ChainReport,
    ) -> None:
        self.store = store
        self.chain = chain
        self.start = anchor.seq if anchor else 0
        # a chain that was never pruned starts at its genesis, whatever its row says
        self.start_hash = anchor.hash if anchor else offline.chain_genesis(store.store_id, chain)
        self.signed = signed
        self.report = report
        self._by_hash: dict[bytes, int] | None = None
        self.reordered: set[int] = set()
        self.found: list[Problem] = []

    def problem(self, kind: str, seq: int, detail: str) -> None:
        self.found.append(Problem(kind, self.chain, seq, f"journal {self.chain}: {detail}"))

    def seq_of_hash(self, digest: bytes) -> int | None:
        """Which row carries this hash (built once, only when the chain is already broken)."""
        if self._by_hash is None:
            self._by_hash = {
                h: s for s, _, _, h in self.store.records_after(self.chain, self.start)
            }
        return self._by_hash.get(digest)

    def run(self) -> list[Problem]:
        """Walk the chain; its problems in order."""
        report = self.report
        expected_seq, expected_prev = self.start + 1, self.start_hash
        # the newest signed record that matched, and the first that did not since then
        last_good, first_bad = self.start, None
        sha256 = hashlib.sha256
        for seq, body, prev, digest, columns_agree in _prefetched(
            self.store.record_batches(self.chain, self.start)
        ):
            report.records += 1
            if report.first_seq is None:
                report.first_seq = seq
            report.last_seq = seq
            gap = seq > expected_seq
            if gap:
                span = f"{expected_seq}" if seq - expected_seq == 1 else f"{expected_seq}-{seq - 1}"
                self.problem("deleted", expected_seq, f"records {span} are missing")
            if sha256(prev + body.encode()).digest() != digest:
                self.problem(
                    "edited", seq, f"record {seq} does not match its hash (content changed)"
                )
            elif not columns_agree:
                self.problem(
                    "edited",
                    seq,
                    f"record {seq}: its query columns (time, subject, status, route) disagree"
                    " with its content (edited to hide it from queries)",
                )
            if prev != expected_prev and not gap:
                self.classify_break(seq, prev)
            want = self.signed.get(seq)
            if want is not None:
                if want.hash == digest.hex():
                    last_good, first_bad = seq, None
                elif first_bad is None:
                    first_bad = seq
                    self.problem(
                        "rewritten",
                        seq,
                        f"record {seq} differs from what checkpoint {want.n} signed: a record in"
                        f" {last_good + 1}-{seq} was changed and the chain re-hashed after it",
                    )
                else:
                    self.problem(
                        "rewritten",
                        seq,
                        f"record {seq} differs from what checkpoint {want.n} signed (still"
                        f" re-hashed after the change at or before {first_bad})",
                    )
            expected_seq, expected_prev = seq + 1, digest
        # A row with a made-up `prev` looks like "predecessor gone" until the next row shows the
        # chain skipping over it: then it was inserted, and nothing was deleted.
        inserted = {p.seq for p in self.found if p.kind == "inserted"}
        return [
            problem
            for problem in self.found
            if not (
                problem.kind == "deleted"
                and "the record that" in problem.detail
                and problem.seq in inserted
            )
        ]

    def classify_break(self, seq: int, prev: bytes) -> None:
        """Row `seq` does not follow the row before it: say how the order was broken."""
        origin = self.seq_of_hash(prev)
        if origin is None:
            self.problem(
                "deleted",
                seq,
                f"the record that preceded {seq} is gone (deleted, or edited together with its"
                " hash)",
            )
        elif origin > seq:
            self.reordered.update((seq, origin))
            self.problem("reordered", seq, f"record {seq} belongs after record {origin}")
        elif origin < seq - 1:
            if all(s in self.reordered for s in range(origin + 1, seq)):
                return  # the rows in between were already reported as moved
            span = f"{origin + 1}" if seq - 1 == origin + 1 else f"{origin + 1}-{seq - 1}"
            self.problem("inserted", origin + 1, f"records {span} were inserted into the chain")
        else:
            self.problem("reordered", seq, f"record {seq} is out of place")


def verify(
    store: AuditStore,
    public_key: Ed25519PublicKey,
    witness: Witness | None = None,
    now: float | None = None,
    workers: int | None = 1,
) -> VerifyReport:
    """Walk every chain against the checkpoints in the store and, given one, the witness's;
    report every problem found (up to 100), naming chain (journal) and record. Callable
    in-process (the console's audit panel) as well as through `meshfn audit verify`.
    `workers`: processes that walk chains at once (None: one per core; 1: none, here)."""
    return Verifier(store, public_key, witness, now, workers).run()
