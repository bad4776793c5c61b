"""Audit records from Envoy access-log lines: every field rule, the bare filter state, the mesh
route and whom it is believed from, and hostile or broken lines kept (never a crash)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from meshfn.audit.record import canonical, from_log_line, trace_id
from meshfn.contracts.journal import ERASED_SUBJECT

EDGE = "spiffe://td/ns/ingress/sa/edge"

# ------------------------------------------------------------------ records from log lines


def test_record_from_access_log_line() -> None:
    state = json.dumps(
        {
            "v": 1,
            "subject": "AB" * 32,
            "salt_id": "k",
            "subject_source": "jwt_authn",
            "tenant": "t",
            "body": "hashed",
            "body_sha256": "cd" * 32,
            "trace_id": "ef" * 16,
        }
    )
    line = json.dumps(
        {
            "id": "abc",
            "time": "2026-01-01T00:00:00.000001Z",
            "method": "POST",
            "authority": "h",
            "path": "/x" * 2000,
            "status": 200,
            "duration_us": "1234",
            "duration_ms": 1,
            "upstream_cluster": "c",
            "route": "local",
            "principal": None,
            "flags": "-",
            "audit": state,
        }
    ).encode()
    r = from_log_line(line, "edge~0")
    assert r["audited"] and r["subject"] == "ab" * 32 and r["body_sha256"] == "cd" * 32
    assert r["duration_us"] == 1234 and r["status"] == 200 and r["principal"] is None
    assert r["flags"] is None and r["source"] == "edge~0" and len(r["path"]) == 2048
    assert r["truncated"] == ["path"]
    # Envoy's own route is not the mesh route (no mesh-route fields on this line)
    assert r["envoy_route"] == "local" and r["route"] is None and r["route_source"] is None


BARE_FIELDS = {"audit_v": "1", "salt_id": "k1", "subject_source": "jwt_headers"}


def test_bare_filter_state_with_its_access_log_fields() -> None:
    """jwt_headers mode without body hashing: the filter state is the subject (or null) and
    Envoy writes the other audit fields next to it (filters.access_log_format)."""
    entry = {"status": 200, "audit": "AB" * 32, "tenant": "acme", **BARE_FIELDS}
    r = from_log_line(json.dumps(entry).encode(), "n")
    assert r["audited"] and r["subject"] == "ab" * 32 and r["tenant"] == "acme"
    assert r["salt_id"] == "k1" and r["subject_source"] == "jwt_headers"
    assert r["body"] == "off" and r["body_sha256"] is None and "error" not in r
    r = from_log_line(json.dumps({**entry, "audit": "null", "tenant": None}).encode(), "n")
    assert r["audited"] and r["subject"] is None and r["tenant"] is None
    assert r["salt_id"] == "k1" and "error" not in r
    # an all-digit subject is still a subject, not a JSON number
    r = from_log_line(json.dumps({**entry, "audit": "1" * 64}).encode(), "n")
    assert r["subject"] == "1" * 64
    # tenant: capped and flagged like the filter's; a non-string claim as compact JSON
    r = from_log_line(json.dumps({**entry, "tenant": "t" * 300}).encode(), "n")
    assert r["tenant"] == "t" * 128 and r["truncated"] == ["tenant"]
    r = from_log_line(json.dumps({**entry, "tenant": {"a": [1]}}).encode(), "n")
    assert r["tenant"] == '{"a":[1]}'
    canonical(r)


def test_an_erased_subject_is_stored_as_erased() -> None:
    """A journal line an erasure redacted (redact.py): the subject is null and says why, in
    both shapes of the filter state; nothing else changes, and no error."""
    bare = {"status": 200, "audit": ERASED_SUBJECT, "tenant": "acme", **BARE_FIELDS}
    full = {"status": 200, "audit": json.dumps({"subject": ERASED_SUBJECT, "tenant": "acme"})}
    for entry in (bare, full):
        r = from_log_line(json.dumps(entry).encode(), "n")
        assert r["audited"] and r["subject"] is None and r["subject_erased"] is True
        assert r["tenant"] == "acme" and "error" not in r
    assert len(ERASED_SUBJECT) == 64  # the HMAC's length: every stored offset stays valid
    with pytest.raises(ValueError):
        bytes.fromhex(ERASED_SUBJECT)  # and never taken for a subject
    r = from_log_line(json.dumps({**bare, "audit": "ab" * 32}).encode(), "n")
    assert "subject_erased" not in r


def test_non_string_fields_are_kept_as_json() -> None:
    """An object where the id belongs (a fuzzer's line) crashed the parser with TypeError:
    every text field takes whatever JSON value a hostile line puts there."""
    line = {"id": {"id": "x"}, "path": ["/a"], "method": 7, "status": 200, "audit": None}
    r = from_log_line(json.dumps(line).encode(), "n")
    assert r["id"] == '{"id":"x"}' and r["path"] == '["/a"]' and r["method"] == "7"
    canonical(r)


def test_integers_past_64_bits_are_dropped() -> None:
    """A duration of 10**31 (a fuzzer's line) does not fit the stores' BIGINT and failed the
    insert of its whole batch: such a number is no number."""
    big = {"status": "200", "duration_us": 8 * 10**31, "audit": None}
    r = from_log_line(json.dumps(big).encode(), "n")
    assert r["status"] == 200 and r["duration_us"] is None
    r = from_log_line(json.dumps({**big, "duration_us": str(2**63)}).encode(), "n")
    assert r["duration_us"] is None
    r = from_log_line(json.dumps({**big, "duration_us": 2**63 - 1}).encode(), "n")
    assert r["duration_us"] == 2**63 - 1


@pytest.mark.parametrize(
    ("status", "grpc_status", "recorded"),
    [
        ("200", "7", 403),  # RBAC's denial of a gRPC call: trailers-only, HTTP 200
        ("200", "16", 401),
        ("200", "8", 429),  # a rate limit
        ("200", "14", 503),
        ("200", "99", 500),  # no such gRPC status: a failure all the same
        ("200", "0", 200),  # gRPC OK
        ("200", None, 200),  # not gRPC (Envoy writes null)
        ("403", None, 403),
        ("503", "14", 503),  # an HTTP status of its own stays
    ],
)
def test_a_grpc_refusal_is_recorded_with_its_http_status(
    status: str, grpc_status: str | None, recorded: int
) -> None:
    line = {"status": status, "grpc_status": grpc_status, "audit": None}
    assert from_log_line(json.dumps(line).encode(), "n")["status"] == recorded


def test_not_audited_lines_ignore_the_bare_fields() -> None:
    """A request the filter never saw (jwt_authn or the codec answered first) has no filter
    state: the constant fields Envoy logs anyway do not make it look audited."""
    r = from_log_line(json.dumps({"status": 401, "audit": None, **BARE_FIELDS}).encode(), "n")
    assert not r["audited"] and r["salt_id"] is None and r["subject_source"] is None
    assert "error" not in r


@pytest.mark.parametrize("state", ["ab" * 31, "zz" * 32, "ab" * 33, "Null", '"' + "ab" * 32 + '"'])
def test_bad_bare_filter_state_is_flagged(state: str) -> None:
    r = from_log_line(json.dumps({"status": 200, "audit": state, **BARE_FIELDS}).encode(), "n")
    assert r["error"] and not r["audited"] and r["subject"] is None


@pytest.mark.parametrize("fields", [{}, {"audit_v": "2"}, {"audit_v": 1}])
def test_bare_filter_state_without_its_fields_is_flagged(fields: dict[str, Any]) -> None:
    r = from_log_line(json.dumps({"status": 200, "audit": "ab" * 32, **fields}).encode(), "n")
    assert r["error"] == "audit filter state without its access log fields"
    assert not r["audited"] and r["subject"] is None


@pytest.mark.parametrize(
    "line", [b"", b"{", b"[1]", b"\xff\xfe", b'"str"', b"{" * 10000, b"[" * 100000]
)
def test_unparseable_line_is_kept_not_dropped(line: bytes) -> None:
    r = from_log_line(line, "n")
    assert r["error"] and r["raw_sha256"] == hashlib.sha256(line).hexdigest()
    canonical(r)  # always storable


def test_bad_filter_state_is_flagged() -> None:
    r = from_log_line(
        json.dumps({"status": "503", "audit": "{oops", "duration_ms": "7"}).encode(), "n"
    )
    assert r["error"] == "audit filter state is not JSON" and not r["audited"]
    assert r["status"] == 503 and r["duration_us"] == 7000


@pytest.mark.parametrize(
    ("traceparent", "b3", "expected"),
    [
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            None,
            "0af7651916cd43dd8448eb211c80319c",
        ),
        (
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            None,
            "0af7651916cd43dd8448eb211c80319c",
        ),
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None, None),
        ("00-0af7651916cd43dd8448eb211c80319c", None, None),
        ("00-0af7651916cd43dd8448eb211c8031zz-b7ad6b7169203331-01", None, None),
        ("zz" * 64, "463ac35c9f6413ad", "463ac35c9f6413ad"),
        (None, "463ac35c9f6413ad48485a3953bb6124", "463ac35c9f6413ad48485a3953bb6124"),
        (None, "463ac35c9f6413a", None),
        (None, "\ufffd" * 16, None),
        (None, None, None),
    ],
)
def test_trace_id(traceparent: str | None, b3: str | None, expected: str | None) -> None:
    assert trace_id(traceparent, b3) == expected
    line = json.dumps({"traceparent": traceparent, "b3_trace_id": b3}).encode()
    assert from_log_line(line, "n")["trace_id"] == expected


def test_a_gateway_names_the_mesh_route_from_its_route_table() -> None:
    line = {"status": 200, "route": "r0", "mesh_route": "default/function-iris"}
    r = from_log_line(json.dumps({**line, "mesh_route_by": "proxy"}).encode(), "edge")
    assert r["route"] == "default/function-iris" and r["route_source"] == "proxy"
    assert r["envoy_route"] == "r0" and "route_claimed" not in r
    r = from_log_line(
        json.dumps({**line, "mesh_route": "-", "mesh_route_by": "proxy"}).encode(), "e"
    )
    assert r["route"] is None and r["route_source"] is None  # a route without metadata


@pytest.mark.parametrize(
    ("principal", "trusted", "believed"),
    [
        (EDGE, f"{EDGE} spiffe://td/ns/ingress/sa/b", True),
        ("spiffe://td/ns/default/sa/client", EDGE, False),  # another mesh workload
        (None, EDGE, False),  # no mTLS peer: a client in PERMISSIVE mode
        (EDGE[:-1], EDGE, False),  # a prefix of a gateway's ID is not that gateway
        (EDGE, "", False),  # a sidecar that believes no gateway
    ],
)
def test_a_sidecar_believes_the_mesh_route_only_from_a_gateway_peer(
    principal: str | None, trusted: str, believed: bool
) -> None:
    line = {
        "status": 200,
        "route": "local",
        "principal": principal,
        "mesh_route": "default/function-iris",
        "mesh_route_from": trusted,
    }
    r = from_log_line(json.dumps(line).encode(), "models")
    if believed:
        assert r["route"] == "default/function-iris" and r["route_source"] == "gateway"
    else:
        assert r["route"] is None and r["route_source"] == "untrusted"
        assert r["route_claimed"] == "default/function-iris"
    assert r["envoy_route"] == "local"
    canonical(r)


def test_a_mesh_route_claim_is_capped() -> None:
    line = {"principal": EDGE, "mesh_route": "x" * 300, "mesh_route_from": EDGE}
    r = from_log_line(json.dumps(line).encode(), "models")
    assert r["route"] == "x" * 256 and "route" in r["truncated"]


def test_a_split_gateways_record_takes_its_internal_listeners_cluster_and_flags() -> None:
    """A request the gateway sampled went through its internal listener, which its own access
    log names as the upstream: the record names the cluster and the response flags the
    internal listener had (a shed there is UO, as on the gateway's own listener) with the
    gateway's own, and the request's own where it did not go that way (null metadata)."""
    base = {"id": "a", "status": 429, "upstream_cluster": "meshfn-traced-http", "flags": "-"}
    traced = from_log_line(
        json.dumps({**base, "traced_cluster": "iris.default", "traced_flags": "UO"}).encode(), "gw"
    )
    assert (traced["upstream_cluster"], traced["flags"]) == ("iris.default", "UO")
    plain = {**base, "upstream_cluster": "iris.default", "flags": "UO"}
    own = from_log_line(
        json.dumps({**plain, "traced_cluster": None, "traced_flags": None}).encode(), "gw"
    )
    assert (own["upstream_cluster"], own["flags"]) == ("iris.default", "UO")
    # the gateway's own flags stay where it had any (the client went away mid-answer)
    both = from_log_line(json.dumps({**base, "flags": "DC", "traced_flags": "UO"}).encode(), "gw")
    assert both["flags"] == "UO,DC"
    quiet = from_log_line(json.dumps({**base, "flags": "DC", "traced_flags": "-"}).encode(), "gw")
    assert quiet["flags"] == "DC"
