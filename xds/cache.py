"""Snapshot cache: per workload (node group) a consistent, versioned set of resources.

Modelled on go-control-plane's split: the cache holds snapshots and knows who watches them; the ADS
server (server.py) owns the protocol. Everything here that is expensive (serialising, hashing,
diffing, assembling response bytes) happens once per version and is shared by every stream of the
group: with a thousand Envoys on one workload, a push costs one encode plus a thousand writes.

`prepare` is pure and thread-safe: call it off the event loop. `publish` is cheap and runs on it.

A snapshot is only published when it is consistent (go-control-plane's `Snapshot.Consistent`):
every resource another one names is in it. Envoy asks for what its clusters and listeners name
and, until it gets it, keeps them warming (a cluster without endpoints, a listener without its
routes or filter configuration never serves): publishing a snapshot that lacks one would stall
those proxies with no error anywhere. What each resource names is worked out once, when it is
encoded (`Resource.needs`), so checking a snapshot costs a dict lookup per reference.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from google.protobuf import any_pb2
from google.protobuf.message import Message

from . import wire
from .names import ENDPOINT, EXTENSION, PUSH_ORDER, ROUTE, SHORT_NAMES

Names = frozenset[str]

# A nonce is shared by every stream that receives the same response bytes; it only has to be
# unique per stream and type, and a global counter is. Hex keeps it short on the wire.
_nonces = itertools.count(1)


def next_nonce() -> str:
    return format(next(_nonces), "x")


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


Reference = tuple[str, str]  # (type URL, resource name)


def references(message: Message) -> tuple[Reference, ...]:
    """The resources of other types that `message` cannot work without.

    Only what Envoy fetches over ADS by name counts: an EDS cluster's assignment (clusters of
    type STATIC, STRICT_DNS or a custom type such as the aggregate carry their own hosts or
    name other clusters, not endpoints), the route configuration of an HTTP connection manager
    that uses RDS (an inline `route_config`, as sidecars' inbound listeners have, needs none),
    and the configuration of every filter fetched by name (`config_discovery`: ECDS).
    """
    if isinstance(message, cluster_pb2.Cluster):
        found: Iterable[Reference] = _cluster_references(message)
    elif isinstance(message, listener_pb2.Listener):
        found = _listener_references(message)
    else:
        return ()
    return tuple(dict.fromkeys(found))


def _cluster_references(cluster: cluster_pb2.Cluster) -> Iterator[Reference]:
    # `type` shares a oneof with `cluster_type`: an aggregate reads as STATIC, so ask the oneof.
    if (
        cluster.WhichOneof("cluster_discovery_type") == "type"
        and cluster.type == cluster_pb2.Cluster.EDS
    ):
        yield ENDPOINT, cluster.eds_cluster_config.service_name or cluster.name


def _listener_references(listener: listener_pb2.Listener) -> Iterator[Reference]:
    for listener_filter in listener.listener_filters:
        if listener_filter.HasField("config_discovery"):
            yield EXTENSION, listener_filter.name
    chains = list(listener.filter_chains)
    if listener.HasField("default_filter_chain"):
        chains.append(listener.default_filter_chain)
    for chain in chains:
        for network_filter in chain.filters:
            if network_filter.HasField("config_discovery"):
                yield EXTENSION, network_filter.name
            elif network_filter.typed_config.Is(hcm.HttpConnectionManager.DESCRIPTOR):
                manager = hcm.HttpConnectionManager()
                network_filter.typed_config.Unpack(manager)
                if manager.HasField("rds"):
                    yield ROUTE, manager.rds.route_config_name
                for http_filter in manager.http_filters:
                    if http_filter.HasField("config_discovery"):
                        yield EXTENSION, http_filter.name


@dataclass(frozen=True, slots=True)
class Resource:
    """One resource, encoded once. `version` is a content hash, so it survives control-plane
    restarts: a reconnecting Envoy that already has this content is not sent it again (Delta)."""

    name: str
    version: str
    message: Message = field(repr=False, compare=False)
    sotw_entry: bytes = field(repr=False)  # DiscoveryResponse.resources field
    delta_entry: bytes = field(repr=False)  # DeltaDiscoveryResponse.resources field
    needs: tuple[Reference, ...] = field(default=(), repr=False, compare=False)

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
            needs=references(message),
        )


class TypeSnapshot:
    """All resources of one type for one group, with memoised responses and diffs."""

    __slots__ = ("_counts", "_diffs", "_needs", "_responses", "resources", "type_url", "version")

    def __init__(self, type_url: str, resources: Mapping[str, Resource]) -> None:
        self.type_url = type_url
        self.resources = dict(sorted(resources.items()))
        self.version = _digest(
            b"\0".join(f"{n}\0{r.version}".encode() for n, r in self.resources.items())
        )
        self._diffs: dict[str, tuple[Names, Names]] = {}
        self._needs: dict[tuple[str, str], Names] = {}
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

    def needed_by_changes(self, older: TypeSnapshot, type_url: str) -> Names:
        """Names of `type_url` that the resources changed or added since `older` need (what a
        cluster update makes Envoy wait for again: see Handler.rewarm). Memoised like
        `diff_from`: every stream on `older` asks the same."""
        key = (older.version, type_url)
        found = self._needs.get(key)
        if found is None:
            changed, _removed = self.diff_from(older)
            found = frozenset(
                name for n in changed for kind, name in self.resources[n].needs if kind == type_url
            )
            if len(self._needs) > 64:
                self._needs.clear()
            self._needs[key] = found
        return found

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

# Missing resources: type URL -> name -> the resources that need it, as (type URL, name).
Missing = dict[str, dict[str, list[Reference]]]


class InconsistentSnapshot(Exception):
    """A snapshot names resources it does not hold; publishing it would stall its proxies."""

    LISTED = 10  # names shown per type; the rest are counted

    def __init__(self, group: str, missing: Missing) -> None:
        self.group = group
        self.missing = missing
        parts = []
        for type_url, names in sorted(missing.items()):
            shown = [
                f"{name} (needed by "
                + ", ".join(f"{SHORT_NAMES[t].removesuffix('s')} {n}" for t, n in users)
                + ")"
                for name, users in sorted(names.items())[: self.LISTED]
            ]
            if len(names) > self.LISTED:
                shown.append(f"and {len(names) - self.LISTED} more")
            parts.append(f"missing {SHORT_NAMES[type_url]}: " + ", ".join(shown))
        super().__init__(f"the configuration for {group} is inconsistent: " + "; ".join(parts))


@dataclass(frozen=True)
class Snapshot:
    group: str
    types: Mapping[str, TypeSnapshot]
    published_at: float = field(default_factory=time.monotonic, compare=False)
    _consistent: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def version(self) -> str:
        return _digest("".join(self.types[t].version for t in sorted(self.types)).encode())

    def type(self, type_url: str) -> TypeSnapshot:
        found = self.types.get(type_url)
        return found if found is not None else _empty(type_url)

    def missing(self) -> Missing:
        """What the snapshot's resources need and it does not hold (empty: consistent).

        Only presence is checked. go-control-plane also refuses resources that nothing needs;
        they are harmless (Envoy asks only for names it uses), so they pass here.
        """
        out: Missing = {}
        for type_url, ts in self.types.items():
            for resource in ts.resources.values():
                for needed_type, name in resource.needs:
                    if name not in self.type(needed_type).resources:
                        users = out.setdefault(needed_type, {}).setdefault(name, [])
                        users.append((type_url, resource.name))
        return out

    def consistent(self) -> None:
        """Raise InconsistentSnapshot unless every needed resource is here. The answer is kept:
        `prepare` pays for it off the event loop and `publish` then finds it."""
        if self._consistent:
            return
        missing = self.missing()
        if missing:
            raise InconsistentSnapshot(self.group, missing)
        object.__setattr__(self, "_consistent", True)


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
    that did not change since `previous`, so unchanged types keep their identity and version.
    Raises InconsistentSnapshot if a resource needs one the translation lacks."""
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
    snapshot = Snapshot(group=group, types=types)
    snapshot.consistent()
    return snapshot


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
        """Make `snapshot` current and wake the group's streams; False if nothing changed.
        Raises InconsistentSnapshot (and keeps the current one) if `snapshot` is not whole."""
        snapshot.consistent()
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
