"""The subject salt: the HMAC key that turns a JWT `sub` into the hash audit records carry.

One per state directory, created on first use, owner-only. Anyone holding it can test a guessed
subject against the trail (that is what `meshfn audit query --subject-raw` does), so it never
leaves the control plane except inside the audit filter's plugin configuration, and our own
config dumps redact it.
"""

from __future__ import annotations

import hmac
import re
import secrets
from pathlib import Path

from meshfn.common.files import read_private, write_private
from meshfn.contracts.plugins import SubjectSalt

_HEX = re.compile(r"^([0-9a-f]{2}){16,64}$")


def salt_path(state_dir: Path) -> Path:
    return state_dir / "audit" / "subject.salt"


def load_or_create(state_dir: Path) -> SubjectSalt:
    path = salt_path(state_dir)
    if not path.exists():
        write_private(path, (secrets.token_hex(32) + "\n").encode())
    text = read_private(path).decode("ascii", "replace").strip().lower()
    if not _HEX.match(text):
        raise ValueError(f"{path}: expected 32-128 hex digits (the audit subject salt)")
    return SubjectSalt(text)


def load(state_dir: Path) -> SubjectSalt | None:
    """The salt if this state directory has one (for query tools; never creates it)."""
    return load_or_create(state_dir) if salt_path(state_dir).exists() else None


def audit_text_key(salt: SubjectSalt) -> str:
    """The key of the digests of prompts and completions (generation.auditText hmac) that the
    backends put in their usage records, as hex: derived from the subject salt (one secret to
    keep), never equal to it (a digest of a text and a subject's hash never match)."""
    return hmac.new(salt.hex.encode(), b"meshfn audit text key", "sha256").hexdigest()
