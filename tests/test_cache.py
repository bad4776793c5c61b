"""Snapshot cache: encode once, content versions, diffs, and hand-built wire bytes that decode
to exactly what protobuf would have built."""

from __future__ import annotations

from pathlib import Path

from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from meshfn.control_plane.policy import load_policies
from meshfn.xds import wire
from meshfn.xds.cache import Resource, SnapshotCache, TypeSnapshot, prepare
from meshfn.xds.names import CLUSTER, ENDPOINT, LISTENER, ROUTE
from meshfn.xds.translate import translate

EXAMPLES = Path(__file__).resolve().parents[1] / "policies" / "examples"


def clusters(*names: str, timeout: int = 1) -> dict[str, cluster_pb2.Cluster]:
    out = {}
    for name in names:
        c = cluster_pb2.Cluster(name=name)
        c.connect_timeout.seconds = timeout
        out[name] = c
    return out


def test_sotw_bytes_decode_to_the_protobuf_equivalent() -> None:
    resources = clusters("a", "b")
    encoded = [Resource.encode(CLUSTER, n, m) for n, m in resources.items()]
    data = wire.sotw_response("v1", b"".join(r.sotw_entry for r in encoded), CLUSTER, "1f")
    decoded = discovery_pb2.DiscoveryResponse.FromString(data)
    expected = discovery_pb2.DiscoveryResponse(version_info="v1", type_url=CLUSTER, nonce="1f")
    for message in resources.values():
        expected.resources.add().Pack(message, deterministic=True)
    expected.control_plane.identifier = "meshfn"
    assert decoded == expected
    # Canonical field order, so the bytes equal protobuf's own serialisation.
    assert data == expected.SerializeToString(deterministic=True)


def test_delta_bytes_decode_to_the_protobuf_equivalent() -> None:
    resources = clusters("a")
    entry = Resource.encode(CLUSTER, "a", resources["a"])
    data = wire.delta_response("sys", entry.delta_entry, CLUSTER, ["gone", "also-gone"], "7")
    decoded = discovery_pb2.DeltaDiscoveryResponse.FromString(data)
    assert decoded.system_version_info == "sys"
    assert decoded.type_url == CLUSTER and decoded.nonce == "7"
    assert list(decoded.removed_resources) == ["gone", "also-gone"]
    (resource,) = decoded.resources
    assert resource.name == "a" and resource.version == entry.version
    unpacked = cluster_pb2.Cluster()
    assert resource.resource.Unpack(unpacked)
    assert unpacked == resources["a"]


def test_versions_are_content_hashes() -> None:
    a1 = Resource.encode(CLUSTER, "a", clusters("a")["a"])
    a2 = Resource.encode(CLUSTER, "a", clusters("a")["a"])
    a3 = Resource.encode(CLUSTER, "a", clusters("a", timeout=2)["a"])
    assert a1.version == a2.version != a3.version
    t1 = TypeSnapshot(CLUSTER, {"a": a1})
    assert t1.version == TypeSnapshot(CLUSTER, {"a": a2}).version
    assert t1.version != TypeSnapshot(CLUSTER, {"a": a3}).version
    assert t1.version != TypeSnapshot(CLUSTER, {}).version


def test_prepare_reuses_unchanged_resources_and_types() -> None:
    first = prepare("g", {CLUSTER: clusters("a", "b"), LISTENER: {}})
    second = prepare("g", {CLUSTER: clusters("a", "b"), LISTENER: {}}, first)
    # Equal content (even from new message objects) keeps the TypeSnapshot object itself.
    assert second.types[CLUSTER] is first.types[CLUSTER]
    third = prepare("g", {CLUSTER: clusters("a", "b", timeout=5) | clusters("a")}, second)
    assert third.types[CLUSTER] is not first.types[CLUSTER]
    assert third.types[CLUSTER].resources["a"] is first.types[CLUSTER].resources["a"]
    changed, removed = third.types[CLUSTER].diff_from(first.types[CLUSTER])
    assert changed == {"b"} and removed == frozenset()
    fourth = prepare("g", {CLUSTER: clusters("a", "c")}, third)
    assert fourth.types[CLUSTER].diff_from(third.types[CLUSTER]) == ({"c"}, {"b"})


def test_publish_notifies_watchers_only_on_change() -> None:
    cache = SnapshotCache()
    calls: list[str] = []
    cache.watch("g", lambda: calls.append("g"))
    cache.watch("h", lambda: calls.append("h"))
    snapshot = prepare("g", {CLUSTER: clusters("a")})
    assert cache.publish(snapshot)
    assert not cache.publish(prepare("g", {CLUSTER: clusters("a")}, snapshot))
    assert calls == ["g"]
    assert cache.retain(["h"]) == ["g"]
    assert cache.get("g") is None


def test_responses_are_shared_bytes_and_nonces() -> None:
    ts = TypeSnapshot(CLUSTER, {"a": Resource.encode(CLUSTER, "a", clusters("a")["a"])})
    built: list[str] = []

    def build(nonce: str) -> bytes:
        built.append(nonce)
        return nonce.encode()

    first = ts.response("key", build)
    second = ts.response("key", build)
    assert first is second and len(built) == 1
    assert ts.response("other", build)[0] != first[0]


def test_translation_of_examples_round_trips_through_any() -> None:
    model = load_policies(EXAMPLES)
    resources = translate(model, "edge.ingress")
    assert resources is not None
    snapshot = prepare("edge.ingress", resources)
    for type_url in (LISTENER, ROUTE, CLUSTER, ENDPOINT):
        for name, resource in snapshot.types[type_url].resources.items():
            entry = discovery_pb2.DiscoveryResponse.FromString(resource.sotw_entry).resources[0]
            assert isinstance(entry, any_pb2.Any) and entry.type_url == type_url
            assert entry.value == resources[type_url][name].SerializeToString(deterministic=True)
