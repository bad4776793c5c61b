"""The book of token budgets (a QoSPolicy's `tokens` limits): per (function, tenant) and calendar
window, the tokens generative requests used and those that requests still running hold.

One implementation, two keepers: the control plane's limit service keeps the mesh's book (every
backend of a function and every process of a backend spend the same budgets: xds/ledger.py),
and a backend run without a control plane keeps its own (per process). Pure book-keeping: no
clock, no I/O; what a request holds or is refused travels as plain dicts between the two.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .qos import TokenBudget, window_bounds

# (function, tenant) pairs kept, least recently used first out: a forgotten pair starts its
# windows again from nothing, as after a restart without the state file.
MAX_KEYS = 100_000

Key = tuple[str, str]  # (function, tenant)


@dataclass(slots=True)
class _Window:
    start: float
    used: int = 0  # tokens settled in this window
    reserved: int = 0  # tokens held by running requests


@dataclass(frozen=True, slots=True)
class Reservation:
    """Tokens held for one request: `reserved` in each window (window, its start) until it
    settles; `completion`, the most completion tokens they allow (None: as many as it asked);
    the tightest budget's `limit`, what is `remaining` of it after this reservation and the
    seconds until it `reset`s (x-ratelimit-*-tokens)."""

    reserved: int
    windows: tuple[tuple[str, float], ...]
    completion: int | None
    limit: int
    remaining: int
    reset: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Reservation:
        windows = tuple((str(w), float(s)) for w, s in data["windows"])
        return Reservation(
            int(data["reserved"]),
            windows,
            None if data["completion"] is None else int(data["completion"]),
            int(data["limit"]),
            int(data["remaining"]),
            int(data["reset"]),
        )


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A request refused: the budget of `window` (`quota` tokens) has `left`, it needs `need`;
    the window ends in `reset` seconds."""

    window: str
    quota: int
    left: int
    need: int
    reset: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Shortfall:
        return Shortfall(
            str(data["window"]),
            int(data["quota"]),
            int(data["left"]),
            int(data["need"]),
            int(data["reset"]),
        )


class TokenBook:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._entries: OrderedDict[Key, dict[str, _Window]] = OrderedDict()

    def _windows(self, key: Key) -> dict[str, _Window]:
        windows = self._entries.get(key)
        if windows is None:
            windows = self._entries[key] = {}
            while len(self._entries) > self.max_keys:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return windows

    def reserve(
        self,
        key: Key,
        budgets: Sequence[TokenBudget],
        prompt: int,
        max_tokens: int,
        reservation: Literal["full", "partial"],
        now: float,
    ) -> Reservation | Shortfall | None:
        """Hold a request's prompt plus max_tokens against every budget (`full`: refused
        unless each has that much left), or with `partial` as much of it as is left (the prompt
        and one completion token must fit). None: no budget applies."""
        if not budgets:
            return None
        windows = self._windows(key)
        lefts = []
        for budget in budgets:
            start, end = window_bounds(budget.per, now)
            use = windows.setdefault(budget.per, _Window(start))
            if use.start != start:  # a new window: what is held now counts in it
                use.start, use.used = start, 0
            lefts.append((budget.tokens - use.used - use.reserved, budget, end))
        want = prompt + max_tokens
        need = want if reservation == "full" else prompt + 1
        for left, budget, end in lefts:
            if left < need:
                reset = max(1, math.ceil(end - now))
                return Shortfall(budget.per, budget.tokens, max(0, left), need, reset)
        left, budget, end = min(lefts, key=lambda item: item[0])
        reserved = min(want, left)
        for b in budgets:
            windows[b.per].reserved += reserved
        return Reservation(
            reserved,
            tuple((b.per, windows[b.per].start) for b in budgets),
            None if reserved >= want else reserved - prompt,
            budget.tokens,
            max(0, left - reserved),
            max(1, math.ceil(end - now)),
        )

    def settle(
        self, key: Key, windows: Iterable[tuple[str, float]], reserved: int, used: int
    ) -> dict[str, int]:
        """A request that held `reserved` tokens ended having used `used` (prompt +
        completion, the model's own count; a cut stream: what it generated): its hold is
        released and its use charged. Returns the tokens used so far per window."""
        book = self._windows(key)
        out = {}
        for window, start in windows:
            use = book.get(window)
            if use is None:
                continue
            if use.start == start:  # else a new window began: the hold was already dropped
                use.reserved = max(0, use.reserved - reserved)
            use.used += used
            out[window] = use.used
        return out

    def usage(self, key: Key) -> dict[str, tuple[int, int]]:
        """window -> (used, reserved) of one (function, tenant)."""
        return {w: (u.used, u.reserved) for w, u in self._entries.get(key, {}).items()}

    def rows(self) -> list[tuple[str, str, str, float, int]]:
        """(function, tenant, window, start, used) of every window: what a restart keeps (what
        running requests hold is theirs to settle)."""
        return [
            (key[0], key[1], window, use.start, use.used)
            for key, windows in self._entries.items()
            for window, use in windows.items()
        ]

    def load(self, rows: Iterable[Sequence[Any]]) -> None:
        for function, tenant, window, start, used in rows:
            self._windows((str(function), str(tenant)))[str(window)] = _Window(
                float(start), int(used)
            )
