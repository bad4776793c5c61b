"""What the translator needs about the proxies' host that policies do not say."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from meshfn import ir
from meshfn.contracts.journal import journal_path
from meshfn.contracts.plugins import SubjectSalt


@dataclass(frozen=True)
class ProxyHost:
    """Where the built filters are, where journals go, the subject salt (a secret; see
    audit.salt), and the run mode's own trace collector (`meshfn up`'s embedded one), used
    where Mesh.spec.tracing names none."""

    wasm_dir: Path
    state_dir: Path
    salt: SubjectSalt = field(repr=False)
    collector: ir.TraceCollector | None = None

    def journal(self, node_cluster: str) -> Path:
        return journal_path(self.state_dir, node_cluster)


# For offline rendering and golden files only: the control plane always passes its own host.
OFFLINE_HOST = ProxyHost(
    Path("/var/lib/meshfn/wasm"), Path("/var/lib/meshfn"), SubjectSalt("00" * 32)
)
