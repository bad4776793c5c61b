"""Secret files: written atomically, readable by the owner only (0600); private directories."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("meshfn.state")


def write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def secret_key(path: Path, size: int = 32) -> bytes:
    """A random key of `size` bytes kept at `path` (0600), created on first use; ValueError for
    a shorter one (someone's hand, or another program's file)."""
    if path.exists():
        key = read_private(path)
    else:
        key = secrets.token_bytes(size)
        write_private(path, key)
    if len(key) < size:
        raise ValueError(f"{path} holds a key shorter than {size} bytes")
    return key


def read_private(path: Path) -> bytes:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {mode:o}); expected 0600")
    return path.read_bytes()


def private_directory(path: Path) -> int | None:
    """Create `path` (mode 0700), or make an existing one 0700: nobody but its owner may list
    or enter it, whatever the modes of the files inside. Returns the mode it had when that was
    wider (for the caller to log), else None."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = path.stat().st_mode & 0o777
    if mode == 0o700:
        return None
    path.chmod(0o700)
    return mode if mode & 0o077 else None


def secure_state_dir(state_dir: Path) -> None:
    """meshfn's state directory is its owner's alone (0700): it holds keys, Envoy bootstraps
    with their ADS tokens, the Envoys' admin sockets, logs, the audit store and its salt."""
    was = private_directory(state_dir)
    if was is not None:
        log.warning(
            "state directory %s was mode %o, open to other users: made it 0700", state_dir, was
        )
