"""Watch a policy directory for finished changes, with inotify on the event loop.

Why not poll or debounce: a policy edit should reach Envoy in a few milliseconds. inotify tells us
when a file is *complete* (IN_CLOSE_WRITE after a write, IN_MOVED_TO after an atomic rename), so
there is no half-written file to debounce, and events arrive on the loop without a thread hop.
Where inotify is unavailable (not Linux, or the per-user watch limit is exhausted) we say so and
fall back to watchfiles' polling-capable watcher, which batches changes over 10 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

log = logging.getLogger("meshfn.watch")

IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

_MASK = (
    IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
_EVENT = struct.Struct("iIII")

OnChange = Callable[[], Awaitable[None]]


class InotifyUnavailable(OSError):
    pass


class Inotify:
    """A recursive inotify watch on one directory tree; `changed` is set on relevant events."""

    def __init__(self, root: Path, relevant: Callable[[str], bool]) -> None:
        self.root = root
        self.relevant = relevant
        libc_name = ctypes.util.find_library("c")
        if libc_name is None:
            raise InotifyUnavailable("no C library found")
        self._libc = ctypes.CDLL(libc_name, use_errno=True)
        if not hasattr(self._libc, "inotify_init1"):
            raise InotifyUnavailable("this platform has no inotify")
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise InotifyUnavailable(os.strerror(ctypes.get_errno()))
        self.fd = fd
        self._dirs: dict[int, Path] = {}
        self.changed = asyncio.Event()
        self._add_tree(root)

    def _add(self, path: Path) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), _MASK)
        if wd < 0:
            code = ctypes.get_errno()
            if code == errno.ENOSPC:
                raise InotifyUnavailable(
                    "the inotify watch limit is exhausted (fs.inotify.max_user_watches)"
                )
            raise InotifyUnavailable(f"cannot watch {path}: {os.strerror(code)}")
        self._dirs[wd] = path

    def _add_tree(self, top: Path) -> None:
        self._add(top)
        for dirpath, dirnames, _ in os.walk(top):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in dirnames:
                self._add(Path(dirpath) / name)

    def read(self) -> None:
        """Drain the inotify fd (called by the loop when readable)."""
        relevant = False
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
                offset += _EVENT.size + length
                name = raw.rstrip(b"\0").decode(errors="replace")
                directory = self._dirs.get(wd)
                if mask & IN_Q_OVERFLOW:
                    relevant = True  # events were lost: reload to be safe
                elif mask & IN_IGNORED:
                    self._dirs.pop(wd, None)
                elif mask & IN_ISDIR:
                    if directory is not None and not name.startswith("."):
                        relevant = True
                        if mask & (IN_CREATE | IN_MOVED_TO):
                            with contextlib.suppress(OSError):
                                self._add_tree(directory / name)
                elif mask & (IN_DELETE_SELF | IN_MOVE_SELF) or self.relevant(name):
                    relevant = True
        if relevant:
            self.changed.set()

    def close(self) -> None:
        os.close(self.fd)


async def watch_directory(
    root: Path,
    relevant: Callable[[str], bool],
    on_change: OnChange,
    stop: asyncio.Event,
    ready: asyncio.Event,
) -> None:
    """Call `on_change()` after every batch of relevant changes until `stop` is set.

    Changes that arrive while `on_change` runs fold into one more call. `on_change()` also runs
    once as soon as the watch exists, to catch up on anything changed before; `ready` is set then.
    """
    try:
        watcher = Inotify(root, relevant)
    except InotifyUnavailable as exc:
        log.warning("inotify unavailable (%s): watching %s with watchfiles instead", exc, root)
        await _watch_with_watchfiles(root, relevant, on_change, stop, ready)
        return
    loop = asyncio.get_running_loop()
    loop.add_reader(watcher.fd, watcher.read)
    # `stop` also wakes the loop below, so waiting needs no extra tasks per change.
    stopper = asyncio.ensure_future(_forward(stop, watcher.changed))
    ready.set()
    try:
        await on_change()
        while True:
            await watcher.changed.wait()
            if stop.is_set():
                break
            watcher.changed.clear()
            await on_change()
    finally:
        stopper.cancel()
        loop.remove_reader(watcher.fd)
        watcher.close()


async def _forward(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def _watch_with_watchfiles(
    root: Path,
    relevant: Callable[[str], bool],
    on_change: OnChange,
    stop: asyncio.Event,
    ready: asyncio.Event,
) -> None:
    import watchfiles

    caught_up = False
    async for changes in watchfiles.awatch(
        root,
        watch_filter=lambda _change, path: relevant(Path(path).name),
        debounce=200,
        step=10,
        stop_event=stop,
        rust_timeout=250,
        yield_on_timeout=True,
    ):
        # The first wake-up (a timeout) proves the watch exists: catch up once then.
        if changes or not caught_up:
            caught_up = True
            ready.set()
            await on_change()
