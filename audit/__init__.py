"""The audit trail: Envoy's audit journals -> collectors -> one hash chain per journal in a store
(SQLite embedded, PostgreSQL in a cluster), checkpointed by a separate signer that also writes
every checkpoint to a witness outside the database.

Entry points: `open_store` (an `AuditStore`), `AuditCollector`, `Signer` / `SignerClient`,
`FileWitness`. Where journals live is meshfn.contracts.journal; the filters' settings are
meshfn.contracts.plugins; the Envoy config that writes the journal is the translator's
(meshfn.xds.translate.wasm). `offline.py` checks chains, checkpoints and exports without meshfn.
"""

from .checkpoint import Checkpoint
from .collector import AuditCollector
from .signer import Signer, SignerClient, SignerError
from .store import AuditStore, JournalPosition, StoreConflict, StoreError
from .stores import open_store
from .verify import VerifyReport, verify
from .witness import FileWitness

__all__ = [
    "AuditCollector",
    "AuditStore",
    "Checkpoint",
    "FileWitness",
    "JournalPosition",
    "Signer",
    "SignerClient",
    "SignerError",
    "StoreConflict",
    "StoreError",
    "VerifyReport",
    "open_store",
    "verify",
]
