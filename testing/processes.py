"""The process rig of tests and benchmarks: real processes on loopback, each tracked by PID,
its output in a log file, stopped by PID (also when a test or benchmark fails)."""

from __future__ import annotations

import contextlib
import http.client
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .ports import ADDRESS_IN_USE, PortInUse

BIN = Path(sys.executable).parent
MESHFN = str(BIN / "meshfn")
T = TypeVar("T")


def meshfn(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the meshfn CLI (`env`: variables to add); the caller checks returncode and output."""
    return subprocess.run(
        [MESHFN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **env} if env else None,
    )


def issue_token(state: Path, sub: str, tenant: str | None = None, ttl: str | None = None) -> str:
    """A token of the mesh in `state` (audience meshfn) for `sub`, with a `tenant` claim."""
    claim = ["--claim", f"tenant={tenant}"] if tenant is not None else []
    more = ["--ttl", ttl] if ttl is not None else []
    out = meshfn(
        "token", "issue", "--state-dir", str(state), "--sub", sub, "--aud", "meshfn",
        *claim, *more,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"meshfn token issue: {out.stderr}")
    return out.stdout.strip()


def up_with_functions(policies: Path, state: Path, registry: Path) -> list[str]:
    """`meshfn up` on `policies` with the example functions published to `registry` (one Envoy
    worker each: the machine has two cores)."""
    return [
        MESHFN, "up", "--policies", str(policies), "--state-dir", str(state),
        "--functions-registry", str(registry), "--publish-examples", "--envoy-concurrency", "1",
    ]  # fmt: skip


def upstream_argv(service: str, port: int, *extra: str) -> list[str]:
    """meshfn's echo upstream (answers with its service, endpoint and locality)."""
    module = [sys.executable, "-P", "-m", "meshfn.control_plane.runtime.upstream"]
    return [*module, "--service", service, "--port", str(port), *extra]


def pin(pid: int, cpu: int) -> None:
    """Pin a just-started process (and the threads it starts later) to one CPU, so a server and
    the load that drives it do not steal each other's core (a no-op without that CPU)."""
    if cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(pid, {cpu})


def alive(pid: int) -> bool:
    """Running: not gone and not a zombie waiting for its parent's reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on: its socket descriptors' inodes, looked up in
    its network namespace's /proc/net/tcp{,6} (state 0A: LISTEN)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@dataclass
class Proc:
    """A subprocess we own; `stop()` is idempotent and verifies the process is gone.

    `pipe`: stdin and stdout are text pipes (for processes driven line by line); stderr
    still goes to the log."""

    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    preexec: Callable[[], None] | None = None
    pipe: bool = False
    popen: subprocess.Popen[Any] | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE if self.pipe else None,
                stdout=subprocess.PIPE if self.pipe else out,
                stderr=out if self.pipe else subprocess.STDOUT,
                text=self.pipe,
                env=self.env,
                start_new_session=True,
                preexec_fn=self.preexec,  # noqa: PLW1509 (callers pass fork-safe functions)
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def send(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def wait(self, timeout: float = 20.0) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def poll(self) -> int | None:
        assert self.popen is not None
        return self.popen.poll()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"{self.argv[:2]} ignored signal {sig}; killed") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def check_running(self) -> None:
        """Raise if the process has exited: PortInUse when it says a port was taken (so
        `ports.retry_on_port_clash` can start it again on new ports), else AssertionError."""
        code = self.poll()
        if code is None:
            return
        output = self.output()
        if ADDRESS_IN_USE in output.lower():
            raise PortInUse(f"{self.argv[0]} exited {code}")
        raise AssertionError(f"{self.argv[:2]} exited {code}:\n{output[-5000:]}")


class Processes:
    """Every process a test or benchmark starts, logs under `tmp/logs/NAME.log`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[Proc] = []

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
        pipe: bool = False,
    ) -> Proc:
        proc = Proc(argv, self.tmp / "logs" / f"{name}.log", env, preexec, pipe).start()
        self.started.append(proc)
        return proc

    def upstream(self, name: str, service: str, port: int, *extra: str) -> Proc:
        return self.start(name, upstream_argv(service, port, *extra))

    def stop_all(self) -> None:
        """Newest first; every process is stopped even when one of them misbehaves (the first
        such error is raised afterwards)."""
        failure: AssertionError | None = None
        for proc in reversed(self.started):
            try:
                proc.stop()
            except AssertionError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 15.0,
    every: float = 0.02,
    proc: Proc | None = None,
) -> T:
    """Poll `probe` until it returns something truthy; connection errors and missing keys
    count as "not yet". With `proc`, fail as soon as that process has exited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None:
            proc.check_running()
        try:
            result = probe()
        except PortInUse:
            raise
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            last = exc
            result = None
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric `name` in a Prometheus text exposition whose labels
    include `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        named = line.startswith(name + "{") or line.startswith(name + " ")
        if named and all(w in line for w in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """A probe for `wait_for`: `url` answers 200."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return bool(reply.status == 200)


def http_status(url: str, headers: dict[str, str] | None = None, timeout: float = 1.0) -> int:
    """The status of one GET of `url` (any status, 4xx and 5xx included)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


class CpuSplit:
    """Where the CPU went while it was running: each descendant process of `root` (labelled by
    its program and last argument naming a file or port), `root` itself, this process's
    waited-for children (e.g. load generators), and the whole machine's busy share."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.started = self._sample()

    def _sample(self) -> tuple[dict[int, tuple[str, int]], float, list[int]]:
        pids = {self.root: "root", **descendants(self.root)}
        cpu = {}
        for pid, label in pids.items():
            with contextlib.suppress(OSError):
                cpu[pid] = (label, cpu_ns(pid))
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:8]]
        return cpu, children.ru_utime + children.ru_stime, ticks

    def result(self) -> dict[str, Any]:
        (before, kids_before, ticks_before), (after, kids_after, ticks_after) = (
            self.started,
            self._sample(),
        )
        by_label: dict[str, float] = {}
        for pid, (label, ns) in after.items():
            spent = (ns - before[pid][1]) / 1e9 if pid in before else ns / 1e9
            by_label[f"{label} [{pid}]"] = round(spent, 3)
        ticks = [b - a for a, b in zip(ticks_before, ticks_after, strict=True)]
        idle = ticks[3] + ticks[4]
        return {
            "cpu_seconds": dict(sorted(by_label.items(), key=lambda kv: -kv[1])),
            "waited_children_cpu_seconds": round(kids_after - kids_before, 3),
            "machine_busy_pct": round(100 * (sum(ticks) - idle) / max(1, sum(ticks)), 1),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        }


def descendants(root: int) -> dict[int, str]:
    """Every process below `root` (one pass over /proc), labelled by its program and the last
    argument naming a file or port."""
    parents: dict[int, list[int]] = {}
    labels: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        named = [w for w in words if w.endswith((".json", ".yaml")) or w.isdigit()]
        program = Path(words[0]).name if words else "?"
        if program.startswith("python") and "-m" in words:
            program = words[words.index("-m") + 1]
        labels[int(entry.name)] = f"{program} {Path(named[0]).name if named else ''}".strip()
        parents.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, str] = {}
    stack = [root]
    while stack:
        for child in parents.get(stack.pop(), []):
            found[child] = labels[child]
            stack.append(child)
    return found


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` in ns (schedstat's run time, not /proc/stat's 10 ms
    ticks: a benchmark's per-request figure is a few microseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited
    return total
