"""Kubernetes as a policy source: meshfn custom resources -> the same MeshModel as the files.

Per kind, a reflector lists once and then watches from the list's resourceVersion (bookmarks
keep an idle watch's version fresh). A watch that ends or breaks is re-opened from the last
version seen, so an apiserver restart costs one request per kind and no resync; only a 410 Gone
(the version was compacted away) relists, and the relisted objects replace the kind's cache
in one step. Nothing of this touches the configuration in force: it changes only when a build
of the whole set succeeds.

Each object becomes a policy document (apiVersion, kind, metadata name/namespace, spec) and goes
through the file source's code path (`validate_document`, the reference checks, `compile_model`):
one model, one set of messages. Change bursts (kubectl apply -f dir/) are debounced into one
build. Every build yields a verdict per object, which the leader writes to its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from meshfn.common.kube.api import ApiError, Backoff, KubeClient, Obj, Resource, Unreachable
from meshfn.common.kube.metrics import KubeMetrics
from meshfn.contracts.kube import GROUP, KINDS, VERSION, Kind
from meshfn.ir import MeshModel

from .errors import PolicyError, PolicyErrors, object_ref
from .loader import build_model, lowered
from .source import Document
from .types import API_VERSION
from .validate import Loaded

log = logging.getLogger("meshfn.kube.source")

CLUSTER = "cluster"  # where set-wide errors (no Mesh) are reported


def resource(info: Kind) -> Resource:
    return Resource(GROUP, VERSION, info.plural, info.kind, info.scope == "Namespaced")


@dataclass(frozen=True, order=True)
class ObjectKey:
    kind: str
    namespace: str  # "" for cluster-scoped kinds
    name: str

    @property
    def ref(self) -> str:
        """How the object is named in messages, as the `file` of its errors."""
        return object_ref(self.kind, self.namespace, self.name)

    @classmethod
    def of(cls, obj: Obj) -> ObjectKey:
        meta = obj.get("metadata") or {}
        return cls(str(obj.get("kind", "")), str(meta.get("namespace", "")), str(meta["name"]))


@dataclass(frozen=True)
class Verdict:
    """What the leader writes into one object's status."""

    state: Literal["Accepted", "Invalid", "Blocked"]
    generation: int
    messages: tuple[str, ...] = ()  # `field: problem` lines, as `meshfn validate` prints them


@dataclass(frozen=True)
class Build:
    """The outcome of one build of the whole set."""

    model: MeshModel | None  # the configuration in force (the previous one when this build failed)
    fresh: bool  # this build produced `model`
    errors: tuple[PolicyError, ...]
    verdicts: dict[ObjectKey, Verdict]
    objects: dict[ObjectKey, Obj]  # the custom resources the build read (uids for owners)
    seconds: float = 0.0


Listener = Callable[[Build], Awaitable[None]]
Cache = dict[tuple["ObjectKey", str], Loaded | list[PolicyError]]


def compile_objects(
    objects: dict[ObjectKey, Obj], previous: Cache | None = None, cache: Cache | None = None
) -> MeshModel:
    """Custom resources -> MeshModel through the file source's path, or PolicyErrors naming
    each object. `previous` holds validated objects of an earlier call (unchanged ones are not
    validated again); `cache` receives this call's."""
    items: list[Loaded] = []
    errors: list[PolicyError] = []
    for key in sorted(objects):
        text = _input(objects[key])
        result = (previous or {}).get((key, text))
        if result is None:
            result = lowered(document(objects[key]))
        if cache is not None:
            cache[(key, text)] = result
        if isinstance(result, Loaded):
            items.append(result)
        else:
            errors.extend(result)
    if not errors and not any(i.kind == "Mesh" for i in items):
        errors.append(
            PolicyError(CLUSTER, 0, "", "no Mesh found: a policy set needs one kind: Mesh")
        )
    return build_model(items, errors)


def document(obj: Obj) -> Document:
    """A custom resource as the policy document a file would hold (status and server-set
    metadata dropped); errors name it `Kind namespace/name`."""
    meta = obj.get("metadata") or {}
    key = ObjectKey.of(obj)
    metadata: Obj = {"name": meta.get("name")}
    if key.namespace:
        metadata["namespace"] = key.namespace
    data: Obj = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": metadata}
    if "spec" in obj:
        data["spec"] = obj["spec"]
    return Document(file=key.ref, index=0, line=0, data=data, lines={})


def _input(obj: Obj) -> str:
    """What a build depends on: changes elsewhere (status, resourceVersion) are not changes."""
    return json.dumps(document(obj).data, sort_keys=True, separators=(",", ":"))


@dataclass
class _Reflector:
    info: Kind
    resource: Resource
    objects: dict[ObjectKey, Obj] = field(default_factory=dict)
    inputs: dict[ObjectKey, str] = field(default_factory=dict)
    version: str | None = None
    synced: bool = False
    connected: bool = False
    last_error: str = ""


class KubePolicySource:
    def __init__(
        self,
        kube: KubeClient,
        namespace: str | None = None,
        metrics: KubeMetrics | None = None,
        debounce: float = 0.1,
        max_delay: float = 1.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace  # None: every namespace
        self.metrics = metrics or KubeMetrics()
        self.debounce = debounce
        self.max_delay = max_delay
        self._reflectors = [_Reflector(info, resource(info)) for info in KINDS]
        self._dirty = asyncio.Event()
        self._listeners: list[Listener] = []
        self._cache: dict[tuple[ObjectKey, str], Loaded | list[PolicyError]] = {}
        self._in_force: dict[ObjectKey, int] = {}  # generation of each object in the model in force
        self.model: MeshModel | None = None
        self.last: Build | None = None
        self.synced = asyncio.Event()
        self.builds = 0

    def on_build(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def objects(self) -> dict[ObjectKey, Obj]:
        """Every custom resource as the watches last saw it, status included (a build's
        `objects` are as of the build; status-only changes do not build)."""
        return {k: o for r in self._reflectors for k, o in r.objects.items()}

    def status(self) -> dict[str, object]:
        """For /debug/status and `meshfn status`."""
        return {
            "synced": self.synced.is_set(),
            "kinds": {
                r.info.kind: {
                    "objects": len(r.objects),
                    "resource_version": r.version,
                    "watching": r.connected,
                    "error": r.last_error,
                }
                for r in self._reflectors
            },
            "builds": self.builds,
            "errors": [str(e) for e in self.last.errors] if self.last else [],
        }

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._reflect(r, stop)) for r in self._reflectors]
        tasks.append(asyncio.create_task(self._build_loop(stop)))
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ------------------------------------------------------------ reflectors

    def _replace(self, reflector: _Reflector, items: list[Obj]) -> None:
        objects = {ObjectKey.of(o): o for o in items}
        inputs = {k: _input(o) for k, o in objects.items()}
        changed = inputs != reflector.inputs or not reflector.synced
        reflector.objects, reflector.inputs = objects, inputs
        reflector.synced = True
        if all(r.synced for r in self._reflectors):
            self.synced.set()
        if changed:
            self._dirty.set()

    def _event(self, reflector: _Reflector, kind: str, obj: Obj) -> None:
        obj.setdefault("kind", reflector.info.kind)
        obj.setdefault("apiVersion", API_VERSION)
        key = ObjectKey.of(obj)
        if kind == "DELETED":
            reflector.objects.pop(key, None)
            if reflector.inputs.pop(key, None) is not None:
                self._dirty.set()
            return
        reflector.objects[key] = obj
        text = _input(obj)
        if reflector.inputs.get(key) != text:
            reflector.inputs[key] = text
            self._dirty.set()

    async def _reflect(self, reflector: _Reflector, stop: asyncio.Event) -> None:
        kind = reflector.info.kind
        backoff = Backoff()
        cause = "start"
        while not stop.is_set():
            try:
                if reflector.version is None:
                    items, reflector.version = await self.kube.list(
                        reflector.resource, self.namespace
                    )
                    self.metrics.relists.labels(kind, cause).inc()
                    self._replace(reflector, items)
                    log.debug("listed %d %s at %s", len(items), kind, reflector.version)
                reflector.connected = True
                reflector.last_error = ""
                self.metrics.apiserver_up.set(1)
                async for event in self.kube.watch(
                    reflector.resource, reflector.version, self.namespace
                ):
                    version = (event.object.get("metadata") or {}).get("resourceVersion")
                    if event.type != "BOOKMARK":
                        self._event(reflector, event.type, event.object)
                    if version:
                        reflector.version = str(version)
                    backoff.reset()
                cause = "timeout"  # the server ended the watch: resume from the last version
                self.metrics.watch_restarts.labels(kind, cause).inc()
            except ApiError as exc:
                reflector.connected = False
                if exc.status == 410:
                    # Compacted: relist. The cache is replaced only when the list arrives, and
                    # the model in force only by a successful build.
                    log.info("%s watch expired (410 Gone): relisting", kind)
                    reflector.version, cause = None, "gone"
                    continue
                reflector.last_error = str(exc)
                self.metrics.watch_restarts.labels(kind, f"http_{exc.status}").inc()
                delay = backoff.next()
                log.warning(
                    "watching %s failed (%s); keeping the configuration in force, retrying in"
                    " %.1fs",
                    kind,
                    exc,
                    delay,
                )
                await sleep_or_stop(stop, delay)
            except Unreachable as exc:
                reflector.connected = False
                reflector.last_error = str(exc)
                self.metrics.apiserver_up.set(0)
                self.metrics.watch_restarts.labels(kind, "unreachable").inc()
                delay = backoff.next()
                log.warning(
                    "apiserver unreachable (%s); keeping the configuration in force, retrying"
                    " %s in %.1fs",
                    exc,
                    kind,
                    delay,
                )
                await sleep_or_stop(stop, delay)

    # ------------------------------------------------------------ builds

    async def _build_loop(self, stop: asyncio.Event) -> None:
        await wait_either(self.synced, stop)
        while not stop.is_set():
            await wait_either(self._dirty, stop)
            if stop.is_set():
                return
            first = time.monotonic()
            while True:  # debounce: until quiet for `debounce`, at most `max_delay`
                self._dirty.clear()
                left = self.max_delay - (time.monotonic() - first)
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._dirty.wait(), min(self.debounce, left))
                except TimeoutError:
                    break
            self._dirty.clear()
            build = await asyncio.to_thread(self.build, self.objects())
            self.last = build
            for listener in self._listeners:
                try:
                    await listener(build)
                except Exception:
                    log.exception("handling policy build %d failed", self.builds)

    def build(self, objects: dict[ObjectKey, Obj]) -> Build:
        """Validate and compile the whole set (a worker thread: touches no loop state)."""
        started = time.perf_counter()
        self.builds += 1
        cache: Cache = {}
        try:
            model: MeshModel | None = compile_objects(objects, self._cache, cache)
            problems: list[PolicyError] = []
        except PolicyErrors as exc:
            model, problems = None, exc.errors
        self._cache = cache
        generations = {
            k: int((o.get("metadata") or {}).get("generation", 0)) for k, o in objects.items()
        }
        if model is not None:
            self.model = model
            self._in_force = dict(generations)
            self.metrics.builds.labels("ok").inc()
        else:
            self.metrics.builds.labels("invalid").inc()
        by_object: dict[str, list[str]] = {}
        for problem in problems:
            line = f"{problem.path}: {problem.message}" if problem.path else problem.message
            by_object.setdefault(problem.file, []).append(line)
        invalid = sorted(f for f in by_object if f != CLUSTER)
        verdicts: dict[ObjectKey, Verdict] = {}
        for key, generation in generations.items():
            mine = by_object.get(key.ref)
            if mine:
                verdicts[key] = Verdict("Invalid", generation, tuple(mine))
            elif model is not None or self._in_force.get(key) == generation:
                verdicts[key] = Verdict("Accepted", generation)
            else:
                blockers = ", ".join(invalid[:5]) or "; ".join(by_object.get(CLUSTER, []))
                verdicts[key] = Verdict(
                    "Blocked",
                    generation,
                    (f"valid, but not in force yet: the policy set has errors ({blockers})",),
                )
        seconds = time.perf_counter() - started
        if model is None:
            log.error(
                "policy set rejected, keeping the configuration in force:\n%s",
                "\n".join(f"  {p}" for p in problems),
            )
        return Build(
            model=self.model,
            fresh=model is not None,
            errors=tuple(problems),
            verdicts=verdicts,
            objects=dict(objects),
            seconds=seconds,
        )


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def wait_either(event: asyncio.Event, stop: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
