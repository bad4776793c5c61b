"""Compile, verify and pin the programs with bcc, in a short-lived child process.

The control plane never imports bcc: the child loads LLVM (~100 MiB), compiles (~0.5 s), pins
the programs and maps into the private bpffs and exits; the pins keep them alive. The compiler's
and the verifier's messages arrive on the child's stderr, which the parent turns into one line.
bcc itself (untyped) is imported only in that child, `_bcc_child.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LoadResult:
    ok: bool
    stage: str  # "import", "compile", "verify", "pin", "crash"
    reason: str
    skipped: tuple[str, ...] = ()  # optional programs this kernel would not load


def load_in_child(
    text: str,
    bpffs: Path,
    headers: Path,
    timeout: float = LOAD_TIMEOUT_S,
    plan: str = "acceleration",
) -> LoadResult:
    """Run `python -m meshfn.ebpf._bcc_child` and report what it did in one line."""
    env = dict(os.environ, BCC_KERNEL_SOURCE=str(headers), PYTHONSAFEPATH="1")
    try:
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "meshfn.ebpf._bcc_child", str(bpffs), plan],
            input=text,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return LoadResult(False, "crash", f"the bcc loader did not finish in {timeout:.0f}s")
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        reply = json.loads(last[0])
    except ValueError:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return LoadResult(False, "crash", f"the bcc loader exited {proc.returncode}: {tail}")
    if reply["ok"]:
        return LoadResult(True, "done", "", tuple(reply.get("skipped", ())))
    stage = str(reply["stage"])
    return LoadResult(False, stage, _explain(stage, str(reply["reason"]), proc.stderr))


def _explain(stage: str, reason: str, stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if stage == "compile":
        errors = [line for line in lines if "error:" in line]
        detail = errors[0] if errors else (lines[-1] if lines else reason)
        return f"BPF compile failed: {detail}"
    if stage == "verify":
        # bcc prints the verifier log; the line before "processed N insns" says why.
        for i, line in enumerate(lines):
            if line.startswith("processed ") and "insns" in line and i > 0:
                return f"the kernel's verifier rejected the program: {lines[i - 1]} ({reason})"
        return f"the kernel refused the program: {reason}"
    return reason
