"""Subscription: one stream's protocol state for one type, without a network. Each test names the
rule of https://www.envoyproxy.io/docs/envoy/latest/api-docs/xds_protocol it checks."""

from __future__ import annotations

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2

from meshfn.xds.cache import Resource, SnapshotCache, TypeSnapshot, next_nonce
from meshfn.xds.names import CLUSTER, ENDPOINT, LISTENER, ROUTE
from meshfn.xds.protocol import ProtocolError
from meshfn.xds.subscription import Subscription


def types(type_url: str, *names: str, **changed: int) -> TypeSnapshot:
    """`names` at one content, `changed` names at another (their value makes the content)."""
    resources = {}
    for name, timeout in (dict.fromkeys(names, 1) | changed).items():
        message = cluster_pb2.Cluster(name=name)
        message.connect_timeout.seconds = timeout
        resources[name] = Resource.encode(type_url, name, message)
    return TypeSnapshot(type_url, resources)


@pytest.fixture
def intern() -> SnapshotCache:
    return SnapshotCache()


# ---------------------------------------------------------------- SotW: what the client wants


@pytest.mark.parametrize("type_url", [CLUSTER, LISTENER])
def test_sotw_empty_first_request_for_lds_cds_is_the_legacy_wildcard(
    type_url: str, intern: SnapshotCache
) -> None:
    sub = Subscription(type_url)
    assert sub.set_sotw_names([], intern.intern) == frozenset()
    assert sub.wildcard and sub.wants("anything")
    # Still never named a resource: an empty list again keeps the wildcard (no change).
    assert sub.set_sotw_names([], intern.intern) is None
    assert sub.wildcard


@pytest.mark.parametrize("type_url", [ENDPOINT, ROUTE])
def test_sotw_empty_request_for_eds_rds_subscribes_to_nothing(
    type_url: str, intern: SnapshotCache
) -> None:
    sub = Subscription(type_url)
    sub.set_sotw_names([], intern.intern)
    assert not sub.wildcard and not sub.wants("a")


def test_sotw_empty_list_after_names_unsubscribes_instead_of_wildcard(
    intern: SnapshotCache,
) -> None:
    sub = Subscription(CLUSTER)
    sub.set_sotw_names([], intern.intern)
    assert sub.set_sotw_names(["a"], intern.intern) == {"a"}
    assert not sub.wildcard and sub.names == {"a"}
    # #how-the-client-specifies-what-resources-to-return: once a name was sent, the legacy
    # semantic is gone and an empty list means "nothing" (#unsubscribing-from-resources).
    assert sub.set_sotw_names([], intern.intern) == frozenset()
    assert not sub.wildcard and not sub.wants("a")


def test_sotw_explicit_wildcard_beside_names(intern: SnapshotCache) -> None:
    sub = Subscription(ENDPOINT)  # "*" works for any type, not only LDS/CDS
    assert sub.set_sotw_names(["*"], intern.intern) == frozenset()
    assert sub.wildcard and sub.names == frozenset()
    assert sub.set_sotw_names(["*", "a"], intern.intern) == {"a"}
    assert sub.wildcard and sub.names == {"a"}
    # Dropping "*" but keeping "a": the named set is unchanged, the subscription is not.
    assert sub.set_sotw_names(["a"], intern.intern) == frozenset()
    assert not sub.wildcard and sub.wants("a") and not sub.wants("b")


def test_sotw_reports_only_new_names_and_interns_sets(intern: SnapshotCache) -> None:
    sub = Subscription(ENDPOINT)
    assert sub.set_sotw_names(["a", "b"], intern.intern) == {"a", "b"}
    assert sub.set_sotw_names(["b", "a", "c"], intern.intern) == {"c"}
    assert sub.set_sotw_names(["c", "b", "a"], intern.intern) is None  # same set, other order
    other = Subscription(ENDPOINT)
    other.set_sotw_names(["a", "c", "b"], intern.intern)
    assert other.names is sub.names  # one object per distinct set: memo keys hit on identity
    assert sub.set_sotw_names(["a"], intern.intern) == frozenset()  # unsubscribed b and c
    assert sub.names == {"a"}


# ---------------------------------------------------------------- Delta: what the client wants


def test_delta_legacy_wildcard_only_from_an_empty_first_request(intern: SnapshotCache) -> None:
    wild = Subscription(CLUSTER)
    wild.start_delta([], {})
    wild.update_delta([], [], intern.intern)
    assert wild.wildcard
    named = Subscription(CLUSTER)
    named.start_delta(["a"], {})
    named.update_delta(["a"], [], intern.intern)
    assert not named.wildcard and named.names == {"a"}
    endpoints = Subscription(ENDPOINT)
    endpoints.start_delta([], {})
    endpoints.update_delta([], [], intern.intern)
    assert not endpoints.wildcard


def test_delta_naming_a_resource_keeps_the_wildcard_until_star_is_unsubscribed(
    intern: SnapshotCache,
) -> None:
    sub = Subscription(CLUSTER)
    sub.start_delta([], {})
    sub.update_delta([], [], intern.intern)
    sub.update_delta(["a"], [], intern.intern)
    assert sub.wildcard and sub.names == {"a"}  # the spec's example: "*" and "a" both hold
    sub.update_delta([], ["*"], intern.intern)
    assert not sub.wildcard and sub.wants("a") and not sub.wants("b")
    sub.update_delta([], ["a"], intern.intern)
    # Now subscribed to nothing: not wildcard again, although the set is empty as at first.
    assert not sub.wildcard and sub.names == frozenset()


def test_delta_unsubscribe_forgets_what_the_client_held(intern: SnapshotCache) -> None:
    ts = types(ENDPOINT, "a", "b")
    sub = Subscription(ENDPOINT)
    sub.start_delta(["a", "b"], {})
    sub.update_delta(["a", "b"], [], intern.intern)
    changed, removed = sub.delta_changes(ts)
    sub.returned(ts, changed, removed)
    sub.on_sent(ts, next_nonce(), len(sub.known), 0.0)
    sub.update_delta([], ["b"], intern.intern)
    assert sub.names == {"a"} and sub.known == {"a": ts.resources["a"].version}
    assert sub.sent is None  # reconciled against the whole snapshot next
    # b changes: the client unsubscribed it, so it hears nothing; a did not change.
    assert sub.delta_changes(types(ENDPOINT, "a", b=9)) == (frozenset(), frozenset())


def test_delta_unsubscribing_a_name_the_wildcard_still_covers(intern: SnapshotCache) -> None:
    ts = types(CLUSTER, "a", "b")
    sub = Subscription(CLUSTER)
    sub.start_delta([], {})
    sub.update_delta([], [], intern.intern)
    sub.update_delta(["a", "gone"], [], intern.intern)
    sub.returned(ts, *sub.delta_changes(ts))
    # The client drops its explicit interest in "a" and "gone"; "*" still covers both, so it
    # must be told again whether each exists: "a" is resent, "gone" reported removed.
    sub.update_delta([], ["a", "gone"], intern.intern)
    assert sub.delta_changes(ts) == ({"a"}, {"gone"})


# ---------------------------------------------------------------- Delta: resource hints


def test_delta_initial_resource_versions_send_only_what_differs(intern: SnapshotCache) -> None:
    ts = types(CLUSTER, "a", "b", "c")
    sub = Subscription(CLUSTER)
    hints = {"a": ts.resources["a"].version, "b": "stale", "gone": "x"}
    sub.start_delta([], hints)
    sub.update_delta([], [], intern.intern)
    changed, removed = sub.delta_changes(ts)
    assert (changed, removed) == ({"b", "c"}, {"gone"})
    sub.returned(ts, changed, removed)
    assert sub.known == {n: r.version for n, r in ts.resources.items()}


def test_delta_hints_outside_a_named_subscription_are_not_reported(
    intern: SnapshotCache,
) -> None:
    ts = types(ENDPOINT, "a", "b")
    sub = Subscription(ENDPOINT)
    sub.start_delta(["a"], {"a": ts.resources["a"].version, "other": "1"})
    sub.update_delta(["a"], [], intern.intern)
    # "a" is current; "other" is gone but the client never subscribed to it here.
    assert sub.delta_changes(ts) == (frozenset(), frozenset())


def test_delta_after_a_response_diffs_from_the_version_sent(intern: SnapshotCache) -> None:
    first = types(ENDPOINT, "a", "b")
    sub = Subscription(ENDPOINT)
    sub.start_delta(["a"], {})
    sub.update_delta(["a"], [], intern.intern)
    sub.returned(first, *sub.delta_changes(first))
    sub.on_sent(first, next_nonce(), 1, 0.0)
    second = types(ENDPOINT, a=2, b=3)
    assert sub.delta_changes(second) == ({"a"}, frozenset())  # b changed too: not subscribed
    assert sub.delta_changes(TypeSnapshot(ENDPOINT, {})) == (frozenset(), {"a"})


# ---------------------------------------------------------------- nonces, ACK and NACK


def test_nonces_current_stale_and_never_sent() -> None:
    ts = types(CLUSTER, "a")
    sub = Subscription(CLUSTER)
    with pytest.raises(ProtocolError) as nothing_sent:
        sub.classify_nonce("1")  # no response of this type went out on this stream yet
    assert nothing_sent.value.code == grpc.StatusCode.INVALID_ARGUMENT
    first, second = next_nonce(), next_nonce()
    sub.on_sent(ts, first, 1, 0.0)
    assert sub.classify_nonce(first) == "current"
    sub.on_sent(ts, second, 1, 0.0)
    # #when-to-send-an-update: a request answering an older response is stale, not an ACK.
    assert sub.classify_nonce(first) == "stale"
    assert sub.classify_nonce(second) == "current"
    for bad in ("not-a-nonce", format(int(second, 16) + 1, "x"), "0", "f" * 40):
        with pytest.raises(ProtocolError) as caught:
            sub.classify_nonce(bad)
        assert caught.value.reason == "bad_nonce"


def test_ack_records_the_sent_version_and_the_latency_start() -> None:
    ts = types(CLUSTER, "a", "b")
    sub = Subscription(CLUSTER)
    sub.on_sent(ts, next_nonce(), 2, published_at=12.5)
    assert sub.status.sent_version == ts.version and sub.status.resources == 2
    assert not sub.status.as_dict()["in_sync"]
    assert sub.on_reply(None, ts.version) == 12.5
    assert sub.status.acked_version == ts.version and sub.status.as_dict()["in_sync"]
    assert sub.on_reply(None, ts.version) == 0.0  # nothing pending any more


def test_nack_keeps_the_last_good_version_and_the_refused_one_unsent() -> None:
    good, bad = types(CLUSTER, "a"), types(CLUSTER, a=7)
    sub = Subscription(CLUSTER)
    sub.on_sent(good, next_nonce(), 1, 1.0)
    sub.on_reply(None, good.version)
    sub.on_sent(bad, next_nonce(), 1, 2.0)
    # SotW: version_info of a NACK is the version the client still runs.
    assert sub.on_reply("cluster a: bad things", good.version) == 0.0
    status = sub.status
    assert status.acked_version == good.version and status.sent_version == bad.version
    assert status.last_nack is not None and status.last_nack.version == bad.version
    assert status.last_nack.error == "cluster a: bad things"
    assert sub.sent is bad  # the handlers send only a version newer than this one
    # Delta NACKs carry no version: the last ACKed one stands.
    sub.on_reply("still bad", "")
    assert status.acked_version == good.version and status.last_nack.error == "still bad"


def test_reconnect_with_the_current_version(intern: SnapshotCache) -> None:
    ts = types(ENDPOINT, "a", "b", "c")
    sub = Subscription(ENDPOINT)
    sub.set_sotw_names(["a", "b", "z"], intern.intern)
    sub.already_current(ts)
    assert sub.sent is ts and sub.status.as_dict()["in_sync"]
    assert sub.status.resources == 2  # z does not exist


# ---------------------------------------------------------------- Delta: compact state


def test_delta_known_is_compact_once_the_client_holds_exactly_a_snapshot(
    intern: SnapshotCache,
) -> None:
    """No per-stream dict of versions: the shared snapshot says what the client holds. What
    it holds must read the same as the explicit dict would, before and after a push."""
    ts = types(ENDPOINT, "a", "b", "c")
    sub = Subscription(ENDPOINT)
    sub.start_delta(["a", "b"], {})
    sub.update_delta(["a", "b"], [], intern.intern)
    assert sub.holds_nothing()
    sub.returned(ts, *sub.delta_changes(ts))
    sub.on_sent(ts, next_nonce(), sub.known_count(), 0.0)
    assert sub._known is None and sub.known_count() == 2 and not sub.holds_nothing()
    newer = types(ENDPOINT, "a", "c", b=5)  # b changed: pushed by diff, state stays compact
    changed, removed = sub.delta_changes(newer)
    assert (changed, removed) == ({"b"}, frozenset())
    sub.returned(newer, changed, removed)
    assert sub._known is None
    assert sub.known == {n: newer.resources[n].version for n in ("a", "b")}
    # Reading `known` made it explicit; the next reconcile compacts it again.
    sub.returned(newer, frozenset(), frozenset())
    assert sub._known is None


def test_delta_caught_up_moves_a_compact_state_to_the_new_snapshot(
    intern: SnapshotCache,
) -> None:
    ts = types(ENDPOINT, "a", "b")
    sub = Subscription(ENDPOINT)
    sub.start_delta(["a"], {})
    sub.update_delta(["a"], [], intern.intern)
    sub.returned(ts, *sub.delta_changes(ts))
    sub.on_sent(ts, next_nonce(), sub.known_count(), 0.0)
    newer = types(ENDPOINT, "a", b=7)  # only an unwanted name changed
    assert sub.delta_changes(newer) == (frozenset(), frozenset())
    sub.caught_up(newer)
    assert sub.sent is newer and sub._held is newer
    assert sub.known == {"a": newer.resources["a"].version}


def test_delta_hints_it_does_not_want_keep_the_state_explicit(intern: SnapshotCache) -> None:
    """A reconnecting client's hint for a name it does not subscribe to stays known (and
    counted): the compact form could not say it holds it."""
    ts = types(ENDPOINT, "a", "b")
    sub = Subscription(ENDPOINT)
    sub.start_delta(["a"], {"other": "1"})
    sub.update_delta(["a"], [], intern.intern)
    assert not sub.holds_nothing()
    sub.returned(ts, *sub.delta_changes(ts))
    assert sub._known == {"a": ts.resources["a"].version, "other": "1"}
    assert sub.known_count() == 2


def test_delta_subscribing_more_names_while_compact_sends_only_the_new_ones(
    intern: SnapshotCache,
) -> None:
    ts = types(ENDPOINT, "a", "b", "c")
    sub = Subscription(ENDPOINT)
    sub.start_delta(["a"], {})
    sub.update_delta(["a"], [], intern.intern)
    sub.returned(ts, *sub.delta_changes(ts))
    sub.on_sent(ts, next_nonce(), sub.known_count(), 0.0)
    sub.update_delta(["b"], [], intern.intern)  # what it holds is taken before names change
    assert sub.delta_changes(ts) == ({"b"}, frozenset())
    sub.update_delta([], ["a"], intern.intern)
    assert sub.known == {} and sub.delta_changes(ts) == ({"b"}, frozenset())
