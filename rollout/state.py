"""What survives a control-plane restart: where each rollout is (phase, step, split), since
when, how many candidate answers its step has had, its last checks and its history.

One JSON document per rollout, written before the split it describes is pushed (a restart
between the two pushes it again, never an older step). Embedded mode keeps it in the state
directory (FileStore); in Kubernetes it is the Rollout's `status.rollout`, written by the
leader (meshfn.kube).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from meshfn import ir

Phase = Literal["Progressing", "Paused", "Promoted", "RolledBack", "Aborted"]
PHASES: tuple[Phase, ...] = ("Progressing", "Paused", "Promoted", "RolledBack", "Aborted")
ENDED: frozenset[Phase] = frozenset({"Promoted", "RolledBack", "Aborted"})
HISTORY = 100  # entries kept per rollout


def identity(rollout: ir.Rollout) -> str:
    """What makes a rollout the same one across edits: its Function, versions and steps. A
    change to them starts it over; a change to its SLOs, interval or pinning does not."""
    text = repr((rollout.function, rollout.stable, rollout.candidate, rollout.steps))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class HistoryEntry:
    at: float  # wall clock
    event: str  # started | step | promoted | rolled-back | paused | resumed | aborted | ...
    step: int
    weight: int
    mirror: int
    reason: str
    by: str = "controller"  # or who asked (a manual action)


@dataclass
class RolloutState:
    rollout: str  # Rollout.key
    identity: str
    phase: Phase
    step: int
    weight: int
    mirror: int
    pinned: bool
    step_started: float  # wall clock
    started: float
    requests: int = 0  # candidate answers (shadow: comparisons) in this step so far
    reason: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)  # the last evaluation's
    history: list[HistoryEntry] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    def split(self) -> ir.Split:
        return ir.Split(self.rollout, self.weight, self.mirror, self.pinned)

    def log(self, entry: HistoryEntry) -> None:
        self.history.append(entry)
        del self.history[:-HISTORY]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RolloutState | None:
        """A stored state, or None if it is not one (a hand-edited or foreign document)."""
        if not isinstance(data, dict):
            return None
        try:
            history = [HistoryEntry(**h) for h in data.get("history", [])]
            state = cls(**{**data, "history": history})
        except TypeError:
            return None
        if state.phase not in PHASES or not isinstance(state.step, int):
            return None
        return state


class Store(Protocol):
    """Where states live between restarts."""

    def load(self, key: str) -> RolloutState | None: ...

    def save(self, state: RolloutState) -> None: ...

    def remove(self, key: str) -> None: ...


class MemoryStore:
    """States that live as long as the process (tests; Kubernetes keeps them in the status)."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    def load(self, key: str) -> RolloutState | None:
        return RolloutState.from_json(self.states.get(key))

    def save(self, state: RolloutState) -> None:
        self.states[state.rollout] = json.loads(json.dumps(state.to_json()))

    def remove(self, key: str) -> None:
        self.states.pop(key, None)


class FileStore:
    """STATE/rollouts/<namespace>/<name>.json, replaced atomically (a crash mid-write leaves
    the previous document)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, key: str) -> Path:
        namespace, name = key.split("/", 1)
        return self.directory / namespace / f"{name}.json"

    def load(self, key: str) -> RolloutState | None:
        try:
            data = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        return RolloutState.from_json(data)

    def save(self, state: RolloutState) -> None:
        path = self._path(state.rollout)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as handle:
            json.dump(state.to_json(), handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)

    def remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
