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
