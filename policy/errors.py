"""The one error type a user sees for bad policy input."""

from __future__ import annotations

from dataclasses import dataclass


def object_ref(kind: str, namespace: str, name: str) -> str:
    """How messages name an object: `Kind namespace/name`, or `Kind name` (the Mesh)."""
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


@dataclass(frozen=True, order=True)
class PolicyError(Exception):
    """A problem in a policy file, pinned to file, line and field path (e.g. spec.endpoints[0])."""

    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line > 0 else self.file
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class PolicyErrors(Exception):
    """Raised when a policy set does not load; carries every error found, sorted."""

    def __init__(self, errors: list[PolicyError]) -> None:
        self.errors = sorted(set(errors))
        super().__init__("\n".join(str(e) for e in self.errors))
