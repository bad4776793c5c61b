"""Child processes that must not outlive the process that started them.

A supervisor can be SIGKILLed (the chaos soak does it): without this its children would keep
serving, holding the port and the CPU, with nobody to stop them.
"""

from __future__ import annotations

import ctypes
import os
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
