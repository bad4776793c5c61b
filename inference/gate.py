"""The worker threads, handed out by priority (dispatch.py, batching.py).

A guest call that does not run on the event loop waits here for a worker thread instead of in
the thread pool's FIFO queue, so that at saturation a QoSPolicy's higher classes are called
first (Triton's priority levels). Priorities are a function's own (its policy's classes):
waiters of one function are served highest priority first, oldest first within a priority;
between functions the order is first come, first served, because two policies' priority
numbers mean nothing to each other. The pool never holds more queued calls than it has
threads, so the order decided here is the order they run in.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from typing import Any

_Waiter = tuple[int, int, "asyncio.Future[None]"]  # (-priority, arrival, handed a thread)


class WorkerGate:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.busy = 0
        # one heap of waiters per function, and the functions in the order their waiters came
        self._waiting: dict[Any, list[_Waiter]] = {}
        self._arrivals: deque[Any] = deque()
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for heap in self._waiting.values() for w in heap if not w[2].done())

    @property
    def contended(self) -> bool:
        """Whether a call waits for a thread (read off the event loop too: a decode loop on a
        worker thread gives its thread back when another call wants one)."""
        return bool(self._arrivals)

    async def acquire(self, owner: Any, priority: int, timeout: float | None) -> None:
        """A worker thread for one call of `owner` (a function); TimeoutError after `timeout`
        seconds without one (None: no bound). The caller must `release` it after the call."""
        if self.busy < self.slots and not self._arrivals:
            self.busy += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting.setdefault(owner, []), (-priority, next(self._seq), future))
        self._arrivals.append(owner)
        try:
            await asyncio.wait_for(future, timeout)
        except BaseException:
            if future.done() and not future.cancelled():
                self.release()  # a thread was handed over as this waiter gave up: pass it on
            else:
                future.cancel()  # left in its heap, skipped when reached
            raise

    def release(self) -> None:
        """A call is done with its thread: hand it to the next waiter, or free it."""
        while self._arrivals:
            owner = self._arrivals.popleft()
            heap = self._waiting.get(owner)
            while heap:
                _, _, future = heapq.heappop(heap)
                if not future.done():
                    future.set_result(None)  # the thread changes hands: busy stays the same
                    if not heap:
                        del self._waiting[owner]
                    return
            self._waiting.pop(owner, None)
        self.busy -= 1
