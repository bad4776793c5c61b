"""Checking meshfn's audit evidence without meshfn: the hash chain, the checkpoint format and its
signatures, and exports (`meshfn audit export`).

Standalone on purpose: this file imports only the standard library and `cryptography`, so an
auditor can copy it out of the repository and run

    python3 offline.py EXPORT.jsonl --public-key audit-signer.pub     (or EXPORT.csv)

against an export, with no meshfn, no database and no network. meshfn itself builds and checks
chains and checkpoints with these same functions, so the format has exactly one definition.

Formats (all hashes SHA-256, hex in JSON):
- record i of chain c: `h_i = SHA-256(h_{i-1} || canonical(record_i))`, `h_0` = `chain_genesis`;
  canonical = JSON with sorted keys, no spaces, ASCII only.
- checkpoint n: canonical JSON `{"type": "meshfn-audit-checkpoint", "v": 3, "store": id, "n": n,
  "time": ISO-8601, "prev": SHA-256 of checkpoint n-1's body (checkpoint_genesis for n = 1),
  "chains": {c: [seq, h_seq], ...}, "retention_days": days}` listing every chain whose head moved
  since checkpoint n-1, and the retention the signer applies; a prune the signer witnessed adds
  `"prune": {c: [seq, h_seq], ...}` (records of c up to seq may be deleted: the chain then starts
  after h_seq). ed25519-signed over those exact bytes. Version 2 (before retention and prunes
  were signed) has neither field.
- export: a header `{"type": "meshfn-audit-export", ...}`, then the checkpoints
  (`{"type": "checkpoint", "body": ..., "signature": ...}`), then per chain a contiguous run of
  records (`{"type": "record", "chain", "seq", "prev", "hash", "record"}`) that ends at a signed
  head. CSV carries the same fields as columns.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

CHECKPOINT_TYPE = "meshfn-audit-checkpoint"
CHECKPOINT_VERSION = 3
# Version 2: no retention_days and no prune (stores written before prunes were witnessed).
CHECKPOINT_VERSIONS = (2, 3)
EXPORT_TYPE = "meshfn-audit-export"
CSV_COLUMNS = (
    "type",
    "chain",
    "seq",
    "time",
    "method",
    "path",
    "status",
    "route",
    "subject",
    "tenant",
    "prev",
    "hash",
    "body",
    "signature",
    "key_id",
)


def canonical(value: Any) -> bytes:
    """The bytes the chain hashes and checkpoints sign: sorted keys, no spaces, ASCII only
    (non-ASCII escaped), so every implementation that re-serialises gets identical bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def link(prev: bytes, body: bytes) -> bytes:
    return hashlib.sha256(prev + body).digest()


def chain_genesis(store_id: str, chain: str) -> bytes:
    return hashlib.sha256(f"meshfn-audit-genesis\0{store_id}\0{chain}".encode()).digest()


def checkpoint_genesis(store_id: str) -> bytes:
    return hashlib.sha256(f"meshfn-audit-checkpoints\0{store_id}".encode()).digest()


def key_id(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()[:16]


def signature_ok(key: Ed25519PublicKey, signature: bytes, body: bytes) -> bool:
    try:
        key.verify(signature, body)
    except InvalidSignature:
        return False
    return True


def load_public_key(data: bytes) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(data)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("not an ed25519 public key")
    return key


def parse_checkpoint(body: bytes) -> dict[str, Any]:
    """A checkpoint body -> its document; ValueError if it is not one (or not canonical)."""
    doc = json.loads(body)
    if not isinstance(doc, dict) or doc.get("type") != CHECKPOINT_TYPE:
        raise ValueError("not a meshfn audit checkpoint")
    if doc.get("v") not in CHECKPOINT_VERSIONS:
        raise ValueError(f"checkpoint version {doc.get('v')!r} is not one of {CHECKPOINT_VERSIONS}")
    if canonical(doc) != body:
        raise ValueError("checkpoint body is not in canonical form")
    chains = doc.get("chains")
    if not isinstance(doc.get("n"), int) or not isinstance(chains, dict):
        raise ValueError("checkpoint without n or chains")
    _check_heads(chains, "head")
    if doc["v"] >= 3:
        days = doc.get("retention_days")
        if not isinstance(days, int) or isinstance(days, bool) or days < 0:
            raise ValueError("checkpoint without a retention (retention_days >= 0)")
        prune = doc.get("prune", {})
        if not isinstance(prune, dict):
            raise ValueError("checkpoint prune is not a map of chains")
        _check_heads(prune, "prune point")
    return doc


def _check_heads(heads: dict[Any, Any], what: str) -> None:
    for chain, head in heads.items():
        if not (
            isinstance(chain, str)
            and isinstance(head, list)
            and len(head) == 2
            and isinstance(head[0], int)
            and isinstance(head[1], str)
            and len(head[1]) == 64
        ):
            raise ValueError(f"checkpoint {what} of chain {chain!r} is malformed")


def checkpoint_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


# ------------------------------------------------------------------ exports


@dataclass
class ExportReport:
    records: int = 0
    checkpoints: int = 0
    chains: dict[str, tuple[int, int]] = field(default_factory=dict)  # chain -> (first, last)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.checkpoints > 0


@dataclass
class _Run:
    """One chain's records in the export, as far as they have been read."""

    first: int
    expected: int
    prev: bytes


def read_entries(path: Path) -> Iterator[dict[str, Any]]:
    """The entries of a JSON-lines or CSV export, as dicts in the JSON-lines shape."""
    with path.open(newline="", encoding="utf-8") as handle:
        first = handle.readline()
        handle.seek(0)
        if first.startswith("type,"):
            for row in csv.DictReader(handle):
                kind = row.get("type")
                if kind == "record":
                    yield {
                        "type": "record",
                        "chain": row["chain"],
                        "seq": int(row["seq"]),
                        "prev": row["prev"],
                        "hash": row["hash"],
                        "record": row["body"],
                    }
                elif kind == "checkpoint":
                    yield {
                        "type": "checkpoint",
                        "body": row["body"],
                        "signature": row["signature"],
                        "key_id": row["key_id"],
                    }
                else:
                    yield {"type": kind, **json.loads(row["body"] or "{}")}
            return
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    entry = json.loads(line)
                except ValueError as exc:
                    yield {"type": "malformed", "line": number, "error": str(exc)}
                    continue
                yield entry if isinstance(entry, dict) else {"type": "malformed", "line": number}


def verify_export(entries: Iterable[dict[str, Any]], key: Ed25519PublicKey) -> ExportReport:
    """Every record links to the one before it, every checkpoint is signed by `key` and links to
    the one before it, every signed head inside the export matches the record there, and every
    chain's run ends at a signed head (so a cut export, an edited record, a forged or reordered
    record and a foreign signature are each reported)."""
    report = ExportReport()
    store: str | None = None
    signed: dict[tuple[str, int], str] = {}  # (chain, seq) -> hash some checkpoint signed
    prev_checkpoint: tuple[int, str] | None = None
    runs: dict[str, _Run] = {}
    matched: set[tuple[str, int]] = set()
    for entry in entries:
        kind = entry.get("type")
        if kind in (EXPORT_TYPE, "export"):
            store = str(entry.get("store"))
        elif kind == "checkpoint":
            prev_checkpoint = _check_checkpoint(entry, key, store, prev_checkpoint, signed, report)
        elif kind == "record":
            _check_record(entry, runs, signed, matched, report)
        elif kind == "malformed":
            report.problems.append(f"line {entry.get('line')}: not JSON")
    for chain, run in runs.items():
        _check_end(chain, run, signed, matched, report)
    if report.checkpoints == 0:
        report.problems.append("the export holds no valid checkpoint")
    return report


def _check_checkpoint(
    entry: dict[str, Any],
    key: Ed25519PublicKey,
    store: str | None,
    prev: tuple[int, str] | None,
    signed: dict[tuple[str, int], str],
    report: ExportReport,
) -> tuple[int, str] | None:
    """A checkpoint entry: signed by `key`, of this store, following `prev`; what it signed
    goes into `signed`. The checkpoint the next one must follow."""
    try:
        body = str(entry["body"]).encode()
        doc = parse_checkpoint(body)
        signature = bytes.fromhex(str(entry["signature"]))
    except (KeyError, ValueError) as exc:
        report.problems.append(f"a checkpoint entry is malformed: {exc}")
        return prev
    n = doc["n"]
    if not signature_ok(key, signature, body):
        report.problems.append(f"checkpoint {n}: signature invalid for this public key")
        return prev
    if store is not None and doc.get("store") != store:
        report.problems.append(f"checkpoint {n} belongs to another store")
    if prev is not None and (n != prev[0] + 1 or doc.get("prev") != prev[1]):
        report.problems.append(
            f"checkpoint {n} does not follow checkpoint {prev[0]}"
            " (checkpoints missing or reordered)"
        )
    report.checkpoints += 1
    for chain, (seq, digest) in doc["chains"].items():
        signed[(chain, seq)] = digest
    return n, checkpoint_digest(body)


def _check_end(
    chain: str,
    run: _Run,
    signed: dict[tuple[str, int], str],
    matched: set[tuple[str, int]],
    report: ExportReport,
) -> None:
    """A chain's run in the export ends at a head some checkpoint signed, and no checkpoint
    signed records beyond it."""
    last = run.expected - 1
    report.chains[chain] = (run.first, last)
    if (chain, last) not in matched:
        report.problems.append(
            f"chain {chain}: the export ends at record {last}, which no checkpoint signed"
            " (cut short, or records added)"
        )
    beyond = [s for (c, s) in signed if c == chain and s > last]
    if beyond:
        report.problems.append(
            f"chain {chain}: checkpoints signed records up to {max(beyond)} but the export"
            f" ends at {last} (records {last + 1}-{max(beyond)} missing)"
        )


def _check_record(
    entry: dict[str, Any],
    runs: dict[str, _Run],
    signed: dict[tuple[str, int], str],
    matched: set[tuple[str, int]],
    report: ExportReport,
) -> None:
    try:
        chain, seq = str(entry["chain"]), int(entry["seq"])
        prev, digest = bytes.fromhex(entry["prev"]), bytes.fromhex(entry["hash"])
        body = str(entry["record"]).encode()
    except (KeyError, ValueError, TypeError) as exc:
        report.problems.append(f"a record entry is malformed: {exc}")
        return
    report.records += 1
    run = runs.get(chain)
    if run is None:
        run = runs[chain] = _Run(seq, seq, prev)
    where = f"chain {chain} record {seq}"
    if seq != run.expected:
        report.problems.append(f"{where}: expected record {run.expected} (records missing/moved)")
    elif prev != run.prev:
        report.problems.append(f"{where}: does not link to the record before it")
    if link(prev, body) != digest:
        report.problems.append(f"{where}: content does not match its hash (edited)")
    want = signed.get((chain, seq))
    if want is not None:
        if want != digest.hex():
            report.problems.append(f"{where}: differs from what a checkpoint signed (rewritten)")
        else:
            matched.add((chain, seq))
    run.expected, run.prev = seq + 1, digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Verify a meshfn audit export offline.")
    parser.add_argument("export", type=Path, help="the file `meshfn audit export` wrote")
    parser.add_argument(
        "--public-key",
        type=Path,
        help="the signer's public key (PEM), from a trusted copy; default: the one the export"
        " carries (then only its integrity is checked, not who signed it)",
    )
    args = parser.parse_args(argv)
    entries = list(read_entries(args.export))
    pem = args.public_key.read_bytes() if args.public_key else None
    if pem is None:
        header = next((e for e in entries if e.get("type") in (EXPORT_TYPE, "export")), {})
        pem = str(header.get("public_key", "")).encode()
        print("warning: using the public key inside the export; pass --public-key", file=sys.stderr)
    try:
        key = load_public_key(pem)
    except ValueError as exc:
        print(f"error: public key: {exc}", file=sys.stderr)
        return 2
    report = verify_export(entries, key)
    for problem in report.problems:
        print(f"problem: {problem}")
    spans = ", ".join(f"{c} {a}-{b}" for c, (a, b) in sorted(report.chains.items()))
    verdict = "ok" if report.ok else "FAILED"
    print(
        f"{verdict}: {report.records} record(s) in {len(report.chains)} chain(s) ({spans}),"
        f" {report.checkpoints} signed checkpoint(s), key {key_id(key)}"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
