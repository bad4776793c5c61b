"""The audit trail: Envoy's audit journal -> collector -> hash-chained, signed SQLite store.

Entry points for the control plane: `AuditStore` and `AuditCollector`. Where journals live is
meshfn.contracts.journal; the filters' settings are meshfn.contracts.plugins; the Envoy config
that writes the journal is the translator's (meshfn.xds.translate.wasm).
"""

from .collector import AuditCollector
from .store import AuditStore, JournalPosition, StoreError, VerifyReport

__all__ = ["AuditCollector", "AuditStore", "JournalPosition", "StoreError", "VerifyReport"]
