"""eBPF socket redirection between Envoy and its backends (sock_ops + sk_msg, loaded with bcc).

accel = Accelerator(state_dir)
status = accel.setup("auto")        # never raises in "auto"; status.reason says why it is off
Popen(..., preexec_fn=accel.child_preexec())   # or accel.add_pid(pid)
accel.stats()                       # {"messages_redirected": ..., "sockets_in_map": ...}
accel.shutdown()                    # idempotent; `python -P -m meshfn.ebpf detach` after a crash
"""

from .accelerator import (
    MODES,
    STATS_KEYS,
    AccelerationStatus,
    AccelerationUnavailable,
    Accelerator,
    Mode,
    cgroup_name,
    detach,
)
from .host import Host, Unavailable

__all__ = [
    "MODES",
    "STATS_KEYS",
    "AccelerationStatus",
    "AccelerationUnavailable",
    "Accelerator",
    "Host",
    "Mode",
    "Unavailable",
    "cgroup_name",
    "detach",
]
