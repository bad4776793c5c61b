"""Delivery to a cluster: server-side apply of rendered objects, only where they changed.

Every object meshfn writes carries the label `app.kubernetes.io/managed-by: meshfn`, the
instance label (one controller installation), and an annotation with the sha256 of what was
applied. The applier keeps an inventory (object -> hash) filled by listing those labels when it
starts leading, so a reconcile with nothing changed sends no request at all, a change re-applies
exactly the objects whose hash moved, and what is no longer rendered is pruned. A periodic
resync compares the live objects with the intent (subset comparison: other managers may own
other fields) and repairs what someone changed or deleted behind meshfn's back.

Conflicts: apply never forces by default. When another field manager owns a field meshfn wants
to set, the apiserver answers 409; the conflict is reported (log, metric, the owning policy's
status and an Event), the object is left as it is, and other objects still apply. `force=True`
(`meshfn kube run --force-conflicts`) takes the fields over instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from meshfn.common.kube.api import ApiError, KubeClient, Obj, Resource, Unreachable
from meshfn.common.kube.metrics import KubeMetrics
from meshfn.contracts.kube import ANNOTATION_HASH, FIELD_MANAGER, LABEL_MANAGED_BY, LABEL_PART_OF
from meshfn.policy.errors import object_ref

log = logging.getLogger("meshfn.kube.apply")

Key = tuple[str, str, str, str]  # apiVersion, kind, namespace, name


def key_of(obj: Obj) -> Key:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def describe(key: Key) -> str:
    return object_ref(*key[1:])


def digest(obj: Obj) -> str:
    """sha256 of the canonical JSON of an intended object (its own hash annotation left out)."""
    text = json.dumps(_without_hash(obj), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _without_hash(obj: Obj) -> Obj:
    meta = dict(obj["metadata"])
    meta["annotations"] = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k != ANNOTATION_HASH
    }
    return {**obj, "metadata": meta}


def mismatch(live: Any, want: Any, path: str = "") -> str | None:
    """Where `live` lacks a field of `want` or has another value (None: it contains it all).
    An empty or false value matches a missing field: the apiserver omits Go zero values
    (`readOnly: false`), and other field managers may add fields of their own."""
    if isinstance(want, dict):
        return _dict_mismatch(live, want, path)
    if isinstance(want, list):
        return _list_mismatch(live, want, path)
    return None if live == want else (path or ".")


def _dict_mismatch(live: Any, want: dict[str, Any], path: str) -> str | None:
    if not isinstance(live, dict):
        return path or "."
    for key, value in want.items():
        if key not in live:
            if value in (False, 0, "", [], {}, None):
                continue
            return f"{path}.{key}"
        found = mismatch(live[key], value, f"{path}.{key}")
        if found is not None:
            return found
    return None


def _list_mismatch(live: Any, want: list[Any], path: str) -> str | None:
    if not isinstance(live, list) or len(live) != len(want):
        return path or "."
    for i, (a, b) in enumerate(zip(live, want, strict=True)):
        found = mismatch(a, b, f"{path}[{i}]")
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Desired:
    resource: Resource
    obj: Obj
    source: str = ""  # "Kind namespace/name" of the policy it comes from (for reports)

    @property
    def key(self) -> Key:
        return key_of(self.obj)


@dataclass
class Report:
    applied: list[Key] = field(default_factory=list)
    unchanged: int = 0
    pruned: list[Key] = field(default_factory=list)
    conflicts: dict[Key, str] = field(default_factory=dict)  # object -> who owns what
    failed: dict[Key, str] = field(default_factory=dict)  # object -> why (422, 403, ...)
    unreachable: str = ""  # the apiserver stopped answering part-way (retry the rest)

    @property
    def ok(self) -> bool:
        return not (self.conflicts or self.failed or self.unreachable)


def _conflict_text(exc: ApiError) -> str:
    causes = [str(c.get("message", "")) for c in exc.causes if c.get("message")]
    fields = [str(c.get("field", "")) for c in exc.causes if c.get("field")]
    text = "; ".join(causes) or exc.message
    if fields:
        text += f" (fields: {', '.join(fields)})"
    return text


class Applier:
    def __init__(
        self,
        kube: KubeClient,
        instance: str,
        kinds: Iterable[Resource],
        metrics: KubeMetrics | None = None,
        force: bool = False,
        field_manager: str = FIELD_MANAGER,
    ) -> None:
        self.kube = kube
        self.instance = instance
        self.kinds = list(kinds)
        self.metrics = metrics or KubeMetrics()
        self.force = force
        self.field_manager = field_manager
        self.inventory: dict[Key, str] = {}
        self.resources: dict[Key, Resource] = {}
        self.synced = False
        self.missing_kinds: set[str] = set()  # kinds whose CRD is not installed

    @property
    def selector(self) -> str:
        return f"{LABEL_MANAGED_BY}={FIELD_MANAGER},{LABEL_PART_OF}={self.instance}"

    def label(self, obj: Obj, source: str = "") -> Obj:
        """The object with meshfn's labels and its hash annotation (what is sent)."""
        meta = dict(obj["metadata"])
        meta["labels"] = {
            **(meta.get("labels") or {}),
            LABEL_MANAGED_BY: FIELD_MANAGER,
            LABEL_PART_OF: self.instance,
        }
        annotations = dict(meta.get("annotations") or {})
        meta["annotations"] = annotations
        labelled = {**obj, "metadata": meta}
        annotations[ANNOTATION_HASH] = digest(labelled)
        return labelled

    async def sync(self, desired: Iterable[Desired] = ()) -> None:
        """(Re)build the inventory from the live objects meshfn manages. Objects whose content
        no longer contains the intent (edited by someone else) are dropped from the inventory,
        so the next reconcile applies them again."""
        intent = {d.key: self.label(d.obj) for d in desired}
        inventory: dict[Key, str] = {}
        resources: dict[Key, Resource] = {}
        missing: set[str] = set()
        for res in self.kinds:
            try:
                items, _ = await self.kube.list(res, None, self.selector)
            except ApiError as exc:
                if exc.status == 404:  # CRD not installed (e.g. KEDA): nothing of that kind
                    missing.add(res.kind)
                    continue
                raise
            for item in items:
                key = key_of(item)
                annotations = item["metadata"].get("annotations") or {}
                recorded = annotations.get(ANNOTATION_HASH, "")
                want = intent.get(key)
                # The content, not the hash annotation (a mismatch there re-applies anyway).
                differs = None if want is None else mismatch(item, _without_hash(want))
                if differs is not None:
                    log.info(
                        "%s differs from what meshfn applied (at %s): re-applying it",
                        describe(key),
                        differs,
                    )
                    recorded = ""
                inventory[key] = recorded
                resources[key] = res
        self.inventory, self.resources, self.missing_kinds = inventory, resources, missing
        self.synced = True

    async def reconcile(
        self, desired: list[Desired], prune: bool = True, leading: Callable[[], bool] = lambda: True
    ) -> Report:
        """Apply what changed, prune what is gone. Stops at the first unreachable error (the
        caller retries with backoff); conflicts and rejections are per object. `leading` is
        asked before every write: a replica that lost the Lease mid-way stops writing at once."""
        report = Report()
        wanted = await self._apply_all(desired, report, leading)
        if wanted is None:  # lost the Lease: nothing more is written, nor counted
            return report
        if prune and not report.unreachable:
            await self._prune(sorted(set(self.inventory) - wanted), report, leading)
        pending = len(report.conflicts) + len(report.failed)
        if report.unreachable:
            pending += sum(1 for d in desired if self.inventory.get(d.key) is None)
        self.metrics.pending.set(pending)
        if report.applied or report.pruned:
            log.info(
                "applied %d object(s), pruned %d, %d unchanged: %s",
                len(report.applied),
                len(report.pruned),
                report.unchanged,
                ", ".join(describe(k) for k in [*report.applied, *report.pruned][:8]),
            )
        return report

    async def _apply_all(
        self, desired: list[Desired], report: Report, leading: Callable[[], bool]
    ) -> set[Key] | None:
        """Apply each object whose hash changed; the keys of all of them, or None when the
        Lease was lost."""
        wanted: set[Key] = set()
        for item in desired:
            if not leading():
                report.unreachable = "lost the leader Lease"
                return None
            obj = self.label(item.obj)
            key = key_of(obj)
            wanted.add(key)
            want_hash = obj["metadata"]["annotations"][ANNOTATION_HASH]
            if self.inventory.get(key) == want_hash:
                report.unchanged += 1
                continue
            if item.resource.kind in self.missing_kinds:
                report.failed[key] = f"the {item.resource.kind} API is not installed in the cluster"
                continue
            if not await self._apply(item, obj, want_hash, report):
                break
        return wanted

    async def _apply(self, item: Desired, obj: Obj, want_hash: str, report: Report) -> bool:
        """Server-side apply of one object; a conflict or a rejection is the object's (in
        `report`); False when the apiserver stopped answering."""
        key = key_of(obj)
        try:
            await self.kube.apply(item.resource, obj, self.field_manager, force=self.force)
        except ApiError as exc:
            if exc.status == 409:
                report.conflicts[key] = _conflict_text(exc)
                self.metrics.applies.labels(item.resource.kind, "conflict").inc()
                log.error(
                    "apply conflict on %s (from %s): %s; not forcing (--force-conflicts would)",
                    describe(key),
                    item.source or "meshfn",
                    report.conflicts[key],
                )
            else:
                report.failed[key] = f"{exc.status} {exc.reason}: {exc.message}"
                self.metrics.applies.labels(item.resource.kind, "error").inc()
                log.error("applying %s failed: %s", describe(key), report.failed[key])
            return True
        except Unreachable as exc:
            report.unreachable = str(exc)
            return False
        self.inventory[key] = want_hash
        self.resources[key] = item.resource
        report.applied.append(key)
        self.metrics.applies.labels(item.resource.kind, "applied").inc()
        return True

    async def _prune(self, gone: list[Key], report: Report, leading: Callable[[], bool]) -> None:
        """Delete what meshfn applied before and no longer wants."""
        for key in gone:
            if not leading():
                report.unreachable = "lost the leader Lease"
                break
            res = self.resources[key]
            try:
                await self.kube.delete(res, key[3], key[2] or None)
            except ApiError as exc:
                report.failed[key] = f"cannot prune: {exc.status} {exc.message}"
                continue
            except Unreachable as exc:
                report.unreachable = str(exc)
                break
            del self.inventory[key]
            self.resources.pop(key, None)
            report.pruned.append(key)
            self.metrics.prunes.labels(res.kind).inc()
