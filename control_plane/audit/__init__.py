"""The audit trail: Envoy's audit journal -> collector -> hash-chained, signed SQLite store.

Entry points for the control plane: `AuditStore`, `AuditCollector`, `journal_path`, and in
`filters` the Envoy config builders (`audit_filter`, `degrade_filter`, `access_log`).
"""

from .collector import AuditCollector, journal_path
from .store import AuditStore, JournalPosition, StoreError, VerifyReport

__all__ = [
    "AuditCollector",
    "AuditStore",
    "JournalPosition",
    "StoreError",
    "VerifyReport",
    "journal_path",
]
