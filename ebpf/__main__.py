"""`python -P -m meshfn.ebpf {attach,run,detach,status} --state-dir DIR`.

attach   attach and exit (the pins keep it attached); exit 1 with the reason if it cannot
run      attach, wait for SIGTERM/SIGINT, detach, exit 0
detach   detach whatever is attached for DIR (also after a crashed process); idempotent
status   the counters as JSON
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import cast

from .accelerator import MODES, AccelerationUnavailable, Accelerator, Mode, detach
from .egress import detach as detach_egress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -P -m meshfn.ebpf", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {
        "attach": "attach and exit; the pins keep it attached",
        "run": "attach, wait for SIGTERM/SIGINT, detach",
        "detach": "detach whatever is attached for --state-dir (also after a crash)",
        "status": "print the counters as JSON",
    }
    for name, text in helps.items():
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--state-dir", type=Path, default=Path(".meshfn"))
        if name in ("attach", "run"):
            cmd.add_argument("--mode", choices=[m for m in MODES if m != "off"], default="ebpf")
    args = parser.parse_args(argv)

    if args.command == "detach":
        # The egress cgroups may sit inside the acceleration cgroup: they go first.
        problems = detach_egress(args.state_dir) + detach(args.state_dir)
        for problem in problems:
            print(f"meshfn ebpf detach: {problem}", file=sys.stderr)
        return 1 if problems else 0
    accel = Accelerator(args.state_dir)
    if args.command == "status":
        print(json.dumps(accel.stats(), indent=2))
        return 0
    stop = threading.Event()
    if args.command == "run":  # handlers first: a SIGTERM during setup still detaches
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        status = accel.setup(cast(Mode, args.mode))
    except AccelerationUnavailable as exc:
        print(f"meshfn ebpf: acceleration unavailable: {exc}", file=sys.stderr)
        return 1
    print(status.line(), flush=True)
    if args.command == "attach" or not status.attached:
        return 0 if status.attached else 1
    try:
        while not stop.wait(0.2):
            pass
    finally:
        problems = accel.shutdown()
    for problem in problems:
        print(f"meshfn ebpf: detach: {problem}", file=sys.stderr)
    print("meshfn ebpf: detached", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
