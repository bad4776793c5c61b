"""An attachment's record in its own directory (`<state>/ebpf/...`), shared by the accelerator
and the egress control: `state.json` (what was made, so any later process can undo it, also
after a crash) and a lock file that serialises setup and teardown between processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load(directory: Path, kind: type[T]) -> T | None:
    """The dataclass `kind` saved in `directory`, None if there is none (or it is unreadable)."""
    try:
        data = json.loads((directory / "state.json").read_text())
        return kind(**data)
    except (OSError, ValueError, TypeError):
        return None


def save(directory: Path, state: Any) -> None:
    """Atomically: a crash leaves the old record or the new one."""
    tmp = directory / ".state.json.tmp"
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(directory / "state.json")
