"""The bcc child of loader.load_in_child: C text on stdin, the bpffs directory as argument,
then the program set: `acceleration` (programs.py, the default) or `egress` (egress_programs.py).

Kept out of the package's imports so that `python -m` runs it without a second copy; the only
module that imports bcc (untyped, hence `Any`).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import bpfsys, egress_programs, programs


def child_main(bpffs: Path, text: str, plan: str = "acceleration") -> int:
    """The child: compile the C text, load, pin into `bpffs`; prints one JSON line."""

    def reply(ok: bool, stage: str = "", reason: str = "", skipped: list[str] | None = None) -> int:
        out = {"ok": ok, "stage": stage, "reason": reason, "skipped": skipped or []}
        print(json.dumps(out), flush=True)
        return 0

    try:
        bcc: Any = importlib.import_module("bcc")
        libbcc: Any = importlib.import_module("bcc.libbcc")
    except ImportError as exc:
        return reply(False, "import", f"bcc is not importable ({exc}); run ebpf/setup_host.sh")
    try:
        module = bcc.BPF(text=text.encode())
    except Exception as exc:
        return reply(False, "compile", str(exc))
    if plan == "egress":
        return _egress(bcc, libbcc, module, bpffs, reply)
    fds: dict[str, int] = {}
    try:
        fds[programs.PIN_SOCK_OPS] = module.load_func(
            programs.FN_SOCK_OPS.encode(), bcc.BPF.SOCK_OPS
        ).fd
        fds[programs.PIN_SK_MSG] = module.load_func(programs.FN_SK_MSG.encode(), bcc.BPF.SK_MSG).fd
    except Exception as exc:
        return reply(False, "verify", _bcc_reason(exc))
    for pin, name in (
        (programs.PIN_SOCKS, programs.MAP_SOCKS),
        (programs.PIN_COUNTERS, programs.MAP_COUNTERS),
        (programs.PIN_CONFIG, programs.MAP_CONFIG),
        (programs.PIN_TCP_PATH, programs.MAP_TCP_PATH),
        (programs.PIN_CLIENTS, programs.MAP_CLIENTS),
    ):
        # bcc 0.26 cannot wrap a sockhash ("Unknown table type 18"): ask libbcc for the fd.
        fd = int(libbcc.lib.bpf_table_fd(module.module, name.encode()))
        if fd < 0:
            return reply(False, "pin", f"bcc has no map {name}")
        fds[pin] = fd
    pinned: list[Path] = []
    try:
        for pin in programs.PINS:
            bpfsys.obj_pin(fds[pin], bpffs / pin)
            pinned.append(bpffs / pin)
    except OSError as exc:
        for path in pinned:
            path.unlink(missing_ok=True)
        return reply(False, "pin", str(exc))
    return reply(True)


def _egress(bcc: Any, libbcc: Any, module: Any, bpffs: Path, reply: Callable[..., int]) -> int:
    """Load egress_programs.PROGRAMS (skipping optional ones the kernel lacks) and pin them."""
    fds: dict[str, int] = {}
    skipped: list[str] = []
    for program in egress_programs.PROGRAMS:
        try:
            fds[program.pin] = module.load_func(
                program.function.encode(), program.prog_type, attach_type=program.attach_type
            ).fd
        except Exception as exc:
            if not program.optional:
                return reply(False, "verify", _bcc_reason(exc))
            skipped.append(program.pin)
    for pin, name in egress_programs.MAPS:
        fd = int(libbcc.lib.bpf_table_fd(module.module, name.encode()))
        if fd < 0:
            return reply(False, "pin", f"bcc has no map {name}")
        fds[pin] = fd
    pinned: list[Path] = []
    try:
        for pin, fd in fds.items():
            bpfsys.obj_pin(fd, bpffs / pin)
            pinned.append(bpffs / pin)
    except OSError as exc:
        for path in pinned:
            path.unlink(missing_ok=True)
        return reply(False, "pin", str(exc))
    return reply(True, skipped=skipped)


def _bcc_reason(exc: Exception) -> str:
    # "Failed to load BPF program b'meshfn_sock_ops': Permission denied"
    text = str(exc)
    return re.sub(r"b'([^']*)'", r"\1", text)


if __name__ == "__main__":
    sys.exit(child_main(Path(sys.argv[1]), sys.stdin.read(), *sys.argv[2:3]))
