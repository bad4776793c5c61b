"""Deserialized code shared by a backend process's functions and kept after they let it go.

A function holds its artifact's code while it is loaded (its codeTtl); once no function holds
it, the code stays here for `codeCache.ttl` (at most `maxEntries` such entries, least recently
released first out; all of them at once under memory pressure, after the warm instances). A
request after the TTLs then only instantiates: deserializing a Python guest is ~2.8 ms of its
~7 ms cold start (bench/coldstart.py). Functions serving one artifact share one entry.

An entry is keyed by the `.cwasm` path and the file identity its function verified (registry.py:
device, inode, size, mtime, ctime), which `FunctionRuntime` re-checks right before it asks:
code deserialized from a file that was replaced or rewritten since is never handed out again,
its key no longer matches. Thread model: `acquire` and `release` run on worker threads, one
load per entry at a time (a second function asking for it meanwhile waits for that load).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import wasmtime
from wasmtime import component as wc

from meshfn.contracts.function import CodeCache as CodeCacheSettings

from .host import Artifact, Kind, component_linker, load_precompiled
from .metrics import Metrics
from .registry import FileIdentity

CodeKey = tuple[Kind, Path, FileIdentity]


@dataclass(eq=False, slots=True)
class _Entry:
    holders: int = 0
    artifact: Artifact | None = None
    loading: threading.Lock = field(default_factory=threading.Lock)


class CodeCache:
    def __init__(
        self,
        engine: wasmtime.Engine,
        metrics: Metrics,
        settings: CodeCacheSettings | None = None,
        linker: wc.Linker | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings or CodeCacheSettings()
        # Shared by every component loaded here (see host.component_linker); made on first need.
        self.linker = linker
        self._lock = threading.Lock()
        self._entries: dict[CodeKey, _Entry] = {}
        self._free: OrderedDict[CodeKey, float] = OrderedDict()  # unheld: key -> released at
        self._lookups = metrics.code_cache_lookups
        metrics.code_cache_entries.labels("held").set_function(lambda: self.held)
        metrics.code_cache_entries.labels("free").set_function(lambda: len(self._free))

    @property
    def held(self) -> int:
        return len(self._entries) - len(self._free)

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(
        self, key: CodeKey, label: str, timing: list[int] | None = None
    ) -> tuple[Artifact, bool]:
        """The code for `key` (the caller verified its identity just now), and whether it was
        already deserialized; the caller holds it until `release(key)`. Raises what loading
        raises (WasmtimeError for an artifact of another engine), holding nothing then.
        `timing` gets when the lookup ended and when the code was deserialized (perf_counter_ns;
        the same on a hit): the cold start's spans (tracing.py)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            entry.holders += 1
            self._free.pop(key, None)
        try:
            with entry.loading:
                hit = entry.artifact is not None
                looked_up = time.perf_counter_ns() if timing is not None else 0
                if entry.artifact is None:
                    kind, cwasm, _ = key
                    if kind == "python" and self.linker is None:
                        self.linker = component_linker(self.engine)
                    entry.artifact = load_precompiled(self.engine, kind, cwasm, self.linker)
                artifact = entry.artifact
                if timing is not None:
                    timing += (looked_up, looked_up if hit else time.perf_counter_ns())
        except BaseException:
            self.release(key)
            raise
        self._lookups.labels(label, "hit" if hit else "miss").inc()
        return artifact, hit

    def release(self, key: CodeKey, keep: bool = True) -> None:
        """One holder of `key` let it go: the last one leaves it to the TTL and the size cap
        (`keep=False`: drop it now, see FunctionRuntime.unload)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.holders <= 0:
                raise RuntimeError(f"code cache: {key[1].name} released more often than acquired")
            entry.holders -= 1
            if entry.holders:
                return
            if (
                not keep
                or entry.artifact is None
                or not self.settings.maxEntries
                or not self._ttl()
            ):
                del self._entries[key]
                return
            self._free[key] = time.monotonic()
            while len(self._free) > self.settings.maxEntries:
                oldest, _ = self._free.popitem(last=False)
                del self._entries[oldest]

    def _ttl(self) -> float:
        return self.settings.ttl.total_seconds()

    def expire(self, now: float | None = None) -> int:
        """Drop the entries no function held for the TTL (the reaper); how many went."""
        now = time.monotonic() if now is None else now
        ttl = self._ttl()
        with self._lock:
            return self._drop([k for k, released in self._free.items() if now - released >= ttl])

    def drop_free(self) -> int:
        """Memory pressure: drop every entry no function holds; how many went."""
        with self._lock:
            return self._drop(list(self._free))

    def _drop(self, keys: list[CodeKey]) -> int:
        """Forget free entries (caller holds `_lock`)."""
        for key in keys:
            del self._free[key]
            del self._entries[key]
        return len(keys)
