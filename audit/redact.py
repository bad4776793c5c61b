"""Erasing a subject from the audit journals: its HMAC overwritten in place.

A journal line carries the filter's HMAC of the subject; the store never does (it keeps a random
pseudonym, destroyed by an erasure). After `meshfn audit erase`, the lines still in a journal
(not yet rotated away, or written while the erasure ran) would link the subject's requests
(their ids also appear in the store) to the HMAC again, and anyone holding the salt could test
a guessed subject against them. So the erasure overwrites every occurrence of the HMAC in every
journal file with `ERASED_SUBJECT`: the same length, so every byte offset the collector has
stored (and will store) stays valid, and Envoy, which only ever appends, is not disturbed. Lines
not yet stored are stored with their subject erased.

Only the fingerprint of a journal (a digest of its first bytes, which tells a journal from a new
file that reuses its inode) can change: `fingerprint` recomputes it, and the caller stores it
(collector.erase, access.redact_journals).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from meshfn.contracts.journal import ERASED_SUBJECT

FINGERPRINT_BYTES = 4096
_CHUNK = 1 << 20
_MARK = ERASED_SUBJECT.encode("ascii")


def fingerprint(fd: int, length: int) -> str:
    """`<n>:<sha256 of the file's first n bytes>` (n = min(length, FINGERPRINT_BYTES))."""
    n = min(length, FINGERPRINT_BYTES)
    return f"{n}:{hashlib.sha256(os.pread(fd, n, 0)).hexdigest()}"


def fingerprint_length(value: str) -> int:
    return int(value.split(":", 1)[0]) if value else 0


def redact_file(path: Path, hashes: Iterable[str]) -> list[int]:
    """Overwrite each of `hashes` (64 hex digits, either case) in the file with ERASED_SUBJECT;
    return the offsets written (empty: the file held none, or is gone)."""
    needles = {h.lower().encode("ascii") for h in hashes} | {
        h.upper().encode("ascii") for h in hashes
    }
    if not needles:
        return []
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return []
    found: list[int] = []
    try:
        size = os.fstat(fd).st_size
        offset = 0
        overlap = len(_MARK) - 1
        while offset < size:
            chunk = os.pread(fd, min(_CHUNK, size - offset), offset)
            if not chunk:
                break
            for needle in needles:
                at = chunk.find(needle)
                while at >= 0:
                    found.append(offset + at)
                    at = chunk.find(needle, at + 1)
            if offset + len(chunk) >= size:
                break
            offset += len(chunk) - overlap
        for at in sorted(set(found)):
            os.pwrite(fd, _MARK, at)
        if found:
            os.fsync(fd)
    finally:
        os.close(fd)
    return sorted(set(found))


def journal_files(directory: Path) -> list[Path]:
    """Every journal in a journal directory, rotated ones (`<name>.<n>`) included."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and ".jsonl" in p.name)
