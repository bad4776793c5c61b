"""Child processes that must not outlive the process that started them.

A supervisor can be SIGKILLed (the chaos soak does it): without this its children would keep
serving, holding the port and the CPU, with nobody to stop them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """For `preexec_fn`: runs in the child between fork and exec. The kernel sends `sig` when the
    parent dies; a parent that died before the prctl took effect is caught by the ppid check."""
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


# With no hard limit on open files, the kernel's default fs.nr_open: no NOFILE limit exceeds it.
_NR_OPEN = 1 << 20


def open_files_limit() -> int:
    """This process's soft limit on open files (what the processes it starts inherit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _NR_OPEN if soft == resource.RLIM_INFINITY else soft


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit, which the processes it
    starts inherit (Envoy does not raise its own: at a usual soft limit of 1,024 a proxy runs
    out of descriptors at about a thousand connections, and then cannot open upstream ones
    either). A limit that cannot be raised stays as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _NR_OPEN if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


_MAX_CPUS = 8192  # the kernel's own limit (CONFIG_NR_CPUS)


def cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("1", "0-3,8", as taskset -c and cpuset.cpus write it), checked against
    the CPUs this process may run on (ValueError saying which are not)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (like 1 or 0-3,8)")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{part!r}: a range goes up (like 0-3)")
        if last >= _MAX_CPUS:
            raise ValueError(f"CPU {last} is beyond any this machine could have")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if missing := cpus - allowed:
        many = len(missing) > 1
        raise ValueError(
            f"CPU{'s' if many else ''} {cpu_list_text(missing)} {'are' if many else 'is'} not among "
            f"those this process may run on ({cpu_list_text(allowed)})"
        )
    return frozenset(cpus)


def cpu_list_text(cpus: set[int] | frozenset[int]) -> str:
    """`cpus` as a Linux CPU list, the inverse of `cpu_list` ({0, 1, 2, 5} -> "0-2,5")."""
    ranges: list[list[int]] = []  # [first, last] of each run
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def pinned(
    cpus: frozenset[int] | None, then: Callable[[], None] | None = None
) -> Callable[[], None] | None:
    """For `preexec_fn`: keep the child, and every thread it starts, on `cpus` (None: wherever
    the kernel puts it), then run `then`. On a small VM a thread woken on another vCPU waits
    for that vCPU to wake, tens of µs or more (docs/benchmarks.md#generative): a process whose
    threads hand work to each other runs faster on one CPU."""
    if cpus is None:
        return then

    def preexec() -> None:
        os.sched_setaffinity(0, cpus)
        if then is not None:
            then()

    return preexec
