"""Simulated Envoys for bench/xds_push.py: N ADS streams (one gRPC connection each) in one
grpc.aio process, subscribing and ACKing the way Envoy does (CDS -> EDS by name -> LDS -> RDS).

Driven over stdin/stdout by the benchmark:
  -> (start)               <- READY <seconds to sync all>
  -> WAIT <cluster> <port> <- DONE <latest time> <streams> <other EDS updates>
                              (once EVERY stream has ACKed an EDS update whose endpoints for
                              <cluster> carry <port>: the latest of those ACK times; and how many
                              EDS updates without it arrived meanwhile, e.g. duplicates)
                           <- TIMEOUT <streams that have it>
  -> QUIT
Each stream has its own TCP connection, as each Envoy has (--shared-connection multiplexes them
on one, as grpc does by default for channels to one target). Convergence is per stream and by
content: a duplicate push to one stream cannot stand in for a
stream that never got the update. Times are time.monotonic() (CLOCK_MONOTONIC, comparable
across processes on Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
SOTW = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
DELTA = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"


class Fleet:
    def __init__(self, clients: int) -> None:
        self.clients = clients
        self.synced = 0
        self.all_synced = asyncio.Event()
        # (cluster, port) -> {stream index: monotonic time of the ACK that carried it}
        self.seen: dict[tuple[str, int], dict[int, float]] = {}
        self.other_updates = 0  # EDS updates after sync carrying no awaited (cluster, port)
        self.waiters: dict[tuple[str, int], asyncio.Future[float]] = {}

    def eds_acked(self, index: int, resources: list[any_pb2.Any]) -> None:
        """Stream `index` ACKed an EDS update (after its initial sync) with these resources."""
        now = time.monotonic()
        new = False
        for resource in resources:
            cla = endpoint_pb2.ClusterLoadAssignment()
            resource.Unpack(cla)
            for locality in cla.endpoints:
                for lb in locality.lb_endpoints:
                    key = (cla.cluster_name, lb.endpoint.address.socket_address.port_value)
                    streams = self.seen.setdefault(key, {})
                    if index not in streams:
                        streams[index] = now
                        new = True
                    future = self.waiters.get(key)
                    if future is not None and len(streams) == self.clients and not future.done():
                        future.set_result(max(streams.values()))
        if not new:
            self.other_updates += 1


async def sotw_client(
    channel: grpc.aio.Channel,
    index: int,
    group: str,
    eds_names: list[str],
    routes: list[str],
    fleet: Fleet,
    authorization: str,
) -> None:
    call = channel.stream_stream(
        SOTW,
        request_serializer=discovery_pb2.DiscoveryRequest.SerializeToString,
        response_deserializer=discovery_pb2.DiscoveryResponse.FromString,
    )(metadata=(("authorization", authorization),) if authorization else None)
    node = base_pb2.Node(id=f"{group}~sim-{index}", cluster=group)
    # Envoy re-sends the full name list with every EDS/RDS request (ACKs included).
    requests = {
        CDS: discovery_pb2.DiscoveryRequest(type_url=CDS),
        EDS: discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=eds_names),
        LDS: discovery_pb2.DiscoveryRequest(type_url=LDS),
        RDS: discovery_pb2.DiscoveryRequest(type_url=RDS, resource_names=routes),
    }
    first = discovery_pb2.DiscoveryRequest(node=node, type_url=CDS)
    await call.write(first)
    acked: set[str] = set()
    async for response in call:
        request = requests[response.type_url]
        request.version_info = response.version_info
        request.response_nonce = response.nonce
        await call.write(request)
        if response.type_url == EDS and len(acked) == 4:
            fleet.eds_acked(index, list(response.resources))
        if response.type_url not in acked:
            acked.add(response.type_url)
            if response.type_url == CDS:
                await call.write(
                    discovery_pb2.DiscoveryRequest(type_url=EDS, resource_names=eds_names)
                )
                await call.write(discovery_pb2.DiscoveryRequest(type_url=LDS))
            elif response.type_url == LDS:
                await call.write(
                    discovery_pb2.DiscoveryRequest(type_url=RDS, resource_names=routes)
                )
            if len(acked) == 4:
                fleet.synced += 1
                if fleet.synced == fleet.clients:
                    fleet.all_synced.set()


async def delta_client(
    channel: grpc.aio.Channel,
    index: int,
    group: str,
    eds_names: list[str],
    routes: list[str],
    fleet: Fleet,
    authorization: str,
) -> None:
    call = channel.stream_stream(
        DELTA,
        request_serializer=discovery_pb2.DeltaDiscoveryRequest.SerializeToString,
        response_deserializer=discovery_pb2.DeltaDiscoveryResponse.FromString,
    )(metadata=(("authorization", authorization),) if authorization else None)
    node = base_pb2.Node(id=f"{group}~sim-{index}", cluster=group)
    await call.write(discovery_pb2.DeltaDiscoveryRequest(node=node, type_url=CDS))
    acked: set[str] = set()
    async for response in call:
        await call.write(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=response.type_url, response_nonce=response.nonce
            )
        )
        if response.type_url == EDS and len(acked) == 4:
            fleet.eds_acked(index, [r.resource for r in response.resources])
        if response.type_url not in acked:
            acked.add(response.type_url)
            if response.type_url == CDS:
                await call.write(
                    discovery_pb2.DeltaDiscoveryRequest(
                        type_url=EDS, resource_names_subscribe=eds_names
                    )
                )
                await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=LDS))
            elif response.type_url == LDS:
                await call.write(
                    discovery_pb2.DeltaDiscoveryRequest(
                        type_url=RDS, resource_names_subscribe=routes
                    )
                )
            if len(acked) == 4:
                fleet.synced += 1
                if fleet.synced == fleet.clients:
                    fleet.all_synced.set()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--services", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--protocol", choices=["sotw", "delta"], default="sotw")
    parser.add_argument("--authorization", default="", help="bootstrap token header value")
    parser.add_argument(
        "--shared-connection", action="store_true", help="all streams on one TCP connection"
    )
    args = parser.parse_args()
    eds_names = [f"svc-{i:05d}.bench" for i in range(args.services)]
    fleet = Fleet(args.clients)
    client = sotw_client if args.protocol == "sotw" else delta_client
    started = time.monotonic()
    channels = []
    tasks = []
    for i in range(args.clients):
        channel = grpc.aio.insecure_channel(
            args.target,
            options=[
                ("grpc.max_receive_message_length", 256 * 1024 * 1024),
                # One connection per simulated Envoy, as real ones have: otherwise grpc shares
                # one subchannel (one TCP connection) between all channels to a target.
                ("grpc.use_local_subchannel_pool", 0 if args.shared_connection else 1),
            ],
        )
        channels.append(channel)
        tasks.append(
            asyncio.create_task(
                client(channel, i, args.group, eds_names, ["http"], fleet, args.authorization)
            )
        )
        if i % 100 == 99:
            await asyncio.sleep(0)  # let earlier streams make progress while we open more
    done = asyncio.ensure_future(fleet.all_synced.wait())
    failed = asyncio.ensure_future(asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION))
    await asyncio.wait({done, failed}, return_when=asyncio.FIRST_COMPLETED)
    if not done.done():
        errors = [t.exception() for t in tasks if t.done() and t.exception()]
        detail = "; ".join(
            f"{e.code()}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else repr(e)
            for e in errors[:3]
        )
        print(f"FAILED {len(errors)} streams: {detail}", flush=True)
        return
    # Real Envoys are not Python: keep the harness's own cost low. Every stream keeps dozens of
    # young objects alive (its pending read), which default GC thresholds walk many times per
    # push (the control plane scales its threshold the same way, control_plane/service.py).
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000 + 100 * args.clients, 50, 50)
    print(f"READY {time.monotonic() - started:.3f}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] == "WAIT":
            key = (line[1], int(line[2]))
            streams = fleet.seen.get(key, {})
            future: asyncio.Future[float] = loop.create_future()
            if len(streams) == args.clients:
                future.set_result(max(streams.values()))
            fleet.waiters[key] = future
            try:
                at = await asyncio.wait_for(future, 60)
                print(f"DONE {at:.6f} {args.clients} {fleet.other_updates}", flush=True)
            except TimeoutError:
                print(f"TIMEOUT {len(fleet.seen.get(key, {}))}", flush=True)
            del fleet.waiters[key]
        elif line[0] == "QUIT":
            break
    for task in tasks:
        task.cancel()
    for channel in channels:
        await channel.close(None)


if __name__ == "__main__":
    asyncio.run(main())
