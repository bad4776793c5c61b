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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import bpfsys, egress_programs, programs


class _Failed(Exception):
    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage, self.reason = stage, reason


def child_main(bpffs: Path, text: str, plan: str = "acceleration") -> int:
    """The child: compile the C text, load, pin into `bpffs`; prints one JSON line."""
    skipped: list[str] = []
    try:
        try:
            bcc: Any = importlib.import_module("bcc")
            libbcc: Any = importlib.import_module("bcc.libbcc")
        except ImportError as exc:
            reason = f"bcc is not importable ({exc}); run ebpf/setup_host.sh"
            raise _Failed("import", reason) from None
        try:
            module = bcc.BPF(text=text.encode())
        except Exception as exc:
            raise _Failed("compile", str(exc)) from None
        maps: Iterable[tuple[str, str]]
        if plan == "egress":
            fds, skipped = _egress(module)
            maps = egress_programs.MAPS
        else:
            fds, maps = _acceleration(bcc, module), programs.MAP_PINS_NAMES
        fds.update(_map_fds(libbcc, module, maps))
        _pin_all(fds, bpffs)
    except _Failed as failed:
        print(json.dumps({"ok": False, "stage": failed.stage, "reason": failed.reason}))
        return 0
    print(json.dumps({"ok": True, "stage": "", "reason": "", "skipped": skipped}), flush=True)
    return 0


def _acceleration(bcc: Any, module: Any) -> dict[str, int]:
    try:
        return {
            programs.PIN_SOCK_OPS: module.load_func(
                programs.FN_SOCK_OPS.encode(), bcc.BPF.SOCK_OPS
            ).fd,
            programs.PIN_SK_MSG: module.load_func(programs.FN_SK_MSG.encode(), bcc.BPF.SK_MSG).fd,
        }
    except Exception as exc:
        raise _Failed("verify", _bcc_reason(exc)) from None


def _egress(module: Any) -> tuple[dict[str, int], list[str]]:
    """egress_programs.PROGRAMS, skipping the optional ones the kernel lacks (named)."""
    fds: dict[str, int] = {}
    skipped: list[str] = []
    for program in egress_programs.PROGRAMS:
        try:
            fds[program.pin] = module.load_func(
                program.function.encode(), program.prog_type, attach_type=program.attach_type
            ).fd
        except Exception as exc:
            if not program.optional:
                raise _Failed("verify", _bcc_reason(exc)) from None
            skipped.append(program.pin)
    return fds, skipped


def _map_fds(libbcc: Any, module: Any, maps: Iterable[tuple[str, str]]) -> dict[str, int]:
    fds = {}
    for pin, name in maps:
        # bcc 0.26 cannot wrap a sockhash ("Unknown table type 18"): ask libbcc for the fd.
        fd = int(libbcc.lib.bpf_table_fd(module.module, name.encode()))
        if fd < 0:
            raise _Failed("pin", f"bcc has no map {name}")
        fds[pin] = fd
    return fds


def _pin_all(fds: dict[str, int], bpffs: Path) -> None:
    """Pin every fd, or none (a failure part way unpins what it pinned)."""
    pinned: list[Path] = []
    try:
        for pin, fd in fds.items():
            bpfsys.obj_pin(fd, bpffs / pin)
            pinned.append(bpffs / pin)
    except OSError as exc:
        for path in pinned:
            path.unlink(missing_ok=True)
        raise _Failed("pin", str(exc)) from None


def _bcc_reason(exc: Exception) -> str:
    # "Failed to load BPF program b'meshfn_sock_ops': Permission denied"
    text = str(exc)
    return re.sub(r"b'([^']*)'", r"\1", text)


if __name__ == "__main__":
    sys.exit(child_main(Path(sys.argv[1]), sys.stdin.read(), *sys.argv[2:3]))
