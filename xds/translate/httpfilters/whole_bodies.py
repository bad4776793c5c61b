"""Small request bodies read whole before any filter decides (contracts.proxy: an HTTP/1.1
request refused from its headers alone costs its connection)."""

from __future__ import annotations

import copy
from collections.abc import Iterable

from envoy.extensions.common.matching.v3 import extension_matcher_pb2  # noqa: F401 (Any types)
from envoy.extensions.filters.common.matcher.action.v3 import skip_action_pb2  # noqa: F401
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm,
)
from envoy.type.matcher.v3 import http_inputs_pb2  # noqa: F401
from google.protobuf import json_format

from meshfn.contracts.proxy import WHOLE_SMALL_BODIES

from .base import FilterContext, HttpFilter

# a copy: ParseDict moves each Any's "@type" to the end of its dict, which would change the
# shared definition's order in what the Istio renderer writes
_FILTER = json_format.ParseDict(copy.deepcopy(WHOLE_SMALL_BODIES), hcm.HttpFilter())


class WholeSmallBodies(HttpFilter[FilterContext]):
    def config(self, ctx: FilterContext) -> FilterContext:
        return ctx  # everywhere: the router refuses from headers too (no route, overflow)

    def http_filters(self, ctx: FilterContext, config: FilterContext) -> Iterable[hcm.HttpFilter]:
        return (_FILTER,)
