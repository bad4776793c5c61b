"""`python -P -m meshfn.testing.kubebuild --log FILE`: run e2e/kube/build.sh with a progress bar.

The build (kube-apiserver, kube-controller-manager and etcd from Debian's sources) takes ~10
minutes the first time; its step lines (`[kube-build HH:MM:SS] step`) drive the shared progress
reporter, the full output goes to the log, and the last line says whether it was built or cached.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from meshfn.common.cli import console
from meshfn.common.progress import RichReporter

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "kube" / "build.sh"
STEPS = 8  # the build script's step lines before "done" (apt update ... go build x2)
_STEP = re.compile(r"^\[kube-build [0-9:]+\] (.*)$")
ITEM = "kube-apiserver, kube-controller-manager, etcd"


def run(log: Path, console: Console, script: Path = SCRIPT) -> int:
    """The build's exit code; progress on `console`, everything the build printed in `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    steps = 0
    with RichReporter(console, "kube binaries") as report, log.open("w") as out:
        report.begin(ITEM, STEPS)
        proc = subprocess.Popen(
            ["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if (match := _STEP.match(line.rstrip("\n"))) and not match[1].startswith("done"):
                steps += 1
                report.step(ITEM, match[1])
        code = proc.wait()
        if code == 0:
            report.finish(ITEM, cached=steps == 0)
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    sys.exit(run(args.log, console(stderr=True)))


if __name__ == "__main__":
    main()
