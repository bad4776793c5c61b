"""Process supervision: readiness, restart with backoff, SIGTERM then SIGKILL, and children that
die with their parent even when the parent is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshfn.common.processes import cpu_list, pinned
from meshfn.control_plane.runtime.process import ProcessFailed, SupervisedProcess
from meshfn.testing.processes import alive, meshfn


def python(code: str) -> list[str]:
    return [sys.executable, "-P", "-c", code]


def marker_ready(path: Path) -> object:
    async def ready() -> bool:
        return path.exists() and "ready" in path.read_text()

    return ready


async def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = SupervisedProcess(
        "stubborn",
        python(
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"
        ),
        log,
        ready=marker_ready(log),  # type: ignore[arg-type]
    )
    await proc.start()
    pid = proc.pid
    assert pid is not None and alive(pid)
    started = time.monotonic()
    await proc.stop(timeout=0.5)
    elapsed = time.monotonic() - started
    # SIGTERM is ignored, so only the SIGKILL after the 0.5 s grace ends it: not before the
    # grace (a slow machine only makes it later), and within a functional deadline with a wide
    # margin (10x the grace; without the escalation the child sleeps its 60 s).
    assert 0.5 <= elapsed < 5, elapsed
    assert not alive(pid)


async def test_crashing_child_is_restarted_with_backoff(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = SupervisedProcess(
        "crasher",
        python("import time; print('ready', flush=True); time.sleep(0.2); raise SystemExit(3)"),
        log,
        ready=marker_ready(log),  # type: ignore[arg-type]
    )
    await proc.start()
    first = proc.pid
    deadline = time.monotonic() + 10
    while proc.restarts < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert proc.restarts >= 2
    assert proc.pid != first
    await proc.stop()
    assert proc.pid is None


async def test_a_child_that_never_gets_ready_fails_clearly(tmp_path: Path) -> None:
    async def never() -> bool:
        return False

    proc = SupervisedProcess(
        "slow", python("import time; time.sleep(30)"), tmp_path / "l", never, ready_timeout=0.5
    )
    with pytest.raises(ProcessFailed, match="was not ready after"):
        await proc.start()
    await proc.stop()
    proc2 = SupervisedProcess("dies", python("raise SystemExit(7)"), tmp_path / "l2", never)
    with pytest.raises(ProcessFailed, match="exited with code 7 before it was ready"):
        await proc2.start()


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from meshfn.control_plane.runtime.process import SupervisedProcess\n"
        "async def main():\n"
        f"    p = SupervisedProcess('sleeper', [sys.executable, '-c', 'import time; time.sleep(60)'], Path({str(tmp_path / 'c.log')!r}))\n"
        "    await p.start()\n"
        "    print(p.pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-P", str(script)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(child), "the child outlived its SIGKILLed parent"


def test_cpu_lists_parse_as_taskset_writes_them_and_name_what_is_wrong() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    first, last = allowed[0], allowed[-1]
    assert cpu_list(str(first)) == {first}
    if allowed == list(range(first, last + 1)):  # a range of CPUs this process may use
        assert cpu_list(f"{first}-{last}") == set(allowed)
    assert cpu_list(f"{first},{last}") == {first, last}
    for bad, says in [
        ("", "not a CPU list"),
        ("one", "not a CPU list"),
        ("1-", "not a CPU list"),
        ("-1", "not a CPU list"),
        ("0,,1", "not a CPU list"),
        ("3-1", "a range goes up"),
        ("0-99999999", "beyond any this machine could have"),  # refused before it is expanded
        (str(last + 1), f"CPU {last + 1} is not among those this process may run on"),
    ]:
        with pytest.raises(ValueError, match=says):
            cpu_list(bad)


async def test_a_pinned_child_and_every_thread_it_starts_stay_on_its_cpus(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    log = tmp_path / "child.log"
    ran = tmp_path / "then"
    proc = SupervisedProcess(
        "pinned",
        python(
            "import os, threading, time\n"
            "t = threading.Thread(target=time.sleep, args=(60,), daemon=True); t.start()\n"
            "print('ready', sorted(os.sched_getaffinity(0)), flush=True); time.sleep(60)"
        ),
        log,
        ready=marker_ready(log),  # type: ignore[arg-type]
        preexec=pinned(frozenset({cpu}), lambda: ran.write_text("ran")),
    )
    await proc.start()
    try:
        assert proc.pid is not None
        threads = os.listdir(f"/proc/{proc.pid}/task")
        assert len(threads) == 2
        assert all(os.sched_getaffinity(int(t)) == {cpu} for t in threads)
        assert ran.read_text() == "ran"  # the preexec it was given runs after
    finally:
        await proc.stop()
    assert pinned(None, None) is None  # unplaced: nothing to run in the child


def test_up_refuses_a_bad_cpu_list_before_it_starts_anything(tmp_path: Path) -> None:
    beyond = str(max(os.sched_getaffinity(0)) + 1)
    for flag, value, says in [
        ("--proxy-cpus", "0-", "--proxy-cpus: '0-' is not a CPU list"),
        ("--backend-cpus", beyond, f"--backend-cpus: CPU {beyond} is not among those"),
    ]:
        state = tmp_path / flag.strip("-")
        run = meshfn("up", "--policies", str(tmp_path), "--state-dir", str(state), flag, value)
        assert run.returncode == 1 and says in run.stderr, run.stderr
        assert not state.exists()  # refused before the state directory was made
