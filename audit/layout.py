"""Where the audit trail keeps its files in a state directory (`meshfn up`, the CLI's defaults).

The signing key is NOT beside the store: the store's writer (the collector, in the control
plane) never opens `audit-signer/`; the signer process does, and reads the store read-only.
The witness defaults to `audit-witness/` of the same state directory; point
`MESHFN_AUDIT_WITNESS` at a file on another volume to survive someone who can rewrite the
store's volume.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from meshfn.common import env

WITNESS_ENV = env.AUDIT_WITNESS.name
_SOCKET_MAX = 100  # sun_path holds 108 bytes


def store_path(state_dir: Path) -> Path:
    return state_dir / "audit" / "audit.db"


def signer_dir(state_dir: Path) -> Path:
    return state_dir / "audit-signer"


def key_path(state_dir: Path) -> Path:
    return signer_dir(state_dir) / "checkpoint.key"


def public_key_path(state_dir: Path) -> Path:
    return signer_dir(state_dir) / "checkpoint.key.pub"


def witness_path(state_dir: Path) -> Path:
    configured = env.AUDIT_WITNESS.get()
    return Path(configured) if configured else state_dir / "audit-witness" / "checkpoints.jsonl"


def signer_socket(state_dir: Path) -> str:
    """`unix:PATH` of the signer; a short path under /tmp when the state dir's is too long."""
    path = (signer_dir(state_dir) / "signer.sock").absolute()
    if len(str(path)) > _SOCKET_MAX:
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
        path = Path("/tmp") / f"meshfn-signer-{digest}.sock"
    return f"unix:{path}"


def state_of(store: str) -> Path | None:
    """The state directory of a store at STATE/audit/audit.db (None for other places)."""
    if store.startswith(("postgres://", "postgresql://")) or "=" in store:
        return None
    path = Path(store)
    return path.parent.parent if path.parent.name == "audit" else None
