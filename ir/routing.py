"""The order of a listener's routes: what a route means when several could match a request.

Envoy (and Istio's VirtualService, within one object) takes the first match, so every renderer
must emit routes in this one order.
"""

from __future__ import annotations

from meshfn import ir

_PATH_RANK = {"exact": 0, "regex": 1, "prefix": 2}


def precedence(route: ir.Route, index: int) -> tuple[int, int, int, int, str, int]:
    """Gateway API-style order: exact paths, then regexes, then longer prefixes; then matches
    with methods; then more header matches; then by name."""
    match = route.matches[index]
    return (
        _PATH_RANK[match.path.kind],
        -len(match.path.value),
        0 if match.methods else 1,
        -len(match.headers),
        route.key,
        index,
    )
