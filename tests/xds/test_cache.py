"""Snapshot cache: encode once, content versions, diffs, hand-built wire bytes that decode to
exactly what protobuf would have built, and the consistency check that keeps a snapshot naming
resources it lacks from ever being published."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, extension_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from meshfn.control_plane import service
from meshfn.control_plane.service import ControlPlane
from meshfn.policy import load_policies
from meshfn.xds import wire
from meshfn.xds.cache import (
    InconsistentSnapshot,
    Resource,
    Snapshot,
    SnapshotCache,
    TypeSnapshot,
    prepare,
)
from meshfn.xds.names import CLUSTER, ENDPOINT, EXTENSION, LISTENER, ROUTE
from meshfn.xds.translate import translate

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


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


# ---------------------------------------------------------------- consistency


def eds(name: str, service_name: str = "") -> cluster_pb2.Cluster:
    out = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS)
    out.eds_cluster_config.service_name = service_name
    return out


def listener(
    name: str, rds: str = "", ecds: str = "", listener_ecds: str = ""
) -> listener_pb2.Listener:
    """An HCM listener: RDS `rds` (else an inline route_config, as sidecars have) and an HTTP
    filter configured over ECDS as `ecds`; `listener_ecds`, a listener filter over ECDS."""
    manager = hcm.HttpConnectionManager(stat_prefix=name)
    if rds:
        manager.rds.route_config_name = rds
    else:
        manager.route_config.name = "inline"
    if ecds:
        manager.http_filters.add(
            name=ecds,
            config_discovery=config_source_pb2.ExtensionConfigSource(type_urls=["t"]),
        )
    manager.http_filters.add(name="envoy.filters.http.router")
    packed = any_pb2.Any()
    packed.Pack(manager)
    out = listener_pb2.Listener(name=name)
    out.filter_chains.add().filters.append(
        listener_components_pb2.Filter(
            name="envoy.filters.network.http_connection_manager", typed_config=packed
        )
    )
    if listener_ecds:
        out.listener_filters.add(
            name=listener_ecds,
            config_discovery=config_source_pb2.ExtensionConfigSource(type_urls=["t"]),
        )
    return out


def needy() -> dict[str, dict[str, Any]]:
    """Clusters and listeners that need five resources of three types; none of them present."""
    aggregate = cluster_pb2.Cluster(
        name="fallback", cluster_type=cluster_pb2.Cluster.CustomClusterType(name="aggregate")
    )
    return {
        CLUSTER: {
            "a": eds("a"),
            "b": eds("b", service_name="b-endpoints"),
            # These carry their hosts (or name other clusters): no EDS resource exists for them.
            "static": cluster_pb2.Cluster(name="static", type=cluster_pb2.Cluster.STATIC),
            "dns": cluster_pb2.Cluster(name="dns", type=cluster_pb2.Cluster.STRICT_DNS),
            "fallback": aggregate,
        },
        LISTENER: {
            "http": listener("http", rds="http-routes", ecds="meshfn.degrade.http"),
            "inbound": listener("inbound", listener_ecds="meshfn.tls"),
        },
        ENDPOINT: {},
        ROUTE: {},
        EXTENSION: {},
    }


def test_inconsistent_translation_is_refused_naming_what_is_missing() -> None:
    with pytest.raises(InconsistentSnapshot) as caught:
        prepare("edge.ingress", needy())
    assert caught.value.missing == {
        ENDPOINT: {"a": [(CLUSTER, "a")], "b-endpoints": [(CLUSTER, "b")]},
        ROUTE: {"http-routes": [(LISTENER, "http")]},
        EXTENSION: {
            "meshfn.degrade.http": [(LISTENER, "http")],
            "meshfn.tls": [(LISTENER, "inbound")],
        },
    }
    message = str(caught.value)
    assert message.startswith("the configuration for edge.ingress is inconsistent: ")
    assert "missing endpoints: a (needed by cluster a), b-endpoints (needed by cluster b)" in (
        message
    )
    assert "missing routes: http-routes (needed by listener http)" in message
    assert "meshfn.degrade.http (needed by listener http)" in message


def test_consistent_once_every_named_resource_is_present() -> None:
    resources = needy()
    resources[ENDPOINT] = {
        n: endpoint_pb2.ClusterLoadAssignment(cluster_name=n) for n in ("a", "b-endpoints")
    }
    resources[ROUTE] = {"http-routes": route_pb2.RouteConfiguration(name="http-routes")}
    resources[EXTENSION] = {
        n: extension_pb2.TypedExtensionConfig(name=n) for n in ("meshfn.degrade.http", "meshfn.tls")
    }
    snapshot = prepare("edge.ingress", resources)
    assert snapshot.missing() == {}
    needs = {n: r.needs for n, r in snapshot.types[CLUSTER].resources.items()}
    assert needs == {
        "a": ((ENDPOINT, "a"),),
        "b": ((ENDPOINT, "b-endpoints"),),
        "static": (),
        "dns": (),
        "fallback": (),
    }
    inbound = snapshot.types[LISTENER].resources["inbound"]
    assert inbound.needs == ((EXTENSION, "meshfn.tls"),)  # its inline route_config needs no RDS
    # A later translation that drops one is refused, against a previous snapshot too.
    del resources[ROUTE]["http-routes"]
    with pytest.raises(InconsistentSnapshot, match="missing routes: http-routes"):
        prepare("edge.ingress", resources, snapshot)


def test_a_long_list_of_missing_names_is_cut_short() -> None:
    clusters = {f"c{i:02}": eds(f"c{i:02}") for i in range(13)}
    with pytest.raises(InconsistentSnapshot) as caught:
        prepare("g", {CLUSTER: clusters})
    assert len(caught.value.missing[ENDPOINT]) == 13
    assert str(caught.value).endswith("c09 (needed by cluster c09), and 3 more")


def test_publish_refuses_an_inconsistent_snapshot_and_keeps_the_current_one() -> None:
    cache = SnapshotCache()
    woken: list[str] = []
    cache.watch("g", lambda: woken.append("g"))
    good = prepare(
        "g", {CLUSTER: {"a": eds("a")}, ENDPOINT: {"a": endpoint_pb2.ClusterLoadAssignment()}}
    )
    assert cache.publish(good)
    # Built by hand, bypassing prepare: publish checks too.
    bad = Snapshot(
        "g", {CLUSTER: TypeSnapshot(CLUSTER, {"b": Resource.encode(CLUSTER, "b", eds("b"))})}
    )
    with pytest.raises(InconsistentSnapshot, match="missing endpoints: b"):
        cache.publish(bad)
    assert cache.get("g") is good and woken == ["g"]


def test_example_policies_translate_to_consistent_snapshots() -> None:
    model = load_policies(EXAMPLES)
    kinds: set[str] = set()
    for workload in model.workloads:
        resources = translate(model, workload.node_cluster)
        assert resources is not None
        snapshot = prepare(workload.node_cluster, resources)  # raises if inconsistent
        assert snapshot.missing() == {}
        kinds |= {
            t for ts in snapshot.types.values() for r in ts.resources.values() for t, _ in r.needs
        }
    # The examples exercise every kind of reference the check knows (so it checked something).
    assert kinds == {ENDPOINT, ROUTE, EXTENSION}


MINIMAL_POLICY = """\
apiVersion: meshfn.io/v1alpha1
kind: Mesh
metadata: {name: demo}
spec: {trustDomain: meshfn.local}
---
apiVersion: meshfn.io/v1alpha1
kind: Gateway
metadata: {name: edge, namespace: ingress}
spec:
  adminPort: 19000
  listeners: [{name: http, port: 10000}]
---
apiVersion: meshfn.io/v1alpha1
kind: Service
metadata: {name: echo, namespace: default}
spec:
  port: 9201
  endpoints: [{address: 127.0.0.1}]
---
apiVersion: meshfn.io/v1alpha1
kind: Route
metadata: {name: echo, namespace: default}
spec:
  gateway: ingress/edge
  matches: [{path: {prefix: /echo}}]
  destination: {service: echo}
"""


async def test_reload_rejects_an_inconsistent_translation_and_keeps_the_last_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "mesh.yaml").write_text(MINIMAL_POLICY)
    cp = ControlPlane(policies, tmp_path / "state")
    assert (await cp.reload()).ok
    good = cp.cache.get("edge.ingress")
    assert good is not None and good.types[ROUTE].resources

    def without_routes(*args: Any, **kwargs: Any) -> Any:
        resources = translate(*args, **kwargs)
        return {**resources, ROUTE: {}}

    monkeypatch.setattr(service, "translate", without_routes)
    result = await cp.reload()
    assert not result.ok
    (error,) = result.errors
    assert "cannot prepare the proxies: the configuration for edge.ingress is inconsistent" in (
        error.message
    )
    assert (
        "missing routes: http (needed by listener http, listener meshfn-traced-http)"
        in error.message
    )
    assert cp.state.errors == result.errors
    assert cp.cache.get("edge.ingress") is good
    assert cp.metrics.reloads.labels("error")._value.get() == 1
