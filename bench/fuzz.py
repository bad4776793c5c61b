"""Long fuzzing runs: every target (or those named) for --seconds each, one after another.

  .venv/bin/python bench/fuzz.py --seconds 600            # 10 minutes per target
  .venv/bin/python bench/fuzz.py --seconds 60 policy ads  # some targets
  .venv/bin/python bench/fuzz.py --merge ...              # fold new coverage into tests/fuzz/corpus

Prints one line per target on stderr and one summary line on stdout (executions and coverage
per target); writes bench/results/fuzz.json (or --json PATH). A finding is
copied to bench/results/fuzz-findings/<target>/ and makes the exit status 1: turn it into a
named regression (tests/fuzz/regressions/<target>/<name>, tests/fuzz/test_fuzz_regressions.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from meshfn.testing import fuzz

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"default: all of {', '.join(fuzz.TARGETS)}")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--merge", action="store_true", help="add new coverage to the corpora")
    parser.add_argument("--json", type=Path, default=RESULTS / "fuzz.json")
    args = parser.parse_args()
    targets = args.targets or list(fuzz.TARGETS)
    unknown = set(targets) - set(fuzz.TARGETS)
    if unknown:
        parser.error(f"unknown target(s) {', '.join(sorted(unknown))}")
    RESULTS.mkdir(exist_ok=True)
    results = []
    found = False
    with tempfile.TemporaryDirectory(prefix="meshfn-fuzz-") as tmp:
        for target in targets:
            work = Path(tmp) / target
            result = fuzz.run(target, args.seconds, work)
            print(result.line(), file=sys.stderr, flush=True)
            if result.finding and Path(result.finding).exists():
                keep = RESULTS / "fuzz-findings" / target
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(result.finding, keep)
                (keep / (Path(result.finding).name + ".log")).write_text(result.log_tail)
                found = True
            elif result.finding:
                found = True
                print(result.log_tail, file=sys.stderr)
            if args.merge and not result.finding:
                added = fuzz.merge(target, work)
                print(f"{target}: {added} inputs added to the corpus", file=sys.stderr)
            results.append(result.as_dict() | {"log_tail": None})
    per_target = " ".join(
        f"{r['target']}={r['execs']}/{r['coverage']}"
        + (f"/{r['edges_total']}" if r["edges_total"] else "")
        for r in results
    )
    print(
        f"fuzz: seconds_each={args.seconds:.0f} findings={sum(1 for r in results if r['finding'])}"
        f" execs={sum(r['execs'] for r in results)} (target=execs/cov[/edges]) {per_target}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"seconds": args.seconds, "targets": results}, indent=2))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
