"""eBPF socket redirection between Envoy and its backends (sock_ops + sk_msg, loaded with bcc).

accel = Accelerator(state_dir)
status = accel.setup("auto")        # never raises in "auto"; status.reason says why it is off
Popen(..., preexec_fn=accel.child_preexec())   # or accel.add_pid(pid)
accel.stats()                       # {"messages_redirected": ..., "sockets_in_map": ...}
accel.shutdown()                    # idempotent; `python -P -m meshfn.ebpf detach` after a crash

and the inference backends' egress control (egress.py): EgressControl(state_dir, parent).
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
from .egress import Denial, EgressControl, EgressStatus, EgressUnavailable
from .egress import detach as detach_egress
from .host import Host, Unavailable

__all__ = [
    "MODES",
    "STATS_KEYS",
    "AccelerationStatus",
    "AccelerationUnavailable",
    "Accelerator",
    "Denial",
    "EgressControl",
    "EgressStatus",
    "EgressUnavailable",
    "Host",
    "Mode",
    "Unavailable",
    "cgroup_name",
    "detach",
    "detach_egress",
]
