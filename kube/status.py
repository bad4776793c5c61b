"""Status conditions and Events on meshfn's custom resources (written by the leader only).

Each object gets two conditions: `Accepted` (its configuration is in force) and `Invalid` (it
has errors, listed one per line as `meshfn validate` prints them), both with the generation
they describe. A patch is sent only when a condition's status, reason or message changes, and
an Event only on a transition, so a steady cluster sees no writes from meshfn at all.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from meshfn.common.kube.api import EVENTS, ApiError, KubeClient, Obj, Unreachable
from meshfn.common.kube.metrics import KubeMetrics
from meshfn.contracts.kube import BY_KIND, CONDITION_ACCEPTED, CONDITION_INVALID
from meshfn.policy.kube_source import Build, ObjectKey, Verdict, resource

log = logging.getLogger("meshfn.kube.status")

MAX_MESSAGE = 4000  # keep conditions well inside etcd's object size limit


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Outcome:
    """A verdict plus what happened when its objects were applied."""

    verdict: Verdict
    apply_problems: tuple[str, ...] = ()  # conflicts and rejections of what it rendered
    resources: tuple[dict[str, str], ...] = ()
    warnings: tuple[str, ...] = ()  # what Istio cannot express (in force without it)
    # conditions of the kind's own (a Rollout's Progressing), after Accepted and Invalid
    extra: tuple[dict[str, Any], ...] = ()

    def conditions(self) -> list[dict[str, Any]]:
        verdict = self.verdict
        messages = "\n".join(verdict.messages)[:MAX_MESSAGE]
        if verdict.state == "Invalid":
            accepted = ("False", "Invalid", messages)
            invalid = ("True", "Invalid", messages)
        elif verdict.state == "Blocked":
            accepted = ("False", "Blocked", messages)
            invalid = ("False", "Valid", "no errors")
        elif self.apply_problems:
            text = "\n".join(self.apply_problems)[:MAX_MESSAGE]
            accepted = ("False", "ApplyFailed", text)
            invalid = ("False", "Valid", "no errors")
        elif self.warnings:
            text = "in force, except what Istio cannot express:\n" + "\n".join(self.warnings)
            accepted = ("True", "AcceptedWithWarnings", text[:MAX_MESSAGE])
            invalid = ("False", "Valid", "no errors")
        else:
            accepted = ("True", "Accepted", "in force")
            invalid = ("False", "Valid", "no errors")
        out = []
        for kind, (status, reason, message) in (
            (CONDITION_ACCEPTED, accepted),
            (CONDITION_INVALID, invalid),
        ):
            out.append(
                {
                    "type": kind,
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "observedGeneration": verdict.generation,
                }
            )
        out += [{**c, "observedGeneration": verdict.generation} for c in self.extra]
        return out


_STATE = ("type", "status", "reason", "message")


def _same(
    live: list[dict[str, Any]],
    want: list[dict[str, Any]],
    fields: tuple[str, ...] = (*_STATE, "observedGeneration"),
) -> bool:
    strip = [{f: c.get(f) for f in fields} for c in live]
    return strip == [{f: c.get(f) for f in fields} for c in want]


class StatusWriter:
    def __init__(self, kube: KubeClient, metrics: KubeMetrics | None = None) -> None:
        self.kube = kube
        self.metrics = metrics or KubeMetrics()
        # what we last wrote: conditions, resources
        self.written: dict[ObjectKey, tuple[list[dict[str, Any]], list[dict[str, str]]]] = {}

    async def write(self, build: Build, outcomes: dict[ObjectKey, Outcome]) -> int:
        """Patch every object whose conditions changed; returns how many were patched."""
        patched = 0
        for key, outcome in sorted(outcomes.items()):
            obj = build.objects.get(key)
            if obj is None:
                continue
            live_status = obj.get("status") or {}
            want = outcome.conditions()
            resources = [dict(r) for r in outcome.resources]
            # What we wrote last (the watch may not have brought it back yet), else the live one.
            live, live_resources = self.written.get(key) or (
                live_status.get("conditions") or [],
                live_status.get("resources") or [],
            )
            if _same(live, want) and live_resources == resources:
                self.written[key] = (live, live_resources)
                continue
            previous = {c.get("type"): c for c in live}
            for condition in want:
                old = previous.get(condition["type"])
                same_status = old is not None and old.get("status") == condition["status"]
                condition["lastTransitionTime"] = (
                    old.get("lastTransitionTime", _now()) if same_status and old else _now()
                )
            body = {
                "status": {
                    "observedGeneration": outcome.verdict.generation,
                    "conditions": want,
                    "resources": resources,
                }
            }
            try:
                await self.kube.patch(
                    resource(BY_KIND[key.kind]), key.name, body, key.namespace or None, "status"
                )
            except ApiError as exc:
                if exc.status != 404:  # deleted meanwhile: nothing to report on
                    log.warning("cannot write the status of %s: %s", key.ref, exc)
                continue
            self.metrics.status_writes.labels("status").inc()
            patched += 1
            # a new generation alone is no news, nor a kind's own condition (a Rollout's
            # Progressing: its transitions are Events of their own, meshfn.kube.rollouts)
            own = (CONDITION_ACCEPTED, CONDITION_INVALID)
            transition = not _same(
                [c for c in live if c.get("type") in own],
                [c for c in want if c.get("type") in own],
                _STATE,
            )
            self.written[key] = (want, resources)
            if transition:
                await self._event(obj, outcome, want[0])
        for key in list(self.written):
            if key not in build.objects:
                del self.written[key]
        return patched

    async def _event(self, obj: Obj, outcome: Outcome, accepted: dict[str, Any]) -> None:
        warning = accepted["status"] != "True"
        message = accepted["message"] or "in force"
        if await create_event(self.kube, obj, accepted["reason"], message, warning):
            self.metrics.status_writes.labels("event").inc()


async def create_event(
    kube: KubeClient, obj: Obj, reason: str, message: str, warning: bool
) -> bool:
    """A Kubernetes Event on `obj`; False (logged) when the apiserver would not take it."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    stamp = _now()
    suffix = hashlib.sha256(f"{meta.get('uid')}{reason}{message}{stamp}".encode()).hexdigest()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta.get('name')}.{suffix[:16]}", "namespace": namespace},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": meta.get("name"),
            "namespace": meta.get("namespace", ""),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": "meshfn"},
        "reportingComponent": "meshfn",
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        await kube.create(EVENTS, event, namespace)
    except (ApiError, Unreachable) as exc:
        log.warning("cannot record an Event for %s: %s", meta.get("name"), exc)
        return False
    return True
