"""The translator's output shape (type URLs and names live in meshfn.xds.names)."""

from __future__ import annotations

from google.protobuf.message import Message

# type_url -> resource name -> message. Messages may be shared between translations (they are
# memoised on IR objects): treat them as immutable.
Resources = dict[str, dict[str, Message]]
