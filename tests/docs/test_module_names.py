"""Every meshfn module the documentation names exists: the layout moved once (issue 33) and the
architecture page is the source of truth for it, so a page naming `meshfn.control_plane.health`
after the drift breaker left for `meshfn.health` is a failing test, not a reader's detour."""

from __future__ import annotations

import importlib
import importlib.util
import re

from meshfn.testing.docs import DOCS, ROOT

# Names after `meshfn.` that are not modules: the API group (meshfn.io), the default trust
# domain (meshfn.local), the filter module file (meshfn.wasm), plugin names (meshfn.plugin.x),
# and the span attributes meshfn adds (contracts.tracing: meshfn.route, meshfn.batch.rows...).
NOT_MODULES = {"io", "local", "wasm", "plugin"} | {
    "route", "model", "version", "tenant", "principal", "batch", "code_loaded", "code_cache_hit",
    "finish_reason",
}  # fmt: skip
NAME = re.compile(r"\bmeshfn\.([a-z_]+(?:\.[a-z_]+)*)")
SOURCES = [*DOCS.rglob("*.md"), ROOT / "README.md"]


def _named() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for page in SOURCES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in NAME.finditer(line):
                parts = match.group(1).split(".")
                if parts[0] not in NOT_MODULES:
                    where = f"{page.relative_to(ROOT)}:{number}"
                    out.setdefault("meshfn." + ".".join(parts), []).append(where)
    return out


def _exists(name: str) -> bool:
    """A module, or an attribute of one (`meshfn.common.env.ADMIN_TOKEN`)."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:
            continue
        value: object = importlib.import_module(module)
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def test_every_module_the_docs_name_exists() -> None:
    named = _named()
    assert named, "no module names found: the pattern is wrong"
    missing = {name: where for name, where in sorted(named.items()) if not _exists(name)}
    assert not missing, "\n".join(f"{n}: {', '.join(w)}" for n, w in missing.items())
