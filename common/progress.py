"""Progress of long work (function builds, filter builds), reported as events by the code that
does the work and drawn by the command that started it.

Builders take a `Reporter` and never print: the inference backend's builds and the control
plane's filter builds share this one vocabulary without importing each other. `RichReporter`
draws bars on a terminal, plain lines elsewhere (log files get no escape codes), and ends with
one line saying what was built and what came from the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class Reporter(Protocol):
    def begin(self, item: str, steps: int) -> None:
        """`item` (a function, a filter module) starts; it takes up to `steps` steps."""

    def step(self, item: str, what: str) -> None:
        """`item` moves on to `what` (e.g. "componentize-py")."""

    def finish(self, item: str, cached: bool) -> None:
        """`item` is done; `cached`: nothing had to be built."""


class NullReporter:
    def begin(self, item: str, steps: int) -> None:
        pass

    def step(self, item: str, what: str) -> None:
        pass

    def finish(self, item: str, cached: bool) -> None:
        pass


NULL = NullReporter()


@dataclass
class Summary:
    """What a run of builds did, for its final line."""

    built: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)

    def line(self, what: str, seconds: float) -> str:
        if not self.built:
            return f"{what}: all {len(self.cached)} cached ({', '.join(self.cached)})"
        cached = f"; cached: {', '.join(self.cached)}" if self.cached else "; nothing was cached"
        return f"{what}: built {', '.join(self.built)} in {seconds:.1f} s{cached}"


class RichReporter:
    """Bars on a terminal; one plain line per step otherwise. Use as a context manager: leaving
    it prints the summary line (`what`: built ..., cached ...)."""

    def __init__(self, console: Console, what: str) -> None:
        self.console = console
        self.what = what
        self.summary = Summary()
        self._started = time.monotonic()
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._totals: dict[str, int] = {}

    def __enter__(self) -> RichReporter:
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("{task.fields[item]}", markup=False),
                BarColumn(),
                TextColumn("{task.fields[what]}", markup=False),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
        if exc[0] is None and (self.summary.built or self.summary.cached):
            seconds = time.monotonic() - self._started
            self.console.print(self.summary.line(self.what, seconds), markup=False, highlight=False)

    def begin(self, item: str, steps: int) -> None:
        self._totals[item] = steps
        if self._progress is not None:
            self._tasks[item] = self._progress.add_task(item, total=steps, item=item, what="")

    def step(self, item: str, what: str) -> None:
        if self._progress is not None and item in self._tasks:
            self._progress.update(self._tasks[item], advance=1, what=what)
        else:
            self.console.print(
                f"{escape(self.what)}: {escape(item)}: {escape(what)}", highlight=False
            )

    def finish(self, item: str, cached: bool) -> None:
        (self.summary.cached if cached else self.summary.built).append(item)
        if self._progress is not None and item in self._tasks:
            self._progress.update(
                self._tasks[item], completed=self._totals[item], what="cached" if cached else "done"
            )
