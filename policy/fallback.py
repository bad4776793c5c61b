"""FallbackPolicy lookups for the reference checks: the policy of each service, and the cycles
between chains (compile/fallback.py lowers the policies)."""

from __future__ import annotations

from collections.abc import Sequence

from .model import FallbackPolicy
from .validate import Loaded


def policies_by_service(items: Sequence[Loaded]) -> dict[str, Loaded]:
    return {
        f"{i.namespace}/{i.obj.spec.service}": i for i in items if isinstance(i.obj, FallbackPolicy)
    }


def find_cycle(key: str, policies: dict[str, Loaded]) -> list[str] | None:
    path: list[str] = []

    def walk(service: str) -> list[str] | None:
        if service in path:
            return [*path[path.index(service) :], service]
        item = policies.get(service)
        if item is None:
            return None
        assert isinstance(item.obj, FallbackPolicy)
        path.append(service)
        for name in item.obj.spec.chain:
            cycle = walk(f"{item.namespace}/{name}")
            if cycle:
                return cycle
        path.pop()
        return None

    return walk(key)
