"""Headers a connection manager removes from a request before Envoy picks a route or runs any
filter (its early header mutation): meshfn's internal headers, a client's trace context."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2

from .messages import pack


def early_header_removal(names: Iterable[str]) -> extension_pb2.TypedExtensionConfig:
    """For HttpConnectionManager.early_header_mutation_extensions: removes `names` from a
    request before Envoy picks a route or runs any filter. One extension for all of a connection
    manager's names: Envoy runs each extension apart for every request."""
    mutation = header_mutation_pb2.HeaderMutation(
        mutations=[mutation_rules_pb2.HeaderMutation(remove=name) for name in names]
    )
    return extension_pb2.TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation", typed_config=pack(mutation)
    )
