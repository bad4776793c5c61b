"""Reading personal data is itself audited: every query by subject, every export and every
erasure is a record in the control chain (`@control`, chained and signed like every other).

An access record names who (the authenticated principal, and how it was authenticated or which
tool it used: `via`), when, what (`action`: query, export, erase), the pseudonyms the subject's
records carry (never the raw subject or the filter's HMAC of it) and how many records came back.
An erasure writes its own record (store.erase: `event: erasure`); an erasure that found nothing
to erase, and every query and export, write `event: access`. `meshfn audit query --accessed` and
the console's audit panel (auditors only) list them.

A subject's pseudonym in an access record stays there after the subject is erased: it is random
and, once the subject's pseudonym row is gone, links to no one. (A note kept outside meshfn of
who was looked up when could link it again: keep such notes out of tickets.)

`redact_journals` is the offline half of an erasure (no control plane running): it overwrites the
subject's HMAC in the journals left in a state directory and keeps the stored positions' journal
fingerprints in step, as the collector does online (collector.erase).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .checkpoint import now_iso
from .redact import fingerprint, fingerprint_length, journal_files, redact_file
from .store import CONTROL_CHAIN, AuditStore

ACTIONS = ("query", "export", "erase")
EVENTS = ("access", "erasure")


def access_event(
    *,
    principal: str,
    action: str,
    via: str,
    pseudonyms: Iterable[str] = (),
    records: int = 0,
    role: str | None = None,
    now: float | None = None,
    **detail: Any,
) -> dict[str, Any]:
    """The record of one access to personal data (see the module docstring)."""
    if action not in ACTIONS:
        raise ValueError(f"unknown access action {action!r}")
    event: dict[str, Any] = {
        "v": 2,
        "event": "access",
        "action": action,
        "time": now_iso(now),
        "principal": principal,
        "via": via,
        "pseudonyms": sorted(set(pseudonyms)),
        "records": records,
    }
    if role is not None:
        event["role"] = role
    event.update({k: v for k, v in detail.items() if v is not None})
    return event


def record_access(store: AuditStore, event: dict[str, Any]) -> int:
    """Append an access record to the control chain; its seq there. Raises StoreError: a read
    of personal data that cannot be recorded must not happen (callers refuse it)."""
    return store.append([event], None, CONTROL_CHAIN)


def accessed(store: AuditStore, limit: int | None = 100) -> list[dict[str, Any]]:
    """The newest access and erasure records, newest first."""
    rows = store.query(chain=CONTROL_CHAIN, limit=None, newest_first=True)
    found = [r for r in rows if r.get("event") in EVENTS]
    return found if limit is None else found[:limit]


def redact_journals(store: AuditStore, directory: Path, hashes: Sequence[str]) -> int:
    """Offline: overwrite `hashes` in every journal under `directory`; for a journal whose
    stored fingerprint covered a redacted byte, store the new fingerprint (same position).
    Returns how many copies were overwritten. Run it only while no collector reads `directory`
    (online, collector.erase does this under the collector's own lock)."""
    if not hashes:
        return 0
    count = 0
    positions = store.journal_positions()
    for path in journal_files(directory):
        written = redact_file(path, hashes)
        count += len(written)
        if not written:
            continue
        inode = os.stat(path).st_ino
        for position in positions:
            length = fingerprint_length(position.fingerprint)
            if position.inode != inode or written[0] >= length:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                fresh = fingerprint(fd, length)
            finally:
                os.close(fd)
            store.append([], dataclasses.replace(position, fingerprint=fresh))
    return count
