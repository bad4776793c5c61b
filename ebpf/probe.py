"""Loopback traffic that proves and measures redirection; run it inside the mesh's cgroup.

    python -P -m meshfn.ebpf.probe pingpong --count N --size S      both ends in this process
    python -P -m meshfn.ebpf.probe exchange --bytes B --seed S --mode blocking|asyncio
    python -P -m meshfn.ebpf.probe halfclose --mode blocking|asyncio  the EAGAIN hazard
    python -P -m meshfn.ebpf.probe hold                             a connection driven from stdin
    python -P -m meshfn.ebpf.probe echo [--family 4|6]              print the port, echo forever
    python -P -m meshfn.ebpf.probe rtt --port P --count N --size S  against `echo`
    python -P -m meshfn.ebpf.probe stream --port P --bytes B --chunk C

Each prints one JSON line. Every blocking read retries EAGAIN and counts it: under redirection a
blocking recv() can fail with EAGAIN after a spurious wake-up (see add_pid's docstring).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

Json = dict[str, Any]

_ADDR = {"4": (socket.AF_INET, "127.0.0.1"), "6": (socket.AF_INET6, "::1")}


def listener(family: str) -> socket.socket:
    """family "dual": an AF_INET6 socket taking IPv4 clients, as a dual-stack listener does (its
    accepted sockets are AF_INET6 with IPv4-mapped addresses). Bound to ::ffff:127.0.0.1, not
    ::, so nothing listens beyond loopback."""
    if family == "dual":
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::ffff:127.0.0.1", 0))
    else:
        af, host = _ADDR[family]
        sock = socket.socket(af, socket.SOCK_STREAM)
        sock.bind((host, 0))
    sock.listen(128)
    return sock


def connect(family: str, port: int) -> socket.socket:
    host = "127.0.0.1" if family in ("4", "dual") else "::1"
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def pair(family: str) -> tuple[socket.socket, socket.socket]:
    with listener(family) as lsock:
        client = connect(family, lsock.getsockname()[1])
        server, _ = lsock.accept()
    server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, server


class Reader:
    """Blocking reads that survive spurious EAGAIN, counting them."""

    def __init__(self, sock: socket.socket) -> None:
        self.fd = sock.fileno()
        self.eagain = 0

    def read(self, size: int) -> bytes:
        while True:
            try:
                return os.read(self.fd, size)
            except BlockingIOError:
                self.eagain += 1

    def exactly(self, size: int) -> bytes:
        parts = []
        while size:
            data = self.read(size)
            if not data:
                raise EOFError("peer closed early")
            parts.append(data)
            size -= len(data)
        return b"".join(parts)


def ports(sock: socket.socket) -> list[int]:
    return [sock.getsockname()[1], sock.getpeername()[1]]


# --- pingpong: exact message counts ----------------------------------------------------------


def pingpong(count: int, size: int, family: str) -> Json:
    """Strict alternation in one thread: 2*count sendmsg calls, each one sk_msg run."""
    client, server = pair(family)
    message = b"p" * size
    rc, rs = Reader(client), Reader(server)
    for _ in range(count):
        client.send(message)
        got = rs.exactly(size)
        server.send(got)
        rc.exactly(size)
    out = {"messages": 2 * count, "bytes": 2 * count * size, "ports": ports(client)}
    out["eagain"] = rc.eagain + rs.eagain
    client.close()
    server.close()
    return out


# --- exchange: integrity -------------------------------------------------------------------------


def _chunks(rng: random.Random, total: int) -> list[int]:
    sizes = []
    while total > 0:
        size = rng.choice([1, 7, 100, 1400, 4096, 65536, 262144, rng.randint(1, 300_000)])
        sizes.append(min(size, total))
        total -= sizes[-1]
    return sizes


def exchange_blocking(nbytes: int, seed: int, family: str) -> Json:
    """Both directions at once, four threads, random write and read sizes."""
    client, server = pair(family)
    payload = {
        "a": random.Random(seed).randbytes(nbytes),
        "b": random.Random(seed + 1).randbytes(nbytes),
    }
    results: Json = {"eagain": 0, "sends": 0, "ports": ports(client)}
    lock = threading.Lock()

    def write(sock: socket.socket, data: bytes, rng: random.Random) -> None:
        offset = 0
        sends = 0
        for size in _chunks(rng, len(data)):
            sock.sendall(data[offset : offset + size])
            offset += size
            sends += 1
            if rng.random() < 0.01:
                time.sleep(0.001)
        sock.shutdown(socket.SHUT_WR)
        with lock:
            results["sends"] += sends

    def read(sock: socket.socket, key: str, rng: random.Random) -> None:
        reader = Reader(sock)
        digest = hashlib.sha256()
        total = 0
        while True:
            data = reader.read(rng.choice([1, 100, 4096, 65536, 1 << 20]))
            if not data:
                break
            digest.update(data)
            total += len(data)
        with lock:
            results[key] = digest.hexdigest() == hashlib.sha256(payload[key]).hexdigest()
            results[key + "_bytes"] = total
            results["eagain"] += reader.eagain

    threads = [
        threading.Thread(target=write, args=(client, payload["a"], random.Random(seed + 2))),
        threading.Thread(target=write, args=(server, payload["b"], random.Random(seed + 3))),
        threading.Thread(target=read, args=(server, "a", random.Random(seed + 4))),
        threading.Thread(target=read, args=(client, "b", random.Random(seed + 5))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results["ok"] = bool(results.get("a")) and bool(results.get("b"))
    client.close()
    server.close()
    return results


def exchange_asyncio(nbytes: int, seed: int, family: str) -> Json:
    """The same with asyncio streams (non-blocking sockets, as Envoy and our backends use)."""

    async def run() -> Json:
        payload = {
            "a": random.Random(seed).randbytes(nbytes),
            "b": random.Random(seed + 1).randbytes(nbytes),
        }
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )

        async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            accepted.set_result((r, w))

        lsock = listener(family)
        server = await asyncio.start_server(on_client, sock=lsock)
        creader, cwriter = await asyncio.open_connection(
            sock=connect(family, lsock.getsockname()[1])
        )
        sreader, swriter = await accepted
        sends = 0

        async def write(w: asyncio.StreamWriter, data: bytes, rng: random.Random) -> None:
            nonlocal sends
            offset = 0
            for size in _chunks(rng, len(data)):
                w.write(data[offset : offset + size])
                offset += size
                sends += 1
                await w.drain()
                if rng.random() < 0.05:
                    await asyncio.sleep(0)
            w.write_eof()

        async def read(r: asyncio.StreamReader, rng: random.Random) -> tuple[str, int]:
            digest = hashlib.sha256()
            total = 0
            while data := await r.read(rng.choice([1, 100, 4096, 65536, 1 << 20])):
                digest.update(data)
                total += len(data)
            return digest.hexdigest(), total

        _, _, (got_a, len_a), (got_b, len_b) = await asyncio.gather(
            write(cwriter, payload["a"], random.Random(seed + 2)),
            write(swriter, payload["b"], random.Random(seed + 3)),
            read(sreader, random.Random(seed + 4)),
            read(creader, random.Random(seed + 5)),
        )
        out: Json = {
            "a": got_a == hashlib.sha256(payload["a"]).hexdigest(),
            "b": got_b == hashlib.sha256(payload["b"]).hexdigest(),
            "a_bytes": len_a,
            "b_bytes": len_b,
            "sends": sends,
            "eagain": 0,
            "ports": list(cwriter.get_extra_info("sockname")[1:2])
            + list(cwriter.get_extra_info("peername")[1:2]),
        }
        out["ok"] = out["a"] and out["b"]
        for w in (cwriter, swriter):
            w.close()
        server.close()
        await server.wait_closed()
        return out

    return asyncio.run(run())


# --- halfclose: the EAGAIN hazard ---------------------------------------------------------------


def halfclose(trials: int, mode: str, family: str) -> Json:
    """A reader waits on a socket while its own side shuts down for writing, then data arrives.

    Plain TCP: the blocking recv() keeps waiting and returns the data. Under sk_msg redirection
    the shutdown's wake-up makes a *blocking* recv() fail with EAGAIN (tcp_bpf_recvmsg waits only
    once). Non-blocking sockets (asyncio, Envoy) treat EAGAIN as "wait again" and get the data.
    """
    eagain = late = 0
    for _ in range(trials):
        if mode == "blocking":
            client, server = pair(family)
            got: list[bytes | None] = []

            def wait_for_data(sock: socket.socket = client, out: list[bytes | None] = got) -> None:
                try:
                    out.append(sock.recv(100))
                except BlockingIOError:
                    out.append(None)

            thread = threading.Thread(target=wait_for_data)
            thread.start()
            time.sleep(0.02)  # the reader is blocked in recv() by now
            client.shutdown(socket.SHUT_WR)
            time.sleep(0.02)
            server.send(b"late")
            thread.join()
            eagain += got[0] is None
            late += got[0] == b"late"
            client.close()
            server.close()
        else:
            # asyncio never surfaces EAGAIN: it waits for readiness again.
            late += asyncio.run(_halfclose_async(family)) == b"late"
    return {"trials": trials, "eagain": eagain, "late_data": late}


async def _halfclose_async(family: str) -> bytes:
    client, server = pair(family)
    reader, writer = await asyncio.open_connection(sock=client)
    read = asyncio.create_task(reader.read(100))
    await asyncio.sleep(0.02)
    writer.write_eof()
    await asyncio.sleep(0.02)
    server.send(b"late")
    data = await asyncio.wait_for(read, 5)
    writer.close()
    server.close()
    return data


# --- hold: one long-lived connection, driven from stdin ------------------------------------------


def hold(family: str) -> None:
    """Keeps a connection across loader restarts and detaches; commands on stdin, one per line:
    `ping N` (N round trips, checked), `unread N` (send N bytes the peer does not read yet),
    `drain` (read what is queued, non-blocking), `exit`."""
    client, server = pair(family)
    print(json.dumps({"ports": ports(client)}), flush=True)
    rc, rs = Reader(client), Reader(server)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "ping":
            ok = True
            for i in range(int(arg)):
                message = f"{i:08d}".encode() * 8
                client.send(message)
                echoed = rs.exactly(len(message))
                server.send(echoed)
                ok &= rc.exactly(len(message)) == message
            print(json.dumps({"ok": ok}), flush=True)
        elif cmd == "unread":
            client.sendall(b"u" * int(arg))
            print(json.dumps({"sent": int(arg)}), flush=True)
        elif cmd == "drain":
            server.setblocking(False)
            total = 0
            try:
                while data := server.recv(1 << 20):
                    total += len(data)
            except BlockingIOError:
                pass
            server.setblocking(True)
            print(json.dumps({"drained": total}), flush=True)
        else:
            break
    client.close()
    server.close()


# --- echo / rtt / stream: two processes ----------------------------------------------------------


def echo(family: str) -> None:
    """Echo connections one after another, in the main thread, until killed. Prints the port.

    Lean on purpose: the round trip it serves should cost the kernel's hop plus as little
    interpreter time as possible (a thread per connection doubled the measured RTT).
    """
    lsock = listener(family)
    print(json.dumps({"port": lsock.getsockname()[1]}), flush=True)
    read, write = os.read, os.write
    while True:
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fd = conn.fileno()
        while True:
            try:
                data = read(fd, 1 << 20)
            except BlockingIOError:  # spurious EAGAIN under redirection: wait again
                continue
            if not data:
                break
            sent = write(fd, data)
            while sent < len(data):
                sent += write(fd, data[sent:])
        conn.close()


def rtt(port: int, count: int, size: int, family: str) -> Json:
    """Round trips of `size` bytes against `echo`; per-trip times, lean loop."""
    sock = connect(family, port)
    fd = sock.fileno()
    message = b"r" * size
    read, write, clock = os.read, os.write, time.perf_counter_ns
    eagain = 0

    def trip() -> None:
        nonlocal eagain
        write(fd, message)
        got = 0
        while got < size:
            try:
                got += len(read(fd, 65536))
            except BlockingIOError:
                eagain += 1

    for _ in range(min(2000, count // 5)):  # warm-up: caches, CPU frequency, the JIT-less VM
        trip()
    samples = [0] * count
    for i in range(count):
        start = clock()
        trip()
        samples[i] = clock() - start
    sock.close()
    samples.sort()
    return {
        "p50_us": samples[len(samples) // 2] / 1000,
        "p99_us": samples[int(len(samples) * 0.99)] / 1000,
        "mean_us": statistics.fmean(samples) / 1000,
        "eagain": eagain,
    }


def stream(port: int, nbytes: int, chunk: int, family: str) -> Json:
    """Send `nbytes` in `chunk`-sized writes; the echo comes back on a reader thread."""
    sock = connect(family, port)
    reader = Reader(sock)
    data = b"s" * chunk
    received = 0

    def drain() -> None:
        nonlocal received
        while received < nbytes:
            got = reader.read(1 << 20)
            if not got:
                return
            received += len(got)

    thread = threading.Thread(target=drain)
    start = time.perf_counter()
    thread.start()
    sent = 0
    while sent < nbytes:
        sock.sendall(data)
        sent += chunk
    thread.join()
    seconds = time.perf_counter() - start
    sock.close()
    return {"mib_per_s": nbytes / seconds / (1 << 20), "bytes": received, "eagain": reader.eagain}


# --- for tests and benchmarks ------------------------------------------------------------------

Preexec = Callable[[], None] | None


def command(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "meshfn.ebpf.probe", *args]


def run(args: Sequence[str], preexec: Preexec = None, timeout: float = 120) -> Json:
    """Run one probe command in a child (inside the cgroup when `preexec` joins it)."""
    proc = subprocess.run(
        command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"probe {' '.join(args)} exited {proc.returncode}: {proc.stderr[-3000:]}"
        )
    result: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def start(args: Sequence[str], preexec: Preexec = None) -> subprocess.Popen[str]:
    """A long-running probe (echo, hold) with stdin/stdout pipes; the caller stops it."""
    return subprocess.Popen(
        command(*args),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,  # noqa: PLW1509 (only os.open/write/close: fork-safe)
    )


def ask(proc: subprocess.Popen[str], line: str | None = None) -> Json:
    """Send one command line to a started probe (None: just read) and parse its JSON answer."""
    assert proc.stdin is not None and proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    answer = proc.stdout.readline()
    if not answer:
        raise RuntimeError(f"probe exited with {proc.wait()}")
    result: Json = json.loads(answer)
    return result


class LoopbackCapture:
    """Counts TCP segments that carry payload on `lo` (AF_PACKET, root).

    Open it before the traffic starts; redirected messages never reach `lo`, so a redirected
    exchange shows only its handshake and FIN segments.
    """

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
        self.sock.bind(("lo", 0))
        self.sock.setblocking(False)
        self.segments: list[tuple[int, int]] = []  # (source port, destination port) with payload

    def _drain(self) -> None:
        while True:
            try:
                frame, addr = self.sock.recvfrom(1 << 17)
            except BlockingIOError:
                return
            if addr[2] == socket.PACKET_OUTGOING:  # each frame on lo is seen twice
                continue
            segment = _tcp_payload(frame)
            if segment is not None and segment[2] > 0:
                self.segments.append(segment[:2])

    def payload_segments(self, ports: Sequence[int], any_port: bool = False) -> int:
        """Segments seen so far between `ports` (both ends among them; `any_port`: either)."""
        self._drain()
        wanted = set(ports)
        if any_port:
            return sum(1 for s in self.segments if wanted & set(s))
        return sum(1 for s in self.segments if set(s) <= wanted)

    def close(self) -> None:
        self.sock.close()


def _tcp_payload(frame: bytes) -> tuple[int, int, int] | None:
    """(source port, destination port, payload length) of a TCP frame, else None."""
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    if ethertype == 0x0800:
        ihl = (frame[14] & 0x0F) * 4
        total = struct.unpack_from("!H", frame, 16)[0]
        if frame[23] != socket.IPPROTO_TCP:
            return None
        tcp, length = 14 + ihl, total - ihl
    elif ethertype == 0x86DD:
        if frame[20] != socket.IPPROTO_TCP:
            return None
        tcp, length = 54, struct.unpack_from("!H", frame, 18)[0]
    else:
        return None
    sport, dport = struct.unpack_from("!HH", frame, tcp)
    offset = (frame[tcp + 12] >> 4) * 4
    return sport, dport, length - offset


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -P -m meshfn.ebpf.probe")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("pingpong", "exchange", "halfclose", "hold", "echo", "rtt", "stream"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--family", choices=["4", "6", "dual"], default="4")
        if name in ("rtt", "stream"):
            cmd.add_argument("--port", type=int, required=True)
        if name in ("pingpong", "rtt"):
            cmd.add_argument("--count", type=int, default=1000)
            cmd.add_argument("--size", type=int, default=64)
        if name in ("exchange", "stream"):
            cmd.add_argument("--bytes", type=int, default=4 << 20)
        if name == "exchange":
            cmd.add_argument("--seed", type=int, default=1)
            cmd.add_argument("--mode", choices=["blocking", "asyncio"], default="blocking")
        if name == "stream":
            cmd.add_argument("--chunk", type=int, default=65536)
        if name == "halfclose":
            cmd.add_argument("--trials", type=int, default=10)
            cmd.add_argument("--mode", choices=["blocking", "asyncio"], default="blocking")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("echo", "hold"):
        (echo if args.command == "echo" else hold)(args.family)
        return 0
    result: Json
    if args.command == "pingpong":
        result = pingpong(args.count, args.size, args.family)
    elif args.command == "exchange":
        run = exchange_blocking if args.mode == "blocking" else exchange_asyncio
        result = run(args.bytes, args.seed, args.family)
    elif args.command == "halfclose":
        result = halfclose(args.trials, args.mode, args.family)
    elif args.command == "rtt":
        result = rtt(args.port, args.count, args.size, args.family)
    else:
        result = stream(args.port, args.bytes, args.chunk, args.family)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
