"""meshfn.ir.dump: the MeshModel as plain data and back (golden files of both translator stages)."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshfn import ir
from meshfn.ir.dump import dump_model, go_duration, load_model, parse_go_duration
from meshfn.policy import load_policies
from meshfn.xds.dump import to_yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(microseconds=3), "3µs"),
        (timedelta(microseconds=1500), "1.5ms"),
        (timedelta(milliseconds=100), "100ms"),
        (timedelta(seconds=1.5), "1.5s"),
        (timedelta(seconds=90), "1m30s"),
        (timedelta(hours=1), "1h0m0s"),
        (timedelta(hours=2, minutes=45, milliseconds=500), "2h45m0.5s"),
        (timedelta(days=1, microseconds=1), "24h0m0.000001s"),
        (-timedelta(seconds=1.5), "-1.5s"),
    ],
)
def test_durations_read_as_go_writes_them(value: timedelta, text: str) -> None:
    assert go_duration(value) == text
    assert parse_go_duration(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", timedelta(0)),
        ("1h30m", timedelta(minutes=90)),
        ("1.5h", timedelta(minutes=90)),
        ("300us", timedelta(microseconds=300)),
        ("1000ns", timedelta(microseconds=1)),
        (".5s", timedelta(milliseconds=500)),
        ("+2m", timedelta(minutes=2)),
    ],
)
def test_other_go_spellings_are_read(text: str, value: timedelta) -> None:
    assert parse_go_duration(text) == value


@pytest.mark.parametrize("text", ["", "5", "1x", "1h 30m", "s", "1.5", "500ns", "--1s"])
def test_what_is_not_a_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|finer"):
        parse_go_duration(text)


def test_the_examples_round_trip_through_yaml() -> None:
    model = load_policies(EXAMPLES)
    text = to_yaml(dump_model(model))
    assert load_model(yaml.safe_load(text)) == model
    assert to_yaml(dump_model(load_model(yaml.safe_load(text)))) == text


def test_the_dump_keeps_field_order_and_defaults() -> None:
    plain = dump_model(load_policies(EXAMPLES))
    assert list(plain)[:4] == ["name", "trust_domain", "xds_port", "admin_port"]
    assert "_services" not in plain  # derived indexes are not data
    endpoint = plain["services"][0]["endpoints"][0]
    assert list(endpoint) == [
        "address",
        "port",
        "weight",
        "locality",
        "sidecar_port",
        "mtls",
        "grpc_port",
    ]
    assert isinstance(plain["services"][0]["endpoints"], list)


def test_left_out_fields_take_their_defaults() -> None:
    model = load_model(
        {
            "name": "m",
            "trust_domain": "t",
            "xds_port": 1,
            "admin_port": 2,
            "services": [
                {
                    "name": "s",
                    "namespace": "n",
                    "port": 80,
                    "protocol": "grpc",
                    "connect_timeout": "250ms",
                    "endpoints": [{"address": "10.0.0.1", "port": 80}],
                    "traffic": {"failover_regions": [["eu", "us"]]},
                }
            ],
            "workloads": [],
            "certificate_ttl": "30m",
        }
    )
    (service,) = model.services
    assert service.endpoints == (ir.Endpoint("10.0.0.1", 80),)
    assert service.connect_timeout == timedelta(milliseconds=250)
    assert service.traffic == ir.TrafficPolicy(failover_regions=(("eu", "us"),))
    assert model.certificate_ttl == timedelta(minutes=30) and model.functions == ()
    assert model.service("n/s") is service  # a real MeshModel, indexes and all


def _broken(change: Any) -> dict[str, Any]:
    plain = copy.deepcopy(dump_model(load_policies(EXAMPLES)))
    change(plain)
    return plain


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.update(colour="blue"), r"^\.: MeshModel has no field colour"),
        (lambda p: p.pop("trust_domain"), r"^\.: MeshModel needs trust_domain"),
        (lambda p: p.update(xds_port="18000"), r"^xds_port: expected int, got '18000'"),
        (lambda p: p.update(xds_port=True), r"^xds_port: expected int"),
        (lambda p: p.update(acceleration="fast"), r"^acceleration: 'fast' is not one of"),
        (lambda p: p.update(certificate_ttl=3600), r"^certificate_ttl: expected a duration"),
        (lambda p: p.update(certificate_ttl="1 hour"), r"^certificate_ttl: '1 hour' is not"),
        (lambda p: p.update(services={}), r"^services: expected a list"),
        (
            lambda p: p["services"][0]["endpoints"][0].update(port=None),
            r"^services\[0\]\.endpoints\[0\]\.port: expected int, got None",
        ),
        (
            lambda p: p["services"][0].update(endpoints=["10.0.0.1:80"]),
            r"^services\[0\]\.endpoints\[0\]: expected a mapping for Endpoint",
        ),
    ],
)
def test_the_loader_names_what_is_wrong(change: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(_broken(change))


def test_pairs_keep_their_arity() -> None:
    def bad_pair(plain: dict[str, Any]) -> None:
        plain["workloads"][0]["jwt_rules"] = [
            {
                "issuer": "i",
                "audiences": [],
                "jwks": None,
                "jwks_uri": "https://i/jwks",
                "from_headers": [["authorization"]],
                "from_params": [],
                "claim_to_headers": [],
                "forward": False,
                "clock_skew_seconds": 60,
            }
        ]

    with pytest.raises(ValueError, match=r"jwt_rules\[0\]\.from_headers\[0\]: expected 2 items"):
        load_model(_broken(bad_pair))
