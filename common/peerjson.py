"""JSON that a peer sent: a request body, a gRPC message, a header's value.

`json.loads` recurses once per level of nesting, so a few kilobytes of `[` raise RecursionError,
which a server would answer as its own failure (a 500). Here that is what it is, malformed
input: a ValueError, like every other way the text can fail to be JSON.
"""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes, **kwargs: Any) -> Any:
    """`json.loads`, with nesting too deep for it a ValueError ("nested too deeply")."""
    try:
        return json.loads(data, **kwargs)
    except RecursionError:
        raise ValueError("nested too deeply") from None
