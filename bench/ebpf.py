"""eBPF socket redirection benchmark: the same traffic with redirection on and off, one run.

(a) Round trip between two processes on loopback (the Envoy <-> backend hop: 64-byte echo),
    both pinned to CPU 0, then unpinned (and, in the JSON, client and server on different
    CPUs). "On" runs both processes in the accelerator's cgroup,
    "off" runs the same programs outside it. The summary uses a C loop compiled here with `cc`
    (Envoy's side of the hop is C++); the lean Python loops of meshfn.ebpf.probe are measured
    too (JSON "python_loop"): their interpreter time is the same on and off and dilutes the ratio.
(b) Throughput of one stream (64 KiB and 1 KiB writes, echoed back), unpinned.
(c) A full mesh request: HTTP client -> real Envoy (static config, concurrency 1) -> backend, p50
    over keep-alive requests, client, Envoy and backend pinned to CPU 1 (--mesh-cpu; unpinned,
    other agents' load made single rounds swing 130 -> 400 us). "On": Envoy and the backend in the
    cgroup; the client is a user outside the mesh, so only the Envoy <-> backend hop is
    redirected (JSON also has the client inside the mesh). The backend is a minimal asyncio
    responder from this file (--backend fast, default; the placeholder aiohttp upstream with
    --backend aiohttp): aiohttp costs far more per request than the hop we accelerate.
    "unix": the fast backend on a unix socket, Envoy in the cgroup: how `meshfn up` runs the hop
    behind a sidecar now (no port a local user could call past the sidecar); redirection only
    acts on TCP, so this is what the sidecar hop costs with acceleration on.

On and off alternate round by round (ABBA order); a ratio is the median of the per-round
ratios, a latency the median over rounds: the machine is a shared, noisy 2-vCPU VM.

Prints one line:
  ebpf: rtt_ratio_same_cpu=… rtt_ratio_unpinned=… mesh_p50_ratio=… mesh_unix_p50_ratio=…
(on / off; unix / off: a unix socket against plain TCP, JSON ratio_unix_vs_on: against on)
and writes the details as JSON (--json, default bench/results/ebpf.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from meshfn.common.unix import listen_private
from meshfn.testing import envoy
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Proc, Processes, upstream_argv, wait_for

HERE = Path(__file__).resolve()
Json = dict[str, Any]
Preexec = Callable[[], None]


def log(message: str) -> None:
    print(f"[ebpf bench] {message}", file=sys.stderr, flush=True)


def preexec(join: Preexec | None, cpus: set[int] | None) -> Preexec | None:
    """Join the cgroup (on) and/or pin to `cpus` before exec."""
    if join is None and cpus is None:
        return None

    def run() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if join is not None:
            join()

    return run


def ratio(on: list[float], off: list[float]) -> float:
    """Median of the per-round ratios: each round measures on and off back to back, so a burst
    of other load, or the scheduler putting two unpinned processes on different CPUs for a
    while, hits both sides of one ratio rather than one side of the whole comparison."""
    return statistics.median(a / b for a, b in zip(on, off, strict=True))


def paired_p50(p50: dict[str, list[float]]) -> Json:
    """What an on/off comparison of per-round p50s reports: medians, the rounds, their ratio."""
    return {
        "p50_us": {mode: statistics.median(v) for mode, v in p50.items()},
        "rounds_p50_us": p50,
        "ratio": ratio(p50["on"], p50["off"]),
    }


def abba(rounds: int) -> Iterator[tuple[int, str]]:
    for i in range(rounds):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            yield i, mode


# --- (a) + (b): the raw hop ----------------------------------------------------------------------


def echo_server(children: Processes, pre: Preexec | None) -> tuple[Proc, int]:
    from meshfn.ebpf import probe

    proc = children.start("echo", probe.command("echo"), preexec=pre, pipe=True)
    assert proc.popen is not None
    return proc, int(probe.ask(proc.popen)["port"])


def python_hop(args: argparse.Namespace, join: Preexec, children: Processes) -> Json:
    """(a) with the lean Python loops of meshfn.ebpf.probe (interpreter time on both sides), for
    the two placements of the summary line."""
    from meshfn.ebpf import probe

    out: Json = {}
    for placement, cpus in (("same_cpu", {0}), ("unpinned", None)):
        servers = {
            "on": echo_server(children, preexec(join, cpus)),
            "off": echo_server(children, preexec(None, cpus)),
        }
        p50: dict[str, list[float]] = {"on": [], "off": []}
        for _, mode in abba(args.rounds):
            port = servers[mode][1]
            pre = preexec(join if mode == "on" else None, cpus)
            result = probe.run(["rtt", "--port", str(port), "--count", str(args.count)], pre)
            p50[mode].append(result["p50_us"])
        for proc, _ in servers.values():
            proc.stop()
        out[placement] = paired_p50(p50)
        log(f"rtt {placement} (Python loop): {out[placement]['p50_us']}")
    return out


def throughput(args: argparse.Namespace, join: Preexec, children: Processes) -> Json:
    from meshfn.ebpf import probe

    out: Json = {}
    for chunk in (65536, 1024):
        servers = {"on": echo_server(children, join), "off": echo_server(children, None)}
        rate: dict[str, list[float]] = {"on": [], "off": []}
        nbytes = args.stream_mib << 20 if chunk > 1024 else args.stream_mib << 17
        for _, mode in abba(max(2, args.rounds // 2)):
            port = servers[mode][1]
            argv = ["stream", "--port", str(port), "--bytes", str(nbytes), "--chunk", str(chunk)]
            rate[mode].append(probe.run(argv, join if mode == "on" else None)["mib_per_s"])
        for proc, _ in servers.values():
            proc.stop()
        out[f"throughput_{chunk}"] = {
            "mib_per_s": {mode: statistics.median(v) for mode, v in rate.items()},
            "rounds_mib_per_s": rate,
            "ratio": ratio(rate["on"], rate["off"]),
        }
        log(f"throughput {chunk} B writes: {out[f'throughput_{chunk}']['mib_per_s']}")
    return out


# --- (a) with a C loop: the kernel's hop without interpreter time -----------------------------

C_LOOP = r"""
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
/* Blocking reads retry EAGAIN: under redirection a blocking read can return it (FACTS.md). */
static ssize_t rd(int fd, char *buf, size_t n) {
    for (;;) { ssize_t r = read(fd, buf, n); if (r >= 0 || errno != EAGAIN) return r; }
}
static long now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                        return t.tv_sec * 1000000000L + t.tv_nsec; }
static int cmp(const void *a, const void *b) { long x = *(const long *)a, y = *(const long *)b;
                                               return (x > y) - (x < y); }
int main(int argc, char **argv) {
    static char buf[65536]; int one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
    if (argc == 2) {  /* server: echo connections one after another */
        int ls = socket(AF_INET, SOCK_STREAM, 0); socklen_t l = sizeof a;
        bind(ls, (void *)&a, sizeof a); listen(ls, 16); getsockname(ls, (void *)&a, &l);
        printf("{\"port\": %d}\n", ntohs(a.sin_port)); fflush(stdout);
        for (;;) {
            int c = accept(ls, 0, 0); setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            ssize_t n; while ((n = rd(c, buf, sizeof buf)) > 0) write(c, buf, n);
            close(c);
        }
    }
    int s = socket(AF_INET, SOCK_STREAM, 0), count = atoi(argv[2]);
    a.sin_port = htons(atoi(argv[1]));
    if (connect(s, (void *)&a, sizeof a)) { perror("connect"); return 1; }
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    long *t = malloc(count * sizeof *t);
    for (int i = 0; i < 2000; i++) { write(s, buf, 64); rd(s, buf, sizeof buf); }
    for (int i = 0; i < count; i++) {
        long b = now(); write(s, buf, 64); rd(s, buf, sizeof buf); t[i] = now() - b;
    }
    qsort(t, count, sizeof *t, cmp);
    printf("{\"p50_us\": %.3f}\n", t[count / 2] / 1000.0);
    return 0;
}
"""


# (name, server CPUs, client CPUs). Unpinned runs are bimodal: ~8 us when the scheduler keeps
# both processes on one CPU, ~40 us when it does not; cross_cpu shows the second case alone.
PLACEMENTS: list[tuple[str, set[int] | None, set[int] | None]] = [
    ("same_cpu", {0}, {0}),
    ("unpinned", None, None),
    ("cross_cpu", {1}, {0}),
]


def c_hop(args: argparse.Namespace, work: Path, join: Preexec, children: Processes) -> Json:
    """The summary's round trip: Envoy's side of the hop is C++, so a C loop on both ends
    measures what redirection changes; the Python loop adds ~1.5 us of interpreter time per
    side to "on" and "off" alike and is reported next to it."""
    cc = shutil.which("cc")
    if cc is None:
        raise SystemExit(
            "bench/ebpf.py needs a C compiler for the round-trip loop: apt-get install gcc"
        )
    (work / "rtt.c").write_text(C_LOOP)
    subprocess.run([cc, "-O2", "-o", str(work / "rtt"), str(work / "rtt.c")], check=True)
    binary = str(work / "rtt")
    out: Json = {}
    for placement, server_cpus, client_cpus in PLACEMENTS:
        servers = {}
        for mode in ("on", "off"):
            pre = preexec(join if mode == "on" else None, server_cpus)
            proc = children.start(f"rtt-{mode}", [binary, "serve"], preexec=pre, pipe=True)
            assert proc.popen is not None and proc.popen.stdout is not None
            servers[mode] = (proc, json.loads(proc.popen.stdout.readline())["port"])
        p50: dict[str, list[float]] = {"on": [], "off": []}
        for _, mode in abba(args.rounds):
            pre = preexec(join if mode == "on" else None, client_cpus)
            argv = [binary, str(servers[mode][1]), str(args.count)]
            result = subprocess.run(
                argv, capture_output=True, text=True, check=True, timeout=120, preexec_fn=pre
            )
            p50[mode].append(json.loads(result.stdout)["p50_us"])
        for proc, _ in servers.values():
            proc.stop()
        out[placement] = paired_p50(p50)
        log(f"rtt {placement} (C loop): {out[placement]['p50_us']}")
    return out


# --- (c): the full mesh request ------------------------------------------------------------------

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


def serve_fast_backend(where: str) -> None:
    """The leanest HTTP/1.1 keep-alive responder asyncio allows (GET without body only), on a
    loopback port or (a path) a unix socket."""

    class Http(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport
            self.buffer = b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                self.buffer = self.buffer[end + 4 :]
                self.transport.write(RESPONSE)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        if where.isdigit():
            server = await loop.create_server(Http, "127.0.0.1", int(where), backlog=1024)
        else:
            server = await loop.create_unix_server(Http, sock=listen_private(Path(where)))
        async with server:
            await server.serve_forever()

    asyncio.run(run())


def envoy_config(
    listen: int,
    admin: int,
    backend: int | Path,
    requests_per_connection: int | None = None,
) -> Json:
    """A static Envoy: one listener routing everything to one backend cluster (a loopback port,
    or a unix socket as a sidecar of `meshfn up` reaches its application), Envoy's default
    route timeout. `requests_per_connection`: close upstream connections after that many
    requests."""
    upstream = (
        {"pipe": {"path": str(backend)}} if isinstance(backend, Path) else envoy.loopback(backend)
    )
    return envoy.bare_proxy(
        "bench", listen, admin, [upstream], route_timeout=None,
        requests_per_connection=requests_per_connection,
    )  # fmt: skip


def start_stack(
    backend_kind: str,
    work: Path,
    join: Preexec | None,
    children: Processes,
    name: str,
    requests_per_connection: int | None = None,
    unix: bool = False,
) -> tuple[int, int]:
    """Backend + Envoy, both in the cgroup when `join`; returns (Envoy's listener, backend).
    `unix`: the (fast) backend listens on a unix socket in `work` instead (port 0)."""
    backend, listen, admin = free_ports(3)
    target: int | Path = backend
    if unix:
        target = work / f"{name}.sock"
        argv = [sys.executable, "-P", str(HERE), "_backend", str(target)]
    elif backend_kind == "fast":
        argv = [sys.executable, "-P", str(HERE), "_backend", str(backend)]
    else:
        argv = upstream_argv("bench/backend", backend)
    children.start(f"{name}-backend", argv, preexec=join)
    wait_for("backend", lambda: _connects(target))
    config = work / f"envoy-{name}.json"
    config.write_text(json.dumps(envoy_config(listen, admin, target, requests_per_connection)))
    proc = children.start(f"{name}-envoy", envoy.argv(config), preexec=join)
    wait_for("envoy", lambda: envoy.live(admin, timeout=1), proc=proc)
    return listen, backend


def _connects(target: int | Path) -> bool:
    if isinstance(target, Path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(target))
    else:
        socket.create_connection(("127.0.0.1", target)).close()
    return True


def http_client(port: int, count: int) -> Json:
    """Keep-alive GETs on one connection; per-request latency."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fd = sock.fileno()
    request = b"GET /bench HTTP/1.1\r\nhost: bench\r\n\r\n"
    read, write, clock = os.read, os.write, time.perf_counter_ns

    def one() -> bytes:
        write(fd, request)
        data = b""
        while (end := data.find(b"\r\n\r\n")) < 0:
            data += read(fd, 65536)
        head = data[:end].lower()
        start = head.index(b"content-length:") + 15
        length = int(head[start : head.index(b"\r\n", start)])
        while len(data) < end + 4 + length:
            data += read(fd, 65536)
        return data[: data.index(b" ", 9)]

    ok = b"HTTP/1.1 200"
    for _ in range(min(500, count // 5)):
        assert one() == ok
    samples = [0] * count
    statuses = [b""] * count
    for i in range(count):
        t0 = clock()
        statuses[i] = one()
        samples[i] = clock() - t0
    sock.close()
    # every sample an answer of the backend: a fast 503 from Envoy is not a faster round trip
    if wrong := [s for s in statuses if s != ok]:
        raise SystemExit(f"{len(wrong)} of {count} answers were not 200: {sorted(set(wrong))}")
    samples.sort()
    return {"p50_us": samples[count // 2] / 1000, "p99_us": samples[int(count * 0.99)] / 1000}


def mesh(
    args: argparse.Namespace, work: Path, join: Preexec, accel: Any, children: Processes
) -> Json:
    """(c) The stacks run side by side; the client alternates between them round by round. A
    third, "unix", is how `meshfn up` now runs the hop behind a sidecar: Envoy (in the cgroup)
    -> the backend's unix socket, which redirection does not touch."""
    cpus = None if args.mesh_cpu < 0 else {args.mesh_cpu}
    ports = {
        "on": start_stack(args.backend, work, preexec(join, cpus), children, "on")[0],
        "off": start_stack(args.backend, work, preexec(None, cpus), children, "off")[0],
    }
    unix = start_stack("fast", work, preexec(join, cpus), children, "unix", unix=True)[0]
    p50: dict[str, list[float]] = {"on": [], "off": [], "client_in_mesh": [], "unix": []}

    def client(port: int, pre: Preexec | None) -> float:
        argv = [sys.executable, "-P", str(HERE), "_client", str(port), str(args.requests)]
        result = subprocess.run(
            argv, capture_output=True, text=True, check=True, timeout=300, preexec_fn=pre
        )
        value: float = json.loads(result.stdout)["p50_us"]
        return value

    before = accel.stats()
    order = ("on", "off", "unix")
    for index in range(args.mesh_rounds):
        for mode in order if index % 2 == 0 else order[::-1]:
            p50[mode].append(client(unix if mode == "unix" else ports[mode], preexec(None, cpus)))
            if mode == "on":
                p50["client_in_mesh"].append(client(ports["on"], preexec(join, cpus)))
    after = accel.stats()
    medians = {mode: statistics.median(v) for mode, v in p50.items()}
    log(f"mesh p50 (median of rounds): { {m: round(v, 1) for m, v in medians.items()} }")
    return {
        "backend": args.backend,
        "cpu": args.mesh_cpu,
        "p50_us": medians,
        "best_round_p50_us": {mode: min(v) for mode, v in p50.items()},
        "rounds_p50_us": p50,
        "ratio": ratio(p50["on"], p50["off"]),
        "ratio_client_in_mesh": ratio(p50["client_in_mesh"], p50["off"]),
        "ratio_unix": ratio(p50["unix"], p50["off"]),
        "ratio_unix_vs_on": ratio(p50["unix"], p50["on"]),
        "counters": {k: after[k] - before[k] for k in after if k != "attached"},
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_backend":
        serve_fast_backend(sys.argv[2])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        print(json.dumps(http_client(int(sys.argv[2]), int(sys.argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="on/off rounds per measurement")
    parser.add_argument("--count", type=int, default=10000, help="round trips per rtt round")
    parser.add_argument("--stream-mib", type=int, default=256, help="MiB per 64 KiB stream")
    parser.add_argument("--mesh-rounds", type=int, default=30, help="on/off rounds for (c)")
    parser.add_argument("--requests", type=int, default=500, help="HTTP requests per round")
    parser.add_argument(
        "--mesh-cpu", type=int, default=1, help="pin client, Envoy, backend of (c) here; -1: no"
    )
    parser.add_argument("--backend", choices=["fast", "aiohttp"], default="fast")
    parser.add_argument("--mesh-only", action="store_true", help="skip (a) and (b)")
    parser.add_argument("--json", type=Path, default=HERE.parent / "results" / "ebpf.json")
    args = parser.parse_args()

    from meshfn.ebpf import Accelerator

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshfn-bench-ebpf-")))
        accel = Accelerator(work / "state")
        status = accel.setup("auto")
        if not status.attached:
            print(f"ebpf: unavailable: {status.reason}", file=sys.stderr)
            return 1
        stack.callback(accel.shutdown)
        children = Processes(work)
        stack.callback(children.stop_all)
        join = accel.child_preexec()
        assert join is not None
        log(status.line())
        results: Json = {"config": {k: str(v) for k, v in vars(args).items()}}
        if not args.mesh_only:
            results.update(c_hop(args, work, join, children))
            results["python_loop"] = python_hop(args, join, children)
            results.update(throughput(args, join, children))
        results["mesh"] = mesh(args, work, join, accel, children)

    def r(part: str) -> str:
        return f"{results[part]['ratio']:.2f}" if part in results else "n/a"

    unix = results["mesh"]["ratio_unix"]
    line = (
        f"ebpf: rtt_ratio_same_cpu={r('same_cpu')} rtt_ratio_unpinned={r('unpinned')} "
        f"mesh_p50_ratio={r('mesh')} mesh_unix_p50_ratio={unix:.2f}"
    )
    results["summary"] = line
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
