"""What the translator needs about the proxies' host that policies do not say."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from meshfn.contracts.journal import journal_path
from meshfn.contracts.plugins import SubjectSalt

AppSockets = tuple[tuple[tuple[str, int], tuple[str, ...]], ...]


@dataclass(frozen=True)
class ProxyHost:
    """Where the built filters are, where journals go, and the subject salt (a secret; see
    audit.salt).

    `app_sockets`: the applications behind sidecars that listen on unix sockets instead of
    their endpoint's loopback port (what `meshfn up` runs: a port on loopback answers every
    local user, a socket in the private state directory only meshfn's own), as ((address,
    port), socket paths) pairs, one path per serving process. A sidecar reaches such an
    application over Envoy `pipe` addresses. Empty offline and for `meshfn serve`, whose
    applications their owners run."""

    wasm_dir: Path
    state_dir: Path
    salt: SubjectSalt = field(repr=False)
    app_sockets: AppSockets = ()
    _sockets: Mapping[tuple[str, int], tuple[str, ...]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sockets", dict(self.app_sockets))

    def journal(self, node_cluster: str) -> Path:
        return journal_path(self.state_dir, node_cluster)

    def app_socket(self, address: str, port: int) -> tuple[str, ...]:
        """The unix sockets of the application at address:port, or () where it listens there."""
        return self._sockets.get((address, port), ())


# For offline rendering and golden files only: the control plane always passes its own host.
OFFLINE_HOST = ProxyHost(
    Path("/var/lib/meshfn/wasm"), Path("/var/lib/meshfn"), SubjectSalt("00" * 32)
)
