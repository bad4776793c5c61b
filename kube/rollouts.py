"""Rollouts in Kubernetes mode: the same controller as `meshfn up` (meshfn.rollout), driven by
the leader only, its state in each Rollout's `status.rollout`.

- Only the leader configures, evaluates and acts; a follower keeps nothing of its own, so a new
  leader resumes every rollout from what the old one wrote in the status (a rollout it does not
  find there starts at its first step).
- Every evaluation's state is patched into `status.rollout` before the operator applies the
  split it leads to (the VirtualService's weights): a leader that dies between the two leaves
  the new step in the status, and its successor applies it.
- Every transition and manual action is a Kubernetes Event on the Rollout (Normal, or Warning
  for a rollback, a pause or an abort) and moves its `Progressing` condition (written with the
  Accepted and Invalid conditions by the status writer).
- The figures: Istio's gateways stream their access logs to the leader (the Telemetry
  `meshfn-latency` provider), whose entries name each version's subset cluster.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from meshfn.common.kube.api import ApiError, KubeClient, Obj, Unreachable
from meshfn.contracts.kube import BY_KIND
from meshfn.policy.kube_source import ObjectKey, resource
from meshfn.rollout.controller import Clusters, Event, RolloutController
from meshfn.rollout.state import RolloutState

from .status import create_event

log = logging.getLogger("meshfn.kube.rollouts")

ROLLOUT = resource(BY_KIND["Rollout"])
CONDITION_PROGRESSING = "Progressing"
# Progressing's status and reason per phase (Kubernetes' Deployment has the same condition).
_PROGRESSING = {
    "Progressing": ("True", "Progressing"),
    "Paused": ("Unknown", "Paused"),
    "Promoted": ("False", "Promoted"),
    "RolledBack": ("False", "RolledBack"),
    "Aborted": ("False", "Aborted"),
}
_REASONS = {
    "started": "RolloutStarted",
    "step": "RolloutStep",
    "promoted": "RolloutPromoted",
    "rolled-back": "RolloutRolledBack",
    "paused": "RolloutPaused",
    "resumed": "RolloutResumed",
    "aborted": "RolloutAborted",
}


def _key(rollout: str) -> ObjectKey:
    namespace, name = rollout.split("/", 1)
    return ObjectKey("Rollout", namespace, name)


class StatusStore:
    """The controller's Store over the Rollouts' `status.rollout`: loads read the custom
    resources the last build saw (or what this leader wrote since); saves wait in `pending`
    until `flush` patches them."""

    def __init__(self, objects: Callable[[], dict[ObjectKey, Obj]]) -> None:
        self.objects = objects
        self.written: dict[str, dict[str, Any]] = {}
        self.pending: dict[str, dict[str, Any]] = {}

    def load(self, key: str) -> RolloutState | None:
        if key in self.written:
            return RolloutState.from_json(copy.deepcopy(self.written[key]))
        obj = self.objects().get(_key(key))
        status = (obj or {}).get("status") or {}
        return RolloutState.from_json(copy.deepcopy(status.get("rollout")))

    def save(self, state: RolloutState) -> None:
        data = state.to_json()
        if self.written.get(state.rollout) != data:
            self.written[state.rollout] = data
            self.pending[state.rollout] = data

    def remove(self, key: str) -> None:
        self.written.pop(key, None)
        self.pending.pop(key, None)

    def forget(self) -> None:
        """Leadership lost: the next leader (maybe this replica again) reads the statuses."""
        self.written.clear()
        self.pending.clear()


class KubeRollouts:
    """The operator's rollout controller, its status writes and Events."""

    def __init__(
        self,
        kube: KubeClient,
        objects: Callable[[], dict[ObjectKey, Obj]],
        clusters: Clusters,
    ) -> None:
        self.kube = kube
        self.objects = objects
        self.store = StatusStore(objects)
        self.controller = RolloutController(self.store, clusters)

    def reset(self) -> None:
        """A new controller for a new leadership: nothing carried over but the statuses."""
        self.store.forget()
        self.controller = RolloutController(self.store, self.controller.clusters_of)

    async def flush(self) -> None:
        """Patch every saved state into its Rollout's status (a 404: it was deleted meanwhile;
        unreachable: kept for the next flush)."""
        for key, data in list(self.store.pending.items()):
            ref = _key(key)
            try:
                await self.kube.patch(
                    ROLLOUT, ref.name, {"status": {"rollout": data}}, ref.namespace, "status"
                )
            except Unreachable:
                return
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("cannot write the status of %s: %s", ref.ref, exc)
            if self.store.pending.get(key) is data:
                del self.store.pending[key]

    async def events(self, events: list[Event]) -> None:
        """One Kubernetes Event per transition, on its Rollout."""
        for event in events:
            obj = self.objects().get(_key(event.rollout))
            if obj is None:
                continue
            reason = _REASONS.get(event.event, "Rollout")
            await create_event(self.kube, obj, reason, event.describe(), event.warning)

    def condition(self, key: ObjectKey) -> dict[str, Any] | None:
        """The Rollout's `Progressing` condition (None for another kind or before it runs)."""
        if key.kind != "Rollout":
            return None
        state = self.store.load(f"{key.namespace}/{key.name}")
        if state is None:
            return None
        status, reason = _PROGRESSING[state.phase]
        where = f"step {state.step + 1}, candidate {state.weight}%"
        if state.mirror:
            where += f", mirrored {state.mirror}%"
        message = f"{where}: {state.reason}" if state.reason else where
        return {
            "type": CONDITION_PROGRESSING,
            "status": status,
            "reason": reason,
            "message": message[:4000],
        }
