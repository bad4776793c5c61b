"""Fuzzing: the targets, their corpora, and a runner with a time budget per target.

C targets (`filter-audit`, `filter-degrade`, `filter-meshfn`) are the proxy-wasm filters' code
under libFuzzer with AddressSanitizer + UndefinedBehaviorSanitizer
(wasm_filters/fuzz/fuzz_filter.c); Python targets run under atheris (testing/fuzz_targets.py).
Corpora live in tests/fuzz/corpus/<target>/ (seeded from the tests by tests/fuzz/make_seeds.py);
a run works on a copy, so a test run never changes the checkout (`bench/fuzz.py --merge`
folds new inputs back in). tests/fuzz/test_fuzz.py runs every target for a few seconds,
bench/fuzz.py for as long as asked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from meshfn import wasm_filters as filters
from meshfn.xds.names import CLUSTER, ENDPOINT, LISTENER, ROUTE

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT / "tests" / "fuzz" / "corpus"
REGRESSIONS = ROOT / "tests" / "fuzz" / "regressions"
C_TARGETS = ("filter-audit", "filter-degrade", "filter-meshfn")
PY_TARGETS = (
    "policy", "kserve", "ads", "journal", "als", "tracecontext", "otlp", "generate",
)  # fmt: skip
TARGETS = C_TARGETS + PY_TARGETS
# libFuzzer flags for every run: a per-input time limit (a hang is a finding), a memory cap
# (an unbounded allocation is a finding), inputs up to 64 KiB.
COMMON_FLAGS = ("-timeout=10", "-rss_limit_mb=2560", "-max_len=65536", "-print_final_stats=1")


class FuzzBuildError(RuntimeError):
    pass


@dataclass
class FuzzResult:
    target: str
    seconds: float
    execs: int
    coverage: int  # libFuzzer's `cov`: edges reached (C: of `edges_total`; Python: atheris')
    edges_total: int | None  # instrumented edges of a C target (Python's grow as code runs)
    features: int  # libFuzzer's `ft`
    corpus: int  # inputs in the working corpus at the end
    finding: str | None  # path of the crash/leak/timeout/oom input, if any
    log_tail: str

    def line(self) -> str:
        return (
            f"{self.target}: execs={self.execs} cov={self.coverage}"
            + (f"/{self.edges_total}" if self.edges_total else "")
            + f" ft={self.features} "
            f"corpus={self.corpus} seconds={self.seconds:.0f}"
            + (f" FINDING={self.finding}" if self.finding else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@cache
def c_fuzzers() -> Path:
    """Build (once per source hash, cached) the sanitized libFuzzer binaries of the filters."""
    script = filters.source_dir() / "fuzz" / "build.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FuzzBuildError(
            f"{script} failed (needs clang and libclang-rt-14-dev: ./dev.sh setup installs"
            f" them):\n{done.stderr[-2000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def command(target: str) -> list[str]:
    """The fuzzer's command line before libFuzzer flags and corpus directories."""
    if target in C_TARGETS:
        return [str(c_fuzzers() / f"{target.removeprefix('filter-')}_fuzz")]
    if target in PY_TARGETS:
        return [sys.executable, "-m", "meshfn.testing.fuzz_targets", target]
    raise ValueError(f"unknown fuzz target {target!r} (known: {', '.join(TARGETS)})")


def dictionary(target: str) -> Path | None:
    path = ROOT / "tests" / "fuzz" / f"{target.split('-', maxsplit=1)[0]}.dict"
    return path if path.exists() else None


_STATS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_EXECS = re.compile(r"stat::number_of_executed_units: (\d+)")
_EDGES = re.compile(r"Loaded \d+ modules\s+\((\d+) inline 8-bit counters\)")


def run(
    target: str, seconds: float, work: Path, jobs_env: dict[str, str] | None = None
) -> FuzzResult:
    """Fuzz `target` for `seconds` in `work` (a copy of its corpus, artifacts); returns the
    figures and the finding's path, if libFuzzer stopped on one."""
    corpus = work / "corpus"
    if corpus.exists():
        shutil.rmtree(corpus)
    seeds = CORPORA / target
    if seeds.is_dir():
        shutil.copytree(seeds, corpus)
    else:
        corpus.mkdir(parents=True)
    artifacts = work / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    flags = [
        *COMMON_FLAGS,
        f"-max_total_time={max(1, int(seconds))}",
        f"-artifact_prefix={artifacts}/",
    ]
    if (d := dictionary(target)) is not None:
        flags.append(f"-dict={d}")
    env = {**os.environ, "PYTHONSAFEPATH": "1", **(jobs_env or {})}
    # detect_leaks: the C filters' own allocator is checked by the driver; LeakSanitizer in
    # addition checks the fake host and anything on malloc.
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:symbolize=1")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    started = time.monotonic()
    done = subprocess.run(
        [*command(target), *flags, str(corpus)],
        capture_output=True,
        text=True,
        errors="replace",
        env=env,
        timeout=seconds + 120,
        check=False,
        cwd=work,
    )
    elapsed = time.monotonic() - started
    log = done.stderr
    (work / "fuzz.log").write_text(log)
    stats = _STATS.findall(log)
    execs = _EXECS.findall(log)
    last = stats[-1] if stats else ("0", "0", "0", "0")
    findings = sorted(
        p
        for p in artifacts.iterdir()
        if p.name.split("-")[0] in ("crash", "leak", "timeout", "oom", "slow")
        and not p.name.startswith("slow")
    )
    finding = str(findings[0]) if findings else None
    if done.returncode != 0 and finding is None:
        finding = f"exit status {done.returncode} without an artifact"
    return FuzzResult(
        target=target,
        seconds=elapsed,
        execs=int(execs[-1]) if execs else int(last[0]),
        coverage=int(last[1]),
        features=int(last[2]),
        edges_total=sum(map(int, _EDGES.findall(log))) or None,
        corpus=sum(1 for _ in corpus.iterdir()),
        finding=finding,
        log_tail="\n".join(log.splitlines()[-60:]),
    )


def merge(target: str, work: Path) -> int:
    """Fold a run's new inputs into the checkout's corpus (libFuzzer -merge=1 keeps only those
    that add coverage); returns how many were added."""
    seeds = CORPORA / target
    seeds.mkdir(parents=True, exist_ok=True)
    before = sum(1 for _ in seeds.iterdir())
    subprocess.run(
        [*command(target), "-merge=1", *COMMON_FLAGS[:3], str(seeds), str(work / "corpus")],
        capture_output=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        check=True,
        cwd=work,
    )
    return sum(1 for _ in seeds.iterdir()) - before


def replay(target: str, inputs: list[Path], work: Path) -> subprocess.CompletedProcess[str]:
    """Run the target once on each input (a regression check): rc 0 when none fails."""
    work.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [*command(target), *COMMON_FLAGS[:3], "-runs=1", *map(str, inputs)],
        capture_output=True,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        timeout=300,
        check=False,
        cwd=work,
    )


# ---------------------------------------------------------------------- shared with the targets


def ads_resources() -> dict[str, dict[str, dict[str, Any]]]:
    """The snapshot the ADS target's streams are served from (the shape of tests/xds/test_ads.py's):
    two workloads, clusters with endpoints."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for group, names in (("edge.default", ("a", "b", "c")), ("model.default", ("m",))):
        endpoints = {}
        for i, name in enumerate(names):
            cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
            lb = cla.endpoints.add().lb_endpoints.add()
            lb.endpoint.address.socket_address.address = "127.0.0.1"
            lb.endpoint.address.socket_address.port_value = 10000 + i
            endpoints[name] = cla
        out[group] = {
            CLUSTER: {n: cluster_pb2.Cluster(name=n, type=cluster_pb2.Cluster.EDS) for n in names},
            ENDPOINT: endpoints,
            LISTENER: {},
            ROUTE: {},
        }
    return out
