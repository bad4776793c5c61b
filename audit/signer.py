"""The checkpoint signer: the only holder of the signing key, and it never writes the store.

The collector (the store's writer) cannot sign: it asks the signer, which reads the store
itself, read-only, and signs a chain's new head only if the record it signed last for that chain
(kept in its witness) is still there, unchanged, and the next record links to it. A writer who
rewrites or truncates signed history gets that chain refused, loudly, instead of a signature
over the forgery; and every checkpoint is in the witness (fsynced) before the collector sees it,
so `verify` holds the store to it.

Run it as its own process: `meshfn audit signer --store DB --key KEY --witness FILE --listen
unix:SOCKET` (`meshfn up` does, with the key under STATE/audit-signer/, not beside the store).
Protocol: one JSON object per line on a Unix socket or TCP: `{"op": "sign"}` ->
`{"ok": true, "checkpoints": [...], "refused": [...]}` (the new checkpoint last, after any the
store lacks); `{"op": "status"}`; `{"op": "public_key"}`.
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

from . import offline
from .checkpoint import Checkpoint
from .offline import canonical
from .store import Anchor, AuditStore, StoreError, now_iso
from .witness import Witness, WitnessError

log = logging.getLogger("meshfn.audit.signer")

_MAX_LINE = 1 << 20


class SignerError(RuntimeError):
    """The signer is unreachable, or refused to start (its message says why)."""


@dataclass
class SignResult:
    # the new checkpoint last, after any earlier ones the store does not have yet (a collector
    # that died between the signer's answer and its own write)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # chains it would not sign, and why

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None


class CheckpointSigner(Protocol):
    """What the collector asks for checkpoints: the signer in-process or over a socket."""

    def sign(self) -> SignResult: ...


class Signer:
    """Signs what it has verified itself. `store` should be opened read-only."""

    def __init__(self, store: AuditStore, key: Ed25519PrivateKey, witness: Witness) -> None:
        self.store = store
        self.key = key
        self.key_id = offline.key_id(key.public_key())
        self.witness = witness
        self._lock = threading.Lock()
        self.n = 0
        self.prev = offline.checkpoint_genesis(store.store_id).hex()
        self.heads: dict[str, tuple[int, bytes]] = {}
        self.refusals: dict[str, str] = {}
        self.recent: collections.deque[Checkpoint] = collections.deque(maxlen=1000)
        found, bad = witness.read()
        for line in bad:
            log.warning("witness entry skipped: %s", line)
        for checkpoint in found:
            doc = checkpoint.doc
            if doc["store"] != store.store_id:
                raise SignerError(
                    f"the witness {witness.location} belongs to store {doc['store']}, not to"
                    f" {store.store_id} ({store.location})"
                )
            if not offline.signature_ok(key.public_key(), checkpoint.signature, checkpoint.body):
                raise SignerError(
                    f"the witness {witness.location} holds checkpoint {doc['n']} not signed by"
                    " this key: refusing to continue someone else's history"
                )
            self.n, self.prev = doc["n"], checkpoint.digest
            self.recent.append(checkpoint)
            for chain, (seq, digest) in doc["chains"].items():
                self.heads[chain] = (seq, bytes.fromhex(digest))

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
        check out; nothing new: no checkpoint."""
        with self._lock:
            result = SignResult()
            moved: dict[str, tuple[int, bytes]] = {}
            for chain, (seq, digest) in self.store.heads().items():
                known = self.heads.get(chain)
                if known is not None and seq == known[0] and digest == known[1]:
                    self.refusals.pop(chain, None)
                    continue
                verified, problem = self._extend(chain, known, seq, digest)
                if problem:
                    result.refused.append(f"journal {chain}: {problem}")
                    if self.refusals.get(chain) != problem:
                        log.error("AUDIT SIGNER REFUSES journal %s: %s", chain, problem)
                    self.refusals[chain] = problem
                else:
                    self.refusals.pop(chain, None)
                if verified is not None and verified != known:
                    moved[chain] = verified
            if not moved:
                result.checkpoints = self._unstored()
                return result
            doc = {
                "type": offline.CHECKPOINT_TYPE,
                "v": offline.CHECKPOINT_VERSION,
                "store": self.store.store_id,
                "n": self.n + 1,
                "time": now_iso(now),
                "prev": self.prev,
                "chains": {c: [s, h.hex()] for c, (s, h) in sorted(moved.items())},
            }
            body = canonical(doc)
            checkpoint = Checkpoint(body, self.key.sign(body), self.key_id)
            self.witness.append(checkpoint)  # before anyone sees it
            self.n, self.prev = checkpoint.n, checkpoint.digest
            self.heads.update(moved)
            self.recent.append(checkpoint)
            result.checkpoints = self._unstored()
            return result

    def _unstored(self) -> list[Checkpoint]:
        have = self.store.last_checkpoint()
        return [c for c in self.recent if c.n > have]

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
        seq, prev = known if known is not None else self._anchor(chain)
        problem = self._link_problem(chain, seq, prev)
        return (None, problem) if problem else ((top, top_hash), "")

    def _anchor(self, chain: str) -> tuple[int, bytes]:
        """Where a chain never signed before starts: its genesis, or where retention left it."""
        anchor = self.store.chains().get(chain)
        if anchor is not None and anchor.seq > 0:
            log.warning(
                "journal %s: first seen after retention (starts at %d): trusted as found",
                chain,
                anchor.seq,
            )
            return anchor.seq, anchor.hash
        return 0, offline.chain_genesis(self.store.store_id, chain)

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
            elif self.store.chains().get(chain) != Anchor(seq, prev):  # not retention either
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


async def serve(signer: Signer, address: str, stop: asyncio.Event) -> None:
    """Answer sign/status requests until `stop` is set."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line)
                    op = request.get("op") if isinstance(request, dict) else None
                    if op == "sign":
                        result = await asyncio.to_thread(signer.sign)
                        answer: dict[str, Any] = {
                            "ok": True,
                            "checkpoints": [c.as_json() for c in result.checkpoints],
                            "refused": result.refused,
                        }
                    elif op == "status":
                        answer = {"ok": True, **signer.status()}
                    elif op == "public_key":
                        answer = {"ok": True, "pem": signer.public_pem()}
                    else:
                        answer = {"ok": False, "error": f"unknown op {op!r}"}
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

    def request(self, op: str) -> dict[str, Any]:
        kind, where = _parse_address(self.address)
        family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(where)
                sock.sendall(json.dumps({"op": op}).encode() + b"\n")
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
            raise SignerError(f"audit signer at {self.address}: {answer.get('error')}")
        return dict(answer)

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
