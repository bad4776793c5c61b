"""The ADS server over real gRPC (in-process server, grpc.aio clients): SotW and Delta protocol
behaviour, and hostile requests that must end only their own stream."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from meshfn.xds.cache import SnapshotCache, prepare
from meshfn.xds.names import CLUSTER, ENDPOINT, LISTENER, ROUTE
from meshfn.xds.server import AdsServer
from meshfn.xds.stream import Stream as ServerStream
from meshfn.xds.stream import WriteBudget

GROUP = "edge.default"
NODE = base_pb2.Node(id="edge.default~test", cluster=GROUP)


def cla(name: str, port: int) -> endpoint_pb2.ClusterLoadAssignment:
    out = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    lb = out.endpoints.add().lb_endpoints.add()
    lb.endpoint.address.socket_address.address = "127.0.0.1"
    lb.endpoint.address.socket_address.port_value = port
    return out


def resources(ports: dict[str, int]) -> dict[str, dict[str, Any]]:
    return {
        CLUSTER: {n: cluster_pb2.Cluster(name=n, type=cluster_pb2.Cluster.EDS) for n in ports},
        ENDPOINT: {n: cla(n, p) for n, p in ports.items()},
        LISTENER: {},
        ROUTE: {},
    }


class Harness:
    def __init__(self) -> None:
        self.cache = SnapshotCache()
        self.server = AdsServer(self.cache)
        self.port = 0
        self.channel: grpc.aio.Channel | None = None
        self.claimed: set[int] = set()

    async def claim(self) -> ServerStream:
        """The server's side of the client stream that just sent its first request: the
        oldest server stream no client stream has claimed yet."""
        await until(
            "the server's stream",
            lambda: any(s.id not in self.claimed for s in self.server.streams()),
        )
        theirs = next(s for s in self.server.streams() if s.id not in self.claimed)
        self.claimed.add(theirs.id)
        return theirs

    def publish(self, ports: dict[str, int], group: str = GROUP) -> None:
        self.cache.publish(prepare(group, resources(ports), self.cache.get(group)))

    @property
    def stub(self) -> ads_pb2_grpc.AggregatedDiscoveryServiceStub:
        assert self.channel is not None
        return ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)


async def until(what: str, condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.005)


class Stream:
    """A client stream whose responses land in a queue, so tests can assert on silence."""

    def __init__(self, call: Any, harness: Harness | None = None) -> None:
        self.call = call
        self.harness = harness
        self.theirs: ServerStream | None = None
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.received = 0
        self.sent = 0
        self.reader = asyncio.create_task(self._read())
        self.error: grpc.aio.AioRpcError | None = None

    async def _read(self) -> None:
        try:
            async for response in self.call:
                self.received += 1
                await self.responses.put(response)
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        await self.responses.put(None)

    async def send(self, request: Any) -> None:
        await self.call.write(request)
        self.sent += 1

    async def settled(self) -> None:
        """Wait until the server has read and answered every request this stream sent and
        pushed whatever its snapshot asked for, and every response it wrote has arrived here:
        a check of what was (not) answered then holds whatever the server's speed."""
        assert self.harness is not None and self.sent, "settled() needs a request sent first"
        if self.theirs is None:
            self.theirs = await self.harness.claim()
        theirs = self.theirs
        await until(
            "the server done with our requests",
            lambda: theirs.requests == self.sent and not theirs.busy and not theirs.wake.is_set(),
        )
        await until("its responses here", lambda: self.received >= theirs.responses)

    async def next(self, timeout: float = 5.0) -> Any:
        response = await asyncio.wait_for(self.responses.get(), timeout)
        assert response is not None, f"stream ended: {self.error}"
        return response

    async def silent(self) -> None:
        """Nothing was answered or pushed since the last response the test took."""
        await self.settled()
        assert self.responses.empty(), f"unexpected response: {self.responses.get_nowait()}"

    async def status(self, timeout: float = 5.0) -> grpc.StatusCode:
        response = await asyncio.wait_for(self.responses.get(), timeout)
        assert response is None, f"expected the stream to end, got {response}"
        assert self.error is not None
        return self.error.code()


@pytest.fixture
async def ads() -> AsyncIterator[Harness]:
    harness = Harness()
    harness.port = await harness.server.start("127.0.0.1", 0)
    harness.channel = grpc.aio.insecure_channel(f"127.0.0.1:{harness.port}")
    yield harness
    await harness.channel.close()
    await harness.server.stop(0)


def sotw(h: Harness) -> Stream:
    return Stream(h.stub.StreamAggregatedResources(), h)


def delta(h: Harness) -> Stream:
    return Stream(h.stub.DeltaAggregatedResources(), h)


def names_in(response: discovery_pb2.DiscoveryResponse) -> list[str]:
    out = []
    for any_resource in response.resources:
        if any_resource.type_url == CLUSTER:
            c = cluster_pb2.Cluster()
            any_resource.Unpack(c)
            out.append(c.name)
        else:
            e = endpoint_pb2.ClusterLoadAssignment()
            any_resource.Unpack(e)
            out.append(e.cluster_name)
    return out


def proxy(h: Harness) -> dict[str, Any]:
    (only,) = h.server.proxies()
    return only


async def ack_sotw(s: Stream, *answered: tuple[Any, list[str]]) -> None:
    """ACK each SotW response, naming what the client subscribes to of its type."""
    for response, names in answered:
        await s.send(
            discovery_pb2.DiscoveryRequest(
                type_url=response.type_url,
                resource_names=names,
                version_info=response.version_info,
                response_nonce=response.nonce,
            )
        )


# ---------------------------------------------------------------- state of the world


async def test_sotw_wildcard_ack_and_nack(ads: Harness) -> None:
    ads.publish({"a": 1, "b": 2})
    s = sotw(ads)
    await s.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER))
    first = await s.next()
    assert names_in(first) == ["a", "b"]
    version = ads.cache.get(GROUP).type(CLUSTER).version  # type: ignore[union-attr]
    assert first.version_info == version and first.nonce
    assert first.control_plane.identifier == "meshfn"
    await s.send(
        discovery_pb2.DiscoveryRequest(
            type_url=CLUSTER, version_info=version, response_nonce=first.nonce
        )
    )
    await s.silent()
    state = proxy(ads)["types"]["clusters"]
    assert state["acked"] == version and state["in_sync"] and state["last_nack"] is None

    ads.publish({"a": 1, "b": 2, "c": 3})
    second = await s.next()
    assert names_in(second) == ["a", "b", "c"]  # CDS is state of the world: the full set
    await s.send(
        discovery_pb2.DiscoveryRequest(
            type_url=CLUSTER,
            version_info=version,
            response_nonce=second.nonce,
            error_detail=status_pb2.Status(code=3, message="cluster c: bad things"),
        )
    )
    await s.silent()  # a NACK is not answered with the same version again
    state = proxy(ads)["types"]["clusters"]
    assert state["last_nack"]["error"] == "cluster c: bad things"
    assert state["last_nack"]["version"] == second.version_info
    assert state["acked"] == version and not state["in_sync"]
    await s.call.done_writing()


async def test_sotw_eds_sends_only_what_changed(ads: Harness) -> None:
    ads.publish({"a": 1, "b": 2, "c": 3})
    s = sotw(ads)
    await s.send(
        discovery_pb2.DiscoveryRequest(node=NODE, type_url=ENDPOINT, resource_names=["a", "b"])
    )
    first = await s.next()
    assert names_in(first) == ["a", "b"]
    ack = discovery_pb2.DiscoveryRequest(
        type_url=ENDPOINT,
        resource_names=["a", "b"],
        version_info=first.version_info,
        response_nonce=first.nonce,
    )
    await s.send(ack)
    await s.silent()
    ads.publish({"a": 1, "b": 20, "c": 30})  # c changed too, but is not subscribed
    second = await s.next()
    assert names_in(second) == ["b"]
    ack.version_info, ack.response_nonce = second.version_info, second.nonce
    await s.send(ack)
    # Subscribing to one more name sends just that one, at once (no wait for a new version).
    await s.send(
        discovery_pb2.DiscoveryRequest(
            type_url=ENDPOINT,
            resource_names=["a", "b", "c"],
            version_info=second.version_info,
            response_nonce=second.nonce,
        )
    )
    third = await s.next()
    assert names_in(third) == ["c"]
    ads.publish({"a": 1, "b": 20, "c": 30, "d": 4})  # only an unsubscribed name changed
    await s.silent()


async def test_sotw_stale_nonce_is_ignored(ads: Harness) -> None:
    ads.publish({"a": 1})
    s = sotw(ads)
    await s.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER))
    first = await s.next()
    ads.publish({"a": 1, "b": 2})
    second = await s.next()
    # An ACK of the first response arrives after the second was sent: stale, not an ACK.
    await s.send(
        discovery_pb2.DiscoveryRequest(
            type_url=CLUSTER, version_info=first.version_info, response_nonce=first.nonce
        )
    )
    await s.silent()
    assert proxy(ads)["types"]["clusters"]["acked"] == ""
    await s.send(
        discovery_pb2.DiscoveryRequest(
            type_url=CLUSTER, version_info=second.version_info, response_nonce=second.nonce
        )
    )
    await s.settled()
    assert proxy(ads)["types"]["clusters"]["acked"] == second.version_info


async def test_sotw_reconnect_with_current_version_gets_nothing(ads: Harness) -> None:
    ads.publish({"a": 1})
    version = ads.cache.get(GROUP).type(CLUSTER).version  # type: ignore[union-attr]
    s = sotw(ads)
    await s.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER, version_info=version))
    await s.silent()
    assert proxy(ads)["types"]["clusters"]["in_sync"]
    ads.publish({"a": 1, "b": 2})
    assert names_in(await s.next()) == ["a", "b"]


async def test_sotw_leaving_an_explicit_wildcard(ads: Harness) -> None:
    ads.publish({"a": 1, "b": 2})
    s = sotw(ads)
    await s.send(
        discovery_pb2.DiscoveryRequest(node=NODE, type_url=ENDPOINT, resource_names=["*", "a"])
    )
    first = await s.next()
    assert names_in(first) == ["a", "b"]
    for names in (["*", "a"], ["a"]):  # ACK, then drop "*" and keep "a": nothing new to send
        await s.send(
            discovery_pb2.DiscoveryRequest(
                type_url=ENDPOINT,
                resource_names=names,
                version_info=first.version_info,
                response_nonce=first.nonce,
            )
        )
        await s.silent()
    ads.publish({"a": 1, "b": 20})  # only b, which it no longer subscribes to
    await s.silent()
    ads.publish({"a": 10, "b": 20})
    assert names_in(await s.next()) == ["a"]


async def test_push_order_is_make_before_break(ads: Harness) -> None:
    ads.publish({"a": 1})
    s = sotw(ads)
    await s.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER))
    cds = await s.next()
    await s.send(discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=["a"]))
    eds = await s.next()
    await ack_sotw(s, (cds, []), (eds, ["a"]))
    await s.silent()
    ads.publish({"a": 2, "b": 3})  # changes endpoints of a and adds cluster b
    first, second = await s.next(), await s.next()
    assert [first.type_url, second.type_url] == [ENDPOINT, CLUSTER]


def publish_with_changed_clusters(
    h: Harness, ports: dict[str, int], changed: tuple[str, ...]
) -> None:
    """Publish `ports` with the clusters `changed` altered (a connect timeout) and their
    endpoints as they were."""
    res = resources(ports)
    for name in changed:
        res[CLUSTER][name].connect_timeout.seconds = 7
    h.cache.publish(prepare(GROUP, res, h.cache.get(GROUP)))


async def test_sotw_changed_cluster_gets_its_endpoints_again(ads: Harness) -> None:
    """Envoy replaces a changed cluster, and the new one warms until it gets its endpoints,
    which Envoy does not ask for again: they follow the clusters, even unchanged. Only the
    changed clusters' (b's are not resent), and only subscribed ones (c's comes when asked)."""
    ads.publish({"a": 1, "b": 2})
    s = sotw(ads)
    await s.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER))
    cds = await s.next()
    await s.send(discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=["a", "b"]))
    eds = await s.next()
    await ack_sotw(s, (cds, []), (eds, ["a", "b"]))
    await s.silent()
    publish_with_changed_clusters(ads, {"a": 1, "b": 2, "c": 3}, ("a",))
    clusters, again = await s.next(), await s.next()
    assert clusters.type_url == CLUSTER and names_in(clusters) == ["a", "b", "c"]
    assert again.type_url == ENDPOINT and names_in(again) == ["a"]
    assert again.resources[0] == eds.resources[0]  # unchanged, sent again
    await ack_sotw(s, (clusters, []), (again, ["a", "b"]))
    await s.silent()
    assert all(t["in_sync"] for t in proxy(ads)["types"].values())
    publish_with_changed_clusters(ads, {"a": 1, "b": 2, "c": 3}, ())  # only a changes back
    clusters = await s.next()
    assert clusters.type_url == CLUSTER
    assert names_in(await s.next()) == ["a"]


async def test_delta_changed_cluster_gets_its_endpoints_again(ads: Harness) -> None:
    ads.publish({"a": 1, "b": 2})
    s = delta(ads)
    await s.send(discovery_pb2.DeltaDiscoveryRequest(node=NODE, type_url=CLUSTER))
    cds = await s.next()
    await s.send(discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=cds.nonce))
    await s.send(
        discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=["a", "b"])
    )
    eds = await s.next()
    await s.send(discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, response_nonce=eds.nonce))
    await s.silent()
    publish_with_changed_clusters(ads, {"a": 1, "b": 2, "c": 3}, ("a",))
    clusters, again = await s.next(), await s.next()
    assert clusters.type_url == CLUSTER
    assert sorted(r.name for r in clusters.resources) == ["a", "c"]
    assert again.type_url == ENDPOINT and [r.name for r in again.resources] == ["a"]
    assert not again.removed_resources
    version = {r.name: r.version for r in eds.resources}["a"]
    assert again.resources[0].version == version  # unchanged, sent again
    for response in (clusters, again):
        await s.send(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=response.type_url, response_nonce=response.nonce
            )
        )
    await s.silent()
    assert all(t["in_sync"] for t in proxy(ads)["types"].values())
    ads.publish({"a": 1, "b": 5, "c": 3})  # a's cluster back; b's endpoints changed
    changed, clusters, again = await s.next(), await s.next(), await s.next()
    assert changed.type_url == ENDPOINT and [r.name for r in changed.resources] == ["b"]
    assert clusters.type_url == CLUSTER and [r.name for r in clusters.resources] == ["a"]
    assert [r.name for r in again.resources] == ["a"]


async def test_unknown_workload_waits_for_its_snapshot(ads: Harness) -> None:
    s = sotw(ads)
    await s.send(
        discovery_pb2.DiscoveryRequest(
            node=base_pb2.Node(id="x~1", cluster="later.default"), type_url=CLUSTER
        )
    )
    await s.silent()
    assert proxy(ads)["known_workload"] is False
    ads.publish({"z": 9}, group="later.default")
    assert names_in(await s.next()) == ["z"]


# ---------------------------------------------------------------- delta


async def test_delta_wildcard_named_and_removal(ads: Harness) -> None:
    ads.publish({"a": 1, "b": 2})
    s = delta(ads)
    await s.send(discovery_pb2.DeltaDiscoveryRequest(node=NODE, type_url=CLUSTER))
    first = await s.next()
    assert sorted(r.name for r in first.resources) == ["a", "b"]
    await s.send(discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=first.nonce))
    await s.send(
        discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=["a"])
    )
    eds = await s.next()
    assert [r.name for r in eds.resources] == ["a"]
    await s.send(discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, response_nonce=eds.nonce))
    await s.silent()
    ads.publish({"a": 1})  # b removed
    removal = await s.next()
    assert removal.type_url == CLUSTER
    assert list(removal.removed_resources) == ["b"] and not removal.resources
    await s.send(
        discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=removal.nonce)
    )
    ads.publish({"a": 5})
    changed = await s.next()
    assert changed.type_url == ENDPOINT and [r.name for r in changed.resources] == ["a"]
    # Unsubscribed names are no longer pushed.
    await s.send(
        discovery_pb2.DeltaDiscoveryRequest(
            type_url=ENDPOINT, response_nonce=changed.nonce, resource_names_unsubscribe=["a"]
        )
    )
    await s.settled()
    ads.publish({"a": 6})
    await s.silent()
    states = proxy(ads)["types"]
    assert states["clusters"]["in_sync"] and states["clusters"]["resources"] == 1


async def test_delta_reconnect_skips_what_the_proxy_has(ads: Harness) -> None:
    ads.publish({"a": 1, "b": 2})
    ts = ads.cache.get(GROUP).type(CLUSTER)  # type: ignore[union-attr]
    s = delta(ads)
    await s.send(
        discovery_pb2.DeltaDiscoveryRequest(
            node=NODE,
            type_url=CLUSTER,
            initial_resource_versions={"a": ts.resources["a"].version, "b": "stale", "gone": "x"},
        )
    )
    first = await s.next()
    assert [r.name for r in first.resources] == ["b"]
    assert list(first.removed_resources) == ["gone"]


async def test_delta_fresh_streams_share_one_response(ads: Harness) -> None:
    """A fleet connecting at once is answered with one shared response (one nonce, one bytes
    object); a client that already holds something gets its own."""
    ads.publish({"a": 1, "b": 2})
    ts = ads.cache.get(GROUP).type(CLUSTER)  # type: ignore[union-attr]
    first, second, holder = delta(ads), delta(ads), delta(ads)
    for s in (first, second):
        await s.send(discovery_pb2.DeltaDiscoveryRequest(node=NODE, type_url=CLUSTER))
    await holder.send(
        discovery_pb2.DeltaDiscoveryRequest(
            node=NODE, type_url=CLUSTER, initial_resource_versions={"a": ts.resources["a"].version}
        )
    )
    one, two, own = await first.next(), await second.next(), await holder.next()
    assert one.nonce == two.nonce and sorted(r.name for r in one.resources) == ["a", "b"]
    assert own.nonce != one.nonce and [r.name for r in own.resources] == ["b"]
    # Each stream ACKs the shared nonce as its own.
    for s, response in ((first, one), (second, two), (holder, own)):
        await s.send(
            discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=response.nonce)
        )
    await until(
        "three ACKs",
        lambda: [p["types"]["clusters"]["in_sync"] for p in ads.server.proxies()] == [True] * 3,
    )


async def test_large_responses_wait_for_the_write_budget() -> None:
    """With room for one large response at a time, every stream still gets its whole
    configuration, and a later push still arrives: the budget delays, never loses."""
    h = Harness()
    budget = WriteBudget(limit=1)
    h.server = AdsServer(h.cache, budget=budget)
    h.port = await h.server.start("127.0.0.1", 0)
    h.channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.port}")
    try:
        ports = {f"cluster-{i:04d}-{'x' * 40}": 1000 + i for i in range(1500)}
        h.publish(ports)
        clusters = h.cache.get(GROUP).type(CLUSTER)  # type: ignore[union-attr]
        assert sum(len(r.delta_entry) for r in clusters.resources.values()) > WriteBudget.SMALL
        streams = [delta(h) for _ in range(6)]
        for s in streams:
            await s.send(discovery_pb2.DeltaDiscoveryRequest(node=NODE, type_url=CLUSTER))
        for s in streams:
            response = await s.next(timeout=20)
            assert len(response.resources) == len(ports)
            await s.send(
                discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=response.nonce)
            )
        assert budget.used == 0
        h.publish(ports | {"added": 9})
        for s in streams:
            pushed = await s.next()
            assert [r.name for r in pushed.resources] == ["added"]
    finally:
        await h.channel.close()
        await h.server.stop(0)


class Writes:
    """The one call WriteBudget makes on a stream's context: writes complete when released."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.release: dict[int, asyncio.Future[None]] = {}

    async def write(self, data: bytes) -> None:
        self.started.append(len(data))
        gate = self.release[len(data)] = asyncio.get_running_loop().create_future()
        await gate


async def test_write_budget_queues_large_writes_and_lets_small_ones_pass() -> None:
    budget = WriteBudget(limit=3 * WriteBudget.SMALL)
    writes = Writes()
    big = [b"x" * (WriteBudget.SMALL * 2 + i) for i in range(3)]
    tasks = [asyncio.create_task(budget.write(writes, data)) for data in big]  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert writes.started == [len(big[0])]  # the second would exceed the limit: it waits
    small = asyncio.create_task(budget.write(writes, b"tiny"))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert writes.started[-1] == 4  # a small push never waits
    writes.release[4].set_result(None)
    tasks[1].cancel()  # a stream that ends while waiting gives up its place
    writes.release[len(big[0])].set_result(None)
    await asyncio.sleep(0.01)
    assert writes.started == [len(big[0]), 4, len(big[2])]
    writes.release[len(big[2])].set_result(None)
    await asyncio.gather(tasks[0], tasks[2], small)
    assert budget.used == 0


async def test_delta_nack(ads: Harness) -> None:
    ads.publish({"a": 1})
    s = delta(ads)
    await s.send(discovery_pb2.DeltaDiscoveryRequest(node=NODE, type_url=CLUSTER))
    first = await s.next()
    await s.send(
        discovery_pb2.DeltaDiscoveryRequest(
            type_url=CLUSTER,
            response_nonce=first.nonce,
            error_detail=status_pb2.Status(code=3, message="nope"),
        )
    )
    await s.silent()
    assert proxy(ads)["types"]["clusters"]["last_nack"]["error"] == "nope"


# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (
            discovery_pb2.DiscoveryRequest(node=NODE, type_url="type.googleapis.com/evil.Thing"),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (discovery_pb2.DiscoveryRequest(type_url=CLUSTER), grpc.StatusCode.INVALID_ARGUMENT),
        (
            discovery_pb2.DiscoveryRequest(
                node=NODE, type_url=ENDPOINT, resource_names=[str(i) for i in range(100_001)]
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            discovery_pb2.DiscoveryRequest(
                node=NODE, type_url=ENDPOINT, resource_names=["x" * 5000]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            discovery_pb2.DiscoveryRequest(
                node=NODE, type_url=CLUSTER, response_nonce="not-a-nonce"
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            discovery_pb2.DiscoveryRequest(
                node=NODE, type_url=CLUSTER, response_nonce="ffffffffff"
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            discovery_pb2.DiscoveryRequest(
                node=base_pb2.Node(id="x" * 2000, cluster="c"), type_url=CLUSTER
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
async def test_hostile_sotw_requests_end_only_their_stream(
    ads: Harness, request_: discovery_pb2.DiscoveryRequest, code: grpc.StatusCode
) -> None:
    ads.publish({"a": 1})
    good = sotw(ads)
    await good.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER))
    first = await good.next()
    bad = sotw(ads)
    await bad.send(request_)
    assert await bad.status() == code
    await good.send(
        discovery_pb2.DiscoveryRequest(
            type_url=CLUSTER, version_info=first.version_info, response_nonce=first.nonce
        )
    )
    ads.publish({"a": 1, "b": 2})
    assert names_in(await good.next()) == ["a", "b"]
    assert len(ads.server.proxies()) == 1


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (payload < 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


GOOD_NODE = _field(1, b"edge.default~test") + _field(2, GROUP.encode())


@pytest.mark.parametrize(
    "raw",
    [
        # node with invalid UTF-8 (fuzz finding ads/sotw-node-with-invalid-utf8)
        _field(2, _field(1, b"ed\xff\xff") + _field(2, GROUP.encode()))
        + _field(4, CLUSTER.encode()),
        # a resource name with invalid UTF-8: the names are parsed only when they change
        _field(2, GOOD_NODE) + _field(3, b"\xff\xfe") + _field(4, ENDPOINT.encode()),
    ],
    ids=["node", "names"],
)
async def test_lazily_parsed_garbage_ends_the_stream_cleanly(ads: Harness, raw: bytes) -> None:
    """SotW requests are parsed in parts (lite.py); a part that fails to parse later still ends
    the stream with INVALID_ARGUMENT, not an unexpected exception."""
    ads.publish({"a": 1})
    assert ads.channel is not None
    call = ads.channel.stream_stream(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
        request_serializer=lambda b: b,
        response_deserializer=discovery_pb2.DiscoveryResponse.FromString,
    )()
    s = Stream(call)
    await s.send(raw)
    assert await s.status() == grpc.StatusCode.INVALID_ARGUMENT
    assert s.error is not None and s.error.details() == "malformed discovery request"


async def test_hostile_delta_request(ads: Harness) -> None:
    s = delta(ads)
    await s.send(
        discovery_pb2.DeltaDiscoveryRequest(node=NODE, type_url=CLUSTER, response_nonce="zz")
    )
    assert await s.status() == grpc.StatusCode.INVALID_ARGUMENT


async def test_malformed_bytes(ads: Harness) -> None:
    assert ads.channel is not None
    raw = ads.channel.stream_stream(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    s = Stream(raw())
    await s.send(b"\xff\xff\xff\xff garbage")
    assert await s.status() == grpc.StatusCode.INVALID_ARGUMENT
    assert ads.server.metrics.stream_errors.labels("malformed")._value.get() == 1


async def test_streams_must_prove_their_workload(tmp_path: Any) -> None:
    from meshfn.control_plane.identity.bootstrap_token import BootstrapTokens

    tokens = BootstrapTokens(tmp_path / "key")
    cache = SnapshotCache()
    cache.publish(prepare(GROUP, resources({"a": 1})))
    server = AdsServer(cache, authenticate=tokens.verify)
    port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    try:
        for metadata in (None, (("authorization", tokens.header("other.default")),)):
            s = Stream(stub.StreamAggregatedResources(metadata=metadata))
            await s.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER))
            assert await s.status() == grpc.StatusCode.UNAUTHENTICATED
        good = Stream(
            stub.StreamAggregatedResources(metadata=(("authorization", tokens.header(GROUP)),))
        )
        await good.send(discovery_pb2.DiscoveryRequest(node=NODE, type_url=CLUSTER))
        assert names_in(await good.next()) == ["a"]
    finally:
        await channel.close()
        await server.stop(0)


async def test_the_server_reports_open_streams_for_gc_tuning() -> None:
    """on_streams hears every change of the open-stream count (control_plane.service scales
    the young-generation GC threshold with it)."""
    counts: list[int] = []
    h = Harness()
    h.server = AdsServer(h.cache, on_streams=counts.append)
    h.port = await h.server.start("127.0.0.1", 0)
    h.channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.port}")
    try:
        h.publish({"a": 1})
        streams = [delta(h), delta(h)]
        for s in streams:
            await s.send(discovery_pb2.DeltaDiscoveryRequest(node=NODE, type_url=CLUSTER))
            await s.next()
        assert counts == [1, 2]
        for s in streams:
            s.call.cancel()
        await until("both streams closed", lambda: counts[-1:] == [0])
        assert counts == [1, 2, 1, 0]
    finally:
        await h.channel.close()
        await h.server.stop(0)


def test_gc_threshold_grows_with_the_streams() -> None:
    from meshfn.control_plane import service

    before = gc.get_threshold()
    try:
        service.scale_gc(10_000)  # before tune_gc (meshfn serve/up call it): no effect
        assert gc.get_threshold() == before
        service._gc_tuned[0] = True  # what tune_gc sets, without its full collection
        service.scale_gc(0)
        assert gc.get_threshold()[0] == service.GC_YOUNG
        service.scale_gc(10_000)
        assert gc.get_threshold()[0] == service.GC_YOUNG + 10_000 * service.GC_YOUNG_PER_STREAM
    finally:
        service._gc_tuned[0] = False
        gc.set_threshold(*before)
