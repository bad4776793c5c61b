"""The translator's output shape (type URLs and names live in meshfn.xds.names)."""

from __future__ import annotations

from google.protobuf.message import Message

# type_url -> resource name -> message. Messages may be shared between translations (they are
# memoised on IR objects): treat them as immutable.
Resources = dict[str, dict[str, Message]]


def merge(into: Resources, extra: Resources) -> None:
    """Add `extra`'s resources to `into` (a resource of the same type and name is the same one:
    several listeners may refer to it). `extra` may be memoised: it is only read."""
    for type_url, by_name in extra.items():
        if by_name:
            into.setdefault(type_url, {}).update(by_name)
