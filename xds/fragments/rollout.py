"""A rolled-out Function's route pieces, for the translator's route tables and the Istio
renderer's inserted routes: the split between the versions' clusters (each entry telling the
backend its version: contracts.rollout.VERSION_HEADER) and the mirror of shadow steps.

Weights are in ten-thousandths, so a split can be the product of two percentages (a drift
breaker's probe share of a canary's weight) without rounding."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.type.v3 import percent_pb2
from google.protobuf import wrappers_pb2

from meshfn.contracts.rollout import VERSION_HEADER

SCALE = 10_000  # a split's weights add up to this


def version_header(version: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=VERSION_HEADER, value=version),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def versioned_clusters(entries: Sequence[tuple[str, int, str]]) -> rc.WeightedCluster:
    """(cluster, weight in ten-thousandths, version) -> the split; every entry stays, at
    weight 0 too, so a step changes weights only."""
    return rc.WeightedCluster(
        clusters=[
            rc.WeightedCluster.ClusterWeight(
                name=cluster,
                weight=wrappers_pb2.UInt32Value(value=weight),
                request_headers_to_add=[version_header(version)],
            )
            for cluster, weight, version in entries
        ]
    )


def mirror(cluster: str, percent: int) -> rc.RouteAction.RequestMirrorPolicy:
    """Copy `percent` of the requests to `cluster`; Envoy appends `-shadow` to the copy's Host
    (the backend's sign of a shadow) and discards its answer."""
    return rc.RouteAction.RequestMirrorPolicy(
        cluster=cluster,
        runtime_fraction=base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=percent, denominator=percent_pb2.FractionalPercent.HUNDRED
            )
        ),
    )
