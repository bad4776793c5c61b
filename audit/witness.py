"""Witnesses: copies of every signed checkpoint kept outside the audit database.

The signer appends each checkpoint to its witness (and fsyncs) before it hands the checkpoint to
the collector, so whatever the store's writer does to the database afterwards, the witness still
says how far every chain reached and what its hashes were: `verify` compares the two and names
a truncated tail, a rewritten record or a re-signed history.

`FileWitness` is an append-only JSON-lines file; put it on another volume than the store (in
a cluster: a volume only the signer mounts). Each line is one checkpoint as the signer signed it
(`{"body": ..., "signature": ..., "key_id": ...}`); checkpoints link to their predecessor, so a
line removed from the middle shows. A torn last line (crash mid-write) was never acknowledged:
it is skipped and reported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from .checkpoint import Checkpoint


class WitnessError(RuntimeError):
    """The witness cannot be read or written (the message says where and why)."""


class Witness(Protocol):
    location: str

    def append(self, checkpoint: Checkpoint) -> None: ...

    def read(self) -> tuple[list[Checkpoint], list[str]]:
        """Every checkpoint, oldest first, and what could not be read (line by line)."""
        ...


class FileWitness:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.location = str(self.path)

    def append(self, checkpoint: Checkpoint) -> None:
        line = json.dumps(checkpoint.as_json(), sort_keys=True, separators=(",", ":")) + "\n"
        try:
            created = not self.path.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size and not _ends_with_newline(fd):
                    os.write(fd, b"\n")  # end a torn line first: it never counted
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            raise WitnessError(f"{self.path}: cannot append: {exc.strerror or exc}") from None

    def read(self) -> tuple[list[Checkpoint], list[str]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            raise WitnessError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        found, bad = [], []
        lines = data.split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                checkpoint = Checkpoint.from_json(json.loads(line))
                checkpoint.doc  # noqa: B018 (parses and validates the body)
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                torn = number == len(lines) and not data.endswith(b"\n")
                bad.append(f"{self.path}:{number}: {'torn last line' if torn else exc}")
                continue
            found.append(checkpoint)
        return found, bad


def _ends_with_newline(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return os.pread(fd, 1, size - 1) == b"\n"
