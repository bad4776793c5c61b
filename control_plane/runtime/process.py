"""Supervised child processes: start, wait until ready, restart with backoff, stop by PID.

Children die with us even if we are SIGKILLed (PR_SET_PDEATHSIG), and run in their own process
group so a terminal's Ctrl-C reaches only meshfn, which then stops them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp

from meshfn.common.processes import die_with_parent

log = logging.getLogger("meshfn.runtime")


class ProcessFailed(RuntimeError):
    pass


ReadyCheck = Callable[[], Awaitable[bool]]


class SupervisedProcess:
    """One child process kept alive until `stop()`.

    Restarts use exponential backoff (0.25 s doubling to 30 s), reset once the child has stayed up
    for a minute, so a crash loop neither spins the CPU nor delays recovery from a one-off crash.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        ready: ReadyCheck | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 15.0,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.ready = ready
        self.env = env
        self.ready_timeout = ready_timeout
        self.preexec = preexec  # more to do in the child before exec (e.g. join a cgroup)
        self.restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._started_at = 0.0

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    async def start(self) -> None:
        """Spawn and wait until ready; then keep it alive in the background."""
        await self._spawn()
        await self._wait_ready()
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.name}")

    async def _spawn(self) -> None:
        # Owner-only: a log may hold what a process was told (Envoy at debug logs headers).
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                env=self.env,
                start_new_session=True,
                preexec_fn=self._in_child,
            )
        finally:
            os.close(log_fd)
        self._started_at = time.monotonic()
        log.info("started %s (pid %d)", self.name, self._proc.pid)

    def _in_child(self) -> None:  # between fork and exec: plain syscalls only
        die_with_parent()
        if self.preexec is not None:
            self.preexec()

    async def _wait_ready(self) -> None:
        if self.ready is None:
            return
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is None or proc.returncode is not None:
                raise ProcessFailed(
                    f"{self.name} exited with code {proc.returncode if proc else '?'} before it "
                    f"was ready; see {self.log_path}"
                )
            with contextlib.suppress(OSError, asyncio.TimeoutError, aiohttp.ClientError):
                if await self.ready():
                    return
            await asyncio.sleep(0.02)
        raise ProcessFailed(
            f"{self.name} was not ready after {self.ready_timeout:.0f}s; see {self.log_path}"
        )

    async def _supervise(self) -> None:
        backoff = 0.25
        while not self._stopping:
            proc = self._proc
            assert proc is not None
            code = await proc.wait()
            if self._stopping:
                return
            if time.monotonic() - self._started_at > 60:
                backoff = 0.25
            log.warning(
                "%s (pid %d) exited with code %s; restarting in %.2fs",
                self.name,
                proc.pid,
                code,
                backoff,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
            if self._stopping:
                return
            try:
                await self._spawn()
                self.restarts += 1
                await self._wait_ready()
            except (OSError, ProcessFailed) as exc:
                log.error("restarting %s failed: %s", self.name, exc)

    async def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; returns once the child is reaped."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            log.warning("%s (pid %d) ignored SIGTERM; killing it", self.name, proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
