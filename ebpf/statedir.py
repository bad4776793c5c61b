"""What the accelerator and the egress control share about an attachment: its record in its own
directory (`<state>/ebpf/...`: `state.json`, what was made, so any later process can undo it,
also after a crash; a lock file that serialises setup and teardown between processes), and
how a mode turns into an attempt and one line of reason."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from .host import Unavailable

T = TypeVar("T")
log = logging.getLogger("meshfn.ebpf")


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


def attempt(
    mode: str,
    shutdown: Callable[[], list[str]],
    attach: Callable[[], T],
    off: Callable[[str], T],
    what: str,
) -> T:
    """Mode "off": remove an earlier attachment, and say so; else `attach()`, and where it
    cannot, the status `off(reason)` in one line: never an exception (the caller raises for a
    mode that requires it). `attach` rolls back what it made before it raises."""
    if mode == "off":
        try:
            problems = shutdown()
        except OSError as exc:
            problems = [str(exc)]
        reason = "disabled by policy"
        if problems:
            reason += "; removing an earlier attachment failed: " + "; ".join(problems)
        return off(reason)
    try:
        return attach()
    except Unavailable as exc:
        return off(str(exc))
    except Exception as exc:  # one line, whatever went wrong
        log.debug("%s setup failed", what, exc_info=True)
        return off(f"{what} setup failed: {exc}")
