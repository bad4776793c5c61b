"""Snapshot cache: per workload (node group) a consistent, versioned set of resources.

Modelled on go-control-plane's split: the cache holds snapshots and knows who watches them; the ADS
server (server.py) owns the protocol. Everything here that is expensive (serialising, hashing,
diffing, assembling response bytes) happens once per version and is shared by every stream of the
group: with a thousand Envoys on one workload, a push costs one encode plus a thousand writes.

`prepare` is pure and thread-safe: call it off the event loop. `publish` is cheap and runs on it.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from google.protobuf import any_pb2
from google.protobuf.message import Message

from . import wire
from .names import PUSH_ORDER

Names = frozenset[str]

# A nonce is shared by every stream that receives the same response bytes; it only has to be
# unique per stream and type, and a global counter is. Hex keeps it short on the wire.
_nonces = itertools.count(1)


def next_nonce() -> str:
    return format(next(_nonces), "x")


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Resource:
    """One resource, encoded once. `version` is a content hash, so it survives control-plane
    restarts: a reconnecting Envoy that already has this content is not sent it again (Delta)."""

    name: str
    version: str
    message: Message = field(repr=False, compare=False)
    sotw_entry: bytes = field(repr=False)  # DiscoveryResponse.resources field
    delta_entry: bytes = field(repr=False)  # DeltaDiscoveryResponse.resources field

    @classmethod
    def encode(cls, type_url: str, name: str, message: Message) -> Resource:
        packed = any_pb2.Any(
            type_url=type_url, value=message.SerializeToString(deterministic=True)
        ).SerializeToString()
        version = _digest(packed)
        wrapper = b"".join(
            (
                wire.text(wire.ResourceField.VERSION, version),
                wire.field(wire.ResourceField.RESOURCE, packed),
                wire.text(wire.ResourceField.NAME, name),
            )
        )
        return cls(
            name=name,
            version=version,
            message=message,
            sotw_entry=wire.field(wire.Sotw.RESOURCES, packed),
            delta_entry=wire.field(wire.Delta.RESOURCES, wrapper),
        )


class TypeSnapshot:
    """All resources of one type for one group, with memoised responses and diffs."""

    __slots__ = ("_counts", "_diffs", "_responses", "resources", "type_url", "version")

    def __init__(self, type_url: str, resources: Mapping[str, Resource]) -> None:
        self.type_url = type_url
        self.resources = dict(sorted(resources.items()))
        self.version = _digest(
            b"\0".join(f"{n}\0{r.version}".encode() for n, r in self.resources.items())
        )
        self._diffs: dict[str, tuple[Names, Names]] = {}
        self._responses: dict[object, tuple[str, bytes]] = {}
        self._counts: dict[Names, int] = {}

    def count(self, names: Names) -> int:
        """How many of `names` exist here (memoised per interned subscription set)."""
        found = self._counts.get(names)
        if found is None:
            found = self._counts[names] = len(names & self.resources.keys())
        return found

    def diff_from(self, older: TypeSnapshot) -> tuple[Names, Names]:
        """(changed or added names, removed names) going from `older` to this version."""
        cached = self._diffs.get(older.version)
        if cached is None:
            mine, theirs = self.resources, older.resources
            changed = frozenset(
                n for n, r in mine.items() if (o := theirs.get(n)) is None or o.version != r.version
            )
            removed = frozenset(n for n in theirs if n not in mine)
            cached = (changed, removed)
            if len(self._diffs) > 64:
                self._diffs.clear()
            self._diffs[older.version] = cached
        return cached

    def response(self, key: object, build: Callable[[str], bytes]) -> tuple[str, bytes]:
        """Memoise the bytes of a response under `key`; streams asking for the same thing share
        one bytes object and one nonce."""
        hit = self._responses.get(key)
        if hit is None:
            nonce = next_nonce()
            hit = (nonce, build(nonce))
            self._responses[key] = hit
        return hit

    def __len__(self) -> int:
        return len(self.resources)


EMPTY_VERSION = TypeSnapshot("", {}).version


@dataclass(frozen=True)
class Snapshot:
    group: str
    types: Mapping[str, TypeSnapshot]
    published_at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def version(self) -> str:
        return _digest("".join(self.types[t].version for t in sorted(self.types)).encode())

    def type(self, type_url: str) -> TypeSnapshot:
        found = self.types.get(type_url)
        return found if found is not None else _empty(type_url)


_EMPTY: dict[str, TypeSnapshot] = {}


def _empty(type_url: str) -> TypeSnapshot:
    found = _EMPTY.get(type_url)
    if found is None:
        found = _EMPTY[type_url] = TypeSnapshot(type_url, {})
    return found


def prepare(
    group: str,
    resources: Mapping[str, Mapping[str, Message]],
    previous: Snapshot | None = None,
) -> Snapshot:
    """Encode a translation into a Snapshot, reusing every resource (and whole TypeSnapshots)
    that did not change since `previous`, so unchanged types keep their identity and version."""
    types: dict[str, TypeSnapshot] = {}
    for type_url in PUSH_ORDER:
        by_name = resources.get(type_url)
        if by_name is None:
            continue
        old = previous.types.get(type_url) if previous is not None else None
        encoded: dict[str, Resource] = {}
        reused_all = old is not None and len(old.resources) == len(by_name)
        for name, message in by_name.items():
            prior = old.resources.get(name) if old is not None else None
            if prior is not None and prior.message is message:
                encoded[name] = prior
                continue
            fresh = Resource.encode(type_url, name, message)
            if prior is not None and prior.version == fresh.version:
                encoded[name] = prior
                continue
            encoded[name] = fresh
            reused_all = False
        if old is not None and reused_all and encoded.keys() == old.resources.keys():
            types[type_url] = old
        else:
            types[type_url] = TypeSnapshot(type_url, encoded)
    return Snapshot(group=group, types=types)


class SnapshotCache:
    """Latest snapshot per group, and the streams watching each group."""

    def __init__(self) -> None:
        self._snapshots: dict[str, Snapshot] = {}
        self._watchers: dict[str, set[Callable[[], None]]] = {}
        self._interned: dict[Names, Names] = {}

    def get(self, group: str) -> Snapshot | None:
        return self._snapshots.get(group)

    def groups(self) -> list[str]:
        return sorted(self._snapshots)

    def publish(self, snapshot: Snapshot) -> bool:
        """Make `snapshot` current and wake the group's streams; False if nothing changed."""
        current = self._snapshots.get(snapshot.group)
        if current is not None and current.types == snapshot.types:
            return False
        self._snapshots[snapshot.group] = snapshot
        for notify in list(self._watchers.get(snapshot.group, ())):
            notify()
        return True

    def remove(self, group: str) -> None:
        self._snapshots.pop(group, None)

    def retain(self, groups: Iterable[str]) -> list[str]:
        """Drop snapshots of groups not in `groups` (workloads removed from the policies)."""
        keep = set(groups)
        gone = [g for g in self._snapshots if g not in keep]
        for group in gone:
            del self._snapshots[group]
        return gone

    def watch(self, group: str, notify: Callable[[], None]) -> None:
        self._watchers.setdefault(group, set()).add(notify)

    def unwatch(self, group: str, notify: Callable[[], None]) -> None:
        watchers = self._watchers.get(group)
        if watchers is not None:
            watchers.discard(notify)
            if not watchers:
                del self._watchers[group]

    def intern(self, names: Names) -> Names:
        """One shared object per distinct subscription set: memo lookups then hit on identity
        instead of comparing thousands of names per stream."""
        found = self._interned.get(names)
        if found is None:
            if len(self._interned) > 100_000:
                self._interned.clear()
            found = self._interned[names] = names
        return found
