"""Gateway listener -> Listener with an HTTP connection manager that takes routes over RDS."""

from __future__ import annotations

from functools import lru_cache

from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from google.protobuf import wrappers_pb2

from meshfn.control_plane import ir

from .common import ads_source, pack, socket_address
from .routes import route_config_name
from .security import jwt_filter, rbac_filters

HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"


def http_filters(
    jwt_rules: tuple[ir.JwtRule, ...], authz: tuple[ir.AuthzPolicy, ...]
) -> list[hcm.HttpFilter]:
    """authn, then authz, then the router: a request is authenticated before it is judged."""
    filters: list[hcm.HttpFilter] = []
    if jwt_rules:
        filters.append(jwt_filter(jwt_rules))
    filters.extend(rbac_filters(authz))
    filters.append(hcm.HttpFilter(name=ROUTER, typed_config=pack(router_pb2.Router())))
    return filters


@lru_cache(maxsize=4096)
def listener(
    listener: ir.Listener,
    jwt_rules: tuple[ir.JwtRule, ...] = (),
    authz: tuple[ir.AuthzPolicy, ...] = (),
) -> listener_pb2.Listener:
    manager = hcm.HttpConnectionManager(
        stat_prefix=listener.name,
        codec_type=hcm.HttpConnectionManager.AUTO,
        rds=hcm.Rds(config_source=ads_source(), route_config_name=route_config_name(listener)),
        http_filters=http_filters(jwt_rules, authz),
        # An edge proxy: normalise paths before matching so /a/../b cannot dodge a route.
        normalize_path=wrappers_pb2.BoolValue(value=True),
        merge_slashes=True,
        strip_any_host_port=True,
        use_remote_address=wrappers_pb2.BoolValue(value=True),
    )
    return listener_pb2.Listener(
        name=listener.name,
        address=socket_address(listener.address, listener.port),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[listener_components_pb2.Filter(name=HCM, typed_config=pack(manager))]
            )
        ],
    )
