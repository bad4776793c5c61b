"""The checkpoint signer: the only holder of the signing key and of the retention setting; of
the store it writes only checkpoints.

The collector (the store's writer) cannot sign: it asks the signer, which reads the store
itself and signs a chain's new head only if the record it signed last for that chain (kept in
its witness) is still there, unchanged, and the next record links to it. A writer who rewrites
or truncates signed history gets that chain refused, loudly, instead of a signature over the
forgery; and every checkpoint is in the witness (fsynced) before the signer inserts it into the
store (on PostgreSQL its role may insert checkpoints and nothing else), so `verify` holds the
store to it.

Retention (retention.py): every checkpoint carries the signer's `retention_days`; a changed
setting is witnessed at once (a checkpoint with no chains), and a prune is witnessed as a
checkpoint whose `prune` names, per chain, the newest head that a checkpoint older than the
retention signed. Only then may the store delete (its anchor trigger checks the checkpoint);
the signer refuses to witness a prune shorter than its retention, whoever asks.

Run it as its own process: `meshfn audit signer --store DB --key KEY --witness FILE --listen
unix:SOCKET` (`meshfn up` does, with the key under STATE/audit-signer/, not beside the store).
Protocol: one JSON object per line on a Unix socket or TCP: `{"op": "sign"}` ->
`{"ok": true, "checkpoints": [...], "refused": [...]}` (the new checkpoint last, after any the
store lacks); `{"op": "prune", "days": N or null}` -> `{"ok": true, "checkpoints": [...],
"points": {chain: [seq, hash, n]}, "retention_days": R}` (every chain's witnessed prune point:
delete up to there); `{"op": "status"}`; `{"op": "public_key"}`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from . import offline, retention
from .checkpoint import Checkpoint, now_iso
from .offline import canonical
from .store import DEFAULT_RETENTION_DAYS, AuditStore, StoreError
from .witness import Witness, WitnessError

log = logging.getLogger("meshfn.audit.signer")

_MAX_LINE = 1 << 20


class SignerError(RuntimeError):
    """The signer is unreachable, or refused to start (its message says why)."""


class PruneRefused(SignerError):
    """The signer will not witness this prune (shorter than its retention)."""


@dataclass
class SignResult:
    # the new checkpoint last, after any earlier ones the store does not have yet (a collector
    # that died between the signer's answer and its own write)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # chains it would not sign, and why

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None


@dataclass
class PruneResult:
    # every chain's witnessed prune point: chain -> (seq, hash, checkpoint n)
    points: dict[str, tuple[int, bytes, int]] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # the new prune's, if any
    retention_days: int = DEFAULT_RETENTION_DAYS


class CheckpointSigner(Protocol):
    """What the collector asks for checkpoints: the signer in-process or over a socket."""

    def sign(self) -> SignResult: ...

    def prune(self, days: int | None = None) -> PruneResult: ...


class Signer:
    """Signs what it has verified itself, and witnesses prunes its retention allows. `store`:
    a role that may read the store and insert checkpoints (nothing else is written)."""

    def __init__(
        self,
        store: AuditStore,
        key: Ed25519PrivateKey,
        witness: Witness,
        retention_days: int = DEFAULT_RETENTION_DAYS,
    ) -> None:
        if retention_days < 0:
            raise SignerError("the retention must be >= 0 days")
        self.store = store
        self.key = key
        self.key_id = offline.key_id(key.public_key())
        self.witness = witness
        self.retention_days = retention_days
        self._lock = threading.Lock()
        self.n = 0
        self.prev = offline.checkpoint_genesis(store.store_id).hex()
        self.heads: dict[str, tuple[int, bytes]] = {}
        self.pruned: dict[str, tuple[int, bytes, int]] = {}
        self.signed_retention: int | None = None
        self.refusals: dict[str, str] = {}
        self.recent: collections.deque[Checkpoint] = collections.deque(maxlen=1000)
        found, bad = witness.read()
        for line in bad:
            log.warning("witness entry skipped: %s", line)
        for checkpoint in found:
            self._follow(checkpoint)

    def _follow(self, checkpoint: Checkpoint) -> None:
        """Continue the history of a witnessed checkpoint (this key's, this store's)."""
        doc = checkpoint.doc
        if doc["store"] != self.store.store_id:
            raise SignerError(
                f"the witness {self.witness.location} belongs to store {doc['store']}, not to"
                f" {self.store.store_id} ({self.store.location})"
            )
        if not offline.signature_ok(self.key.public_key(), checkpoint.signature, checkpoint.body):
            raise SignerError(
                f"the witness {self.witness.location} holds checkpoint {doc['n']} not signed by"
                " this key: refusing to continue someone else's history"
            )
        self.n, self.prev = doc["n"], checkpoint.digest
        self.recent.append(checkpoint)
        self.signed_retention = checkpoint.retention_days
        for chain, (seq, digest) in doc["chains"].items():
            self.heads[chain] = (seq, bytes.fromhex(digest))
        for chain, (seq, digest) in checkpoint.prune.items():
            self.pruned[chain] = (seq, bytes.fromhex(digest), checkpoint.n)

    def public_pem(self) -> str:
        from cryptography.hazmat.primitives import serialization

        return (
            self.key.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        )

    def sign(self, now: float | None = None) -> SignResult:
        """Checkpoint every chain that grew since the last checkpoint, as far as its links
        check out; nothing new: no checkpoint (unless the retention changed: that is
        witnessed at once)."""
        with self._lock:
            result = SignResult()
            moved: dict[str, tuple[int, bytes]] = {}
            for chain, (seq, digest) in self.store.heads().items():
                known = self.heads.get(chain)
                if known is not None and seq == known[0] and digest == known[1]:
                    self.refusals.pop(chain, None)
                    continue
                verified, problem = self._extend(chain, known, seq, digest)
                self._refused(chain, problem, result)
                if verified is not None and verified != known:
                    moved[chain] = verified
            if moved or (self.n and self.signed_retention != self.retention_days):
                adopted = self._adopt(now) if self.n and self.signed_retention is None else {}
                self._checkpoint(now, moved, adopted)
            result.checkpoints = self._unstored()
            return result

    def _refused(self, chain: str, problem: str, result: SignResult) -> None:
        if problem:
            result.refused.append(f"journal {chain}: {problem}")
            if self.refusals.get(chain) != problem:
                log.error("AUDIT SIGNER REFUSES journal %s: %s", chain, problem)
            self.refusals[chain] = problem
        else:
            self.refusals.pop(chain, None)

    def prune(self, days: int | None = None, now: float | None = None) -> PruneResult:
        """Witness a prune of what is older than `days` (default: the signer's retention;
        never less): per chain, up to the newest head a checkpoint older than that signed.
        Returns every chain's witnessed prune point (delete up to there)."""
        days = self.retention_days if days is None else days
        if days < self.retention_days:
            raise PruneRefused(
                f"the signer's retention is {self.retention_days} day(s): it witnesses no prune"
                f" of records younger than that ({days} day(s) asked); the retention is set on"
                " the signer (`meshfn audit signer --retention-days`, or the Mesh policy's"
                " audit.retentionDays under `meshfn up`)"
            )
        moment = time.time() if now is None else now
        found, _ = self.witness.read()  # (what is due is older than anything signed meanwhile)
        with self._lock:
            pruned = {chain: point[0] for chain, point in self.pruned.items()}
            points = retention.due(found, days, moment, pruned)
            new = []
            if points:
                self._checkpoint(now, {}, points)
                new = [self.recent[-1]]
            self._unstored()
            return PruneResult(dict(self.pruned), new, self.retention_days)

    def _adopt(self, now: float | None) -> dict[str, tuple[int, str]]:
        """The first checkpoint after version-2 ones (signed before prunes were witnessed):
        the chains' current starts become witnessed prunes where this signer's retention
        would have allowed them (a head it signed, in a checkpoint older than the retention);
        any other start is left for verify to report as a deletion."""
        found, _ = self.witness.read()
        before = retention.cutoff(self.retention_days, time.time() if now is None else now)
        signed = {
            (chain, seq): digest
            for checkpoint in found
            if checkpoint.time < before
            for chain, (seq, digest) in checkpoint.heads.items()
        }
        adopted = {}
        for chain, anchor in self.store.chains().items():
            if anchor.seq == 0 or self.pruned.get(chain, (0,))[0] >= anchor.seq:
                continue
            if signed.get((chain, anchor.seq)) == anchor.hash.hex():
                adopted[chain] = (anchor.seq, anchor.hash.hex())
            else:
                log.error(
                    "journal %s starts after record %d, which no checkpoint older than the"
                    " %d-day retention signed: not witnessed as a prune",
                    chain,
                    anchor.seq,
                    self.retention_days,
                )
        return adopted

    def _checkpoint(
        self,
        now: float | None,
        moved: dict[str, tuple[int, bytes]],
        prune: dict[str, tuple[int, str]],
    ) -> None:
        """Sign the next checkpoint, witness it (before anyone sees it), store it."""
        doc: dict[str, Any] = {
            "type": offline.CHECKPOINT_TYPE,
            "v": offline.CHECKPOINT_VERSION,
            "store": self.store.store_id,
            "n": self.n + 1,
            "time": now_iso(now),
            "prev": self.prev,
            "chains": {c: [s, h.hex()] for c, (s, h) in sorted(moved.items())},
            "retention_days": self.retention_days,
        }
        if prune:
            doc["prune"] = {c: [s, h] for c, (s, h) in sorted(prune.items())}
        body = canonical(doc)
        checkpoint = Checkpoint(body, self.key.sign(body), self.key_id)
        self.witness.append(checkpoint)
        self.n, self.prev = checkpoint.n, checkpoint.digest
        self.heads.update(moved)
        self.signed_retention = self.retention_days
        for chain, (seq, digest) in prune.items():
            self.pruned[chain] = (seq, bytes.fromhex(digest), checkpoint.n)
        self.recent.append(checkpoint)

    def _unstored(self) -> list[Checkpoint]:
        """Insert the witnessed checkpoints the store lacks (the newest just made, or any a
        failed insert left behind) and return them."""
        have = self.store.last_checkpoint()
        missing = [c for c in self.recent if c.n > have]
        for checkpoint in missing:
            self.store.add_checkpoint(checkpoint)
        return missing

    def _extend(
        self, chain: str, known: tuple[int, bytes] | None, top: int, top_hash: bytes
    ) -> tuple[tuple[int, bytes] | None, str]:
        """The chain's new head (`top`) if the record signed last is still there, unchanged,
        and the next record links to it; else None and why. Two rows per chain and checkpoint,
        not the whole new stretch: a break in there is verify's to find (named, and covered by
        a checkpoint from then on), while a rewritten or truncated signed history is refused
        here, at once."""
        if known is not None and top < known[0]:
            return None, f"the store ends at record {top} but record {known[0]} was signed"
        if known is not None and top == known[0] and top_hash != known[1]:
            return None, f"record {top} differs from the one signed"
        if known is None:
            anchor = self.store.chains().get(chain)
            if anchor is not None and anchor.seq > 0:
                return None, (
                    f"the journal starts after record {anchor.seq}, but no prune this signer"
                    f" witnessed covers records 1-{anchor.seq}"
                )
            known = (0, offline.chain_genesis(self.store.store_id, chain))
        problem = self._link_problem(chain, *known)
        return (None, problem) if problem else ((top, top_hash), "")

    def _link_problem(self, chain: str, seq: int, prev: bytes) -> str:
        """Why record `seq` (signed, with hash `prev`) and the next one do not hold together
        in the store; "" when they do."""
        # two rows, whatever the chain's length: the record signed last and the one after it
        rows = list(itertools.islice(self.store.records_after(chain, max(0, seq - 1), 2), 2))
        if seq > 0:
            if rows and rows[0][0] == seq:
                if rows[0][3] != prev:
                    return f"record {seq} differs from the one signed"
                rows = rows[1:]
            elif self.pruned.get(chain, (0, b""))[:2] != (seq, prev):  # not a witnessed prune
                return f"record {seq}, which was signed, is gone"
        if not rows or rows[0][0] != seq + 1:
            return f"record {seq + 1} is missing"
        if rows[0][2] != prev:
            return f"record {seq + 1} does not link to record {seq} as signed"
        return ""

    def status(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "checkpoint": self.n,
            "retention_days": self.retention_days,
            "chains": len(self.heads),
            "witness": self.witness.location,
            "refused": dict(self.refusals),
        }


# ------------------------------------------------------------------ over a socket


def _parse_address(address: str) -> tuple[str, Any]:
    if address.startswith("tcp:"):
        host, _, port = address[4:].rpartition(":")
        return "tcp", (host or "127.0.0.1", int(port))
    return "unix", address.removeprefix("unix:")


def _prune_answer(signer: Signer, request: dict[str, Any]) -> dict[str, Any]:
    days = request.get("days")
    if days is not None and (not isinstance(days, int) or isinstance(days, bool) or days < 0):
        raise ValueError(f"prune: days must be a whole number >= 0, not {days!r}")
    try:
        result = signer.prune(days)
    except PruneRefused as exc:
        log.warning("audit signer: %s", exc)
        return {"ok": False, "refused": True, "error": str(exc)}
    return {
        "ok": True,
        "checkpoints": [c.as_json() for c in result.checkpoints],
        "points": {c: [s, h.hex(), n] for c, (s, h, n) in result.points.items()},
        "retention_days": result.retention_days,
    }


def _answer(signer: Signer, request: Any) -> dict[str, Any]:
    """One request's answer (run in a worker thread: signing reads the store)."""
    op = request.get("op") if isinstance(request, dict) else None
    if op == "sign":
        result = signer.sign()
        return {
            "ok": True,
            "checkpoints": [c.as_json() for c in result.checkpoints],
            "refused": result.refused,
        }
    if op == "prune":
        return _prune_answer(signer, request)
    if op == "status":
        return {"ok": True, **signer.status()}
    if op == "public_key":
        return {"ok": True, "pem": signer.public_pem()}
    return {"ok": False, "error": f"unknown op {op!r}"}


async def serve(signer: Signer, address: str, stop: asyncio.Event) -> None:
    """Answer sign/prune/status requests until `stop` is set."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    answer = await asyncio.to_thread(_answer, signer, json.loads(line))
                except (ValueError, StoreError, WitnessError) as exc:
                    log.error("audit signer: %s", exc)
                    answer = {"ok": False, "error": str(exc)}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    kind, where = _parse_address(address)
    if kind == "unix":
        path = Path(where)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(handle, path, limit=_MAX_LINE)
        path.chmod(0o600)
    else:
        server = await asyncio.start_server(handle, where[0], where[1], limit=_MAX_LINE)
    async with server:
        log.info("audit signer (key %s) listening on %s", signer.key_id, address)
        await stop.wait()


class SignerClient:
    """The collector's side: one request per call, a fresh connection each time (checkpoints
    are seconds apart)."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = timeout

    def request(self, op: str, **params: Any) -> dict[str, Any]:
        kind, where = _parse_address(self.address)
        family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(where)
                sock.sendall(json.dumps({"op": op, **params}).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise SignerError(f"audit signer at {self.address}: {exc.strerror or exc}") from None
        try:
            answer = json.loads(data)
        except ValueError:
            raise SignerError(f"audit signer at {self.address}: no answer") from None
        if not answer.get("ok"):
            error = PruneRefused if answer.get("refused") else SignerError
            raise error(f"audit signer at {self.address}: {answer.get('error')}")
        return dict(answer)

    def prune(self, days: int | None = None) -> PruneResult:
        answer = self.request("prune", days=days)
        return PruneResult(
            {c: (int(s), bytes.fromhex(h), int(n)) for c, (s, h, n) in answer["points"].items()},
            [Checkpoint.from_json(c) for c in answer.get("checkpoints", [])],
            int(answer["retention_days"]),
        )

    def sign(self) -> SignResult:
        answer = self.request("sign")
        return SignResult(
            [Checkpoint.from_json(c) for c in answer.get("checkpoints", [])],
            [str(r) for r in answer.get("refused", [])],
        )


def wait_ready(address: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            SignerClient(address, timeout=1).request("status")
            return
        except SignerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
