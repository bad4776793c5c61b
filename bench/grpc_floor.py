"""The grpc.aio floor under bench/xds_push.py's 10,000-stream figure: what Python's gRPC costs
with no xDS work at all, on this machine, set up as that bench is.

N bidi streams, each on its own TCP connection (as each Envoy has its own), the server pinned to
CPU 0 and the client fleet (one grpc.aio process) to CPU 1. Per edit the server writes one
pre-encoded 300-byte message to every stream and reads one pre-encoded ACK back from each;
identity (de)serializers on both sides, no protobuf, no bookkeeping. Convergence: from the
server's first write until every connected client has received the message (CLOCK_MONOTONIC,
comparable across processes). Baseline in the same run: one stream.

If this floor is above a goal, no control plane on grpc.aio meets that goal here: meshfn's ADS
server (xds/) adds its protocol work on top of exactly these writes and reads.

  .venv/bin/python bench/grpc_floor.py                 # 10,000 streams, 10 edits
  .venv/bin/python bench/grpc_floor.py --streams 2000
Prints one line:
  grpc_floor: streams=… converge_p50_ms=… converge_max_ms=… one_stream_p50_ms=…
              server_us_per_stream=… clients_us_per_stream=… server_peak_rss_mb=…
  (server_peak_rss_mb: the server process's peak resident set, ru_maxrss, initial connections
  included; not its RSS at the end)
and writes bench/results/grpc_floor.json (or --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from meshfn.common.processes import raise_open_files_limit
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import pin

HERE = Path(__file__).resolve().parent
METHOD = "/floor/Stream"
PAYLOAD = b"x" * 300
ACK = b"ack-" + b"y" * 20


def _identity(data: bytes) -> bytes:
    return data


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _serve(port: int, conn: Connection) -> None:
    streams: list[Any] = []
    acks, target = [0], [0]
    acked = asyncio.Event()  # every stream has ACKed the current edit

    async def stream(requests: Any, context: Any) -> None:
        streams.append(context)
        async for _ in requests:
            acks[0] += 1
            if acks[0] >= target[0]:
                acked.set()

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: Any) -> Any:
            return grpc.stream_stream_rpc_method_handler(stream, _identity, _identity)

    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 20)])
    server.add_generic_rpc_handlers((Handler(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    conn.send("up")
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command == "count":
            conn.send(len(streams))
        elif command == "quit":
            conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            await server.stop(0)
            return
        else:  # an edit: write to every stream, then wait for every ACK
            cpu, started = _cpu_s(), time.monotonic()
            target[0] = acks[0] + len(streams)
            acked.clear()
            await asyncio.gather(*(context.write(PAYLOAD) for context in streams))
            await acked.wait()
            conn.send((started, _cpu_s() - cpu))


async def _fleet(port: int, n: int, conn: Connection) -> None:
    received: dict[int, float] = {}
    want = [1 << 62]
    arrived = asyncio.Event()  # every counted stream has received the current edit

    async def client(index: int) -> None:
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        call = channel.stream_stream(
            METHOD, request_serializer=_identity, response_deserializer=_identity
        )()
        try:
            await call.write(b"hello")
            async for _ in call:
                received[index] = time.monotonic()
                if len(received) >= want[0]:
                    arrived.set()
                await call.write(ACK)
        except grpc.aio.AioRpcError:
            pass  # a stream that could not connect or was ended: not counted by the server

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(client(i)))
        if i % 100 == 99:
            await asyncio.sleep(0)  # let earlier streams connect while more are opened
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command == "quit":
            for task in tasks:
                task.cancel()
            return
        if command == "reset":
            received.clear()
            want[0] = 1 << 62
            arrived.clear()
            conn.send(_cpu_s())
            continue
        want[0] = command  # the streams the server has
        if len(received) < command:
            await arrived.wait()
        conn.send((max(received.values()), _cpu_s()))


def _run_server(port: int, conn: Connection) -> None:
    asyncio.run(_serve(port, conn))


def _run_fleet(port: int, n: int, conn: Connection) -> None:
    asyncio.run(_fleet(port, n, conn))


def measure(streams: int, edits: int, port: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    server_end, server_child = ctx.Pipe()
    fleet_end, fleet_child = ctx.Pipe()
    server = ctx.Process(target=_run_server, args=(port, server_child))
    server.start()
    fleet = None
    try:
        pin(server.pid or 0, 0)
        if not server_end.poll(60) or server_end.recv() != "up":
            raise SystemExit("the gRPC server did not start")
        fleet = ctx.Process(target=_run_fleet, args=(port, streams, fleet_child))
        fleet.start()
        pin(fleet.pid or 0, 1)
        connected, last = 0, -1
        while connected < streams and connected != last:  # until all, or no more, connect
            last = connected
            time.sleep(3)
            server_end.send("count")
            connected = server_end.recv()
        if not connected:
            raise SystemExit("no stream connected")
        time.sleep(1)
        converge, server_cpu, clients_cpu = [], [], []
        for _ in range(edits):
            fleet_end.send("reset")
            fleet_cpu_before = fleet_end.recv()
            server_end.send("edit")
            fleet_end.send(connected)
            started, cpu = server_end.recv()
            last_received, fleet_cpu_after = fleet_end.recv()
            converge.append((last_received - started) * 1000)
            server_cpu.append(1e6 * cpu / connected)
            clients_cpu.append(1e6 * (fleet_cpu_after - fleet_cpu_before) / connected)
            time.sleep(0.3)
        server_end.send("quit")
        peak_rss = server_end.recv()
        fleet_end.send("quit")
    finally:
        for proc in (server, fleet):
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    return {
        "streams_asked": streams,
        "streams": connected,
        "converge_ms": converge,
        "converge_p50_ms": statistics.median(converge),
        "converge_max_ms": max(converge),
        "server_us_per_stream": statistics.median(server_cpu),
        "clients_us_per_stream": statistics.median(clients_cpu),
        "server_peak_rss_mb": peak_rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=10000)
    parser.add_argument("--edits", type=int, default=10)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "grpc_floor.json")
    args = parser.parse_args()
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no GOAWAY lines as the streams end
    raise_open_files_limit()  # inherited by both processes
    if args.port:
        port, other = args.port, args.port + 1
    else:
        port, other = free_ports(2)
    baseline = measure(1, max(3, args.edits // 2), other)
    large = measure(args.streams, args.edits, port)
    result = {"one_stream": baseline, "large": large}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"grpc_floor: streams={large['streams']} "
        f"converge_p50_ms={large['converge_p50_ms']:.0f} "
        f"converge_max_ms={large['converge_max_ms']:.0f} "
        f"one_stream_p50_ms={baseline['converge_p50_ms']:.2f} "
        f"server_us_per_stream={large['server_us_per_stream']:.0f} "
        f"clients_us_per_stream={large['clients_us_per_stream']:.0f} "
        f"server_peak_rss_mb={large['server_peak_rss_mb']:.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
