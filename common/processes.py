"""Child processes that must not outlive the process that started them.

A supervisor can be SIGKILLed (the chaos soak does it): without this its children would keep
serving, holding the port and the CPU, with nobody to stop them.
"""

from __future__ import annotations

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


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, which the processes it
    starts inherit (Envoy does not raise its own: at a usual soft limit of 1,024 a proxy runs
    out of descriptors at about a thousand connections, and then cannot open upstream ones
    either). Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # with no hard limit, the kernel's default fs.nr_open (a NOFILE limit cannot exceed it)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft
        return target
    return target if soft == resource.RLIM_INFINITY else soft
